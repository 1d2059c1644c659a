"""Lockstep device programs across processes, so the single-process RL step runs unchanged on a pod.

In multi-controller JAX every process must launch every global (mesh-wide) program, in the same
order, with the same shapes. A MemPO step breaks that naively: each process rolls out its own
questions (host tools, parsing), and its rollout may need more or fewer sampling turns than
another's. This module restores lockstep with one rule: *before every global program the
processes exchange a small header* (``HostSync.agree``: an ``int32[16]`` allgather naming the
operation and its local sizes). If some processes are still sampling while others have moved on
(to scoring, log-probs, an update or a barrier), the others join the sampling call with zero
rows and ask again. Host data are exchanged with ``distributed.gather_rows`` /
``gather_lists``, so every process feeds the same global batch to each program (the batch is
then split over the mesh by its shardings).

Wrappers (pass them where the single-process objects go; with one process they are the plain
objects' calls):

* ``LockstepSampleFn(sample_fn, sync, pad_id)`` — the rollout's ``sample_fn``. The global
  sampling batch is every process's real rows in process order, padded like a single process
  pads it (rows to ``bucket_length(total, min bucket)`` with one-token rows, prompts left-padded
  to the longest bucket), so row ``b`` — and its ``fold_in(key, b)`` sampling key — is the row
  a single process would have given the same trajectory. Two processes with contiguous halves of
  the questions therefore sample exactly the single-process tokens.
* ``DistributedScorer(scorer, sync)`` — scores every process's ``<mem>`` turns in one global
  stacked batch, returns this process's.
* ``DistributedLearner(...)`` — a ``Learner`` whose ``logprobs`` / ``ppo_update`` /
  ``sft_step`` take this process's rows, run on the concatenated global batch, and return this
  process's slice (log-probs) or the global metrics.

Source: JAX "Multi-process environments" (every process runs the same programs; host-local data
is assembled into global arrays); the header/serve protocol is this project's.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import numpy as np

from mempo_jax.core.batching import bucket_length
from mempo_jax.core.distributed import allgather, gather_lists, gather_rows
from mempo_jax.rl.learner import Learner
from mempo_jax.agent.sampler import SampleOutput
from mempo_jax.rl.memory_reward import MemoryRewardOutput

SAMPLE, SCORE, LOGPROBS, UPDATE, SFT, BARRIER = 1, 2, 3, 4, 5, 6
OP_NAMES = {SAMPLE: "sample", SCORE: "score", LOGPROBS: "logprobs", UPDATE: "update", SFT: "sft", BARRIER: "barrier"}
HEADER = 16  # int32 words per process: op, then the op's sizes


def _f2i(x: float) -> int:
    return int(np.float32(x).view(np.int32))


def _i2f(x) -> float:
    return float(np.asarray(x, np.int32).view(np.float32))


class HostSync:
    """The header exchange that keeps processes in lockstep (one per run, shared by the wrappers).

    Attributes:
      sampler: the ``LockstepSampleFn`` that serves sampling calls of other processes.
      policy_params: the current policy parameters (kept up to date by ``DistributedLearner``);
        what a process serves another's sampling call with when no parameters are given.
    """

    def __init__(self):
        self.sampler: Optional["LockstepSampleFn"] = None
        self.policy_params: Any = None

    @property
    def multiprocess(self) -> bool:
        """True when ``jax.process_count() > 1`` (otherwise every wrapper is a pass-through)."""
        return jax.process_count() > 1

    def agree(self, op: int, payload: Sequence[int] = (), params: Any = None) -> np.ndarray:
        """Exchange ``[op, *payload]`` with every process until all run the same operation.

        While another process is sampling, a process at a different operation joins that sampling
        call with zero rows (using ``params``, else ``policy_params``, else the parameters of its
        own last sampling call) and asks again. A sampling process returns at once.

        Args:
          op: one of ``SAMPLE, SCORE, LOGPROBS, UPDATE, SFT, BARRIER``.
          payload: up to 15 int32 sizes.
          params: policy parameters to serve another process's sampling call with.

        Returns:
          ``[P, 16]`` int32 headers of every process (process order).

        Raises:
          RuntimeError: processes at different non-sampling operations (a program was skipped
            on one of them), or a sampling call to serve without a ``LockstepSampleFn``.
        """
        header = np.zeros(HEADER, np.int32)
        header[0] = op
        header[1 : 1 + len(payload)] = np.asarray(payload, np.int64).astype(np.int32)
        while True:
            headers = allgather(header)
            ops = headers[:, 0]
            if op == SAMPLE or (ops == op).all():
                return headers
            if (ops == SAMPLE).any():
                if self.sampler is None:
                    raise RuntimeError("another process is sampling but this one has no LockstepSampleFn")
                self.sampler.serve(headers, params if params is not None else self.policy_params)
                continue
            names = [OP_NAMES.get(int(o), str(o)) for o in ops]
            raise RuntimeError(f"processes out of step: process {jax.process_index()} runs "
                               f"{OP_NAMES.get(op, op)}, the processes run {names}")

    def barrier(self, params: Any = None) -> None:
        """Wait until every process reaches this point, serving pending sampling calls.

        Call it after a rollout that is not followed by a wrapped call (e.g. after evaluation,
        before a checkpoint or any other global program), with the parameters that rollout
        sampled with if they are not the learner's current ones. No-op on one process.
        """
        if self.multiprocess:
            self.agree(BARRIER, params=params)


def real_rows(prompt_mask: np.ndarray) -> int:
    """Rows before the rollout's bucket padding: trailing rows with at most one real token.

    ``agent.rollout`` pads a sampling batch with one-token rows (``contexts[0][:1]``); a real
    context holds the system prompt and the question, so it has more than one token.
    """
    n = prompt_mask.shape[0]
    real = np.asarray(prompt_mask).sum(axis=1) > 1
    while n > 0 and not real[n - 1]:
        n -= 1
    return n


class LockstepSampleFn:
    """A rollout ``sample_fn`` that samples every process's rows in one global call.

    Args:
      sample_fn: ``(params, ids [B,P], mask [B,P], key, max_new_tokens, temperature, top_p) ->
        SampleOutput`` over the global batch (e.g. ``Experiment.sample_fn`` of a mesh ``Sampler``).
      sync: the run's ``HostSync``; this object registers itself as its sampler.
      pad_id: the tokenizer's padding id.
    """

    def __init__(self, sample_fn, sync: HostSync, pad_id: int):
        self.sample_fn = sample_fn
        self.sync = sync
        self.pad_id = int(pad_id)
        self.last_params = None
        sync.sampler = self

    @property
    def sampler(self):
        """The ``Sampler`` behind ``sample_fn`` on one process (the cached rollout engine drives its
        slot programs directly); ``None`` with several processes, where only the legacy engine runs."""
        return None if self.sync.multiprocess else getattr(self.sample_fn, "sampler", None)

    def __call__(self, params, prompt_ids, prompt_mask, key, max_new_tokens, temperature, top_p):
        """Same contract as ``sample_fn`` on this process's ``[B, P]`` rows; returns numpy
        ``SampleOutput`` arrays of ``B`` rows (rows after ``real_rows`` are zero)."""
        if not self.sync.multiprocess:
            return self.sample_fn(params, prompt_ids, prompt_mask, key, max_new_tokens, temperature, top_p)
        ids, mask = np.asarray(prompt_ids, np.int32), np.asarray(prompt_mask, bool)
        n = real_rows(mask)
        typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        words = np.asarray(jax.random.key_data(key) if typed else key).astype(np.uint32).ravel().view(np.int32)
        if words.size > HEADER - 9:
            raise ValueError(f"PRNG key of {words.size} words does not fit the sampling header")
        payload = [n, ids.shape[0], ids.shape[1], int(max_new_tokens), _f2i(temperature), _f2i(top_p), int(typed),
                   words.size, *words.tolist()]
        self.last_params = params
        headers = self.sync.agree(SAMPLE, payload, params)
        local = self._run(headers, params, ids[:n], mask[:n])
        rows = ids.shape[0]

        def pad(x):
            return np.concatenate([x, np.zeros((rows - x.shape[0],) + x.shape[1:], x.dtype)], axis=0)

        return SampleOutput(*(pad(x) for x in local))

    def serve(self, headers: np.ndarray, params: Any = None) -> None:
        """Join another process's sampling call with zero rows (called by ``HostSync.agree``).

        Raises:
          RuntimeError: without parameters to sample with.
        """
        params = self.last_params if params is None else params
        if params is None:
            raise RuntimeError("cannot serve a sampling call: no policy parameters seen yet")
        self._run(headers, params, np.zeros((0, 1), np.int32), np.zeros((0, 1), bool))

    def _run(self, headers, params, ids, mask) -> tuple[np.ndarray, ...]:
        sampling = headers[:, 0] == SAMPLE
        counts = np.where(sampling, headers[:, 1], 0)
        lead = headers[int(np.argmax(sampling))]
        width = int(headers[sampling, 3].max())
        min_rows = int(headers[sampling, 2].min())
        n_new, temperature, top_p, typed, k = int(lead[4]), _i2f(lead[5]), _i2f(lead[6]), bool(lead[7]), int(lead[8])
        key = lead[9 : 9 + k].astype(np.int32).view(np.uint32)
        key = jax.random.wrap_key_data(key) if typed else key
        g_ids, g_mask = gather_rows([ids, mask], counts, width, [self.pad_id, False], side="left")
        total = g_ids.shape[0]
        rows = bucket_length(total, min_rows)
        if rows > total:  # the single-process padding: one-token rows of row 0's first token
            first = g_ids[0, int(np.argmax(g_mask[0]))]
            pad_ids = np.full((rows - total, width), self.pad_id, np.int32)
            pad_mask = np.zeros((rows - total, width), bool)
            pad_ids[:, -1], pad_mask[:, -1] = first, True
            g_ids, g_mask = np.concatenate([g_ids, pad_ids]), np.concatenate([g_mask, pad_mask])
        out = self.sample_fn(params, g_ids, g_mask, key, n_new, temperature, top_p)
        host = _fetch(out)
        start = int(counts[: jax.process_index()].sum())
        return tuple(np.asarray(x)[start : start + int(counts[jax.process_index()])] for x in host)


def _fetch(out: SampleOutput) -> SampleOutput:
    """Global output arrays → numpy on every process."""
    from jax.experimental import multihost_utils

    return SampleOutput(*(np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in out))


class DistributedScorer:
    """A ``MemoryRewardScorer`` over every process's turns (one global stacked batch per step).

    Args:
      scorer: the ``MemoryRewardScorer`` (ideally with mesh shardings).
      sync: the run's ``HostSync``.
    """

    def __init__(self, scorer, sync: HostSync):
        self.scorer = scorer
        self.sync = sync

    def __call__(self, params, full_contexts, mem_contexts, answers) -> MemoryRewardOutput:
        """R_M of this process's ``M`` turns, scored together with every other process's turns.

        Always a collective on several processes (also when this process has no turn).

        Raises:
          ValueError: as ``build_scoring_batch``.
        """
        if not self.sync.multiprocess:
            return self.scorer(params, full_contexts, mem_contexts, answers)
        m = len(full_contexts)
        if len(mem_contexts) != m or len(answers) != m:
            raise ValueError(f"need as many contexts as answers: {m} full, {len(mem_contexts)} mem, "
                             f"{len(answers)} answers")
        counts = self.sync.agree(SCORE, [m], params)[:, 1]
        if counts.sum() == 0:
            empty = np.zeros((0,), np.float32)
            return MemoryRewardOutput(empty, empty.copy(), empty.copy())
        out = self.scorer(params, gather_lists(full_contexts), gather_lists(mem_contexts), gather_lists(answers))
        start = int(counts[: jax.process_index()].sum())
        return MemoryRewardOutput(*(x[start : start + m] for x in out))


class DistributedLearner(Learner):
    """A ``Learner`` fed with this process's rows on several processes.

    Args are ``Learner``'s (give it the run's ``mesh``), plus:
      sync: the run's ``HostSync``.
      pad_id: padding id for the column padding of gathered rows.

    Construction waits at a barrier (serving pending sampling calls), since it runs global
    programs (placement, optimizer init). The learner keeps ``sync.policy_params`` current.
    """

    def __init__(self, *args, sync: HostSync, pad_id: int = 0, **kwargs):
        self.sync = sync
        params = args[1] if len(args) > 1 else kwargs.get("params")
        sync.barrier(params)
        super().__init__(*args, pad_id=pad_id, **kwargs)

    @property
    def params(self):
        """The policy parameters; every assignment also updates ``sync.policy_params`` (the old
        arrays are donated to the update step, so nothing may serve sampling with them)."""
        return self._params

    @params.setter
    def params(self, value):
        self._params = value
        self.sync.policy_params = value

    def _gather(self, op: int, rows: dict, params=None) -> tuple[dict, np.ndarray, int]:
        first = next(iter(rows.values()))
        headers = self.sync.agree(op, [first.shape[0], first.shape[1]], params)
        counts, width = headers[:, 1], int(headers[:, 2].max())
        keys = list(rows)
        fills = [self.pad_id if k == "input_ids" else 0 for k in keys]
        arrays = gather_rows([np.asarray(rows[k]) for k in keys], counts, width, fills, side="right")
        return dict(zip(keys, arrays)), counts, width

    def logprobs(self, params, input_ids: np.ndarray, valid: np.ndarray, chunk_rows: int | None = None) -> np.ndarray:
        """``Learner.logprobs`` of this process's ``[R_p, L_p]`` rows, computed in the global batch."""
        if not self.sync.multiprocess:
            return super().logprobs(params, input_ids, valid, chunk_rows)
        g, counts, _ = self._gather(LOGPROBS, {"input_ids": input_ids, "valid": valid})
        lp = super().logprobs(params, g["input_ids"], g["valid"], chunk_rows)
        start = int(counts[: jax.process_index()].sum())
        return lp[start : start + input_ids.shape[0], : input_ids.shape[1]]

    def ppo_update(self, rows, loss_cfg, num_mini_batches, rng, *, max_rows=None):
        """``Learner.ppo_update`` on the concatenation of every process's rows (process order).

        ``rng`` must be in the same state on every process (same seed, same use), as the shuffle
        of the global rows is drawn from it on each of them. ``max_rows`` bounds one process's
        rows (the global bound is ``max_rows · process_count``).
        """
        if not self.sync.multiprocess:
            return super().ppo_update(rows, loss_cfg, num_mini_batches, rng, max_rows=max_rows)
        g, _, _ = self._gather(UPDATE, dict(rows))
        bound = None if max_rows is None else max_rows * jax.process_count()
        return super().ppo_update(g, loss_cfg, num_mini_batches, rng, max_rows=bound)

    def sft_step(self, batch):
        """``Learner.sft_step`` on the concatenation of every process's batch rows."""
        if not self.sync.multiprocess:
            return super().sft_step(batch)
        g, _, _ = self._gather(SFT, dict(batch))
        return super().sft_step(g)


def distribute(sample_fn, scorer, pad_id: int, sync: Optional[HostSync] = None):
    """``(sync, lockstep sample_fn, distributed scorer)`` for a run (pass-throughs on one process)."""
    sync = HostSync() if sync is None else sync
    return sync, LockstepSampleFn(sample_fn, sync, pad_id), DistributedScorer(scorer, sync)
