"""The memory reward's inputs in the RL step: which ``<mem>`` turns are scored (malformed turns are
not, by default), which ids Z is (the sampled answer ids, never re-encoded), and the prefix
between each view and Z (``MemoryRewardConfig.prefix``)."""

import pathlib

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import without_shape_checks
from reference_rollout import ReferenceEngine

from mempo_jax.agent.format import AgentFormat
from mempo_jax.agent.rollout import RolloutConfig, make_turn
from mempo_jax.agent.tags import TagCodec
from mempo_jax.agent.trajectory import Trajectory, build_training_rows
from mempo_jax.rl.memory_reward import MEMORY_TRAJECTORIES, MemoryRewardConfig
from mempo_jax.rl.config import RLConfig
from mempo_jax.rl.interfaces import RLCluster
from mempo_jax.rl.memory_views import answer_ids_of, memory_contexts, scored_memory_turns
from mempo_jax.rl.step import compute_advantages, rl_step
from toy_agent import WordTokenizer, toy_model, toy_world

TOK = WordTokenizer()
FMT = AgentFormat.plain(TOK)
MALFORMED = {
    "mem not first": "<think> search</think><mem> alice</mem><search> alice</search>",
    "nested tag": "<mem> alice<think> x</think> bob</mem><search> alice</search>",
    "second mem": "<mem> alice</mem><mem> bob</mem><search> alice</search>",
}
VALID = "<mem> alice</mem><search> alice</search>"
ANSWER = "<mem> paris</mem><answer> paris</answer>"
WRONG = "<mem> rome</mem><answer> rome</answer>"


def _turn(text, tok=TOK):
    turn = make_turn(AgentFormat.plain(tok), tok.encode(text), None, True)
    turn.observation_ids = tok.encode("<information> alice was born in paris</information>")
    return turn


def _trajectory(texts, group_id=0, golds=(("paris",),)):
    tr = Trajectory("q", group_id, golds, TOK.encode("question where was alice born"))
    tr.turns = [_turn(t) for t in texts]
    last = tr.turns[-1].parsed
    if last.error is None and last.action == "answer":
        tr.done, tr.answer = True, last.argument.strip()
    return tr


def test_malformed_turns_are_parsed_as_errors_and_keep_a_mem_span():
    for why, text in MALFORMED.items():
        turn = _turn(text)
        assert turn.parsed.error is not None, why
        assert turn.mem_span is not None, why  # found on the ids: the scorer would see it


def test_scored_memory_turns_excludes_format_errors_unless_asked():
    trajs = [_trajectory([MALFORMED["mem not first"], ANSWER]), _trajectory([VALID, MALFORMED["second mem"], ANSWER]),
             _trajectory([MALFORMED["nested tag"], ANSWER])]
    rows = build_training_rows(trajs, 1, TOK.pad_id)
    assert rows.mem_turn == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1)]
    keep = scored_memory_turns(trajs, rows.mem_turn, include_malformed=False)
    assert keep.tolist() == [False, True, True, False, True, False, True]
    assert scored_memory_turns(trajs, rows.mem_turn, include_malformed=True).all()
    assert scored_memory_turns(trajs, [], False).shape == (0,)


def test_memory_reward_on_correct_keeps_only_the_turns_of_rewarded_trajectories():
    trajs = [_trajectory([VALID, ANSWER]), _trajectory([VALID, MALFORMED["second mem"], ANSWER]),
             _trajectory([VALID, VALID, ANSWER])]
    rows = build_training_rows(trajs, 1, TOK.pad_id)
    rewards = np.asarray([0.0, 1.0, 0.5], np.float32)
    owner = [i for i, _ in rows.mem_turn]
    correct = MEMORY_TRAJECTORIES.get("correct")(rewards)
    assert correct.tolist() == [False, True, True]
    assert MEMORY_TRAJECTORIES.get("all")(rewards).all()
    keep = scored_memory_turns(trajs, rows.mem_turn, True, correct)
    assert keep.tolist() == [owner_i != 0 for owner_i in owner] and not keep.all() and keep.any()
    both = scored_memory_turns(trajs, rows.mem_turn, False, correct)  # and the format filter still applies
    assert both.tolist() == (keep & scored_memory_turns(trajs, rows.mem_turn, False)).tolist()
    assert both.sum() < keep.sum()


