"""Protocol tags as text (``TagCodec`` text mode) on the real SmolLM2 tokenizer, where every tag is
several tokens (``<mem>`` = ``<`` ``mem`` ``>``, ``</search>`` = ``</`` ``search`` ``>``).

References are independent of the codec's byte tables: ``HFTokenizer.decode`` of every prefix
(stops) and character offsets from decoded prefixes (spans). The jitted sampler is checked on a
tiny model over SmolLM2's 49,152 ids whose next-token distribution is forced onto tag fragments.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.agent.format import AgentFormat
from mempo_jax.text.protocol import ALL_TAG_PIECES, MEM, STOP_TAGS
from mempo_jax.agent.rollout import make_turn
from mempo_jax.agent.tags import TagCodec
from mempo_jax.agent.trajectory import Trajectory
from mempo_jax.model.config import ModelConfig
from mempo_jax.model.forward import create_model, split_model
from mempo_jax.agent.engine import RolloutEngine
from mempo_jax.text.stop_strings import token_bytes


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from mempo_jax.text.hf_tokenizer import HFTokenizer

    return HFTokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def codec(tok):
    return TagCodec(tok, "text")


def _decode_stop(tok, ids, stop_ids):
    """Reference: the shortest prefix whose decoded text holds a closing tag, or that ends in a stop id."""
    return next((n for n in range(1, len(ids) + 1)
                 if ids[n - 1] in stop_ids or any(t in tok.decode(ids[:n]) for t in STOP_TAGS)), None)


def _char_span(tok, ids, open_tag, close_tag):
    """Reference span from character offsets of decoded prefixes (ASCII ids: one char per byte)."""
    text = tok.decode(ids)
    a = text.find(open_tag)
    c = text.find(close_tag, a + len(open_tag)) if a >= 0 else -1
    if a < 0 or c < 0:
        return None
    ends = [len(tok.decode(ids[:k])) for k in range(1, len(ids) + 1)]
    start = next(k for k, e in enumerate(ends) if e > a)
    end = next(k for k, e in enumerate(ends) if e >= c + len(close_tag)) + 1
    return start, end


def test_every_tag_is_several_tokens_and_tag_ids_encode_it(tok, codec):
    assert tok.vocab_size == 49152 and not tok.tag_ids
    assert codec.tag_ids("<mem>") == [44, 9808, 46] and codec.tag_ids("</search>") == [9617, 7916, 46]
    assert all(len(codec.tag_ids(t)) > 1 and codec.tag_ids(t) == tok.encode(t) for t in ALL_TAG_PIECES)
    assert codec.stop_ids == (0, 2)  # <|endoftext|>, <|im_end|>: no tag is a stop id in text mode
    with pytest.raises(KeyError, match="not a protocol tag"):
        codec.tag_ids("<b>")
    with pytest.raises(ValueError, match="needs every protocol tag as one token"):
        TagCodec(tok, "tokens")


@pytest.mark.parametrize("text, stop_text", [
    ("<mem>x</mem><search>paris</search> more", "<mem>x</mem><search>paris</search>"),  # split tag
    ("<answer>Paris</answer>.\nok", "<answer>Paris</answer>."),  # ">." straddles the tag's end
    ("<search>a</search></answer>", "<search>a</search></"),  # "></" straddles; the first tag wins
    ("<mem>m</mem><answer>a</answer><search>q</search>", "<mem>m</mem><answer>a</answer><"),  # first wins
    ("x </access> y", "x </access>"),  # " </" carries a space
    ("<mem>a</mem><think>b</think></sear", None),  # a partial tag and </mem> never stop
    ("<mem>a</mem><|im_end|><answer>b</answer>", "<mem>a</mem>"),  # a stop id (decode drops it)
])
def test_first_stop_on_smollm2(tok, codec, text, stop_text):
    ids = tok.encode(text)
    n = codec.first_stop(ids)
    assert n == _decode_stop(tok, ids, codec.stop_ids)
    if stop_text is None:
        assert n is None
    else:
        assert tok.decode(ids[:n]) == stop_text


def test_the_straddling_token_is_one_token(tok, codec):
    ids = tok.encode("</answer>.\n")
    assert [tok.decode([i]) for i in ids[:3]] == ["</", "answer", ">."]
    assert codec.first_stop(ids) == 3
    assert codec.turn_text(ids[:3]) == "</answer>"  # the parser does not see the "."


# Single SmolLM2 tokens a policy may sample in any order: tag parts, straddling tokens (">.",
# "></", "><"), other segmentations of a tag ("m" "em", "sea" "rch"), words, and (in the stop
# test) the <|im_end|> stop id.
FRAGMENTS = ["<", "</", " </", "m", "em", "mem", "search", "sea", "rc", "h", "answer", "access", "think", ">", ">.",
             "></", "><", " Paris", "x"]


@pytest.fixture(scope="module")
def fragment_ids(tok):
    ids = [tok.encode(f) for f in FRAGMENTS]
    assert all(len(i) == 1 for i in ids), [f for f, i in zip(FRAGMENTS, ids) if len(i) != 1]
    return [i[0] for i in ids]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(FRAGMENTS)), min_size=1, max_size=16))
def test_first_stop_equals_decoding_every_prefix(tok, codec, fragment_ids, picks):
    ids = [fragment_ids[k] if k < len(fragment_ids) else tok.eos_id for k in picks]
    assert codec.first_stop(ids) == _decode_stop(tok, ids, codec.stop_ids)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(FRAGMENTS) - 1), min_size=1, max_size=16))
def test_find_span_equals_character_offsets(tok, codec, fragment_ids, picks):
    ids = [fragment_ids[k] for k in picks]
    span = codec.find_span(ids, *MEM)
    assert span == _char_span(tok, ids, *MEM)
    if span is not None:
        text = tok.decode(ids[span[0]:span[1]])
        assert MEM[0] in text and text.rstrip().endswith(MEM[1]) or MEM[1] in text


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(FRAGMENTS) - 1), max_size=8), st.sampled_from([">", "><", ">.", "></"]),
       st.lists(st.integers(0, len(FRAGMENTS) - 1), max_size=4))
def test_end_at_close_ends_the_block_exactly_at_the_close(tok, codec, fragment_ids, middle, close_end, tail):
    """``end_at_close`` on a found ``<mem>`` block (``<mem>``, random fragments, ``</`` ``mem`` and
    a last token that may straddle, random fragments): its text is the block's text cut right after
    the first ``</mem>`` (reference: the decoded text); at most the last id changes."""
    ids = (tok.encode("<mem>") + [fragment_ids[k] for k in middle] + tok.encode("</mem")
           + tok.encode(close_end) + [fragment_ids[k] for k in tail])
    span = codec.find_span(ids, *MEM)
    block = ids[span[0]:span[1]]
    text = tok.decode(block)
    got = codec.end_at_close(block, MEM[1])
    assert tok.decode(got) == text[: text.find(MEM[1], text.find(MEM[0]) + len(MEM[0])) + len(MEM[1])]
    assert got[: len(block) - 1] == block[:-1]
    assert TagCodec(_OneIdTags(), "tokens").end_at_close(block, MEM[1]) == block  # tokens mode: never changed


class _OneIdTags:
    """A stand-in tokenizer with every tag as one piece (tokens mode needs ``piece_id`` only)."""
    eos_id, pad_id, bos_id, vocab_size = 0, 0, None, 49152

    def piece_id(self, tag):
        return ALL_TAG_PIECES.index(tag) + 1


def test_memory_view_reads_the_close_then_the_scorers_prefix(tok, codec):
    """The memory reward's view of a text-mode turn (SmolLM2 writes ``</mem><think>`` as
    ``</ mem >< think >``): ``mem_traj`` ends in the straddling ``><``; ``memory_view`` ends at
    ``</mem>``, so view + the scorer's answer prefix reads ``…</mem><think></think><answer>``
    and a hindsight view ``…</mem><information>``, not ``…</mem><<think>``."""
    from mempo_jax.rl.memory_views import memory_contexts, memory_view
    from mempo_jax.run.experiment import answer_prefix_ids

    out = tok.encode("<mem> Paris</mem><think> next</think><search> France</search>")
    assert [tok.decode([i]) for i in out].count("><") == 2
    turn = make_turn(AgentFormat(tok, codec), out, None, stopped=True)
    turn.observation_ids = tok.encode("<information>x</information>")
    tr = Trajectory("q", 0, (("Paris",),), tok.encode("Q:"), [turn])
    assert tok.decode(tr.mem_traj(0)) == "Q:<mem> Paris</mem><"
    assert tok.decode(memory_view(tr, 0, codec)) == "Q:<mem> Paris</mem>"
    assert memory_view(tr, 0, None) == tr.mem_traj(0)
    _, prefix = answer_prefix_ids(tok)
    assert tok.decode(memory_view(tr, 0, codec) + prefix) == "Q:<mem> Paris</mem><think></think><answer>"
    _, mem, _ = memory_contexts([tr], [(0, 0)], tok, "gold", codec=codec, hindsight=True)
    assert tok.decode(mem[0]) == "Q:<mem> Paris</mem><information>x</information>"
    assert tok.decode(memory_contexts([tr], [(0, 0)], tok, "gold", hindsight=True)[1][0]).endswith("</mem><<information>x</information>")


def test_spans_on_sampled_ids_never_retokenised(tok, codec):
    # "<" "m" "em" ">" is not how the tokenizer writes <mem>, but a policy may sample it
    ids = tok.encode("Ok <") + tok.encode("m") + tok.encode("em") + tok.encode("> Paris") + tok.encode(
        "</mem><think>b</think><search>q</search>")
    assert tok.encode(tok.decode(ids)) != ids
    start, end = codec.find_span(ids, *MEM)
    assert tok.decode(ids[start:end]) == " <mem> Paris</mem><"  # " <" and "><" straddle the edges
    assert codec.find_span(tok.encode("<mem> a</me"), *MEM) is None
    assert codec.find_span(tok.encode("</mem><mem>"), *MEM) is None
    two = tok.encode("<mem>a</mem><mem>b</mem>")
    assert tok.decode(two[slice(*codec.find_span(two, *MEM))]) == "<mem>a</mem><"  # the first block


def test_make_turn_and_mem_traj_in_text_mode(tok, codec):
    fmt = AgentFormat(tok, codec)
    ids = tok.encode(" <mem> bridge: Paris</mem><think> next</think><answer> France</answer>.")
    turn = make_turn(fmt, ids, [0.0] * len(ids), stopped=True)
    assert turn.parsed.valid, turn.parsed.error  # the "." of ">." is not stray text
    assert (turn.parsed.mem, turn.parsed.action, turn.parsed.argument) == (" bridge: Paris", "answer", " France")
    assert turn.output_ids == ids  # token-in/token-out: the ids are kept as sampled
    prompt = tok.encode("Question: where?\n")
    tr = Trajectory("q", 0, (("France",),), prompt, [turn])
    mem = tr.mem_traj(0)
    assert mem[: len(prompt)] == prompt and mem[len(prompt):] == ids[turn.mem_span[0]:turn.mem_span[1]]
    assert tok.decode(mem[len(prompt):]) == " <mem> bridge: Paris</mem><"
    cut = make_turn(fmt, tok.encode("<mem>a</mem><search>q</sear"), None, stopped=False)
    assert not cut.parsed.valid and cut.mem_span is not None


def test_a_tag_the_tokenizer_cannot_write_is_refused():
    class Unk:  # every text is the unknown token
        eos_id, pad_id, bos_id, vocab_size = 0, 0, None, 4

        def encode(self, text):
            return [3]

        def decode(self, ids):
            return "?"

    with pytest.raises(ValueError, match="cannot write the protocol tag '<mem>'"):
        TagCodec(Unk(), "text")


# ------------------------------------------------------------------------ the jitted sampler

SAMPLED = ["</", " </", "search", "answer", "access", "mem", ">", ">.", "></", "<", "h", " x"]


def _forced_model(vocab, favoured, logits):
    """A 1-layer model whose next-token distribution is the same at every position: zero block
    outputs (the residual stream is the token's embedding), every embedding row the same vector,
    and an LM head putting ``logits[k]`` on ``favoured[k]`` (−30 elsewhere). At temperature 1 each
    row is an i.i.d. sequence over ``favoured``."""
    cfg = ModelConfig(vocab_size=vocab, embed_dim=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                      mlp_dim=8, tie_embeddings=False)
    graphdef, params = split_model(create_model(cfg, seed=0))
    layer = params["layers"]  # the one layer, stacked
    layer["attn"]["o"].set_value(jnp.zeros_like(layer["attn"]["o"].get_value()))
    layer["mlp"]["down"].set_value(jnp.zeros_like(layer["mlp"]["down"].get_value()))
    params["embed"].set_value(jnp.ones((vocab, 8), jnp.float32))
    head = np.full((8, vocab), -30.0 / 8, np.float32)  # rmsnorm(ones) = ones: a logit is a column sum
    for t, lg in zip(favoured, logits):
        head[:, t] = lg / 8
    params["lm_head"].set_value(jnp.asarray(head))
    return cfg, graphdef, params


def test_sampler_lengths_equal_first_stop(tok, codec):
    favoured = [tok.encode(f)[0] for f in SAMPLED] + [tok.eos_id]
    assert all(len(tok.encode(f)) == 1 for f in SAMPLED)
    cfg, graphdef, params = _forced_model(tok.vocab_size, favoured, [1.0] * len(SAMPLED) + [-2.0])
    auto = codec.stop_automaton(cfg.vocab_size)
    sampler = RolloutEngine(graphdef, cfg, codec.stop_ids, tok.pad_id, stop_automaton=auto)
    rows, n = 64, 20
    prompt = jnp.full((rows, 4), tok.encode("</")[0], jnp.int32)  # the prompt never counts
    out = sampler(params, prompt, jnp.ones((rows, 4), bool), jax.random.key(3), n, 1.0)
    tokens, lengths, stopped, mask = map(np.asarray, (out.tokens, out.lengths, out.stopped, out.mask))
    ends = {"tag": 0, "stop id": 0, "budget": 0, "first token": 0}
    for b in range(rows):
        row = tokens[b].tolist()
        kept = row[: lengths[b]]
        if stopped[b]:
            assert codec.first_stop(row) == lengths[b] == _decode_stop(tok, kept, codec.stop_ids)
            ends["stop id" if kept[-1] in codec.stop_ids else "tag"] += 1
            ends["first token"] += lengths[b] == 3  # a tag completed by the prefill's own token
        else:
            assert lengths[b] == n and codec.first_stop(kept) is None
            ends["budget"] += 1
        assert mask[b].sum() == lengths[b] and all(t == tok.pad_id for t in row[lengths[b]:])
    assert min(ends[k] for k in ("tag", "stop id", "budget")) > 0, ends
    # an equal automaton built again shares the compiled programs (one per shape, not per sampler)
    from mempo_jax.agent.slot_sampler import _compiled

    before = _compiled.cache_info().currsize
    again = RolloutEngine(graphdef, cfg, codec.stop_ids, tok.pad_id, stop_automaton=TagCodec(tok, "text").stop_automaton(
        cfg.vocab_size))
    again(params, prompt, jnp.ones((rows, 4), bool), jax.random.key(3), n, 1.0)
    assert _compiled.cache_info().currsize == before


def _bigram_model(vocab, chain):
    """A 1-layer model that greedily continues ``chain`` cyclically: zero block outputs, token
    ``chain[k]`` embedded as the unit vector ``e_k``, and an LM head mapping ``e_k`` to
    ``chain[k + 1]`` (logit 10, every other logit 0). Tokens of ``chain`` must be distinct."""
    cfg = ModelConfig(vocab_size=vocab, embed_dim=8, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=4,
                      mlp_dim=8, tie_embeddings=False)
    graphdef, params = split_model(create_model(cfg, seed=0))
    layer = params["layers"]  # the one layer, stacked
    layer["attn"]["o"].set_value(jnp.zeros_like(layer["attn"]["o"].get_value()))
    layer["mlp"]["down"].set_value(jnp.zeros_like(layer["mlp"]["down"].get_value()))
    embed = np.zeros((vocab, 8), np.float32)
    head = np.zeros((8, vocab), np.float32)
    for k, t in enumerate(chain):
        embed[t, k] = 1.0
        head[k, chain[(k + 1) % len(chain)]] = 10.0 / np.sqrt(8.0)  # rmsnorm(e_k) = sqrt(8) e_k
    params["embed"].set_value(jnp.asarray(embed))
    params["lm_head"].set_value(jnp.asarray(head))
    return cfg, graphdef, params


def test_prefill_token_advances_the_automaton_and_the_prompt_never_counts(tok, codec):
    x, close, search, gt = tok.encode(" x")[0], *tok.encode("</search>")
    cfg, graphdef, params = _bigram_model(tok.vocab_size, [x, close, search, gt])
    sampler = RolloutEngine(graphdef, cfg, codec.stop_ids, tok.pad_id, stop_automaton=codec.stop_automaton(cfg.vocab_size))
    # row 0 ends its prompt on " x": the prefill samples "</", then "search", ">" → stop after 3;
    # row 1 ends its prompt on "</": its output "search", ">", " x", "</", "search", ">" stops after 6.
    prompt = jnp.asarray([[x, x, x], [x, x, close]], jnp.int32)
    out = sampler(params, prompt, jnp.ones((2, 3), bool), jax.random.key(0), 10, 0.0)
    assert np.asarray(out.lengths).tolist() == [3, 6] and np.asarray(out.stopped).all()
    assert np.asarray(out.tokens)[0, :3].tolist() == [close, search, gt]
    assert np.asarray(out.tokens)[1, :6].tolist() == [search, gt, x, close, search, gt]


def test_token_bytes_are_what_decode_gives(tok):
    table = token_bytes(tok)
    rng = np.random.default_rng(0)
    for _ in range(300):
        ids = rng.integers(0, tok.vocab_size, size=int(rng.integers(1, 8))).tolist()
        assert b"".join(table[i] for i in ids).decode("utf-8", errors="replace") == tok.decode(ids)


# ------------------------------------------------------- wiring: a checkpoint run in text mode


def test_checkpoint_run_defaults_to_text_tags_end_to_end(tok, codec, smollm2_dir, tmp_path):
    """``build_experiment`` on a checkpoint (here: the forced model exported with SmolLM2's
    tokenizer) keeps the tokenizer as it is, and its rollout stops every turn where the codec says;
    ``experiment.make_engine`` builds the same engine."""
    from mempo_jax.agent.rollout import RolloutConfig, new_trajectories
    from mempo_jax.config import ExperimentConfig, ModelOptions
    from mempo_jax.data.world import WorldConfig
    from mempo_jax.run.experiment import make_engine
    from mempo_jax.run.experiment import build_experiment
    from mempo_jax.model.hf_io import save_hf_checkpoint

    favoured = [tok.encode(f)[0] for f in SAMPLED + ["<", "mem", "think", " Paris"]] + [tok.eos_id]
    cfg, _, params = _forced_model(tok.vocab_size, favoured, [1.0] * (len(favoured) - 1) + [-3.0])
    save_hf_checkpoint(tmp_path / "ckpt", cfg, params, tokenizer=tok)
    world = WorldConfig(num_countries=3, num_cities=6, num_companies=6, num_people=24, offices_per_company=2,
                        num_single=4, num_bridge=4, num_multi=2)
    exp = build_experiment(ExperimentConfig(seed=0, world=world, model=ModelOptions(checkpoint=str(tmp_path / "ckpt"))),
                           tmp_path / "cache")
    policy = exp.policy
    assert policy.fmt.codec.mode == "text" and policy.model_cfg.vocab_size == 49152 and not policy.tokenizer.tag_ids
    rcfg = RolloutConfig(max_turns=3, max_new_tokens=16, max_context_tokens=512, max_observation_tokens=8,
                         temperature=1.0, context_steps=1, min_rows_bucket=8)
    trajs = new_trajectories(policy.fmt, exp.train_questions[:8], group_size=1)
    policy.engine.rollout(policy.params, trajs, policy.fmt, exp.tool_env, rcfg, jax.random.key(5))
    turns = [t for tr in trajs for t in tr.turns]
    stopped = 0
    for t in turns:
        n = codec.first_stop(t.output_ids)
        assert n == len(t.output_ids) or (n is None and len(t.output_ids) == rcfg.max_new_tokens)
        stopped += n is not None
        assert t.mem_span == codec.find_span(t.output_ids, *MEM)
    assert stopped > 0 and len(turns) > len(trajs)
    # the evaluation command's sampler is the same program with the same stops
    ids = jnp.asarray([trajs[0].prompt_ids[-6:]] * 8, jnp.int32)
    mask = jnp.ones(ids.shape, bool)
    a = policy.engine(policy.params, ids, mask, jax.random.key(1), 16, 1.0, 1.0)
    engine = make_engine(policy.graphdef, policy.model_cfg, policy.fmt)
    b = engine(policy.params, ids, mask, jax.random.key(1), 16, 1.0, 1.0)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
