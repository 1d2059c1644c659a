"""Training from a Hugging Face checkpoint.

A tiny random Qwen2 checkpoint is saved by transformers next to a small byte-level BPE
``tokenizer.json`` in the Qwen2.5 special-token layout (``<|endoftext|>``, ``<|im_start|>``,
``<|im_end|>``, no BOS, no protocol tags) and spare embedding rows. ``build_experiment`` with
``ModelOptions.checkpoint`` must load both, make the 12 protocol tags single tokens in the spare
rows, and run the MemPO rollout and one RL step on them.

The checkpoint's weights are shaped into a near-bigram "scripted" policy (small layer outputs, an
LM head that maps each token of a scripted turn to the next one), so the greedy rollout is exact: every
turn writes ``<mem> a</mem><think> b</think><search> c</search>`` (three vocabulary words) and the sampler must stop
at the ``</search>`` tag id of the HF tokenizer.
"""

import json
import math

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from mempo_jax.agent.format import AgentFormat
from mempo_jax.text.protocol import ALL_TAG_PIECES, MEM, STOP_TAGS, render_turn  # noqa: E402
from mempo_jax.agent.rollout import RolloutConfig, make_turn, new_trajectories  # noqa: E402
from mempo_jax.config import ExperimentConfig, ModelOptions  # noqa: E402
from mempo_jax.data.scripted_agent import ScriptedAgentConfig, scripted_trajectory  # noqa: E402
from mempo_jax.data.world import WorldConfig, build_world  # noqa: E402
from mempo_jax.run.experiment import _tokenizer_texts, build_experiment, load_checkpoint_policy  # noqa: E402
from mempo_jax.text.hf_tokenizer import HFTokenizer  # noqa: E402
from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer  # noqa: E402
from mempo_jax.rl.losses import LossConfig  # noqa: E402
from mempo_jax.model.hf_io import save_hf_checkpoint  # noqa: E402
from mempo_jax.rl.config import RLConfig  # noqa: E402
from mempo_jax.rl.interfaces import RLCluster  # noqa: E402
from mempo_jax.rl.step import rl_step  # noqa: E402

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BASE_VOCAB = 480
SPARE_ROWS = 16  # embedding rows beyond the tokenizer (Qwen2.5-0.5B: 151,936 rows, 151,665 ids)
WORLD = WorldConfig(num_countries=3, num_cities=6, num_companies=6, num_people=24, offices_per_company=2,
                    num_single=6, num_bridge=6, num_multi=4)
D_MODEL = 64


