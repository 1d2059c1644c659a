"""Lockstep global programs across processes, so the single-process RL step runs unchanged on a pod.

In multi-controller JAX every process must launch every global (mesh-wide) program, in the same
order, with the same shapes. The rollout has none: each process samples its own questions on its
own host-local mesh (``mempo_jax.core.rollout_mesh``), for as long as its episodes need. What
follows it — scoring, log-probs, the update — are global programs over every process's rows, whose
sizes differ by process. So *before every global program the processes exchange a small header*
(``HostSync.agree``: an ``int32[16]`` allgather naming the operation and its local sizes), from
which each builds the same global batch (``distributed.gather_rows`` / ``gather_lists``: every
process's rows in process order; the batch is then split over the mesh by its shardings). A
process that finished its rollout early simply waits in that allgather.

Wrappers (pass them where the single-process objects go; with one process they are the plain
objects' calls):

* ``DistributedScorer(scorer, sync)`` — scores every process's ``<mem>`` turns in one global
  stacked batch, returns this process's.
* ``LockstepRows(sync, pad_id)`` — the ``rl.learner.Learner``'s row placement: its SFT step, PPO
  update and packed log-prob pass take this process's rows and run on the concatenated global
  batch (the same ``TrainSteps`` as on one process); metrics are global, log-probs this
  process's slice.

Source: JAX "Multi-process environments" (every process runs the same programs; host-local data
is assembled into global arrays); the header protocol is this project's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import numpy as np

from mempo_jax.core.distributed import allgather, gather_lists, gather_rows
from mempo_jax.rl.memory_reward import MemoryRewardOutput

SCORE, LOGPROBS, UPDATE, SFT, BARRIER = 2, 3, 4, 5, 6
OP_NAMES = {SCORE: "score", LOGPROBS: "logprobs", UPDATE: "update", SFT: "sft", BARRIER: "barrier"}
_OPS = {name: op for op, name in OP_NAMES.items()}
HEADER = 16  # int32 words per process: op, then the op's sizes


class HostSync:
    """The header exchange that keeps processes in lockstep (one per run, shared by the wrappers)."""

    @property
    def multiprocess(self) -> bool:
        """True when ``jax.process_count() > 1`` (otherwise every wrapper is a pass-through)."""
        return jax.process_count() > 1

    def agree(self, op: int, payload: Sequence[int] = ()) -> np.ndarray:
        """Exchange ``[op, *payload]`` with every process (an allgather: it waits for all of them).

        Args:
          op: one of ``SCORE, LOGPROBS, UPDATE, SFT, BARRIER``.
          payload: up to 15 int32 sizes.

        Returns:
          ``[P, 16]`` int32 headers of every process (process order).

        Raises:
          RuntimeError: processes at different operations (a program was skipped on one of them).
        """
        header = np.zeros(HEADER, np.int32)
        header[0] = op
        header[1 : 1 + len(payload)] = np.asarray(payload, np.int64).astype(np.int32)
        headers = allgather(header)
        ops = headers[:, 0]
        if not (ops == op).all():
            names = [OP_NAMES.get(int(o), str(o)) for o in ops]
            raise RuntimeError(f"processes out of step: process {jax.process_index()} runs "
                               f"{OP_NAMES.get(op, op)}, the processes run {names}")
        return headers

    def barrier(self) -> None:
        """Wait until every process reaches this point. No-op on one process."""
        if self.multiprocess:
            self.agree(BARRIER)


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
        counts = self.sync.agree(SCORE, [m])[:, 1]
        if counts.sum() == 0:
            empty = np.zeros((0,), np.float32)
            return MemoryRewardOutput(empty, empty.copy(), empty.copy())
        out = self.scorer(params, gather_lists(full_contexts), gather_lists(mem_contexts), gather_lists(answers))
        start = int(counts[: jax.process_index()].sum())
        return MemoryRewardOutput(*(x[start : start + m] for x in out))

    @property
    def full_prefix(self) -> list[int]:
        """The wrapped scorer's ``full_prefix``."""
        return self.scorer.full_prefix

    def length_buckets(self, max_tokens: int) -> list[int]:
        """The wrapped scorer's ``length_buckets``."""
        return self.scorer.length_buckets(max_tokens)

    def precompile(self, params, lengths) -> int:
        """The wrapped scorer's ``precompile`` (programs are per process; nothing is exchanged)."""
        return self.scorer.precompile(params, lengths)


class LockstepRows:
    """The rows of a global step gathered from every process (``rl.learner.RowPlacement``): the
    learner runs its steps on every process's rows in process order.

    Args:
      sync: the run's ``HostSync``.
      pad_id: padding id for the column padding of gathered rows.
    """

    def __init__(self, sync: HostSync, pad_id: int = 0):
        self.sync, self.pad_id = sync, int(pad_id)

    def global_rows(self, op: str, rows) -> tuple[dict, int]:
        """Every process's ``[R_p, L_p]`` rows of ``op`` (``"update"``, ``"sft"``, ``"logprobs"``),
        right-padded to the longest (``input_ids`` with ``pad_id``, the rest with 0) and
        concatenated in process order, and this process's first row; ``(rows, 0)`` on one process."""
        if not self.sync.multiprocess:
            return dict(rows), 0
        first = next(iter(rows.values()))
        headers = self.sync.agree(_OPS[op], [first.shape[0], first.shape[1]])
        counts, width = headers[:, 1], int(headers[:, 2].max())
        keys = list(rows)
        fills = [self.pad_id if k == "input_ids" else 0 for k in keys]
        arrays = gather_rows([np.asarray(rows[k]) for k in keys], counts, width, fills, side="right")
        return dict(zip(keys, arrays)), int(counts[: jax.process_index()].sum())


def distribute(scorer, sync: Optional[HostSync] = None):
    """``(sync, distributed scorer)`` for a run (pass-throughs on one process)."""
    sync = HostSync() if sync is None else sync
    return sync, DistributedScorer(scorer, sync)
