"""Two CPU processes joined by ``jax.distributed.initialize`` on 127.0.0.1 run one full MemPO RL step
(memory-reward scoring, reference log-probs and PPO update on a mesh that spans both; rollout with
host tools on each process's own devices, each rolling out its half of the questions with the
cached engine) and end with the parameters (and the sampled tokens) of the same step run by one
process.

The policy is the toy agent model after a short SFT on scripted two-turn episodes
(``<mem>`` + ``<search>``, then ``<mem>`` + ``<answer>``), so sampled turns call the search tool
and write ``<mem>`` spans. Run as a script, this file is the worker process.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
from mempo_jax.agent.format import AgentFormat

HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/ (toy_agent, conftest)
REPO = HERE.parent
WORKER_TIMEOUT_S = 240


def rl_config():
    from mempo_jax.agent.rollout import RolloutConfig
    from mempo_jax.rl.losses import LossConfig
    from mempo_jax.rl.config import RLConfig

    rollout = RolloutConfig(max_turns=3, max_new_tokens=16, max_context_tokens=256, max_observation_tokens=12,
                            temperature=1.0, context_steps=1, min_rows_bucket=16)
    # two mini-batches = two optimizer steps: the warm-up schedule gives the first one lr = 0
    return RLConfig(steps=1, questions_per_step=4, group_size=4, num_mini_batches=2, loss=LossConfig(),
                    rollout=rollout)


def run_rl_step(params, mesh, seed: int = 0):
    """One ``rl_step`` on this process's share of the toy questions (all of them on one process).

    Returns ``(new params, metrics, sampled turn ids per trajectory)``.
    """
    import jax

    from mempo_jax.run import lockstep
    from mempo_jax.text.protocol import STOP_TAGS
    from mempo_jax.core.distributed import process_slice
    from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
    from mempo_jax.model.forward import make_logits_fn
    from mempo_jax.rl.interfaces import RLCluster
    from mempo_jax.rl.step import rl_step
    from mempo_jax.agent.engine import RolloutEngine
    from mempo_jax.rl.memory_reward import MemoryRewardScorer
    from mempo_jax.core.rollout_mesh import rollout_mesh
    from mempo_jax.core.sharding import logical_to_sharding, param_shardings
    from toy_agent import toy_model, toy_world

    tok, env, questions = toy_world()
    cfg, graphdef, _ = toy_model(tok.vocab_size)
    stop_ids = [tok.eos_id] + [tok.piece_id(t) for t in STOP_TAGS]
    local = None if mesh is None else rollout_mesh(mesh, cfg.num_heads, cfg.num_kv_heads)
    engine = RolloutEngine(graphdef, cfg, stop_ids, tok.pad_id, mesh=local)
    logits_fn = make_logits_fn(graphdef)
    kw = {}
    if mesh is not None:
        kw = dict(batch_sharding=logical_to_sharding(("batch", None), mesh),
                  param_shardings=param_shardings(params, mesh))
    scorer = MemoryRewardScorer(logits_fn, tok.pad_id, [tok.piece_id("<answer>")], temperature=1.0, **kw)
    sync, scorer = lockstep.distribute(scorer)
    sync.barrier()  # the learner's construction runs global programs
    learner = Learner(logits_fn, params, make_optimizer(OptimConfig(learning_rate=1e-3, warmup_steps=1)),
                      temperature=1.0, micro_batch_rows=8, mesh=mesh, pad_id=tok.pad_id,
                      placement=lockstep.LockstepRows(sync, tok.pad_id))
    ref_params = jax.tree.map(lambda x: x.copy(), learner.params)
    share = process_slice(len(questions))
    cluster = RLCluster(learner, ref_params, engine, scorer, AgentFormat.plain(tok), env)
    metrics, trajs = rl_step(cluster, questions[share], rl_config(), jax.random.PRNGKey(seed), np.random.default_rng(seed),
                             traj_offset=share.start * rl_config().group_size)
    turns = [[list(map(int, t.output_ids)) for t in tr.turns] for tr in trajs]
    if jax.process_count() > 1:
        metrics["_lockstep"] = _after_the_step(learner, engine, sync, tok, env, questions)
    return learner.params, metrics, turns


def _after_the_step(learner, engine, sync, tok, env, questions) -> dict:
    """Process 1 alone rolls out one more question (an evaluation) with the updated policy, synced
    onto its rollout mesh by both, while process 0 goes straight to collectives and waits there."""
    import jax

    from mempo_jax.agent.rollout import new_trajectories
    from mempo_jax.core.distributed import gather_lists, mean_metrics

    pid = jax.process_index()
    extra = []
    params = engine.place(learner.params)  # the weight sync: a collective
    if pid == 1:
        extra = new_trajectories(AgentFormat.plain(tok), questions[:1], 2)
        engine.rollout(params, extra, AgentFormat.plain(tok), env, rl_config().rollout, jax.random.PRNGKey(7))
    mean = mean_metrics({"x": float(pid + 1), "turns": float(sum(len(t.turns) for t in extra))}, weight=pid + 1,
                        sync=sync)
    return {"mean": mean, "concat": [x for (x,) in gather_lists([[pid]] * (pid + 1))],
            "extra_turns": [len(t.turns) for t in extra]}


def sft_params():
    """The toy model after 80 SFT steps on scripted episodes (one device, deterministic)."""
    import jax

    from mempo_jax.text.protocol import parse_turn, render_turn
    from mempo_jax.core.batching import pad_sequences
    from mempo_jax.rl.learner import Learner, OptimConfig, make_optimizer
    from mempo_jax.model.forward import make_logits_fn
    from toy_agent import toy_model, toy_world

    tok, env, questions = toy_world()
    _, graphdef, params = toy_model(tok.vocab_size)
    keywords = {"q0": "alice", "q1": "acme", "q2": "globex", "q3": "carol"}
    rows = []
    for q in questions:
        prompt = AgentFormat.plain(tok).prompt_ids(q.question)
        first = render_turn(" " + q.question, " search", "search", " " + keywords[q.id])
        obs = AgentFormat.plain(tok).observation_ids(env.execute(parse_turn(first)).observation, 12)
        second = render_turn(" " + keywords[q.id] + " " + q.golds[0][0], " answer", "answer", " " + q.golds[0][0])
        t1, t2 = tok.encode(first), tok.encode(second)
        rows.append((prompt + t1, [0.0] * len(prompt) + [1.0] * len(t1)))
        ctx = prompt + t1 + obs
        rows.append((ctx + t2, [0.0] * len(ctx) + [1.0] * len(t2)))
    ids, valid = pad_sequences([r[0] for r in rows], tok.pad_id, 64)
    mask = np.zeros(ids.shape, np.float32)
    for i, (_, m) in enumerate(rows):
        mask[i, : len(m)] = m
    learner = Learner(make_logits_fn(graphdef), params, make_optimizer(OptimConfig(learning_rate=1e-2, warmup_steps=5)),
                      micro_batch_rows=8)
    for _ in range(80):
        m = learner.sft_step({"input_ids": ids, "valid": valid, "loss_mask": mask})
    assert m["sft/loss"] < 0.5, m
    return jax.tree.map(np.asarray, learner.params)


def _flat(params) -> list[np.ndarray]:
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(params)]


# ------------------------------------------------------------------------------------- worker


def worker(argv) -> int:
    """``python tests/run/test_multiprocess.py --process_id I --num_processes N --port P --params F --out D``."""
    ap = argparse.ArgumentParser()
    for name in ("--process_id", "--num_processes", "--port"):
        ap.add_argument(name, type=int, required=True)
    ap.add_argument("--params", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    sys.path[:0] = [str(HERE), str(REPO)]
    import jax
    from jax.experimental import multihost_utils

    from mempo_jax.core.distributed import maybe_initialize
    from mempo_jax.core.mesh_config import MeshConfig
    from toy_agent import toy_model, toy_world

    assert maybe_initialize(f"127.0.0.1:{args.port}", args.num_processes, args.process_id)
    assert jax.process_count() == args.num_processes and jax.device_count() == 2 * args.num_processes
    mesh = MeshConfig(data=1, fsdp=-1, tensor=2).make()  # fsdp across the processes, tensor within
    _, _, abstract = toy_model(toy_world()[0].vocab_size)
    stored = np.load(args.params)
    params = jax.tree.unflatten(jax.tree.structure(abstract), [stored[f"p{i}"] for i in range(len(stored.files))])
    new_params, metrics, turns = run_rl_step(params, mesh)
    full = multihost_utils.process_allgather(new_params, tiled=True)
    out = pathlib.Path(args.out)
    if args.process_id == 0:
        np.savez(out / "params.npz", **{f"p{i}": x for i, x in enumerate(_flat(full))})
    (out / f"result_{args.process_id}.json").write_text(json.dumps({
        "metrics": metrics, "turns": turns, "process_count": jax.process_count(),
        "mesh": dict(mesh.shape), "addressable": len(jax.tree.leaves(new_params)[0].addressable_shards)}))
    return 0


# -------------------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_two_processes_run_one_rl_step_like_one_process(tmp_path):
    import jax

    from conftest import FAST_XLA, free_port  # here, not at the top: the worker processes run this file without conftest

    params = sft_params()
    np.savez(tmp_path / "init.npz", **{f"p{i}": x for i, x in enumerate(_flat(params))})
    # Two CPU devices per process; cheaper LLVM passes halve the workers' compile time on a busy CPU
    # (the comparison below checks that the numbers still agree).
    flags = f"--xla_force_host_platform_device_count=2 {FAST_XLA}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags,
               PYTHONPATH=os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")]))
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(pathlib.Path(__file__)), "--process_id", str(i), "--num_processes",
                               "2", "--port", str(port), "--params", str(tmp_path / "init.npz"), "--out", str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        # the single-process reference runs meanwhile (plain single-device learner and sampler)
        ref_params, ref_metrics, ref_turns = run_rl_step(jax.tree.map(jax.numpy.asarray, params), mesh=None)
        deadline = time.time() + WORKER_TIMEOUT_S
        logs = []
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
            logs.append(out)
        for i, p in enumerate(procs):
            assert p.returncode == 0, f"worker {i} failed:\n{logs[i][-4000:]}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = [json.loads((tmp_path / f"result_{i}.json").read_text()) for i in range(2)]
    assert [r["process_count"] for r in results] == [2, 2]
    assert results[0]["mesh"] == {"data": 1, "fsdp": 2, "tensor": 2} and results[0]["addressable"] == 2
    # Each process rolled out its half of the questions; together: exactly the single-process tokens.
    assert results[0]["turns"] + results[1]["turns"] == ref_turns
    assert len(results[0]["turns"]) == len(results[1]["turns"]) == 8
    # After the step: process 1's extra rollout ran alone, then both averaged and gathered.
    extra = sum(results[1]["metrics"]["_lockstep"]["extra_turns"])
    for r in results:
        lock = r["metrics"].pop("_lockstep")
        assert lock["mean"]["x"] == pytest.approx(5 / 3) and lock["concat"] == [0, 1, 1]
        assert lock["mean"]["turns"] == pytest.approx(2 / 3 * extra) and extra >= 2
    # The step exercised tools, memory scoring and the update.
    assert ref_metrics["tool_calls/mean"] > 0 and ref_metrics["mem/turns"] > 0
    assert sum(r["metrics"]["mem/turns"] for r in results) == ref_metrics["mem/turns"]
    # PPO metrics are global. The gradient norm gets 3e-4: the two processes' rows are padded to
    # the global fixed mini-batch shape (rl_step.training_row_bound x processes), so its float32
    # gradient sums run over other micro-batch groupings than one process's (measured 1.7e-4 with
    # the layers rematerialised as a scan and the LM head in chunks, 6.7e-5 before).
    # The KL term is ~1e-5 right after SFT (a cancellation), hence the 1e-7 absolute floor
    # (measured 1.5e-8).
    for k, rel in (("actor/pg_loss", 1e-5), ("actor/grad_norm", 3e-4), ("actor/kl_loss", 1e-5)):
        for r in results:
            assert r["metrics"][k] == np.float32(r["metrics"][k])
            assert abs(r["metrics"][k] - ref_metrics[k]) <= rel * abs(ref_metrics[k]) + 1e-7, (k, r["metrics"][k], ref_metrics[k])
    got = np.load(tmp_path / "params.npz")
    got = [got[f"p{i}"].astype(np.float64) for i in range(len(got.files))]
    ref, old = _flat(ref_params), _flat(params)
    diff = sum(float(np.sum((g - r) ** 2)) for g, r in zip(got, ref)) ** 0.5
    norm = sum(float(np.sum(r.astype(np.float64) ** 2)) for r in ref) ** 0.5
    moved = sum(float(np.sum((r.astype(np.float64) - o) ** 2)) for r, o in zip(ref, old)) ** 0.5
    assert diff <= 5e-5 * norm  # the same parameters as one process (Adam step on the sums above: 1.6e-5)
    assert moved > 100 * diff and moved > 1e-4 * norm  # ... after an update that changed them


# ------------------------------------------------------------------- single-process unit tests


def test_process_slice_covers_the_items_in_order():
    from mempo_jax.core.distributed import process_slice

    parts = [process_slice(10, i, 4) for i in range(4)]
    assert parts == [slice(0, 3), slice(3, 6), slice(6, 8), slice(8, 10)]
    assert process_slice(5) == slice(0, 5)  # one process: everything
    with pytest.raises(ValueError, match="cannot be split over 4"):
        process_slice(3, 0, 4)


def test_maybe_initialize_decides_from_arguments_and_environment(monkeypatch):
    import jax

    from mempo_jax.core import distributed

    calls = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(jax.config, "update", lambda *a: calls.append(("config", a)))
    assert distributed.maybe_initialize(env={}) is False and calls == []
    assert distributed.maybe_initialize(env={"TPU_WORKER_HOSTNAMES": "10.0.0.2"}) is False  # one host
    env = {"MEMPO_COORDINATOR": "10.0.0.2:1234", "MEMPO_NUM_PROCESSES": "4", "MEMPO_PROCESS_ID": "3",
           "JAX_PLATFORMS": "cpu"}
    assert distributed.maybe_initialize(env=env) is True
    timeouts = {"heartbeat_timeout_seconds": 60, "shutdown_timeout_seconds": 60}  # 2 x DistributedConfig.peer_timeout_s
    assert calls == [("config", ("jax_cpu_collectives_implementation", "gloo")),
                     (("10.0.0.2:1234",), {"num_processes": 4, "process_id": 3, **timeouts})]
    calls.clear()
    assert distributed.maybe_initialize(env={"MEMPO_MULTIHOST": "1"}) is True
    assert distributed.maybe_initialize(env={"TPU_WORKER_HOSTNAMES": "a,b,c,d"},
                                        config=distributed.DistributedConfig(peer_timeout_s=5)) is True
    # TPU slices: jax reads the coordinator from the metadata
    assert calls == [((), timeouts), ((), {"heartbeat_timeout_seconds": 10, "shutdown_timeout_seconds": 10})]
    with pytest.raises(ValueError, match="DistributedConfig.peer_timeout_s must be >= 2"):
        distributed.DistributedConfig(peer_timeout_s=1)
    with pytest.raises(ValueError, match="process id"):
        distributed.maybe_initialize("h:1", 2, 5, env={})


def test_one_process_wrappers_pass_through():
    from mempo_jax.run import lockstep
    from mempo_jax.core.distributed import allgather, gather_lists, gather_rows, mean_metrics

    sync, scorer = lockstep.distribute(lambda *a: "scored")
    assert not sync.multiprocess and scorer(1, [2], [3], [4]) == "scored"
    sync.barrier()  # no-op
    rows = {"input_ids": np.ones((2, 3), np.int32)}
    got, start = lockstep.LockstepRows(sync, pad_id=9).global_rows("update", rows)
    assert start == 0 and got.keys() == rows.keys() and got["input_ids"] is rows["input_ids"]
    assert allgather(np.arange(3)).tolist() == [[0, 1, 2]]
    assert gather_lists([[1, 2], [], [3]]) == [[1, 2], [], [3]]
    ids, = gather_rows([np.ones((2, 3), np.int32)], [2], 5, [9], side="left")
    assert ids.tolist() == [[9, 9, 1, 1, 1]] * 2
    assert mean_metrics({"b": 2.0, "a": 1.0}, sync=sync) == {"a": 1.0, "b": 2.0}


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
