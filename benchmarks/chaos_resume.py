"""Chaos test of checkpoint/resume: SIGKILL a small training run at seeded random moments, resume it
each time, and compare the end result with an uninterrupted run of the same seed.

    python benchmarks/chaos_resume.py --kills 10 --seed 0

Every kill moment is drawn (seeded) as "when ``metrics.jsonl`` first holds L lines, plus a random
delay", with L spread over the whole run, so kills land in start-up, SFT steps, checkpoint
saves, evaluations and RL rollouts/updates alike. After each kill the same command is started
again (it resumes by itself). At the end the script compares, with the uninterrupted run:

* the final RL checkpoint (parameters and optimizer state): bitwise;
* ``metrics.jsonl``: line by line, every value bitwise except the wall-clock ``timing/*`` keys;
  a line is *lost* when the reference has it and the chaos run does not, *duplicated* when the
  chaos run has it more often than the reference (a line is keyed by its stage and step);
* ``rollouts.jsonl``: byte for byte; ``summary.json``: all but ``wall_s``.

It prints kills survived, metric lines lost and duplicated, and exits 1 on any mismatch.
The run is small (1-layer model, tiny world, a few SFT and RL steps) and runs on CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# The small run shared by the chaos script and tests/run/test_resume.py, tests/run/test_faults.py.
SMALL_PARAMS = (
    "WorldConfig.num_people=30", "WorldConfig.num_companies=10", "WorldConfig.num_cities=8",
    "WorldConfig.num_countries=3", "WorldConfig.num_single=10", "WorldConfig.num_bridge=10",
    "WorldConfig.num_multi=10", "ExperimentConfig.vocab_size=400",
    'ModelOptions.overrides=(("num_layers",1),("embed_dim",32),("num_heads",2),("num_kv_heads",1),'
    '("head_dim",16),("mlp_dim",64))',
    "SFTConfig.steps=6", "SFTConfig.batch_rows=8",
    "RLConfig.steps=6", "RLConfig.questions_per_step=2", "RLConfig.group_size=2",
    "LossConfig.entropy_coef=0.01",  # a gradient on every RL step even when every reward is 0
    "RolloutConfig.max_turns=2", "RolloutConfig.max_new_tokens=16", "RolloutConfig.min_rows_bucket=8",
    "EvalConfig.num_questions=4", "EvalConfig.context_modes=(1,)", "EvalConfig.bootstrap_samples=200",
    "CheckpointConfig.every_steps=2", "CheckpointConfig.max_to_keep=2",
)
TIMING_PREFIX = "timing/"


def train_command(run_dir, params=(), cache_dir=None) -> list[str]:
    """The ``python -m mempo_jax.commands.train`` command of the small run (extra gin ``params`` last)."""
    cmd = [sys.executable, "-m", "mempo_jax.commands.train", "--run_dir", str(run_dir)]
    for p in (*SMALL_PARAMS, *params):
        cmd += ["--gin_param", p]
    if cache_dir is not None:
        cmd += ["--cache_dir", str(cache_dir)]
    return cmd


def small_env(xla_cache: str | os.PathLike, **extra: str) -> dict:
    """Environment of the small run: CPU, the shared persistent XLA cache (every program cached)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", MEMPO_XLA_CACHE=str(xla_cache), MEMPO_XLA_CACHE_MIN_S="0",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def count_lines(path: pathlib.Path) -> int:
    """Complete lines of a file (0 when absent)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def metric_records(path: pathlib.Path) -> list[dict]:
    """The lines of ``metrics.jsonl`` without the wall-clock ``timing/*`` keys (a torn line is kept
    as ``{"torn": text}``, so it counts as a difference)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            out.append({"torn": line})
            continue
        out.append({k: v for k, v in rec.items() if not k.startswith(TIMING_PREFIX)})
    return out


def compare_runs(ref: pathlib.Path, run: pathlib.Path) -> dict:
    """Differences between two finished run folders (see the module doc).

    Returns:
      ``{"lost", "duplicated", "changed", "order_ok", "params_equal", "opt_state_equal",
      "rollouts_equal", "summary_equal", "final_step"}``.
    """
    import numpy as np
    import jax

    from mempo_jax.run.checkpoint import read_checkpoint

    a, b = metric_records(ref / "metrics.jsonl"), metric_records(run / "metrics.jsonl")
    key = lambda r: (r.get("stage"), r.get("step"), r.get("torn"))  # noqa: E731
    ca, cb = collections.Counter(map(key, a)), collections.Counter(map(key, b))
    lost = sum(max(n - cb[k], 0) for k, n in ca.items())
    duplicated = sum(max(n - ca[k], 0) for k, n in cb.items())
    first_a = {key(r): r for r in reversed(a)}
    changed = sum(1 for r in b if key(r) in first_a and r != first_a[key(r)])
    step_a, ca_ = read_checkpoint(ref / "checkpoints")
    step_b, cb_ = read_checkpoint(run / "checkpoints")

    def equal(x, y):
        lx, ly = jax.tree.leaves(x), jax.tree.leaves(y)
        return len(lx) == len(ly) and all(np.asarray(u).dtype == np.asarray(v).dtype
                                          and np.array_equal(np.asarray(u), np.asarray(v)) for u, v in zip(lx, ly))

    sa = json.loads((ref / "summary.json").read_text())
    sb = json.loads((run / "summary.json").read_text())
    sa.pop("wall_s"), sb.pop("wall_s")
    return {
        "lost": lost, "duplicated": duplicated, "changed": changed, "order_ok": a == b,
        "params_equal": step_a == step_b and equal(ca_["params"], cb_["params"]),
        "opt_state_equal": step_a == step_b and equal(ca_["opt_state"], cb_["opt_state"]),
        "rollouts_equal": (ref / "rollouts.jsonl").read_bytes() == (run / "rollouts.jsonl").read_bytes(),
        "summary_equal": sa == sb, "final_step": step_b,
    }


def run_to_end(cmd, env, timeout_s: float) -> float:
    """Run ``cmd`` to completion; returns its wall time. Raises RuntimeError on a non-zero exit."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} … exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return time.monotonic() - t0


def chaos(run_dir: pathlib.Path, cmd, env, kills: int, seed: int, total_lines: int, max_delay_s: float,
          timeout_s: float, log=print) -> dict:
    """Kill-and-resume ``cmd`` ``kills`` times, then let it finish.

    Kill i happens once ``metrics.jsonl`` holds ``targets[i]`` lines (sorted seeded draws from
    ``[0, total_lines - 2]``) plus a seeded delay in ``[0, max_delay_s]``; target 0 kills during
    start-up. A kill is *survived* when it hit a live process and the next start resumed it.

    Returns:
      ``{"kills_delivered", "kills_missed", "restarts", "wall_s"}``.
    """
    rnd = random.Random(seed)
    targets = sorted(rnd.randint(0, max(total_lines - 2, 0)) for _ in range(kills))
    delivered = missed = restarts = 0
    t0 = time.monotonic()
    for i, target in enumerate(targets):
        delay = rnd.uniform(0.0, max_delay_s)
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        restarts += 1
        t_start = time.monotonic()
        while proc.poll() is None and count_lines(run_dir / "metrics.jsonl") < target:
            if time.monotonic() - t_start > timeout_s:
                proc.kill()
                raise RuntimeError(f"kill {i}: no progress to line {target} within {timeout_s} s")
            time.sleep(0.02)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            delivered += 1
            log(f"kill {i + 1}/{kills}: SIGKILL at metrics line {count_lines(run_dir / 'metrics.jsonl')} "
                f"(target {target} + {delay:.2f} s)")
        else:
            missed += 1
            log(f"kill {i + 1}/{kills}: missed (the run ended with status {proc.returncode} first)")
            if proc.returncode != 0:
                raise RuntimeError(f"the resumed run exited {proc.returncode}")
    run_to_end(cmd, env, timeout_s)
    restarts += 1
    return {"kills_delivered": delivered, "kills_missed": missed, "restarts": restarts,
            "wall_s": time.monotonic() - t0}


def main(argv=None) -> int:
    """CLI: see the module doc. Exit status 0 when everything matches, 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="seed of the kill moments (the run itself uses seed 0)")
    p.add_argument("--work_dir", default=None, help="folder for the runs (default: a temporary folder)")
    p.add_argument("--reference", default=None, help="an uninterrupted run folder of the same command to reuse")
    p.add_argument("--max_delay_s", type=float, default=1.5, help="largest random delay after a kill's target line")
    p.add_argument("--timeout_s", type=float, default=600.0, help="limit for one process")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    args = p.parse_args(argv)

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="mempo_chaos_"))
    work.mkdir(parents=True, exist_ok=True)
    env = small_env(os.environ.get("MEMPO_XLA_CACHE", work / "xla"))
    cache = work / "spm"
    try:
        ref = pathlib.Path(args.reference) if args.reference else work / "reference"
        if not args.reference:
            shutil.rmtree(ref, ignore_errors=True)
            t = run_to_end(train_command(ref, cache_dir=cache), env, args.timeout_s)
            print(f"reference run: {t:.1f} s, {count_lines(ref / 'metrics.jsonl')} metric lines", flush=True)
        chaos_dir = work / "chaos"
        shutil.rmtree(chaos_dir, ignore_errors=True)
        stats = chaos(chaos_dir, train_command(chaos_dir, cache_dir=cache), env, args.kills, args.seed,
                      count_lines(ref / "metrics.jsonl"), args.max_delay_s, args.timeout_s,
                      log=lambda s: print(s, flush=True))
        diff = compare_runs(ref, chaos_dir)
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    ok = (stats["kills_delivered"] == args.kills and diff["lost"] == 0 and diff["duplicated"] == 0
          and diff["changed"] == 0 and diff["order_ok"] and diff["params_equal"] and diff["opt_state_equal"]
          and diff["rollouts_equal"] and diff["summary_equal"])
    print(f"kills survived: {stats['kills_delivered']}/{args.kills} (missed {stats['kills_missed']}, "
          f"{stats['restarts']} starts, {stats['wall_s']:.0f} s)")
    print(f"metric lines lost: {diff['lost']}  duplicated: {diff['duplicated']}  changed: {diff['changed']}  "
          f"same order: {diff['order_ok']}")
    print(f"final checkpoint {diff['final_step']}: params bitwise equal: {diff['params_equal']}  "
          f"optimizer state bitwise equal: {diff['opt_state_equal']}  rollouts equal: {diff['rollouts_equal']}  "
          f"summary equal: {diff['summary_equal']}")
    print("CHAOS OK" if ok else "CHAOS MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
