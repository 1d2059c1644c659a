"""``Learner.ppo_update``: the shuffled rows are split evenly into mini-batches (sizes differ by at
most one), each padded to one fixed shape, and each optimizer step's gradient equals an
independent reference (verl's clipped surrogate + low_var_kl, token-mean) on exactly its rows."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mempo_jax.rl import learner as learner_module
from mempo_jax.rl.learner import Learner, fill_whole_micro_batches, mini_batch_slices, ppo_plan
from mempo_jax.rl.losses import LossConfig
from mempo_jax.model.forward import make_logits_fn
from toy_agent import toy_model

VOCAB, LENGTH = 40, 16


def _rows(rng, n, length=LENGTH):
    valid = np.arange(length)[None] < rng.integers(length // 2, length + 1, n)[:, None]
    mask = (valid & (np.arange(length)[None] >= 3)).astype(np.float32)
    return {"input_ids": rng.integers(4, VOCAB, (n, length)).astype(np.int32), "valid": valid, "loss_mask": mask,
            "old_logprobs": np.where(mask > 0, rng.normal(-3.7, 0.3, (n, length)), 0.0).astype(np.float32),
            "ref_logprobs": np.where(mask > 0, rng.normal(-3.7, 0.3, (n, length)), 0.0).astype(np.float32),
            "advantages": (rng.normal(0, 1, (n, 1)) * mask).astype(np.float32)}


class _Recorder:
    """Wraps ``learner.steps.ppo_step``: records each call's batch (numpy), and the parameters
    before and after it; ``run=False`` records without running the program (shape/row checks only)."""

    def __init__(self, learner, run=True):
        self.inner, self.run, self.calls = learner.steps.ppo_step, run, []
        learner.steps.ppo_step = self

    def __call__(self, state, batch, n_micro, loss_cfg, tail=0):
        before = [np.array(x) for x in jax.tree.leaves(state.params)]  # copied: the program donates params
        batch = {k: np.asarray(v) for k, v in batch.items()}
        self.layouts = getattr(self, "layouts", []) + [(len(batch["loss_mask"]) // n_micro, tail)]
        if not self.run:
            self.calls.append((batch, before, before))
            return state.replace(step=state.step + 1), {"actor/pg_loss": 0.0}
        state, m = self.inner(state, batch, n_micro, loss_cfg, tail)
        self.calls.append((batch, before, [np.array(x) for x in jax.tree.leaves(state.params)]))
        return state, m

    def real_rows(self):
        """Source rows per call: packed sequences (a segment start each) or non-empty rows."""
        return [int(_starts(b).sum()) for b, _, _ in self.calls]


def _starts(b):
    """``[R, L]`` bool: the first token of each source row in a (packed or padded) batch."""
    if "segment_ids" not in b:
        return b["valid"] & (np.arange(b["valid"].shape[1])[None] == 0)
    return b["valid"] & (b["positions"] == 0)


def _unpack(b):
    """The source rows of a packed batch, each left-aligned in its own row (right padding)."""
    if "segment_ids" not in b:
        real = b["valid"].any(1)
        return {k: v[real] for k, v in b.items()}
    length = b["input_ids"].shape[1]
    out = {k: [] for k in ("input_ids", "valid", "loss_mask", "old_logprobs", "ref_logprobs", "advantages")}
    for r in range(b["input_ids"].shape[0]):
        for k in np.unique(b["segment_ids"][r]):
            if k == 0:
                continue
            cols = np.nonzero(b["segment_ids"][r] == k)[0]
            for key in out:
                row = np.zeros((length,), b[key].dtype)
                row[: len(cols)] = b[key][r, cols]
                out[key].append(row)
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("n, k, sizes", [
    (130, 2, [65, 65]), (257, 2, [129, 128]), (1100, 4, [275] * 4), (10, 3, [4, 3, 3]), (3, 4, [1, 1, 1, 0]),
    (0, 2, [0, 0]),
])
def test_mini_batch_slices_golden(n, k, sizes):
    sl = mini_batch_slices(n, k)
    assert [b - a for a, b in sl] == sizes
    assert sl[0][0] == 0 and sl[-1][1] == n and all(sl[i][1] == sl[i + 1][0] for i in range(k - 1))


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 64))
def test_mini_batch_slices_cover_every_row_once_near_equal(n, k):
    sizes = [b - a for a, b in mini_batch_slices(n, k)]
    assert sum(sizes) == n and len(sizes) == k
    assert max(sizes) - min(sizes) <= 1
    assert max(sizes) <= ppo_plan(n, k, 32).rows  # every mini-batch fits the fixed shape
    assert max(sizes) <= ppo_plan(n, k, 32, max_rows=5000).rows


def test_mini_batch_slices_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_mini_batches"):
        mini_batch_slices(4, 0)


def _learner(params, graphdef, micro=32, optimizer=None, **fn_kw):
    opt = optimizer or optax.sgd(1.0)
    return Learner(make_logits_fn(graphdef, **fn_kw), jax.tree.map(lambda x: x.copy(), params), opt, temperature=0.7,
                   micro_batch_rows=micro)


@pytest.mark.parametrize("n, k, micro, bound, sizes", [
    (1100, 4, 32, None, [275] * 4),
    (257, 2, 32, 512, [129, 128]),
    (32, 3, 32, None, [11, 11, 10]),  # k not a power of two: before, 2 of the 32 rows were never used
    (70, 8, 4, 128, [9] * 6 + [8] * 2),
])
def test_ppo_update_feeds_even_mini_batches_of_one_shape(n, k, micro, bound, sizes):
    cfg, graphdef, params = toy_model(VOCAB)
    learner = _learner(params, graphdef, micro)
    rec = _Recorder(learner, run=False)
    rows = _rows(np.random.default_rng(n), n)
    rows["input_ids"][:, 0] = np.arange(n) % VOCAB  # a row identity in column 0 …
    rows["old_logprobs"][:, 0] = np.arange(n)  # … exactly (no loss there: column 0 is masked)
    learner.ppo_update(rows, LossConfig(), k, np.random.default_rng(0), max_rows=bound)
    assert rec.real_rows() == sizes
    plan = ppo_plan(n, k, micro, bound)
    assert {b["input_ids"].shape for b, _, _ in rec.calls} == {(plan.rows, LENGTH)}
    seen = np.concatenate([b["old_logprobs"][_starts(b)] for b, _, _ in rec.calls])
    assert sorted(seen.astype(int).tolist()) == list(range(n))  # every row exactly once
    assert learner.state.step == k


def _computed_rows(batch, micro, tail):
    """Rows the update program computes: its micro-batches with a loss token (the last one split
    into micro-batches of ``tail`` rows), times their rows."""
    has = (np.asarray(batch["loss_mask"]) > 0).reshape(len(batch["loss_mask"]), -1).any(1)
    head, last = has[: len(has) - micro], has[len(has) - micro :]
    return micro * int(head.reshape(-1, micro).any(1).sum()) + tail * int(last.reshape(-1, tail).any(1).sum())


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.sampled_from([(8, 2), (8, 4), (4, 1), (16, 4), (8, 8)]), st.data())
def test_fill_whole_micro_batches_computes_the_loss_rows_rounded_to_the_tail(n_micro, layout, data):
    """Whatever rows carry loss tokens, the reordered batch is a permutation of the rows whose
    update computes ceil(loss rows / micro) whole micro-batches at most, the remainder rounded up
    to ``tail`` rows: never more than the loss rows plus ``tail - 1``."""
    micro, tail = layout
    rows = n_micro * micro
    has = np.array(data.draw(st.lists(st.booleans(), min_size=rows, max_size=rows)))
    batch = {"loss_mask": np.where(has[:, None], 1.0, 0.0) * np.ones((rows, 3)), "row": np.arange(rows)}
    out = fill_whole_micro_batches(batch, micro, tail)
    assert sorted(out["row"].tolist()) == list(range(rows))
    np.testing.assert_array_equal(out["loss_mask"], batch["loss_mask"][out["row"]])
    k = int(has.sum())
    if tail < micro:
        whole = min(k // micro, n_micro - 1)  # micro-batches of loss rows before the last one
        computed = _computed_rows(out, micro, tail)
        assert computed == whole * micro + -(-(k - whole * micro) // tail) * tail <= k + tail - 1


def _reference_loss(logits_fn, params, b, temperature, cfg: LossConfig):
    """verl ``compute_policy_loss`` (dual clip) + kl_coef · low_var_kl, token-mean, written out
    here from the formulas (not the project's loss code) on the unpadded rows ``b``."""
    logits = logits_fn(params, jnp.asarray(b["input_ids"]), jnp.asarray(b["valid"])).astype(jnp.float32)
    logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)[:, :-1]  # position t predicts t + 1
    nxt = jnp.asarray(b["input_ids"])[:, 1:]
    logp = jnp.take_along_axis(logp_all, nxt[..., None], axis=-1)[..., 0]
    mask = jnp.asarray(b["loss_mask"])[:, 1:]
    adv, old, ref = (jnp.asarray(b[k])[:, 1:] for k in ("advantages", "old_logprobs", "ref_logprobs"))
    ratio = jnp.exp(jnp.clip(logp - old, -20, 20))
    surrogate = jnp.maximum(-adv * ratio, -adv * jnp.clip(ratio, 1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high))
    pg = jnp.where(adv < 0, jnp.minimum(surrogate, -adv * cfg.clip_ratio_c), surrogate)
    d = jnp.clip(ref - logp, -20, 20)
    kl = jnp.clip(jnp.exp(d) - d - 1, -10, 10)
    per_token = pg + cfg.kl_coef * kl
    return jnp.sum(jnp.where(mask > 0, per_token, 0.0)) / jnp.sum(mask)


