"""Multi-process JAX: start-up, this process's share of the work, host-side gathers.

On a TPU pod slice every worker VM runs the same command (``launch/run.sh`` uses
``gcloud ... ssh --worker=all``); each is one JAX process that owns its host's chips. The entry
point calls ``maybe_initialize()`` first; afterwards ``jax.devices()`` lists every chip of the
slice and a ``Mesh`` over them spans all processes. Host-side work (questions, tool calls,
parsing) is split with ``process_slice``; device programs are global (every process calls them
in the same order, see ``mempo_jax.run.lockstep``); metrics and files are written by the primary
process only (``is_primary``), checkpoints by orbax (every process calls ``save``, each shard is
written once). Source: JAX "Multi-process environments" guide; MaxText ``max_utils``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional, Sequence

import jax
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Shaped

from mempo_jax.core.paths import is_remote
from mempo_jax.core.peers import PeerWatch
from mempo_jax.core.validation import check

# Environment variables read by ``maybe_initialize`` (explicit clusters, e.g. CPU tests or GPUs).
ENV_COORDINATOR = "MEMPO_COORDINATOR"  # "host:port" of process 0
ENV_NUM_PROCESSES = "MEMPO_NUM_PROCESSES"
ENV_PROCESS_ID = "MEMPO_PROCESS_ID"
ENV_MULTIHOST = "MEMPO_MULTIHOST"  # "1": a Cloud TPU slice; jax auto-detects the coordinator


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """What a multi-process run does when one of its processes is lost (docs/resume.md).

    Attributes:
      peer_timeout_s: a process whose heartbeat (``core.peers.PeerWatch``, one a second) has not
        moved for this long is lost; every other process then exits with status
        ``peers.EXIT_PEER_LOST`` and one line naming it and the last complete checkpoint. JAX's
        own heartbeat and shutdown timeouts are twice this (a backstop).

    Raises:
      ValueError: from ``__post_init__``, a timeout that is not a number in [2, 600].
    """

    peer_timeout_s: float = 30.0

    def __post_init__(self):
        check(self, "peer_timeout_s", float, lo=2.0, hi=600.0)

    @property
    def jax_timeout_s(self) -> int:
        """``heartbeat_timeout_seconds`` / ``shutdown_timeout_seconds`` of ``jax.distributed.initialize``."""
        return int(round(2 * self.peer_timeout_s))


def maybe_initialize(coordinator_address: Optional[str] = None, num_processes: Optional[int] = None,
                     process_id: Optional[int] = None, env: Optional[Mapping[str, str]] = None,
                     config: DistributedConfig = DistributedConfig()) -> bool:
    """Call ``jax.distributed.initialize`` when this job runs as several processes.

    Decides from the arguments, else from the environment:

    * an explicit cluster (``coordinator_address`` / ``$MEMPO_COORDINATOR`` and
      ``num_processes`` / ``$MEMPO_NUM_PROCESSES`` > 1 and ``process_id`` / ``$MEMPO_PROCESS_ID``):
      ``initialize(coordinator, num_processes, process_id)``; on CPU the gloo collectives are
      selected first (cross-process CPU collectives need them);
    * a Cloud TPU slice with several hosts (``$MEMPO_MULTIHOST=1``, set by ``launch/run.sh``, or
      ``$TPU_WORKER_HOSTNAMES`` naming more than one host): ``initialize()`` without arguments,
      which reads the slice's metadata;
    * otherwise nothing (one process; returns False).

    JAX's heartbeat and shutdown timeouts are ``config.jax_timeout_s``. Must run before any other
    JAX call that touches devices.

    Returns:
      True when ``jax.distributed.initialize`` was called.

    Raises:
      ValueError: for an explicit cluster with a missing or out-of-range process id.
    """
    env = os.environ if env is None else env
    coordinator = coordinator_address or env.get(ENV_COORDINATOR) or None
    n = int(num_processes if num_processes is not None else env.get(ENV_NUM_PROCESSES, "0") or 0)
    if coordinator and n > 1:
        pid = process_id if process_id is not None else env.get(ENV_PROCESS_ID)
        if pid is None or not 0 <= int(pid) < n:
            raise ValueError(f"process id {pid!r} must be in [0, {n}) (set ${ENV_PROCESS_ID})")
        if "cpu" in str(env.get("JAX_PLATFORMS", "")).split(","):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator, num_processes=n, process_id=int(pid),
                                   heartbeat_timeout_seconds=config.jax_timeout_s,
                                   shutdown_timeout_seconds=config.jax_timeout_s)
        return True
    hosts = [h for h in str(env.get("TPU_WORKER_HOSTNAMES", "")).split(",") if h.strip()]
    if env.get(ENV_MULTIHOST) == "1" or len(hosts) > 1:
        jax.distributed.initialize(heartbeat_timeout_seconds=config.jax_timeout_s,
                                   shutdown_timeout_seconds=config.jax_timeout_s)
        return True
    return False


def watch_peers(config: DistributedConfig, run_dir: Optional[str] = None, guardian: bool = True):
    """Start the lost-process watch of a joined multi-process run (``core.peers.PeerWatch``).

    Returns:
      The started ``PeerWatch``, or None on one process.
    """
    if jax.process_count() == 1:
        return None
    from jax._src import distributed as jax_distributed  # the joined client (orbax reads it the same way)

    state = jax_distributed.global_state
    return PeerWatch(state.client, jax.process_index(), jax.process_count(), config.peer_timeout_s,
                     run_dir=None if run_dir is None else run_dir if is_remote(run_dir) else os.path.abspath(run_dir),
                     coordinator=state.coordinator_address, guardian=guardian).start()


def is_primary() -> bool:
    """True on process 0: the one that writes metrics, summaries and run artefacts."""
    return jax.process_index() == 0


def process_slice(n: int, index: Optional[int] = None, count: Optional[int] = None) -> slice:
    """This process's contiguous share of ``n`` items (balanced; the first ``n % count`` get one more).

    Processes in index order cover ``[0, n)`` exactly, so concatenating their results in process
    order gives the single-process order.

    Args:
      n: global item count (questions of a step, rows of a batch).
      index, count: default ``jax.process_index()`` / ``jax.process_count()``.

    Raises:
      ValueError: if ``n < count`` (a process would get no item and could not take part).
    """
    index = jax.process_index() if index is None else int(index)
    count = jax.process_count() if count is None else int(count)
    if n < count:
        raise ValueError(f"{n} items cannot be split over {count} processes (each needs at least one)")
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return slice(start, start + base + (1 if index < extra else 0))


def allgather(x: Shaped[ArrayLike, "*shape"]) -> Shaped[np.ndarray, "processes *shape"]:
    """``[P, *x.shape]``: every process's ``x`` (same shape and dtype everywhere), stacked in
    process order. A collective: every process must call it. One process: ``x[None]``."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False))


