"""The rollout engine (``agent/engine.py``, ``slot_sampler.py``, the ``Decoder`` over a slot cache) against
the re-prefill-every-turn reference (``tests/reference_rollout.py``): same turns on the toy world, greedy float32
(full and k = 1, with slot refill, with the token budget); sampled trajectories independent of the
slot layout; prefills hold only what the cache lacks; nothing compiles after the warm-up; the
blocked attention equals dense softmax attention computed in numpy; sampled trajectories and tool
answers equal to golden ones recorded from an earlier engine."""

import dataclasses
import hashlib
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import CompileCounter  # noqa: E402
from toy_agent import toy_model, toy_world  # noqa: E402

from mempo_jax.agent.format import AgentFormat  # noqa: E402
from mempo_jax.agent.rollout import RolloutConfig, new_trajectories  # noqa: E402
from reference_rollout import ReferenceEngine  # noqa: E402
from mempo_jax.model.attention_mask import AttentionMask  # noqa: E402
from mempo_jax.model.attention_xla import blocked_attention  # noqa: E402
from mempo_jax.agent.engine import RolloutEngine  # noqa: E402

COUNTER = CompileCounter()


@pytest.fixture(scope="module")
def world():
    tok, env, questions = toy_world()
    cfg, graphdef, params = toy_model(tok.vocab_size, seed=3)
    fmt = AgentFormat.plain(tok)
    engine = RolloutEngine(graphdef, cfg, fmt.codec.stop_ids, tok.pad_id)
    return fmt, env, questions, params, engine


BASE = RolloutConfig(max_turns=4, max_new_tokens=10, max_context_tokens=128, max_observation_tokens=8,
                     temperature=0.0, min_rows_bucket=4, decode_chunk=4, prefill_chunk=32)


def _run(world, cfg, key=0, group=2, reference=False):
    """``rollout`` on the world's engine (``reference``: the re-prefill loop over its one-shot generate)."""
    fmt, env, questions, params, engine = world
    trajs = new_trajectories(fmt, questions, group)
    (ReferenceEngine(engine) if reference else engine).rollout(params, trajs, fmt, env, cfg, jax.random.PRNGKey(key))
    return trajs


def _assert_same(a, b, logprob_atol=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.end_reason, x.answer, len(x.turns)) == (y.end_reason, y.answer, len(y.turns))
        for tx, ty in zip(x.turns, y.turns):
            assert tx.output_ids == ty.output_ids
            assert tx.observation_ids == ty.observation_ids
            assert (tx.context_len, tx.mem_span, tx.tool_ok, tx.parsed) == (ty.context_len, ty.mem_span, ty.tool_ok,
                                                                             ty.parsed)
            np.testing.assert_allclose(tx.output_logprobs, ty.output_logprobs, atol=logprob_atol, rtol=0)


@pytest.mark.parametrize("context_steps,slots,max_context,chunk", [("full", 0, 128, 32), (1, 0, 128, 32),
                                                                   ("full", 3, 128, 32), (1, 3, 128, 32),
                                                                   ("full", 0, 60, 32), ("full", 0, 128, 2),
                                                                   (1, 3, 128, 4), ("full", 16, 128, 4),
                                                                   (1, 16, 128, 32)])
def test_cached_engine_gives_todays_turns(world, context_steps, slots, max_context, chunk):
    """Chunks of 2 and 4 tokens: a slot's prefill spans several rows of one call and several calls;
    16 slots for 8 trajectories: decode runs on a row bucket of the generating slots (``decode_rows``)."""
    cfg = dataclasses.replace(BASE, context_steps=context_steps, num_slots=slots, max_context_tokens=max_context,
                              prefill_chunk=chunk)
    reference = _run(world, cfg, reference=True)
    cached = _run(world, cfg)
    _assert_same(reference, cached)
    reasons = {tr.end_reason for tr in reference}
    assert reasons == ({"budget"} if max_context == 60 else {"max_turns"})  # the budget case has teeth
    assert sum(len(t.output_ids) for tr in reference for t in tr.turns) > 8 * 4 * 2


