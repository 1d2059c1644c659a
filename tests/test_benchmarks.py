"""Smoke tests of ``benchmarks/``: the compilation counter sees no compilation after the RL
step's precompile (toy world, a few steps), fixed-shape scoring and PPO updates give the values of
the unpadded computation, an all-padding mini-batch leaves the parameters alone, and the scripts'
smallest configurations write JSON with the expected keys and positive figures."""

import json
import pathlib
import sys

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from common import CompileCounter  # noqa: E402

from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer, ppo_plan  # noqa: E402
from mempo_jax.rl.losses import LossConfig  # noqa: E402
from mempo_jax.model.forward import make_logits_fn  # noqa: E402
from toy_agent import toy_model, toy_world  # noqa: E402
from mempo_jax.agent.format import AgentFormat

COUNTER = CompileCounter()  # one listener per process (listeners cannot be removed)


def _rl_setup(monkeypatch, precompile=True):
    from mempo_jax.text.protocol import STOP_TAGS
    from mempo_jax.agent.rollout import RolloutConfig
    from mempo_jax.rl.config import RLConfig
    from mempo_jax.agent.engine import RolloutEngine
    from mempo_jax.rl.memory_reward import MemoryRewardScorer

    tok, env, questions = toy_world()
    cfg, graphdef, params = toy_model(tok.vocab_size, seed=3)
    stop = [tok.eos_id] + [tok.piece_id(t) for t in STOP_TAGS]
    engine = RolloutEngine(graphdef, cfg, stop, tok.pad_id)
    from mempo_jax.agent import engine as engine_module

    mem_open, mem_close = tok.piece_id("<mem>"), tok.piece_id("</mem>")
    make_turn, rng = engine_module.make_turn, np.random.default_rng(0)

    def with_mem(fmt, ids, logps, stopped):
        # most turns open with a <mem> span (a random toy model rarely closes one), so the number of
        # memory turns M varies from step to step, as in training
        ids, logps = np.array(ids), np.array(logps)
        if rng.random() < 0.8:
            ids, logps = np.concatenate([[mem_open, 5, mem_close], ids[3:]]).astype(ids.dtype), np.resize(logps, max(len(ids), 3))
        return make_turn(fmt, ids, logps, stopped)

    monkeypatch.setattr(engine_module, "make_turn", with_mem)

    rl = RLConfig(questions_per_step=2, group_size=2, num_mini_batches=2, precompile=precompile,
                  rollout=RolloutConfig(max_turns=2, max_new_tokens=10, max_context_tokens=128,
                                        max_observation_tokens=8, temperature=1.0, context_steps=1, min_rows_bucket=4))
    logits_fn = make_logits_fn(graphdef)
    scorer = MemoryRewardScorer(logits_fn, tok.pad_id, [tok.piece_id("<answer>")], chunk_rows=8)
    learner = Learner(logits_fn, params, make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=1)),
                      temperature=1.0, micro_batch_rows=4)
    ref = jax.tree.map(lambda x: x.copy(), learner.params)
    return tok, env, questions, rl, engine, scorer, learner, ref


def test_rl_steps_compile_nothing_after_precompile(monkeypatch):
    from mempo_jax.rl.interfaces import RLCluster
    from mempo_jax.rl.step import rl_step

    tok, env, questions, rl, sample_fn, scorer, learner, ref = _rl_setup(monkeypatch)
    per_step, mem_turns = [], []
    for step in range(4):
        mark = COUNTER.count
        qs = [questions[(2 * step + i) % len(questions)] for i in range(2)]
        m, _ = rl_step(RLCluster(learner, ref, sample_fn, scorer, AgentFormat.plain(tok), env), qs, rl,
                       jax.random.PRNGKey(step), np.random.default_rng(step))
        per_step.append(COUNTER.since(mark))
        mem_turns.append(m["mem/turns"])
        assert np.isfinite(m["actor/pg_loss"])
    assert len(per_step[0]) > 0  # the counter has teeth: the precompile is seen
    assert per_step[1:] == [[], [], []], per_step  # from the second step on: nothing compiles
    assert sum(mem_turns) > 0  # the scorer ran on real <mem> turns


def test_ppo_plan_shapes_depend_on_the_bound_only():
    shapes = {ppo_plan(n, 2, 32, max_rows=96)[2:] for n in range(1, 97)}
    assert shapes == {(64, 32)}
    assert ppo_plan(20, 2, 32) == (32, 10, 16, 16)  # without a bound: 10 real rows (at most) in 16