def test_excluded_turns_get_no_memory_advantage_and_stay_out_of_the_group_statistics():
    trajs = [_trajectory([MALFORMED["mem not first"], ANSWER]), _trajectory([VALID, MALFORMED["second mem"], ANSWER]),
             _trajectory([MALFORMED["nested tag"], VALID, ANSWER])]
    rows = build_training_rows(trajs, 1, TOK.pad_id)
    m = len(rows.mem_turn)
    r_mem = np.linspace(-0.4, 0.9, m).astype(np.float32)
    keep = scored_memory_turns(trajs, rows.mem_turn, False)
    rewards = np.asarray([1.0, 0.0, 1.0], np.float32)
    adv, a_t, a_m = compute_advantages(trajs, rows, rewards, r_mem, 1, 1.0, max_rows=16, max_mem=16, mem_valid=keep)
    kept = r_mem[keep].astype(np.float64)
    want = (kept - kept.mean()) / (kept.std(ddof=1) + 1e-6)  # one group: z-score over the scored turns only
    np.testing.assert_allclose(a_m[keep], want, rtol=1e-5, atol=1e-6)
    assert np.all(a_m[~keep] == 0.0)
    for j in np.flatnonzero(~keep):  # the excluded <mem> tokens carry A_T alone
        row, s, e = rows.mem_rows[j], rows.mem_starts[j], rows.mem_ends[j]
        np.testing.assert_array_equal(adv[row, s:e], np.full(e - s, a_t[rows.traj_index[row]], np.float32))
    # today's behaviour with the switch on: every turn pooled
    _, _, a_all = compute_advantages(trajs, rows, rewards, r_mem, 1, 1.0)
    full = r_mem.astype(np.float64)
    np.testing.assert_allclose(a_all, (full - full.mean()) / (full.std(ddof=1) + 1e-6), rtol=1e-5, atol=1e-6)
    with without_shape_checks(), pytest.raises(ValueError, match="mem_valid"):
        compute_advantages(trajs, rows, rewards, r_mem, 1, 1.0, mem_valid=keep[:-1])


