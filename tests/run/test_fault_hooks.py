"""The test-only fault hooks are explicit objects the trainer calls (``train.main(hooks=...)``;
``python -m mempo_jax.train`` reads them from ``$MEMPO_TEST_*``), not replaced learner methods."""

import signal
import types

import numpy as np
import pytest

from mempo_jax.run.resume import FaultHooks


def test_update_rows_nans_the_advantages_of_the_listed_steps_only():
    hooks = FaultHooks.from_env({"MEMPO_TEST_NAN_GRAD_STEPS": "2,4-5"})
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
    hooks = FaultHooks.from_env({"MEMPO_TEST_SIGTERM_ROLLOUT_STEP": "3"})
    pre = types.SimpleNamespace(requested=False)
    for step in (0, 2, 3):
        hooks.before_sample(step, pre)
    assert sent == [signal.SIGTERM]
    pre.requested = True  # already pending: not sent again
    hooks.before_sample(3, pre)
    assert sent == [signal.SIGTERM]
    FaultHooks().before_sample(3, types.SimpleNamespace(requested=False))
    assert sent == [signal.SIGTERM]


def test_malformed_environment_value_is_one_line():
    with pytest.raises(ValueError, match="MEMPO_TEST_NAN_GRAD_STEPS must look like"):
        FaultHooks.from_env({"MEMPO_TEST_NAN_GRAD_STEPS": "two"})
