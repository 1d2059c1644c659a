"""A LoRA run of the trainer (``LoraConfig.rank > 0``) on the small config of
``benchmarks/chaos_resume.py``: SFT and RL train the adapters alone, the checkpoints hold the
adapters and their optimizer state, a run stopped by SIGTERM resumes bit for bit, and
``load_policy`` rebuilds the policy (base from the seed, adapters from the checkpoint)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from chaos_resume import SMALL_PARAMS, compare_runs, train_command  # noqa: E402
from conftest import SPM_CACHE, one_device_env  # noqa: E402
from fault_train import fault_command  # noqa: E402

LORA = ("LoraConfig.rank=4", "LoraConfig.alpha=8.0", "LoraConfig.target_modules=('q_proj', 'v_proj', 'up_proj')",
        "SFTConfig.steps=4", "RLConfig.steps=4", "SFTConfig.optim=@OptimConfig()", "OptimConfig.learning_rate=0.01")


def _train(run_dir, faults=None, args=()):
    cmd = train_command(run_dir, LORA, SPM_CACHE) + list(args)
    if faults:  # through tests/fault_train.py (train.main with FaultHooks)
        cmd = fault_command(faults) + cmd[3:]  # cmd[:3]: python -m mempo_jax.commands.train
    return subprocess.run(cmd, env=one_device_env(), cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lora") / "run"
    proc = _train(run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.mark.slow
def test_lora_checkpoints_hold_the_adapters_and_load_policy_rebuilds_the_policy(lora_run):
    from mempo_jax.model import lora
    from mempo_jax.model.forward import create_model, split_model
    from mempo_jax.run.checkpoint import load_policy, read_checkpoint

    model_cfg = json.loads((lora_run / "model_config.json").read_text())
    assert (model_cfg["lora_rank"], model_cfg["lora_targets"]) == (4, ["q_proj", "v_proj", "up_proj"])
    step, ckpt = read_checkpoint(lora_run / "checkpoints")
    names = sorted(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ckpt["params"])[0])
    assert step == 4 and names == [f"['layers']['{m}']['{w}_lora_{x}']['value']"
                                   for m, w in (("attn", "q"), ("attn", "v"), ("mlp", "up")) for x in "ab"]
    mu = ckpt["opt_state"][1][0]["mu"]  # chain(clip, adamw): Adam's first moment, adapters only
    assert len(jax.tree.leaves(mu)) == 6
    rl = [json.loads(line) for line in (lora_run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["actor/grad_norm"] > 0 for r in rl if r["stage"] == "rl")
    _, sft = read_checkpoint(lora_run / "sft_checkpoint")
    assert all(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ckpt["params"]), jax.tree.leaves(sft["params"]))
               if np.asarray(a).ndim)  # RL moved every adapter away from the SFT result

    _, cfg, _, params = load_policy(lora_run)
    assert cfg.lora_rank == 4
    trainable, frozen = lora.split_trainable(params)
    for a, b in zip(jax.tree.leaves(trainable), jax.tree.leaves(ckpt["params"])):
        np.testing.assert_array_equal(np.asarray(a), b)
    _, seed_init = split_model(create_model(cfg, 0))  # ExperimentConfig.seed = 0: the base is the seed's init
    for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(lora.split_trainable(seed_init)[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_lora_run_stopped_by_sigterm_resumes_bitwise(lora_run, tmp_path):
    run = tmp_path / "run"
    proc = _train(run, faults={"sigterm_rollout_step": 3})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "preempted: checkpoint saved" in proc.stderr
    assert not (run / "summary.json").exists()
    proc = _train(run, args=["--resume"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming RL after step 3" in proc.stdout
    assert compare_runs(lora_run, run) == {"lost": 0, "duplicated": 0, "changed": 0, "order_ok": True,
                                           "params_equal": True, "opt_state_equal": True, "rollouts_equal": True,
                                           "summary_equal": True, "final_step": 4}