def test_memory_group_turn_normalises_each_turn_index_within_its_question():
    # two questions, three trajectories each, 2-3 <mem> turns a trajectory
    trajs = [_trajectory([VALID, ANSWER], 0), _trajectory([VALID, VALID, ANSWER], 0), _trajectory([VALID, ANSWER], 0),
             _trajectory([VALID, VALID, ANSWER], 1), _trajectory([VALID, ANSWER], 1), _trajectory([VALID, VALID, ANSWER], 1)]
    rows = build_training_rows(trajs, 1, TOK.pad_id)
    m = len(rows.mem_turn)
    r_mem = np.random.default_rng(0).normal(size=m).astype(np.float32)
    rewards = np.asarray([1, 0, 1, 0, 1, 1], np.float32)
    _, _, a_m = compute_advantages(trajs, rows, rewards, r_mem, 2, 1.0, memory_group="turn", max_turns=4)
    want = np.zeros(m)
    segs = [(trajs[i].group_id, t) for i, t in rows.mem_turn]
    for seg in set(segs):  # numpy reference: z-score (ddof 1) within (question, turn index); a segment of one: its raw R_M
        idx = [j for j, g in enumerate(segs) if g == seg]
        x = r_mem[idx].astype(np.float64)
        want[idx] = x if len(x) == 1 else (x - x.mean()) / (x.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(a_m, want, rtol=1e-5, atol=1e-5)
    _, _, a_q = compute_advantages(trajs, rows, rewards, r_mem, 2, 1.0)  # the spec's pooling differs
    assert not np.allclose(a_q, a_m)
    with pytest.raises(ValueError, match="turn index 2 >= max_turns 2"):
        compute_advantages(trajs, rows, rewards, r_mem, 2, 1.0, memory_group="turn", max_turns=2)
    assert MemoryRewardConfig(group="turn").group == "turn"
    with pytest.raises(ValueError, match=r"MemoryRewardConfig.group must be one of \('question', 'turn'\)"):
        MemoryRewardConfig(group="step")


class _Recording:
    def __init__(self, scorer):
        self.scorer, self.calls = scorer, []

    def __getattr__(self, name):  # the rest of the MemoryScorer protocol: the scorer's own
        return getattr(self.scorer, name)

    def __call__(self, params, full, mem, answers):
        self.calls.append((list(full), list(mem), list(answers)))
        self.outputs = getattr(self, "outputs", []) + [self.scorer(params, full, mem, answers)]
        return self.outputs[-1]


def _scripted_sample_fn(plan):
    """An engine (the re-prefill reference over a scripted sampler) that writes ``plan[turn][row]``
    (texts) for each row of each call, in order."""
    calls = {"n": 0}

    def sample_fn(params, ids, mask, key, max_new_tokens, temperature, top_p):
        texts = plan[min(calls["n"], len(plan) - 1)]
        calls["n"] += 1
        rows = ids.shape[0]
        tokens = np.zeros((rows, max_new_tokens), np.int32)
        lengths = np.zeros((rows,), np.int32)
        for i in range(rows):
            t = TOK.encode(texts[i % len(texts)])[:max_new_tokens]
            tokens[i, : len(t)], lengths[i] = t, len(t)
        logprobs = np.where(np.arange(max_new_tokens)[None] < lengths[:, None], -1.5, 0.0).astype(np.float32)

        class Out:
            pass

        out = Out()
        out.tokens, out.logprobs, out.lengths, out.stopped = tokens, logprobs, lengths, np.ones((rows,), bool)
        return out

    return ReferenceEngine(sample_fn)


def _toy_learner_and_scorer():
    """The toy world, and a learner and a recording scorer on its seed-3 toy model."""
    from mempo_jax.model.forward import make_logits_fn
    from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
    from mempo_jax.rl.memory_reward import MemoryRewardScorer

    tok, env, questions = toy_world()
    _, graphdef, params = toy_model(tok.vocab_size, seed=3)
    logits_fn = make_logits_fn(graphdef)
    scorer = _Recording(MemoryRewardScorer(logits_fn, tok.pad_id, [tok.piece_id("<answer>")], chunk_rows=8))
    learner = Learner(logits_fn, params, make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=1)),
                      micro_batch_rows=4)
    return tok, env, questions, learner, scorer


@pytest.mark.parametrize("include", [False, True])
def test_rl_step_scores_only_well_formed_turns_and_counts_the_rest(include):
    tok, env, questions, learner, scorer = _toy_learner_and_scorer()
    ref = jax.tree.map(lambda x: x.copy(), learner.params)
    first = [MALFORMED["mem not first"], MALFORMED["nested tag"], VALID, MALFORMED["second mem"], VALID, VALID]
    cfg = RLConfig(questions_per_step=2, group_size=3, memory_reward=MemoryRewardConfig(include_malformed=include),
                   rollout=RolloutConfig(max_turns=2, max_new_tokens=12, max_context_tokens=128,
                                         max_observation_tokens=8, temperature=1.0, context_steps=1,
                                         min_rows_bucket=8))
    cluster = RLCluster(learner, ref, _scripted_sample_fn([first, [ANSWER]]), scorer, AgentFormat.plain(tok), env)
    m, trajs = rl_step(cluster, questions[:2], cfg, jax.random.PRNGKey(0), np.random.default_rng(0))
    assert [tr.turns[0].parsed.error is not None for tr in trajs] == [True, True, False, True, False, False]
    assert m["mem/turns"] == 12.0
    assert m["mem/excluded_malformed"] == (0.0 if include else 3.0)
    (full, mem, answers), = scorer.calls
    assert len(full) == (12 if include else 9)  # the excluded turns are not even scored
    assert np.isfinite(m["mem/reward/mean"]) and np.isfinite(m["actor/pg_loss"])


