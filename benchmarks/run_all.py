"""Run every benchmark section in turn (one process each, one at a time) and merge their JSON.

Sections: 1-2 ``bench_decode.py`` (decode and prefill vs transformers), 3 ``bench_scoring.py``
(memory-reward scoring), 4 ``bench_rl_step.py`` (RL step split and compilations), 5
``bench_tokens.py`` (k = 1 vs full-history TT/PT/EM of a trained run), 6 ``bench_roofline.py``
(achieved FLOP/s vs peak), 7 ``bench_rollout.py`` (multi-turn rollout: the engine vs a transformers and a
tunix generate-per-turn loop; decode at batch 64), 8 ``bench_attention.py`` (the decode step's attention vs torch
SDPA). ``benchmarks/chaos_resume.py`` (the resume check) is not run here.

Run: ``python benchmarks/run_all.py [--json bench.json] [--small] [--only decode,rl_step]``
(about 10 minutes on a 2-core CPU; ``--small``: the smoke test's configurations, ~2 minutes).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
SECTIONS = [  # (name, script, extra arguments)
    ("decode", "bench_decode.py", []),
    ("scoring", "bench_scoring.py", []),
    ("rl_step", "bench_rl_step.py", []),
    ("tokens", "bench_tokens.py", []),
    ("roofline", "bench_roofline.py", []),
    ("rollout", "bench_rollout.py", []),
    ("attention", "bench_attention.py", []),
]


def main(argv=None) -> int:
    """Run the sections; print each one's output and a summary; write the merged JSON.

    Returns:
      0 when every section ran (a skipped section counts as run), 1 otherwise.
    """
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="merged JSON of every section")
    p.add_argument("--small", action="store_true", help="smallest configurations")
    p.add_argument("--only", default=None, help="comma-separated section names")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    p.add_argument("--run_dir", default=None, help="trained run for the token-efficiency section")
    args = p.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    merged, failed, t_all = {}, [], time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as tmp:
        for name, script, extra in SECTIONS:
            if only and name not in only:
                continue
            out = pathlib.Path(tmp) / f"{name}.json"
            cmd = [sys.executable, str(HERE / script), "--json", str(out), "--device", args.device] + extra
            if args.small:
                cmd.append("--small")
            if name == "tokens" and args.run_dir:
                cmd += ["--run_dir", args.run_dir]
            print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
            t = time.perf_counter()
            rc = subprocess.call(cmd, cwd=HERE.parent, env=env)
            wall = time.perf_counter() - t
            if rc == 0 and out.is_file():
                merged[name] = json.loads(out.read_text())
                merged[name]["wall_s"] = wall
            else:
                failed.append(name)
                merged[name] = {"error": f"exit status {rc}", "wall_s": wall}
    total = time.perf_counter() - t_all
    merged["_total_wall_s"] = total
    print("\n=== summary")
    for name in merged:
        if not name.startswith("_"):
            print(f"  {name:9s} {merged[name]['wall_s']:7.1f} s  {'FAILED' if name in failed else 'ok'}")
    print(f"  total     {total:7.1f} s")
    _print_targets(merged)
    if args.json:
        path = pathlib.Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged, indent=2, default=float) + "\n", encoding="utf-8")
        print(f"-> {path}")
    return 1 if failed else 0


def _print_targets(merged: dict) -> None:
    """One line per target of the issue: met, missed or not measured."""
    def get(name, *keys):
        x = merged.get(name, {}).get("results", {})
        for k in keys:
            x = x.get(k) if isinstance(x, dict) else None
        return x

    dec = get("decode", "decode") or []
    b64 = next((r for r in dec if r.get("batch") == 64 and "ratio" in r), None)
    print("  target decode b64 >= 3x transformers: "
          + (f"{b64['ratio']:.2f}x -> {'met' if b64['ratio'] >= 3 else 'missed'}" if b64 else "not measured"))
    comp = get("rl_step", "compilations_from_step_3")
    print("  target 0 compilations from step 3: " + ("not measured" if comp is None else
                                                     f"{comp} -> {'met' if comp == 0 else 'missed'}"))
    full = get("rollout", "rollout", "full") or {}
    for other, target in (("transformers", 3.0), ("tunix", 2.0)):
        r = full.get(f"speedup_vs_{other}")
        print(f"  target rollout (full) >= {target:g}x {other}: "
              + ("not measured" if r is None else f"{r:.2f}x -> {'met' if r >= target else 'missed'}"))
    dec = (get("rollout", "decode") or [{}])[0]
    r = dec.get("cached_over_transformers")
    print("  target cached decode b64 >= 1.2x transformers: "
          + ("not measured" if r is None else f"{r:.2f}x -> {'met' if r >= 1.2 else 'missed'}"))
    ratio = get("tokens", "k1_over_full")
    skipped = get("tokens", "skipped")
    if ratio:
        print(f"  target k1 TT <= 35% of full at >= EM: TT {ratio['tt']:.1%}, EM {ratio['em_delta']:+.3f} -> "
              f"{'met' if get('tokens', 'target_met') else 'missed'}")
    else:
        print(f"  target k1 TT <= 35% of full: {skipped or 'not measured'}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