def test_one_slot_in_several_rows_of_a_call_equals_one_row(world):
    """``extend`` with a slot's prefill cut into three rows given out of order (chunk 3, 1, 2, and
    a padding row) leaves the state of the same prefill in one row: cache, length, first token."""
    _, _, _, params, engine = world
    ss = engine.sampler
    ids = np.arange(3, 15, dtype=np.int32)  # 12 tokens: rows of 4
    key = jax.random.PRNGKey(0)

    def run(rows, chunks, starts, first):
        state = ss.init_state(2, 32, 4)
        width = max(len(c) for c in chunks)
        padded = np.zeros((len(chunks), width), np.int32)
        for r, c in enumerate(chunks):
            padded[r, : len(c)] = c
        z = np.zeros((len(chunks),), np.int32)
        counts = np.asarray([max(len(c), 1) for c in chunks])
        return ss.extend(params, state, np.asarray(rows, np.int32), padded, counts, np.asarray(starts, np.int32),
                         np.asarray(first), z, z, key, 1.0, 1.0, True)

    one = run([1], [ids], [0], [True])
    split = run([1, 1, 2, 1], [ids[8:], ids[:4], [], ids[4:8]], [8, 0, 0, 4], [True, False, False, False])
    assert int(split.lengths[1]) == int(one.lengths[1]) == 12
    assert int(split.last[1]) == int(one.last[1]) and bool(split.active[1]) == bool(one.active[1])
    np.testing.assert_allclose(np.asarray(split.cache.k[:, 1, :, :12]), np.asarray(one.cache.k[:, 1, :, :12]),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(split.logps[1]), np.asarray(one.logps[1]), atol=1e-5)


def test_sampled_trajectories_do_not_depend_on_the_slot_layout(world):
    cfg = dataclasses.replace(BASE, temperature=1.0)
    one_slot_each = _run(world, cfg, key=5)
    refilled = _run(world, dataclasses.replace(cfg, num_slots=3), key=5)  # other slots, other batches
    _assert_same(one_slot_each, refilled)
    other_key = _run(world, cfg, key=6)
    assert [tr.turns[0].output_ids for tr in other_key] != [tr.turns[0].output_ids for tr in one_slot_each]


def test_prefills_hold_only_what_the_cache_lacks(world, monkeypatch):
    from mempo_jax.agent.slot_sampler import SlotSampler

    written = []
    real = SlotSampler.extend

    def counting(self, params, state, rows, ids, counts, *args, **kw):
        written.append(int(np.sum(np.asarray(counts)[np.asarray(rows) < state.lengths.shape[0]])))
        return real(self, params, state, rows, ids, counts, *args, **kw)

    monkeypatch.setattr(SlotSampler, "extend", counting)
    for steps in ("full", 1):
        written.clear()
        trajs = _run(world, dataclasses.replace(BASE, context_steps=steps))
        expect = 0
        seen = set()
        for tr in trajs:  # turn 0: the prompt once per group (then its last id); turn t: what the context adds
            expect += 1 if tuple(tr.prompt_ids) in seen else len(tr.prompt_ids)
            seen.add(tuple(tr.prompt_ids))
            for t in range(1, len(tr.turns)):
                prev = tr.turns[t - 1]
                if steps == "full":  # the last sampled id (never fed) + the tool result
                    expect += 1 + len(prev.observation_ids)
                else:  # k = 1: the prompt (at least) stays: the longest common prefix with the cache
                    before = tr.policy_context(1, t - 1) + prev.output_ids[:-1]
                    ctx = tr.policy_context(1, t)
                    keep = next((i for i, (a, b) in enumerate(zip(before, ctx)) if a != b), min(len(before), len(ctx)))
                    keep = min(keep, len(ctx) - 1)  # one id at least is fed: its logits start the turn
                    assert keep >= len(tr.prompt_ids)
                    expect += len(ctx) - keep
        assert sum(written) == expect
        today = sum(t.context_len for tr in trajs for t in tr.turns)  # the reference prefills every whole context
        assert sum(written) < (today / 2 if steps == "full" else today)


@pytest.mark.parametrize("slots", [0, 16])
def test_no_compilation_after_warm_up(world, slots):
    """16 slots for 8 trajectories: prefill calls of 8 and 16 rows, decode row buckets; the first
    call of a rollout starts from ``init_state`` (it compiled anew when that state's placement
    differed from the programs' outputs)."""
    fmt, env, questions, params, engine = world
    cfg = dataclasses.replace(BASE, temperature=1.0, num_slots=slots, prefill_chunk=4)
    engine.warm(params, cfg, 8, jax.random.PRNGKey(0))
    mark = COUNTER.count
    for key in (1, 2):
        _run(world, cfg, key=key)
    assert COUNTER.since(mark) == []
    mark = COUNTER.count
    _run(world, dataclasses.replace(cfg, decode_chunk=5))  # a new chunk length is a new program:
    assert COUNTER.since(mark) != []  # the counter sees it