def _bpe(folder, texts, specials=QWEN_SPECIALS, added_specials=(), config=None, vocab_size=BASE_VOCAB):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    if added_specials:
        tok.add_special_tokens(list(added_specials))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        config or {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    return folder


def _chain_ids(tok):
    """The scripted turn ``<mem> a</mem><think> b</think><search> c</search>`` as 9 distinct ids,
    ``a, b, c`` the first three words of the BPE vocabulary that are one token each."""
    vocab = sorted((i, t) for t, i in tok._tok.get_vocab().items() if t.startswith("Ġ") and t[1:].isalpha())
    words = [" " + t[1:] for _, t in vocab if len(tok.encode(" " + t[1:])) == 1][:3]
    ids = tok.encode(render_turn(*words[:2], "search", words[2]))
    assert len(ids) == 9 and len(set(ids)) == 9, tok.decode(ids)
    return ids, words


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Qwen2 checkpoint folder (transformers ``save_pretrained``) + its tokenizer files."""
    folder = tmp_path_factory.mktemp("qwen_tiny")
    world = build_world(WORLD)
    _bpe(folder, _tokenizer_texts(world.documents, world.train + world.heldout))
    base = HFTokenizer(folder)
    assert base.vocab_size == BASE_VOCAB and not base.tag_ids
    tagged = base.with_protocol_tags(BASE_VOCAB + SPARE_ROWS)  # the ids build_experiment will assign
    chain, words = _chain_ids(tagged)
    nl, info_close = tagged.encode("\n")[-1], tagged.piece_id("</information>")
    prompt_end = AgentFormat.plain(tagged).prompt_ids(world.train[0].question)[-1]
    assert prompt_end == nl
    # After the prompt ("\n") or a tool result ("</information>") comes <mem>, then the chain.
    transitions = [(nl, chain[0]), (info_close, chain[0])] + list(zip(chain[:-1], chain[1:]))

    cfg = transformers.Qwen2Config(
        vocab_size=BASE_VOCAB + SPARE_ROWS, hidden_size=D_MODEL, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
        rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=base.eos_id, pad_token_id=base.pad_id)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:  # small layer outputs: the residual stream ≈ the token's embedding
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
        emb = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for src, dst in transitions:  # logit(dst | src) ≈ 12; every other logit ≈ 0
            head[dst] += 12.0 / math.sqrt(D_MODEL) * emb[src] / emb[src].norm()
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)
    return folder, chain, words


def _config(checkpoint_dir, temperature):
    rollout_cfg = RolloutConfig(max_turns=2, max_new_tokens=12, max_context_tokens=256, max_observation_tokens=16,
                                temperature=temperature, context_steps=1, min_rows_bucket=4)
    rl = RLConfig(steps=1, questions_per_step=2, group_size=2, num_mini_batches=2, loss=LossConfig(),
                  rollout=rollout_cfg)
    return ExperimentConfig(seed=0, world=WORLD, model=ModelOptions(checkpoint=str(checkpoint_dir), tags="tokens"), rl=rl)


@pytest.fixture(scope="module")
def experiment(checkpoint, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    exp = build_experiment(_config(checkpoint[0], temperature=1.0), cache)
    assert not list(cache.glob("spm-*")), "no SentencePiece model is trained for a checkpoint run"
    return exp


# --------------------------------------------------------------------------- protocol tags


def test_tags_become_single_tokens_in_spare_rows(checkpoint):
    folder, _, _ = checkpoint
    base = HFTokenizer(folder)
    with pytest.raises(ValueError, match="<mem>"):
        base.check_protocol_tags()
    tok = base.with_protocol_tags(BASE_VOCAB + SPARE_ROWS)
    tok.check_protocol_tags()
    assert tok.tag_ids == {t: BASE_VOCAB + i for i, t in enumerate(ALL_TAG_PIECES)}
    assert [tok.piece_id(t) for t in ALL_TAG_PIECES] == list(range(BASE_VOCAB, BASE_VOCAB + 12))
    assert tok.vocab_size == BASE_VOCAB + 12 and base.vocab_size == BASE_VOCAB  # base unchanged
    assert tok.bos_id is None and (tok.eos_id, tok.pad_id) == (base.eos_id, base.pad_id)
    ids = tok.encode("x<mem>y")
    assert tok.piece_id("<mem>") in ids and len(ids) == 3
    text = "<mem> paris; (1) 東京</mem><think> ok</think><answer> naïve</answer>"
    assert tok.decode(tok.encode(text)) == text
    assert set(tok.stop_ids()) == {base.eos_id, base.pad_id, *(tok.piece_id(t) for t in STOP_TAGS)}
    assert AgentFormat.plain(tok).prompt_ids("who?") == tok.encode("Search, remember in mem, answer.\nQuestion: who?\n")
    with pytest.raises(ValueError, match=r"no room for protocol tag '</information>'"):
        base.with_protocol_tags(BASE_VOCAB + 11)


def test_llama_reserved_tokens_are_renamed_to_tags(tmp_path):
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(14)]
    folder = _bpe(tmp_path / "llama", ["the capital of france is paris . who wrote hamlet ?"] * 20, specials=(),
                  added_specials=["<|begin_of_text|>", "<|end_of_text|>", *reserved, "<|eot_id|>"],
                  config={"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, vocab_size=300)
    base = HFTokenizer(folder)
    first_reserved = base.piece_id(reserved[0])
    tok = base.with_protocol_tags(base.vocab_size)  # no spare row at all, as Llama 3
    assert tok.vocab_size == base.vocab_size
    assert [tok.piece_id(t) for t in ALL_TAG_PIECES] == list(range(first_reserved, first_reserved + 12))
    assert tok.piece_id(reserved[12]) == first_reserved + 12  # the unused ones stay
    assert tok.bos_id == base.bos_id is not None
    assert tok.decode(tok.encode("who<search> paris</search>")) == "who<search> paris</search>"
    saved = HFTokenizer(tok.save(tmp_path / "export"))
    assert saved.tag_ids == tok.tag_ids


# ------------------------------------------------------------------------ build + rollout + RL


def test_build_experiment_loads_checkpoint_and_tagged_tokenizer(experiment, checkpoint):
    policy = experiment.policy
    tok = policy.tokenizer
    assert isinstance(tok, HFTokenizer) and policy.model_cfg.vocab_size == BASE_VOCAB + SPARE_ROWS
    assert policy.model_cfg.qkv_bias and not policy.model_cfg.tie_embeddings
    tok.check_protocol_tags()
    assert max(tok.tag_ids.values()) < policy.model_cfg.vocab_size
    # A scripted turn encoded by the HF tokenizer parses and its <mem> span is found on the ids.
    ids = tok.encode(render_turn(" alpha; (1) beta", " search", "search", " gamma"))
    turn = make_turn(policy.fmt, ids, None, stopped=True)
    assert turn.parsed.valid and turn.parsed.mem == " alpha; (1) beta" and turn.parsed.action == "search"
    start, end = turn.mem_span
    assert (ids[start], ids[end - 1]) == (tok.piece_id(MEM[0]), tok.piece_id(MEM[1]))
    assert tok.decode(ids[start:end]) == "<mem> alpha; (1) beta</mem>"
    # The SFT cold start's scripted agent works on the HF ids too.
    q = experiment.train_questions[0]
    tr = scripted_trajectory(q, experiment.offices, policy.fmt, experiment.tool_env, ScriptedAgentConfig(),
                             experiment.cfg.rl.rollout, np.random.default_rng(0))
    assert tr.answer is not None and all(t.mem_span is not None and t.parsed.valid for t in tr.turns)


def test_greedy_rollout_stops_at_tag_ids_and_finds_mem_spans(experiment, checkpoint):
    _, chain, words = checkpoint
    policy = experiment.policy
    tok = policy.tokenizer
    cfg = RolloutConfig(max_turns=2, max_new_tokens=12, max_context_tokens=256, max_observation_tokens=16,
                        temperature=0.0, context_steps=1, min_rows_bucket=4)
    trajs = new_trajectories(policy.fmt, experiment.train_questions[:2], group_size=1)
    policy.engine.rollout(policy.params, trajs, policy.fmt, experiment.tool_env, cfg, jax.random.PRNGKey(0))
    for tr in trajs:
        assert tr.end_reason == "max_turns" and len(tr.turns) == 2
        for turn in tr.turns:
            # Stopped at </search>, a single HF token id (chain continues past it otherwise).
            assert turn.output_ids == chain, tok.decode(turn.output_ids)
            assert turn.mem_span == (0, 3) and turn.parsed.valid
            assert (turn.parsed.action, turn.parsed.argument, turn.parsed.mem) == ("search", words[2], words[0])
            assert turn.observation_ids[0] == tok.piece_id("<information>") and turn.tool_ok


def test_rl_step_on_checkpoint_changes_params_and_exports(experiment, tmp_path):
    exp, policy = experiment, experiment.policy
    before = [np.array(x) for x in jax.tree.leaves(policy.params)]
    params = jax.tree.map(lambda x: x.copy(), policy.params)  # the learner donates its params
    ref_params = jax.tree.map(lambda x: x.copy(), policy.params)
    learner = Learner(policy.logits_fn, params, make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=1)),
                      temperature=1.0, micro_batch_rows=8)
    cluster = RLCluster(learner, ref_params, policy.engine, exp.scorer, policy.fmt, exp.tool_env)
    metrics, trajs = rl_step(cluster, exp.train_questions[:2], exp.cfg.rl, jax.random.PRNGKey(1),
                             np.random.default_rng(1))
    assert len(trajs) == 4 and all(np.isfinite(v) for v in metrics.values()), metrics
    assert sum(t.mem_span is not None for tr in trajs for t in tr.turns) >= 4  # the memory reward had turns
    after = jax.tree.leaves(learner.params)
    changed = sum(not np.array_equal(b, np.asarray(a)) for b, a in zip(before, after))
    assert changed >= len(before) // 2, f"{changed} of {len(before)} parameter arrays changed"
    # Export back to the HF layout (weights + tokenizer with its tags) and re-import.
    save_hf_checkpoint(tmp_path, policy.model_cfg, learner.params)
    policy.tokenizer.save(tmp_path)
    cfg2, _, params2, tok2 = load_checkpoint_policy(ModelOptions(checkpoint=str(tmp_path), tags="tokens"))
    assert cfg2 == policy.model_cfg and tok2.tag_ids == policy.tokenizer.tag_ids
    for a, b in zip(jax.tree.leaves(learner.params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ids = policy.tokenizer.encode("x<mem> y</mem><answer> z</answer>")
    assert transformers.AutoTokenizer.from_pretrained(tmp_path)("x<mem> y</mem><answer> z</answer>",
                                                                add_special_tokens=False).input_ids == ids
