"""Between SFT and RL the trainer holds the policy and the frozen reference, not the SFT optimizer
state (``mempo_jax/commands/train.py``): measured on the device buffers of ``jax.live_arrays()`` (each
buffer once: two arrays may alias one) in a run of the small config of
``benchmarks/chaos_resume.py``, in its own process."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from chaos_resume import train_command  # noqa: E402
from conftest import SPM_CACHE, one_device_env  # noqa: E402

PROBE = r"""
import gc, json, sys
import jax
from mempo_jax.commands import train
from mempo_jax.run import stages

real = stages.rl_stage


def probe(ctx, params, ref_params, stack):
    gc.collect()
    size = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
    buffers = {x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays()}  # aliases counted once
    print("PROBE " + json.dumps({"live": sum(buffers.values()), "params": size(params),
                                 "reference": size(ref_params)}), flush=True)
    return real(ctx, params, ref_params, stack)


stages.rl_stage = probe
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_rl_starts_without_the_sft_optimizer_state(tmp_path):
    cmd = train_command(tmp_path / "run", ("RLConfig.steps=1", "EvalConfig.num_questions=2"), SPM_CACHE)
    proc = subprocess.run([sys.executable, "-c", PROBE, *cmd[3:]], env=one_device_env(), cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    m = json.loads(line[len("PROBE "):])
    # AdamW's two moments would add 2 x the parameters' bytes; a few PRNG keys and scalars may remain
    assert m["params"] + m["reference"] <= m["live"] < m["params"] + m["reference"] + 0.25 * m["params"], m