@pytest.mark.parametrize("scale,baseline,hindsight", [("prob", "full", False), ("log", "full", False),
                                                      ("log", "input", False), ("prob", "input", True)])
def test_rl_step_gives_the_advantages_the_memory_reward_in_the_configured_scale(scale, baseline, hindsight,
                                                                                 monkeypatch):
    """``MemoryRewardConfig.scale``: the R_M that ``rl_step`` hands to ``compute_advantages``
    is the scorer's ``P_mem − P_full`` (``prob``) or ``log P_mem − log P_full`` (``log``),
    recomputed here from the scorer's own P values. ``MemoryRewardConfig.baseline``: the scored
    baseline views are ``full_traj[t]`` or the k = 1 context each memory was written from;
    ``MemoryRewardConfig.hindsight``: both views end with the later tool results."""
    from mempo_jax.agent.trajectory import FULL
    from mempo_jax.rl import step as step_mod

    tok, env, questions, learner, scorer = _toy_learner_and_scorer()
    seen = []
    real = step_mod.compute_advantages
    monkeypatch.setattr(step_mod, "compute_advantages",
                        lambda trajs, rows, rewards, r_mem, *a, **k: seen.append(np.array(r_mem)) or
                        real(trajs, rows, rewards, r_mem, *a, **k))
    cfg = RLConfig(questions_per_step=2, group_size=3,
                   memory_reward=MemoryRewardConfig(scale=scale, baseline=baseline, hindsight=hindsight), rollout=RolloutConfig(max_turns=3, max_new_tokens=12, max_context_tokens=160,
                                         max_observation_tokens=8, temperature=1.0, context_steps=1,
                                         min_rows_bucket=8))
    cluster = RLCluster(learner, jax.tree.map(lambda x: x.copy(), learner.params),
                        _scripted_sample_fn([[VALID] * 6, [VALID] * 6, [ANSWER]]), scorer, AgentFormat.plain(tok), env)
    m, trajs = rl_step(cluster, questions[:2], cfg, jax.random.PRNGKey(0), np.random.default_rng(0))
    (out,), (r_mem,), ((views, mems, _),) = scorer.outputs, seen, scorer.calls
    steps = 1 if baseline == "input" else FULL
    later = lambda tr, t: tr.later_observations(t) if hindsight else []  # noqa: E731
    assert sorted(views) == sorted(tr.policy_context(steps, t) + later(tr, t) for tr in trajs
                                   for t in range(len(tr.turns)))
    assert sorted(mems) == sorted(tr.mem_traj(t) + later(tr, t) for tr in trajs for t in range(len(tr.turns)))
    assert any(tr.policy_context(1, 2) != tr.full_traj(2) for tr in trajs)  # the two baselines differ
    assert len(out.p_mem) == len(r_mem) == 18 and np.all(out.p_mem > 0) and np.all(out.p_full > 0)
    want = out.p_mem - out.p_full if scale == "prob" else np.log(out.p_mem.astype(np.float64)) - np.log(out.p_full)
    np.testing.assert_allclose(r_mem, want, rtol=1e-5, atol=1e-7)
    assert np.abs(r_mem).max() > 1e-4  # the views differ, so the two scales are told apart
    np.testing.assert_allclose(m["mem/reward/mean"], want.mean(), rtol=1e-5, atol=1e-7)  # logged in the same units


# ---- Z = the sampled answer ids (docs/algorithm.md §2), never the re-encoded decoded text ----------

@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    from mempo_jax.text.tokenizer import train_sentencepiece

    texts = ["Paris is a city in France", "the answer is Paris", "Rome and Oslo are cities"] * 30
    return train_sentencepiece(texts, tmp_path_factory.mktemp("spm"), 300)