def _rows(rng, n, length, vocab):
    valid = np.arange(length)[None] < rng.integers(length // 2, length + 1, n)[:, None]
    mask = (valid & (np.arange(length)[None] >= 3)).astype(np.float32)
    return {"input_ids": rng.integers(4, vocab, (n, length)).astype(np.int32), "valid": valid, "loss_mask": mask,
            "old_logprobs": np.where(mask > 0, -3.0, 0.0).astype(np.float32),
            "ref_logprobs": np.where(mask > 0, -3.1, 0.0).astype(np.float32),
            "advantages": (rng.normal(0, 1, (n, 1)) * mask).astype(np.float32)}


def test_fixed_shape_ppo_update_equals_the_natural_one():
    cfg, graphdef, params = toy_model(40)
    rows = _rows(np.random.default_rng(0), 10, 16, 40)
    out = []
    for bound in (None, 40):
        learner = Learner(make_logits_fn(graphdef), jax.tree.map(lambda x: x.copy(), params),
                          make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1)), micro_batch_rows=4)
        for _ in range(2):
            m = learner.ppo_update(rows, LossConfig(), 2, np.random.default_rng(1), max_rows=bound)
        out.append((m, [np.asarray(x) for x in jax.tree.leaves(learner.params)]))
    (m0, p0), (m1, p1) = out
    # the two shapes group rows into micro-batches differently (float32 summation order); Adam
    # divides near-zero gradients by their own size, so allow 1e-5 absolute on steps of ~1e-2
    for a, b in zip(p0, p1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert m0.keys() == m1.keys()
    np.testing.assert_allclose([m0[k] for k in sorted(m0)], [m1[k] for k in sorted(m1)], rtol=1e-4, atol=1e-6)


def test_all_padding_mini_batch_does_not_move_the_params():
    cfg, graphdef, params = toy_model(40)
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=1)),
                      micro_batch_rows=4)
    rows = _rows(np.random.default_rng(0), 8, 16, 40)
    learner.ppo_update(rows, LossConfig(), 1, np.random.default_rng(0))  # Adam has momentum now
    snap = [np.array(x) for x in jax.tree.leaves(learner.params)]
    updates = learner.state.step
    empty = dict(rows, loss_mask=np.zeros_like(rows["loss_mask"]))
    assert learner.ppo_update(empty, LossConfig(), 2, np.random.default_rng(0)) == {}
    assert learner.state.step == updates + 2  # scheduled slots are counted, as for a non-finite skip
    # the program itself also keeps params when its mini-batch has no loss token
    packed = dict(empty, segment_ids=empty["valid"].astype(np.int32),  # one sequence per row
                  positions=np.maximum(np.cumsum(empty["valid"], axis=1) - 1, 0).astype(np.int32))
    learner.state, _ = learner.steps.ppo_step(learner.state, learner.steps.place(packed), 2, LossConfig())
    assert all(np.array_equal(a, np.asarray(b)) for a, b in zip(snap, jax.tree.leaves(learner.params)))


def test_chunked_scoring_equals_one_call():
    from mempo_jax.rl.memory_reward import MemoryRewardScorer

    cfg, graphdef, params = toy_model(40)
    rng = np.random.default_rng(0)
    full = [rng.integers(4, 40, int(rng.integers(3, 60))).tolist() for _ in range(7)]
    mem = [rng.integers(4, 40, int(rng.integers(2, 9))).tolist() for _ in range(7)]
    answers = [rng.integers(4, 40, 3).tolist() for _ in range(7)]
    one = MemoryRewardScorer(make_logits_fn(graphdef), 0, [1], chunk_rows=16, min_length=16)(params, full, mem, answers)
    chunked = MemoryRewardScorer(make_logits_fn(graphdef), 0, [1], chunk_rows=4, min_length=16)(params, full, mem,
                                                                                                answers)
    for a, b in zip(one, chunked):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _script(name, tmp_path, *extra):
    import importlib

    mod = importlib.import_module(name)
    path = tmp_path / f"{name}.json"
    doc = mod.main(["--small", "--json", str(path), *extra])
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc, default=float))
    assert doc["machine"]["cores"] >= 1
    return doc["results"]