@pytest.mark.parametrize("fn_kw", [{}, {"logit_chunk": 4, "remat": "full"}, {"logit_chunk": 3, "remat": "dots_saveable"}])
def test_ppo_update_gradient_of_each_mini_batch_equals_a_reference(fn_kw):
    """Each mini-batch's update is the gradient of the loss written out from the formulas over the
    full logits, whatever the LM-head chunk and the decoder-layer rematerialisation."""
    cfg, graphdef, params = toy_model(VOCAB, seed=1)
    n, k = 130, 2
    learner = _learner(params, graphdef, micro=32, **fn_kw)  # SGD, lr 1: params_after = params_before - grad
    rows = _rows(np.random.default_rng(7), n)
    lp = learner.detached_logprobs(learner.params, rows["input_ids"], rows["valid"])  # a realistic ratio near 1
    rows["old_logprobs"] = np.where(rows["loss_mask"] > 0, lp + np.random.default_rng(1).normal(0, 0.3, lp.shape),
                                    0.0).astype(np.float32)
    rows["ref_logprobs"] = np.where(rows["loss_mask"] > 0, lp - 0.2, 0.0).astype(np.float32)
    loss_cfg = LossConfig(kl_coef=0.05)
    rec = _Recorder(learner)
    learner.ppo_update(rows, loss_cfg, k, np.random.default_rng(3), max_rows=256)
    assert rec.real_rows() == [65, 65]  # before: [128, 2]
    for (batch, _, _), (micro, tail) in zip(rec.calls, rec.layouts):  # micro 32, the last run 8 rows at a time
        loss_rows = int((batch["loss_mask"] > 0).any(1).sum())
        assert (micro, tail) == (32, 8) and _computed_rows(batch, micro, tail) == -(-loss_rows // tail) * tail
    treedef = jax.tree.structure(learner.params)
    logits_fn = make_logits_fn(graphdef)
    for batch, before, after in rec.calls:
        assert "segment_ids" in batch and batch["segment_ids"].max() > 1  # several rows share a packed row
        b = _unpack(batch)
        p = jax.tree.unflatten(treedef, [jnp.asarray(x) for x in before])
        ref_grad = jax.grad(_reference_loss, argnums=1)(logits_fn, p, b, 0.7, loss_cfg)
        got = [x - y for x, y in zip(before, after)]
        want = [np.asarray(g) for g in jax.tree.leaves(ref_grad)]
        scale = max(float(np.abs(w).max()) for w in want)
        assert scale > 1e-4  # the gradient is not trivially zero
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-5 * scale)