def test_generated_answer_is_scored_as_its_sampled_ids(spm):
    tok = spm
    canonical = tok.encode(" Paris")
    sampled = [tok.piece_id(p) for p in ("▁", "P", "a", "r", "i", "s")]  # a valid, non-canonical spelling
    assert tok.decode(sampled) == " Paris" and sampled != canonical  # re-encoding would change the ids
    ids = tok.encode("<mem> x</mem><think> answer</think><answer>") + sampled + tok.encode("</answer>")
    fmt = AgentFormat.plain(tok)
    answered = Trajectory("q", 0, (("Rome",),), tok.encode("Q: where?\n"))
    answered.turns = [make_turn(fmt, tok.encode("<mem> y</mem><search> Paris</search>"), None, True),
                      make_turn(fmt, ids, None, True)]
    answered.answer = answered.turns[-1].parsed.argument.strip()
    unanswered = Trajectory("q", 0, (("Rome",), ("Oslo",)), tok.encode("Q: where?\n"))
    unanswered.turns = [make_turn(fmt, tok.encode("<mem> y</mem><search> Paris</search>"), None, True)]
    assert answer_ids_of(answered.turns[-1], fmt.codec) == sampled
    assert answer_ids_of(unanswered.turns[-1], fmt.codec) is None
    mem_turn = [(0, 0), (0, 1), (1, 0)]
    _, _, answers = memory_contexts([answered, unanswered], mem_turn, tok, "generated", codec=fmt.codec)
    assert answers == [sampled, sampled, tok.encode(" Rome; Oslo")]  # no answer given: the gold
    assert memory_contexts([answered, unanswered], mem_turn, tok, "generated")[2] == answers  # default codec
    _, _, gold = memory_contexts([answered, unanswered], mem_turn, tok, "gold")
    assert gold == [tok.encode(" Rome"), tok.encode(" Rome"), tok.encode(" Rome; Oslo")]


def test_input_baseline_is_the_context_the_memory_was_written_from():
    """``memory_contexts(..., baseline_steps=1)`` (``MemoryRewardConfig.baseline = "input"`` in k = 1
    mode): turn t's baseline view is prompt + turn t−1's output + its tool result, not the whole
    history; the memory view and Z do not change; ``FULL`` gives ``full_traj[t]``."""
    from mempo_jax.agent.trajectory import FULL

    tr = Trajectory("q", 0, (("paris",),), TOK.encode("who is alice"))
    tr.turns = [_turn("<mem> none</mem><search> alice</search>"), _turn("<mem> alice paris</mem><search> bob</search>"),
                _turn("<mem> bob</mem><answer> paris</answer>")]
    turns = [(0, 0), (0, 1), (0, 2)]
    full, mem, z = memory_contexts([tr], turns, TOK, "gold")
    inp, mem1, z1 = memory_contexts([tr], turns, TOK, "gold", baseline_steps=1)
    assert (mem1, z1) == (mem, z) and full == [tr.full_traj(t) for t in range(3)]
    assert memory_contexts([tr], turns, TOK, "gold", baseline_steps=FULL)[0] == full
    p, (t0, t1, _) = tr.prompt_ids, tr.turns
    assert inp == [p, p + t0.output_ids + t0.observation_ids, p + t1.output_ids + t1.observation_ids]
    assert inp[2] != full[2]  # turn 0's search result is in the history, not in turn 2's input


def test_hindsight_views_end_with_the_later_tool_results():
    """``memory_contexts(..., hindsight=True)`` (``MemoryRewardConfig.hindsight``): turn t's memory
    and baseline views are followed by the tool results of turns t.. in order (turn t's own
    search result first, no outputs); the answer turn, which has none, is scored as without."""
    tr = Trajectory("q", 0, (("paris",),), TOK.encode("who is alice"))
    tr.turns = [_turn("<mem> none</mem><search> alice</search>"), _turn("<mem> alice paris</mem><search> bob</search>"),
                _turn("<mem> bob</mem><answer> paris</answer>")]
    t0, t1, t2 = tr.turns
    t1.observation_ids = TOK.encode("<information> bob was born in rome</information>")
    t2.observation_ids = []  # the answer turn calls no tool
    turns = [(0, 0), (0, 1), (0, 2)]
    full, mem, z = memory_contexts([tr], turns, TOK, "gold", baseline_steps=1)
    full_h, mem_h, z_h = memory_contexts([tr], turns, TOK, "gold", baseline_steps=1, hindsight=True)
    later = [t0.observation_ids + t1.observation_ids, t1.observation_ids, []]
    assert full_h == [f + o for f, o in zip(full, later)] and mem_h == [m + o for m, o in zip(mem, later)]
    assert z_h == z and full_h[2] == full[2] and mem_h[2] == mem[2]


