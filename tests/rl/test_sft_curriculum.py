"""SFT copy warm-up (``SFTConfig.copy_warmup_fraction``, ``sft.with_copy_warmup``): the first batches
are induction rows ``BOS s s`` drawn from the pool, then the run's own batches, unchanged."""

import pathlib

import numpy as np
import pytest

from mempo_jax.config import SFTConfig

from mempo_jax.config_loader import load_config
from mempo_jax.rl.sft import iterate_sft_batches, with_copy_warmup
from mempo_jax.run.stages import copy_rows_warning

POOL = list(range(100, 140))
BOS, PAD = 2, 0


def _agent_rows(n=40):
    rng = np.random.default_rng(5)
    return [(list(rng.integers(10, 90, int(rng.integers(5, 30)))), [0.0] * 3 + [1.0] * 2) for _ in range(n)]


def _plain():
    return iterate_sft_batches(_agent_rows(), 4, PAD, np.random.default_rng(1))


def test_no_warmup_returns_the_same_iterator():
    batches = _plain()
    assert with_copy_warmup(batches, POOL, 0, 4, PAD, BOS, np.random.default_rng(9)) is batches


def test_warmup_batches_are_copy_rows_then_the_runs_batches_unchanged():
    it = with_copy_warmup(_plain(), POOL, 3, 4, PAD, BOS, np.random.default_rng(9))
    for _ in range(3):
        b = next(it)
        assert b["input_ids"].shape[0] == 4
        for ids, valid, mask in zip(b["input_ids"], b["valid"], b["loss_mask"]):
            row, m = ids[valid].tolist(), mask[valid].tolist()
            n = (len(row) - 1) // 2
            assert row[0] == BOS and len(row) == 1 + 2 * n and 4 <= n < 16
            assert row[1:1 + n] == row[1 + n:] and set(row[1:]) <= set(POOL)
            assert m == [0.0] * (1 + n) + [1.0] * n
    reference = _plain()
    for _ in range(5):  # the run's batches follow, the same as without a warm-up
        got, want = next(it), next(reference)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_the_warmup_is_a_share_of_the_steps_and_out_of_range_shares_are_refused():
    assert SFTConfig(steps=2500, copy_warmup_fraction=0.24).copy_warmup_steps == 600
    assert SFTConfig(steps=4, copy_warmup_fraction=0.24).copy_warmup_steps == 1
    assert SFTConfig(steps=10).copy_warmup_steps == 0
    with pytest.raises(ValueError, match=r"SFTConfig.copy_warmup_fraction must be <= 1"):
        SFTConfig(copy_warmup_fraction=1.5)


CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[2] / "configs").glob("*.gin"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_recipes_from_a_checkpoint_train_no_copy_rows(path, monkeypatch):
    """A recipe that starts from a pretrained checkpoint (``ModelOptions.checkpoint``) trains no
    synthetic copy rows, neither mixed in nor as copy-only warm-up steps: those rows are random
    entity tokens for a model trained from scratch. The SmolLM2 recipe inherited tiny_world.gin's
    ``copy_warmup_fraction = 0.24`` through its include, so 10 of its 40 SFT steps were copy rows
    (step-0 loss 11.3 nats against 1.89 on its own data), and both pod recipes left the class
    default ``copy_fraction = 1.0`` (as many copy rows as agent rows)."""
    monkeypatch.chdir(path.parents[1])  # the recipes include each other by repository-relative path
    cfg = load_config([str(path)])
    if not cfg.model.checkpoint:
        pytest.skip(f"{path.name} trains from scratch")
    assert (cfg.sft.copy_warmup_steps, cfg.sft.copy_fraction) == (0, 0.0), path.name
    assert copy_rows_warning(cfg) is None


def test_copy_rows_on_a_checkpoint_print_a_warning(monkeypatch):
    """The class defaults train no copy rows; a checkpoint SFT that still trains them (here the
    SmolLM2 recipe with tiny_world.gin's inherited bindings put back) gets one line naming both
    bindings and the warm-up steps they give (0.24 of 40 = 10); a from-scratch run gets none."""
    assert (SFTConfig().copy_fraction, SFTConfig().copy_warmup_fraction) == (0.0, 0.0)
    monkeypatch.chdir(CONFIGS[0].parents[1])
    leak = load_config(["configs/smollm2_hotpotqa.gin"], ["SFTConfig.copy_warmup_fraction = 0.24",
                                                          "SFTConfig.copy_fraction = 0.25"])
    line = copy_rows_warning(leak)
    assert line is not None and "ckpt/smollm2-135m-instruct" in line, line
    assert "SFTConfig.copy_fraction = 0.25" in line and "10 of 40 steps copy-only" in line, line
    assert copy_rows_warning(load_config(["configs/smollm2_hotpotqa.gin"], ["SFTConfig.copy_fraction = 0.25"]))
    assert copy_rows_warning(load_config(["configs/smollm2_hotpotqa.gin"], ["SFTConfig.copy_warmup_fraction = 0.24",
                                                                            "SFTConfig.steps = 0"])) is None
    assert copy_rows_warning(load_config(["configs/tiny_world.gin"])) is None  # from scratch: copy rows wanted


def test_rows_as_arrays_give_the_same_batches():
    """The trainer keeps its SFT rows as int32 / float32 arrays (``stages._sft_batches``): the
    batches are those of the same rows as lists, draw for draw."""
    rows = _agent_rows() + [(r[0], [float(x) for x in r[1]]) for r in _agent_rows(7)]
    compact = [(np.asarray(i, np.int32), np.asarray(m, np.float32)) for i, m in rows]
    a = iterate_sft_batches(rows, 4, PAD, np.random.default_rng(1))
    b = iterate_sft_batches(compact, 4, PAD, np.random.default_rng(1))
    for _ in range(25):
        x, y = next(a), next(b)
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) and x[k].dtype == y[k].dtype for k in x)