def gather_rows(arrays: Sequence[Shaped[ArrayLike, "rows _"]], counts: Sequence[int], width: int, pad_values: Sequence,
                side: str = "right") -> list[Shaped[np.ndarray, "_ _"]]:
    """Concatenate every process's ``[n_p, w_p]`` arrays into ``[sum n_p, width]`` (process order).

    Columns are padded to ``width`` on ``side`` with ``pad_values`` (one per array); rows are
    padded to ``max n_p`` for the collective and dropped after it.

    Args:
      arrays: this process's 2-D arrays (equal row counts).
      counts: every process's row count (from a header exchange), ``[P]``.
      width: the common column count (``>=`` every ``w_p``).
      pad_values: fill value per array.
      side: ``"right"`` (training rows) or ``"left"`` (sampler prompts).

    Returns:
      The global arrays, identical on every process.
    """
    n_max = max(int(max(counts)), 1)
    out = []
    for a, fill in zip(arrays, pad_values):
        a = np.asarray(a)
        cols = width - a.shape[1]
        padded = np.full((n_max, width), fill, a.dtype)
        if side == "right":
            padded[: a.shape[0], : a.shape[1]] = a
        else:
            padded[: a.shape[0], cols:] = a
        stacked = allgather(padded)
        out.append(np.concatenate([stacked[p, : int(c)] for p, c in enumerate(counts)], axis=0))
    return out


def gather_lists(seqs: Sequence[Sequence[int]]) -> list[list[int]]:
    """Every process's list of id lists, concatenated in process order (a collective)."""
    lengths = np.asarray([len(s) for s in seqs], np.int32)
    flat = np.asarray([int(t) for s in seqs for t in s], np.int32)
    sizes = allgather(np.asarray([len(seqs), flat.size], np.int32))
    n_max, f_max = int(sizes[:, 0].max()), int(sizes[:, 1].max())
    all_lengths = allgather(np.pad(lengths, (0, n_max - lengths.size)))
    all_flat = allgather(np.pad(flat, (0, f_max - flat.size)))
    out = []
    for p in range(sizes.shape[0]):
        pos = 0
        for length in all_lengths[p, : int(sizes[p, 0])]:
            out.append(all_flat[p, pos : pos + int(length)].tolist())
            pos += int(length)
    return out


def mean_metrics(metrics: Mapping[str, float], weight: float = 1.0, sync=None) -> dict[str, float]:
    """Weighted mean of every process's metrics (a collective; keys must agree across processes).

    Args:
      metrics: this process's scalar metrics.
      weight: this process's weight (e.g. its number of trajectories).
      sync: the run's ``HostSync``; when given, a barrier first (after a rollout outside the
        lockstep wrappers, e.g. an evaluation, the processes reach this call at different times).

    Raises:
      ValueError: if processes report different metric names.
    """
    keys = sorted(metrics)
    if jax.process_count() == 1:
        return {k: float(metrics[k]) for k in keys}
    if sync is not None:
        sync.barrier()
    code = np.frombuffer(("\0".join(keys)).encode()[:64].ljust(64, b"\0"), np.uint8).astype(np.int32)
    codes = allgather(np.concatenate([[len(keys)], code]))
    if not (codes == codes[0]).all():
        raise ValueError("processes report different metric names; cannot average them")
    values = allgather(np.asarray([weight] + [float(metrics[k]) for k in keys], np.float32))
    w = values[:, 0]
    mean = (values[:, 1:] * w[:, None]).sum(0) / max(float(w.sum()), 1e-12)
    return {k: float(v) for k, v in zip(keys, mean)}