def test_answer_ids_of_needs_a_closed_non_empty_block():
    assert answer_ids_of(_turn("<mem> a</mem><answer></answer>"), FMT.codec) is None
    assert answer_ids_of(_turn("<mem> a</mem><answer> paris"), FMT.codec) is None
    assert answer_ids_of(_turn("<mem> a</mem><answer> paris rome</answer>"), FMT.codec) == TOK.encode("paris rome")


def test_answer_ids_of_text_tags_on_smollm2(smollm2_dir):
    """Text mode: every tag is several SmolLM2 tokens; the answer is cut on the tokens' bytes."""
    from mempo_jax.text.hf_tokenizer import HFTokenizer

    tok = HFTokenizer(smollm2_dir)
    codec = TagCodec(tok, "text")
    head, tail = tok.encode("<mem> x</mem><answer>"), tok.encode("</answer>")
    sampled = tok.encode(" P") + tok.encode("aris")  # non-canonical: encode(" Paris") is one id
    assert tok.decode(sampled) == " Paris" and sampled != tok.encode(" Paris")
    turn = make_turn(AgentFormat(tok, codec), head + sampled + tail, None, True)
    assert turn.parsed.valid and answer_ids_of(turn, codec) == sampled
    # a token straddling the opening tag's edge ("><": the ">" of <answer> and the "<" of <b>) holds
    # tag bytes and is left out; the reference is the decoded text of the kept ids
    straddle = [tok.encode("<")[0], tok.encode("answer")[0]] + tok.encode("><") + tok.encode("b> Paris")
    assert tok.decode(straddle + tail) == "<answer><b> Paris</answer>"
    inner = answer_ids_of(make_turn(AgentFormat(tok, codec), straddle + tail, None, True), codec)
    assert tok.decode(inner) == "b> Paris" and inner == tok.encode("b> Paris")
    assert answer_ids_of(make_turn(AgentFormat(tok, codec), head + sampled, None, False), codec) is None


def test_log_scale_memory_reward_golden_values_and_floor():
    """``memory_reward_values``: ``"prob"`` is the scorer's P_mem − P_full; ``"log"`` is log P_mem −
    log P_full (the docstring's worked example: −3.0546 nats where the probabilities differ by
    −0.0404); P = 0 (no Z token) on both views gives 0, on one view the floor's log."""
    from mempo_jax.rl.memory_reward import LOG_FLOOR, MemoryRewardOutput, memory_reward_values

    p_full = np.array([0.9 ** 0.5 * 0.002 ** 0.5, 0.5, 0.0, 0.25], np.float32)
    p_mem = np.array([0.002, 0.5, 0.0, 0.0], np.float32)
    out = MemoryRewardOutput(p_mem - p_full, p_full, p_mem)
    np.testing.assert_array_equal(memory_reward_values(out, "prob"), p_mem - p_full)
    np.testing.assert_allclose(memory_reward_values(out, "log"),
                               [-3.0546238, 0.0, 0.0, np.log(LOG_FLOOR) - np.log(0.25)], rtol=1e-6)
    with pytest.raises(ValueError, match=r"known: \['log', 'prob'\]"):
        memory_reward_values(out, "logit")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(1e-6, 1.0), st.floats(1e-6, 1.0)), min_size=1, max_size=16))