def test_scoring_script_json(tmp_path):
    res = _script("bench_scoring", tmp_path)
    assert res["stacked_tok_s"] > 0 and res["two_calls_tok_s"] > 0
    assert res["max_abs_diff_two_calls"] < 1e-5
    assert res["stacked_packed_tok_s"] > 0 and res["max_abs_diff_packed_vs_padded"] < 1e-5
    if "transformers_tok_s" in res:  # same weights: transformers gives the same probabilities
        assert res["transformers_tok_s"] > 0 and res["max_abs_diff_transformers"] < 1e-4


def test_roofline_script_json(tmp_path):
    res = _script("bench_roofline", tmp_path, "--repeats", "1")
    for part in ("peak", "update", "decode"):
        assert res[part]["flop_s"] > 0
    assert res["update"]["flops_analytic"] > 0


def test_update_script_json(tmp_path, smollm2_first_layers):
    """The update benchmark times the recipe's learner and a binding's side by side on the real
    checkpoint, cut to its first layers (conftest's ``smollm2_first_layers``)."""
    res = _script("bench_update", tmp_path, "--checkpoint", str(smollm2_first_layers),
                  "--against", "ExecutionConfig.micro_batch_rows=2")
    assert res["recipe"]["rows"] == res["bindings"]["rows"] == 8 and res["recipe"]["tokens"] > 8 * 64 * 0.2
    assert (res["recipe"]["micro_batch_rows"], res["bindings"]["micro_batch_rows"]) == (8, 2)
    assert all(r["epoch_s"] > 0 and r["s_per_row"] == r["epoch_s"] / 8 and r["peak_rss_gib"] > 0
               and r["page_faults"] >= 0 for r in res.values())


def test_synthetic_update_rows_are_right_padded_with_loss_on_their_last_quarter():
    from bench_update import synthetic_rows

    rows = synthetic_rows(32, 100, 50, seed=3)
    n = rows["valid"].sum(1)
    assert ((n >= 20) & (n <= 80)).all()
    np.testing.assert_array_equal(rows["valid"], np.arange(100)[None] < n[:, None])
    np.testing.assert_array_equal(rows["loss_mask"].sum(1), n // 4)  # the last quarter, never column 0
    assert not rows["loss_mask"][:, 0].any() and ((rows["loss_mask"] > 0) <= rows["valid"]).all()


def test_attention_script_json(tmp_path):
    rows = _script("bench_attention", tmp_path, "--repeats", "1")
    assert [r["keys"] for r in rows] == [64, 96] and all(r["ours_ms"] > 0 for r in rows)
    for r in rows:  # the same attention as torch's SDPA on the same keys
        if "torch_ms" in r:
            assert r["max_abs_diff"] < 1e-5


def test_tokens_script_skips_without_a_run(tmp_path):
    res = _script("bench_tokens", tmp_path, "--run_dir", str(tmp_path / "absent"))
    assert res["skipped"].startswith("SKIP") and "python -m mempo_jax.commands.train --run_dir runs/tiny" in res["skipped"]


@pytest.mark.skipif(not (REPO / "benchmarks" / "run_all.py").is_file(), reason="no run_all")
def test_run_all_lists_every_section():
    import run_all

    assert [s[0] for s in run_all.SECTIONS] == ["decode", "scoring", "rl_step", "tokens", "roofline", "rollout",
                                                   "attention"]
    for _, script, _ in run_all.SECTIONS:
        assert (REPO / "benchmarks" / script).is_file()


def test_device_check_smoke_prints_one_json_of_every_section():
    """``device_check.py --smoke``: the GPU check's code on the CPU (the kernel strategy in interpret
    mode), one JSON line, no section failed, float32 parity with transformers."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one device, as on the lent machine
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "device_check.py"), "--smoke", "--sections",
                          "env,parity,decode,prefill,update"], capture_output=True, text=True, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [k for k, v in res.items() if isinstance(v, dict) and ("error" in v or "skipped" in v)], res
    assert res["env"]["kernel_impl"] == "cudnn" and res["parity"]["float32"]["max_abs"] < 1e-4
    assert {(r["batch"], r["attention_impl"]) for r in res["decode"]["runs"]} == {
        (4, i) for i in ("xla", "cudnn")}
    assert all(r["tokens_per_s"] is None or r["tokens_per_s"] > 0 for r in res["decode"]["runs"])
    assert all(r["tokens_per_s"] > 0 for r in res["prefill"]["runs"])
    assert res["update"]["tflop_s"] > 0 and res["update"]["memory"]["plan_bytes"] > 0
