"""The detached per-token log-probs of the trainer's rows, computed over the rows packed end to end."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Float, Int, Shaped

from mempo_jax.core.batching import bucket_length
from mempo_jax.core.packing import pack, plan_packing
from mempo_jax.model.forward import LogitsFn, token_stats


class PackedLogprobs:
    """Per-token log-probs of padded rows, computed over the rows packed end to end (no gradient).

    The trainer's recompute of the PPO "old" log-probs (verl ``compute_log_prob`` before the
    update): the real tokens of each ``[R, L]`` row are packed (``mempo_jax.core.packing``: first-fit
    decreasing, segment ids, positions restarting per segment) into calls of ``[rows, L_p]``,
    scored with the model's packed call, and scattered back to the row layout.

    Args:
      logits_fn: the model (``model.forward.LogitsFn``; scored through ``model.forward.token_stats``,
        the LM head in chunks).
      temperature: the sampler's temperature (> 0).
      rows_per_call: most packed rows per call (a power of two).
      min_rows: smallest row bucket (the mesh's batch shards).
      min_length: smallest length bucket.
      param_shardings, batch_sharding: optional shardings (as ``TrainSteps``'): the call then
        declares ``in_shardings=(params, batch × 3)`` and a replicated output.

    Raises:
      ValueError: if ``temperature <= 0``.
    """

    def __init__(self, logits_fn: LogitsFn, temperature: float = 1.0, *, rows_per_call: int = 64, min_rows: int = 1,
                 min_length: int = 128, param_shardings=None, batch_sharding=None):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.logits_fn = logits_fn
        self.temperature = float(temperature)
        self.min_rows = max(int(min_rows), 1)
        self.rows_per_call = bucket_length(int(rows_per_call), self.min_rows)
        self.min_length = int(min_length)
        self.param_shardings, self.batch_sharding = param_shardings, batch_sharding
        self._length_cap = None
        if param_shardings is not None and batch_sharding is not None:
            rep = jax.sharding.NamedSharding(batch_sharding.mesh, jax.sharding.PartitionSpec())
            self._call = jax.jit(self._impl, in_shardings=(param_shardings,) + (batch_sharding,) * 3,
                                 out_shardings=rep)
        else:
            self._call = jax.jit(self._impl)

    def _impl(self, params, ids, segment_ids, positions):
        params = jax.lax.stop_gradient(params)
        logp, _ = token_stats(self.logits_fn, params, ids, segment_ids=segment_ids, positions=positions,
                              temperature=self.temperature, grad=False)
        return jax.lax.stop_gradient(logp)

    def __call__(self, params, input_ids: Int[ArrayLike, "rows length"],
                 valid: Shaped[ArrayLike, "rows length"]) -> Float[np.ndarray, "rows length"]:
        """``[R, L]`` float32 log-probs of ``input_ids`` (``token_logprobs`` convention); 0 where
        the token or its predecessor is not a real token (nothing real predicts it).

        Args:
          params: policy parameters (constants).
          input_ids: ``[R, L]`` int32.
          valid: ``[R, L]`` bool, True on real tokens (any padding layout).
        """
        input_ids, valid = np.asarray(input_ids), np.asarray(valid, bool)
        out = np.zeros(input_ids.shape, np.float32)
        cols = [np.flatnonzero(v) for v in valid]
        rows = [input_ids[i, c].tolist() for i, c in enumerate(cols)]
        keep = [i for i, r in enumerate(rows) if len(r) > 1]
        if not keep:
            return out
        sizes = [len(rows[i]) for i in keep]
        keep_arr = np.asarray(keep, np.int64)
        colmap = np.zeros((len(keep), max(sizes)), np.int64)  # packed segment column -> column of the padded row
        for j, i in enumerate(keep):
            colmap[j, : sizes[j]] = cols[i]
        d = 2
        if self._length_cap is not None:
            base, d = bucket_length(max(sizes), self.min_length), 0
            while d < 2 and base * 2 ** (d + 1) <= self._length_cap:
                d += 1
        length, calls = plan_packing(sizes, self.min_length, self.rows_per_call, self.min_rows, max_doublings=d)
        if self.param_shardings is not None:
            params = jax.device_put(params, self.param_shardings)
        for bins in calls:
            r = bucket_length(len(bins), self.min_rows)
            pk = pack([rows[i] for i in keep], bins, length, r, 0)
            batch = (pk.input_ids, pk.segment_ids, pk.positions)
            if self.batch_sharding is not None:
                batch = tuple(jax.device_put(x, self.batch_sharding) for x in batch)
            lp = np.asarray(jax.device_get(self._call(params, *batch)), np.float32)
            sel = pk.col_of >= 1  # a segment's first token is predicted by nothing of its own
            j, c = pk.row_of[sel], pk.col_of[sel]
            out[keep_arr[j], colmap[j, c]] = lp[sel]
        return out

    def precompile(self, params, lengths) -> int:
        """Compile ``[R, L]`` for every row bucket ``R`` (``min_rows`` … ``rows_per_call``) and
        ``L`` in ``lengths`` (nothing runs); later calls keep to lengths ``<= max(lengths)``
        unless one row is longer. Returns the number of programs built."""
        if self.param_shardings is not None:
            params = jax.device_put(params, self.param_shardings)
        built = 0
        for length in lengths:
            r = self.min_rows
            while r <= self.rows_per_call:
                self.lower(params, r, length).compile()
                built += 1
                r *= 2
        if lengths:
            self._length_cap = max(int(x) for x in lengths)
        return built

    def lower(self, params, rows: int, length: int) -> jax.stages.Lowered:
        """The packed pass's program lowered at ``[rows, length]`` int32 inputs (nothing runs;
        ``params`` may be ``jax.ShapeDtypeStruct``s)."""
        kw = {} if self.batch_sharding is None else {"sharding": self.batch_sharding}
        return self._call.lower(params, *[jax.ShapeDtypeStruct((int(rows), int(length)), jnp.int32, **kw)] * 3)


__all__ = ["PackedLogprobs"]