def _dense_attention(q, k, v, q_pos):
    """numpy reference: causal-by-position softmax attention, GQA (query head j uses kv head j // g)."""
    b, t, h, hd = q.shape
    kvh = k.shape[1]
    out = np.zeros_like(q, dtype=np.float64)
    for bi in range(b):
        for ti in range(t):
            for hi in range(h):
                kk, vv = k[bi, hi // (h // kvh)], v[bi, hi // (h // kvh)]
                s = kk[: q_pos[bi, ti] + 1] @ q[bi, ti, hi] / np.sqrt(hd)
                w = np.exp(s - s.max())
                out[bi, ti, hi] = (w / w.sum()) @ vv[: q_pos[bi, ti] + 1]
    return out


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**16), t=st.sampled_from([1, 3]), block=st.sampled_from([4, 8, 16]))
def test_blocked_attention_equals_dense_softmax(seed, t, block):
    rng = np.random.default_rng(seed)
    b, h, kvh, hd, size = 3, 4, 2, 8, 32
    q = rng.normal(size=(b, t, h, hd)).astype(np.float32)
    k = rng.normal(size=(b, kvh, size, hd)).astype(np.float32)
    v = rng.normal(size=(b, kvh, size, hd)).astype(np.float32)
    q_pos = rng.integers(0, size - t, (b, 1)) + np.arange(t)[None]
    bound = int(q_pos.max()) + 1
    unread = -(-bound // block) * block  # blocks past the bound are never read: NaN there changes nothing
    k_junk, v_junk = k.copy(), v.copy()
    k_junk[:, :, unread:], v_junk[:, :, unread:] = np.nan, np.nan
    ours = blocked_attention(q, k_junk[None], v_junk[None], AttentionMask.cached(q_pos), layer=0,
                             kv_bound=np.int32(bound), block_k=block)
    np.testing.assert_allclose(np.asarray(ours), _dense_attention(q, k, v, q_pos), atol=2e-5, rtol=1e-5)


@pytest.mark.slow  # a real checkpoint through both engines
def test_cached_engine_gives_todays_turns_on_smollm2(smollm2_first_layers, shared_data, context_steps="full"):
    """The real checkpoint (text tags: the stop automaton, its chat template, BM25 over HotpotQA),
    cut to its first layers (conftest's ``smollm2_first_layers``; ``MEMPO_SMOLLM2_LAYERS=30`` runs
    the whole model)."""
    from bench_rollout import setup_smollm2

    fmt, env, held, _, _, params, engine, _ = setup_smollm2(smollm2_first_layers)
    cfg = RolloutConfig(max_turns=2, max_new_tokens=24, max_context_tokens=512, max_observation_tokens=24,
                        temperature=0.0, min_rows_bucket=4, context_steps=context_steps, prefill_chunk=256)
    out = []
    for e in (ReferenceEngine(engine), engine):
        trajs = new_trajectories(fmt, held[:2], 2)
        e.rollout(params, trajs, fmt, env, cfg, jax.random.PRNGKey(0))
        out.append(trajs)
    _assert_same(*out, logprob_atol=1e-4)
    assert all(len(tr.turns) == 2 for tr in out[0])
    assert any(t.observation_ids for tr in out[0] for t in tr.turns)


def test_bench_rollout_small_writes_its_figures(tmp_path, shared_data):  # the recipe reads HotpotQA
    import json

    import bench_rollout

    bench_rollout.main(["--small", "--modes", "full", "--no_decode", "--questions", "2", "--json",
                        str(tmp_path / "r.json")])
    doc = json.loads((tmp_path / "r.json").read_text())
    rows = {r["engine"]: r for r in doc["results"]["rows"]}
    assert "cached" in rows
    for r in rows.values():
        assert r["generated_tokens"] > 0 and r["tok_s_steady"] > 0 and 0 < r["useful_fraction"] <= 1
    if "transformers" in rows:
        assert all(r["same_as_transformers"] == 1.0 for r in rows.values())  # greedy float32: the same episodes
        assert rows["cached"]["useful_fraction"] > rows["transformers"]["useful_fraction"]


@pytest.mark.parametrize("shape", [(2, 2, 2)])
def test_cached_engine_on_a_mesh_gives_the_one_device_turns(world, shape):
    """The mesh engine's slot programs: cache slots over data x fsdp, kv heads over tensor."""
    from mempo_jax.core.sharding import make_mesh, shard_params

    fmt, env, questions, params, engine = world
    mesh = make_mesh(*shape)
    ss = engine.sampler
    mesh_engine = RolloutEngine(ss.graphdef, ss.model_cfg, ss.stop_ids, ss.pad_id, mesh=mesh)
    cfg = dataclasses.replace(BASE, min_rows_bucket=8)
    ref = _run(world, cfg)
    trajs = new_trajectories(fmt, questions, 2)
    mesh_engine.rollout(shard_params(params, mesh), trajs, fmt, env, cfg, jax.random.PRNGKey(0))
    _assert_same(ref, trajs)
    slots = mesh_engine.sampler
    state = slots.init_state(8, 128, 10)
    placed = state.cache.k.sharding
    assert placed.shard_shape(state.cache.k.shape)[1] == 8 // (shape[0] * shape[1])
    state = slots.copy(state, np.zeros((1,), np.int32), np.ones((1,), np.int32))
    state = slots.decode(shard_params(params, mesh), state, 2, jax.random.PRNGKey(0), 1.0, 1.0, True)
    # the programs return the slots exactly as init_state placed them: before, the cache came back as
    # P(None, ('data', 'fsdp'), 'tensor'), the same layout spelled otherwise, i.e. another jit key
    assert state.cache.k.sharding == placed and state.cache.v.sharding == placed
    # the decoder's activations are pinned on the rollout mesh (activation_sharding), not left to propagation
    lowered = slots._program("decode", state).lower(shard_params(params, mesh), state, jax.random.PRNGKey(0),
                                                    jnp.float32(1.0), jnp.float32(1.0), rows=None, steps=2,
                                                    greedy=True, use_top_p=False)
    assert lowered.as_text().count("sdy.sharding_constraint") >= ss.model_cfg.num_layers


@pytest.mark.slow  # tunix compiles a prefill and a decode program per batch shape
def test_bench_rollout_tunix_loop_gives_the_cached_engines_episodes(tmp_path, shared_data):
    """tunix's Sampler in the benchmark's turn loop (rows run to EOS, cut at the first stop)
    on the toy world: greedy float32, so the same trajectories as the cached engine."""
    import json

    import bench_rollout
    from common import import_tunix

    try:
        import_tunix()
    except ImportError as e:  # tunix is not a project dependency (bench_rollout's docstring)
        pytest.skip(str(e))
    bench_rollout.main(["--small", "--modes", "full", "--no_decode", "--questions", "2", "--engines", "cached,tunix",
                        "--json", str(tmp_path / "r.json")])
    rows = {r["engine"]: r for r in json.loads((tmp_path / "r.json").read_text())["results"]["rows"]}
    assert rows["tunix"]["generated_tokens"] > 0 and rows["tunix"]["computed_positions"] > 0
    assert rows["cached"]["same_as_tunix"] == 1.0


def test_bfloat16_rollout_weights_are_the_trainers_rounded_to_bfloat16(world):
    """``ExecutionConfig.rollout_dtype = "bfloat16"``: the weight sync casts every floating parameter,
    and the engine's turns are those of float32 weights rounded through bfloat16 (the layers upcast
    a weight to the activation dtype), not the float32 policy's own."""
    import jax.numpy as jnp

    fmt, env, questions, params, engine = world
    ss = engine.sampler
    bf16 = RolloutEngine(ss.graphdef, ss.model_cfg, ss.stop_ids, ss.pad_id, param_dtype="bfloat16")
    floating = [x for x in jax.tree.leaves(bf16.place(params)) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floating and {x.dtype for x in floating} == {jnp.dtype(jnp.bfloat16)}
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                           else x, params)
    cfg = dataclasses.replace(BASE, temperature=1.0)
    got, want = new_trajectories(fmt, questions, 2), new_trajectories(fmt, questions, 2)
    bf16.rollout(params, got, fmt, env, cfg, jax.random.PRNGKey(5))
    engine.rollout(rounded, want, fmt, env, cfg, jax.random.PRNGKey(5))
    _assert_same(want, got, logprob_atol=1e-6)
    own = new_trajectories(fmt, questions, 2)
    engine.rollout(params, own, fmt, env, cfg, jax.random.PRNGKey(5))
    first = lambda trajs: np.asarray(trajs[0].turns[0].output_logprobs[:1])  # noqa: E731 (same first token)
    assert np.abs(first(own) - first(got)).max() > 0  # the rounding is visible: the test sees the cast


GOLDEN = REPO / "tests" / "fixtures" / "engine_golden.json"
GOLDEN_CASES = {  # name: (changes to BASE, PRNG seed); the sampled tests' shapes above: nothing compiles anew
    "full_refill_budget": (dict(temperature=1.0, context_steps="full", num_slots=3, max_turns=7), 11),
    "k1_one_slot_each": (dict(temperature=1.0, context_steps=1), 12),
}
GOLDEN_TURNS = ("<mem> alice</mem><search> globex rome</search>",
                "<mem></mem><think> who</think><access> acme</access>",
                "<mem> bob</mem><think> is</think><access> globex</access>", "<mem></mem><access> lima</access>",
                "<mem> paris</mem><answer> paris</answer>", "<search> rome",
                "<mem> oslo</mem><search> oslo</search>")


def _golden_record(trajs) -> list[dict]:
    """What the golden file keeps of each trajectory (log-probs as the sha256 of their float32 bytes)."""
    return [{"end_reason": tr.end_reason, "answer": tr.answer, "turns": [
        {"ids": t.output_ids, "logprobs_sha256": None if t.output_logprobs is None else
         hashlib.sha256(np.asarray(t.output_logprobs, np.float32).tobytes()).hexdigest(),
         "observation": t.observation_ids, "context_len": t.context_len,
         "mem_span": None if t.mem_span is None else list(t.mem_span), "tool_ok": t.tool_ok,
         "error": t.parsed.error} for t in tr.turns]} for tr in trajs]


def _golden_observed(world) -> dict:
    from mempo_jax.agent.trajectory import Trajectory
    from mempo_jax.agent.turns import apply_tools, make_turn
    from mempo_jax.tools.bm25 import BM25Index
    from mempo_jax.tools.corpus import Document
    from mempo_jax.tools.search import search_environment

    fmt = world[0]
    out = {name: _golden_record(_run(world, dataclasses.replace(BASE, **change), key=seed))
           for name, (change, seed) in GOLDEN_CASES.items()}
    env = search_environment(BM25Index([Document("acme", "acme", "bob works at acme"),
                                     Document("globex", "globex", "globex is in rome")]), topk=1)
    trajs = [Trajectory(f"t{i}", i, (("paris",),), fmt.prompt_ids("where")) for i in range(len(GOLDEN_TURNS))]
    turns = [make_turn(fmt, fmt.tokenizer.encode(text), None, i < len(GOLDEN_TURNS) - 1)
             for i, text in enumerate(GOLDEN_TURNS)]
    apply_tools(fmt, env, trajs, turns, dataclasses.replace(BASE, max_turns=1))
    out["tools"] = _golden_record(trajs)
    return out


def test_engine_and_tools_give_the_golden_trajectories(world):
    """Sampled turns of the toy model with slot refill, the token budget and k = 1 contexts, and the
    tool answers to hand-written turns (search, access, an unknown id, an answer, malformed turns, a
    turn cut by its token budget, the turn limit), against ``tests/fixtures/engine_golden.json``
    (recorded from an earlier engine on these seeds). Ids, observations, context lengths, ``<mem>``
    spans, tool flags and end reasons compare exactly; log-probs bit for bit (sha256 of their
    float32 bytes). ``MEMPO_RECORD_GOLDEN=1`` rewrites the fixture: only after a change meant to
    move the trajectories."""
    got = json.loads(json.dumps(_golden_observed(world)))
    if os.environ.get("MEMPO_RECORD_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, separators=(",", ":")) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got.keys() == want.keys()
    for name in want:
        assert len(got[name]) == len(want[name]), name
        for i, (g, w) in enumerate(zip(got[name], want[name])):
            assert g == w, f"{name}: trajectory {i} differs from the golden record"
    assert {tr["end_reason"] for tr in want["full_refill_budget"]} == {"budget", "max_turns"}  # the cases have teeth
    assert [t["tool_ok"] for tr in want["tools"] for t in tr["turns"]] == [True, True, True, False, True, False, False]