def test_log_scale_memory_reward_ranks_like_the_probability_difference(pairs):
    """For each turn the two scales agree in sign (a memory that lost probability of Z is
    penalised in both), and at a fixed P_full both are increasing in P_mem."""
    from mempo_jax.rl.memory_reward import MemoryRewardOutput, memory_reward_values

    p_full, p_mem = (np.array(x, np.float32) for x in zip(*pairs))
    out = MemoryRewardOutput(p_mem - p_full, p_full, p_mem)
    prob, log = memory_reward_values(out, "prob"), memory_reward_values(out, "log")
    clear = np.abs(prob) > 1e-6  # float32 rounding aside
    assert np.array_equal(np.sign(prob[clear]), np.sign(log[clear]))
    order = np.argsort(p_mem, kind="stable")
    same_full = MemoryRewardOutput(p_mem - p_full[0], np.full_like(p_full, p_full[0]), p_mem)
    assert np.all(np.diff(memory_reward_values(same_full, "log")[order]) >= 0)


def test_memory_reward_variants_are_bound_by_name_and_old_field_names_are_refused(tmp_path):
    """``MemoryRewardConfig.*`` bindings apply without an ``RLConfig.memory_reward`` line; a run
    folder's ``config.gin`` that binds an ``RLConfig.memory_*`` field is refused with one line naming
    the new binding (``config_loader.RETIRED_FIELDS``; a recipe likewise, test_bad_input)."""
    from mempo_jax.config import DEFAULT_GIN
    from mempo_jax.config_loader import load_config

    cfg = load_config([DEFAULT_GIN], ['MemoryRewardConfig.baseline = "input"', "MemoryRewardConfig.hindsight = True"])
    assert cfg.rl.memory_reward == MemoryRewardConfig(baseline="input", hindsight=True)
    old = tmp_path / "config.gin"
    old.write_text(pathlib.Path(DEFAULT_GIN).read_text() + "\nRLConfig.memory_norm = 'center'\n")
    line = len(old.read_text().splitlines())
    with pytest.raises(ValueError) as e:
        load_config([str(old)])
    assert str(e.value) == (f"config error: RLConfig.memory_norm moved to MemoryRewardConfig.norm; bind "
                            f"MemoryRewardConfig.norm instead ({old}:{line}: RLConfig.memory_norm = 'center')")


def test_hindsight_views_of_a_real_step_differ_only_in_history_against_memory():
    """``MemoryRewardConfig.hindsight`` through ``rl_step`` with the scorer's ``"empty_mem"`` prefix:
    every scored pair of rows is ``H + S`` against ``V + S'``, with ``H`` the baseline context,
    ``V`` the memory view and one shared tail from the tool results on. A turn followed by tool
    results gets ``later + <mem></mem> + <think></think><answer> + Z`` on both views (the policy
    writes a ``<mem>`` block after a tool result); the answer turn, which has none, ends both views
    in a closed ``<mem>`` block (``…</mem> + T + Z``)."""
    from mempo_jax.rl.memory_reward import MemoryRewardScorer, build_scoring_batch
    from mempo_jax.run.experiment import answer_prefix_ids

    tok, env, questions, learner, toy_scorer = _toy_learner_and_scorer()
    full_prefix, answer_prefix = answer_prefix_ids(tok, "empty_mem")
    scorer = _Recording(MemoryRewardScorer(toy_scorer.scorer.logits_fn, tok.pad_id, answer_prefix,
                                           full_prefix=full_prefix, chunk_rows=8))
    cfg = RLConfig(questions_per_step=2, group_size=2, memory_reward=MemoryRewardConfig(hindsight=True),
                   rollout=RolloutConfig(max_turns=3, max_new_tokens=12, max_context_tokens=160,
                                         max_observation_tokens=8, temperature=1.0, context_steps=1,
                                         min_rows_bucket=8))
    cluster = RLCluster(learner, jax.tree.map(lambda x: x.copy(), learner.params),
                        _scripted_sample_fn([[VALID] * 4, [VALID] * 4, [ANSWER]]), scorer, AgentFormat.plain(tok), env)
    _, trajs = rl_step(cluster, questions[:2], cfg, jax.random.PRNGKey(0), np.random.default_rng(0))
    (full, mem, answers), = scorer.calls
    ids, valid, _ = build_scoring_batch(full, mem, answers, answer_prefix, tok.pad_id, full_prefix=full_prefix)
    m = len(full)
    pairs = sorted((ids[i][valid[i]].tolist(), ids[m + i][valid[m + i]].tolist()) for i in range(m))
    close = tok.encode("</mem>")
    want, tails = [], 0
    for tr in trajs:
        for t in range(len(tr.turns)):
            later, z = tr.later_observations(t), tok.encode(" " + tr.golds[0][0])
            history, memory = tr.full_traj(t), tr.mem_traj(t)
            assert memory[-len(close):] == close  # the memory view ends in its closed block
            if later:
                tail = later + full_prefix + answer_prefix + z
                want.append((history + tail, memory + tail))
                tails += 1
            else:  # the answer turn: the full view gets the empty block the memory view already has
                want.append((history + full_prefix + answer_prefix + z, memory + answer_prefix + z))
    assert pairs == sorted(want) and tails == 8 and m == 12
    assert full_prefix == tok.encode("<mem></mem>") and full_prefix[-len(close):] == close