def _one_sequence_per_row(rows, num_rows, pad_id=0):
    """The padded layout as a packing (``pack_token_rows``'s contract): every row its own segment,
    then all-invalid rows up to ``num_rows``."""
    out = {k: np.pad(np.asarray(v), [(0, num_rows - len(v))] + [(0, 0)] * (np.ndim(v) - 1)) for k, v in rows.items()}
    out["segment_ids"] = out["valid"].astype(np.int32)
    out["positions"] = np.maximum(np.cumsum(out["valid"], axis=1) - 1, 0).astype(np.int32)
    return out


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_packed_update_equals_the_padded_update_in_every_aggregation_mode(mode, monkeypatch):
    """Packing changes the layout only: parameters and metrics after one epoch equal the padded
    (one row per row) update's, sequences counted per packed segment."""
    cfg, graphdef, params = toy_model(VOCAB, seed=2)
    rng = np.random.default_rng(11)
    rows = _rows(rng, 40)
    rows["valid"] = np.arange(LENGTH)[None] < rng.integers(4, 11, 40)[:, None]  # short rows: 2-4 share a row
    for k in ("loss_mask", "old_logprobs", "ref_logprobs", "advantages"):
        rows[k] = np.where(rows["valid"], rows[k], 0.0).astype(np.float32)
    loss_cfg = LossConfig(kl_coef=0.05, loss_agg_mode=mode)
    out = []
    for packs in (True, False):
        if not packs:
            monkeypatch.setattr(learner_module, "pack_token_rows", _one_sequence_per_row)
        learner = _learner(params, graphdef, micro=8)
        rec = _Recorder(learner)
        m = learner.ppo_update(rows, loss_cfg, 2, np.random.default_rng(5), max_rows=64)
        out.append((m, [np.asarray(x) for x in jax.tree.leaves(learner.params)], rec))
    (m_p, p_p, rec_p), (m_d, p_d, _) = out
    assert all("segment_ids" in b for b, _, _ in rec_p.calls)
    assert sum(int(b["valid"].any(1).sum()) for b, _, _ in rec_p.calls) < 40  # fewer rows computed
    for a, b in zip(p_p, p_d):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/entropy"):
        np.testing.assert_allclose(m_p[k], m_d[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_pack_token_rows_refuses_left_padding_and_a_loss_in_column_0():
    from mempo_jax.core.packing import pack_token_rows

    rows = _rows(np.random.default_rng(0), 4)
    left = dict(rows, valid=rows["valid"][:, ::-1].copy())
    with pytest.raises(ValueError, match="right-padded"):
        pack_token_rows(left, 4)
    bad = dict(rows, loss_mask=rows["loss_mask"].copy())
    bad["loss_mask"][1, 0] = 1.0
    with pytest.raises(ValueError, match="column 0"):
        pack_token_rows(bad, 4)


def _opt_leaves(learner):
    return [np.array(x) for x in jax.tree.leaves(learner.state.opt_state)]


def test_zero_advantage_mini_batch_moves_adam_unless_skipped():
    """After one real step, a mini-batch whose loss tokens all carry advantage 0 has an exactly zero
    gradient (``kl_coef = 0``), yet with ``zero_advantage = "train"`` Adam's first moment still moves
    the parameters; ``"skip"`` leaves parameters and optimizer state bitwise unchanged and counts
    the update slot."""
    cfg, graphdef, params = toy_model(VOCAB, seed=4)
    rows = _rows(np.random.default_rng(21), 12)
    zero = dict(rows, advantages=np.zeros_like(rows["advantages"]))
    moved = {}
    for mode in ("train", "skip"):
        loss_cfg = LossConfig(kl_coef=0.0, zero_advantage=mode)
        learner = _learner(params, graphdef, micro=4, optimizer=optax.adam(1e-2))
        learner.ppo_update(rows, loss_cfg, 1, np.random.default_rng(0), max_rows=16)
        before, opt_before = [np.array(x) for x in jax.tree.leaves(learner.params)], _opt_leaves(learner)
        m = learner.ppo_update(zero, loss_cfg, 1, np.random.default_rng(1), max_rows=16)
        after = [np.array(x) for x in jax.tree.leaves(learner.params)]
        moved[mode] = max(float(np.abs(a - b).max()) for a, b in zip(after, before))
        assert learner.state.step == 2
        if mode == "train":
            assert m["actor/grad_norm"] == 0.0 and "actor/zero_advantage_skipped" not in m
        else:
            assert m == {"actor/zero_advantage_skipped": 1.0}
            assert all(np.array_equal(a, b) for a, b in zip(_opt_leaves(learner), opt_before))
    assert moved["train"] > 1e-3 and moved["skip"] == 0.0


def test_only_the_zero_advantage_mini_batch_is_skipped():
    """Two mini-batches, the first (of the shuffled order) with zero advantages: one program call,
    on the other's rows; the skipped share is reported."""
    cfg, graphdef, params = toy_model(VOCAB, seed=5)
    rows = _rows(np.random.default_rng(22), 10)
    order = np.random.default_rng(7).permutation(10)
    first = order[slice(*mini_batch_slices(10, 2)[0])]
    rows["advantages"][first] = 0.0
    learner = _learner(params, graphdef, micro=4)
    rec = _Recorder(learner)
    m = learner.ppo_update(rows, LossConfig(zero_advantage="skip"), 2, np.random.default_rng(7), max_rows=16)
    assert len(rec.calls) == 1 and rec.real_rows() == [5] and learner.state.step == 2
    assert m["actor/zero_advantage_skipped"] == 0.5 and "actor/pg_loss" in m


def test_unknown_zero_advantage_strategy_names_the_field():
    with pytest.raises(ValueError, match="zero_advantage"):
        LossConfig(zero_advantage="drop")


def test_train_steps_map_a_state_to_the_next():
    """``TrainSteps.ppo_step`` is a function of its state: the same state (copies: the step donates
    its input) and batch give bitwise the same next state, one step further, and the state passed
    in is not changed."""
    cfg, graphdef, params = toy_model(VOCAB, seed=6)
    learner = _learner(params, graphdef, micro=4, optimizer=optax.adam(1e-2))
    batch = _one_sequence_per_row(_rows(np.random.default_rng(3), 8), 8)
    state, before = learner.state, [np.array(x) for x in jax.tree.leaves(learner.state)]
    copy = lambda s: jax.tree.map(lambda x: x.copy(), s)  # noqa: E731
    (a, ma), (b, mb) = (learner.steps.ppo_step(copy(state), batch, 2, LossConfig()) for _ in range(2))
    assert a.step == b.step == state.step + 1 and ma.keys() == mb.keys()
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert all(np.array_equal(ma[k], mb[k]) for k in ma)
    assert not np.array_equal(jax.tree.leaves(a.trainable)[0], before[0])  # it moved
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(state), before))
