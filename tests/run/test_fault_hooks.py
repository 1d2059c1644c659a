"""The test-only fault hooks are explicit objects the trainer calls (``train.main(hooks=...)``; a
subprocess test runs ``tests/fault_train.py``), not replaced learner methods, and the product's
command line reads none from the environment."""

import signal
import types

import numpy as np
import pytest

from fault_train import main as fault_main, parse_steps
from mempo_jax.run.faults import FaultHooks


def test_update_rows_nans_the_advantages_of_the_listed_steps_only():
    hooks = FaultHooks(nan_grad_steps=parse_steps("2,4-5"))
    rows = {"advantages": np.ones((3, 4), np.float32), "loss_mask": np.ones((3, 4), np.float32)}
    for step in range(7):
        out = hooks.update_rows(step, rows)
        if step in (2, 4, 5):
            assert np.isnan(out["advantages"]).all() and out["advantages"].dtype == np.float32
            assert out["loss_mask"] is rows["loss_mask"]
        else:
            assert out is rows
    assert not np.isnan(rows["advantages"]).any()  # the caller's rows are never changed


def test_before_sample_sends_sigterm_once_at_its_step(monkeypatch):
    sent = []
    monkeypatch.setattr("os.kill", lambda pid, sig: sent.append(sig))
    hooks = FaultHooks(sigterm_rollout_step=3)
    pre = types.SimpleNamespace(requested=False)
    for step in (0, 2, 3):
        hooks.before_sample(step, pre)
    assert sent == [signal.SIGTERM]
    pre.requested = True  # already pending: not sent again
    hooks.before_sample(3, pre)
    assert sent == [signal.SIGTERM]
    FaultHooks().before_sample(3, types.SimpleNamespace(requested=False))
    assert sent == [signal.SIGTERM]


def test_malformed_fault_value_is_one_line(capsys):
    assert parse_steps("2,4-5") == {2, 4, 5} and parse_steps("") == frozenset()
    with pytest.raises(SystemExit) as exit_info:
        fault_main(["--nan_grad_steps", "two", "--run_dir", "unused"])
    assert exit_info.value.code == 2
    assert "--nan_grad_steps: must look like '1,3-5', got 'two'" in capsys.readouterr().err


def test_the_product_command_reads_no_fault_from_the_environment():
    import inspect

    from mempo_jax.commands import train
    from mempo_jax.run import faults, resume

    for module in (train, resume, faults):
        assert "MEMPO_TEST_" not in inspect.getsource(module)
    assert not hasattr(FaultHooks, "from_env")