def test_grpo_skips_the_memory_reward_pass_and_updates_bitwise_alike():
    """``RLConfig.memory_coef = 0`` (GRPO) skips the memory-reward pass (``RLConfig.scores_memory``):
    the scorer is never called, and the advantages and the updated parameters are bitwise those of
    a step that scored R_M and multiplied it by 0 (``MemoryRewardConfig.score_when_unused``)."""
    from mempo_jax.rl import step as step_mod

    runs = {}
    for score in (False, True):
        tok, env, questions, learner, scorer = _toy_learner_and_scorer()
        seen = []
        real = step_mod.compute_advantages

        def recording(*a, **k):
            seen.append(real(*a, **k))
            return seen[-1]

        step_mod.compute_advantages = recording
        try:
            cfg = RLConfig(questions_per_step=2, group_size=3, memory_coef=0.0,
                           memory_reward=MemoryRewardConfig(score_when_unused=score),
                           rollout=RolloutConfig(max_turns=3, max_new_tokens=12, max_context_tokens=160,
                                                 max_observation_tokens=8, temperature=1.0, context_steps=1,
                                                 min_rows_bucket=8))
            assert cfg.scores_memory is score
            cluster = RLCluster(learner, jax.tree.map(lambda x: x.copy(), learner.params),
                                _scripted_sample_fn([[VALID] * 6, [VALID, ANSWER] * 3, [WRONG]]), scorer,
                                AgentFormat.plain(tok), env)
            m, _ = rl_step(cluster, questions[:2], cfg, jax.random.PRNGKey(0), np.random.default_rng(0))
        finally:
            step_mod.compute_advantages = real
        runs[score] = (m, seen[0][0], jax.tree.map(np.asarray, learner.params), len(scorer.calls))
    (m0, adv0, p0, calls0), (m1, adv1, p1, calls1) = runs[False], runs[True]
    assert calls0 == 0 and calls1 == 1
    assert m1["mem/p_mem/mean"] > 0 and m0["mem/p_mem/mean"] == 0.0  # scored only when asked
    assert np.asarray(adv0).tobytes() == np.asarray(adv1).tobytes() and np.abs(adv0).max() > 0
    assert all(a.tobytes() == b.tobytes() for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)))
    assert m0["actor/pg_loss"] == m1["actor/pg_loss"]
    assert RLConfig(memory_coef=1.0).scores_memory and not RLConfig(memory_coef=0.0).scores_memory


def test_rl_seed_defaults_to_the_experiment_seed():
    """``RLConfig.seed`` (the RL stage's own stream) falls back to ``ExperimentConfig.seed``."""
    from mempo_jax.config import ExperimentConfig

    assert ExperimentConfig().rl_seed == 0 and ExperimentConfig(seed=3).rl_seed == 3
    assert ExperimentConfig(seed=3, rl=RLConfig(seed=1)).rl_seed == 1
    with pytest.raises(ValueError, match=r"^RLConfig.seed must be an int, got 1.5$"):
        RLConfig(seed=1.5)
