"""A lost process ends a multi-process run: every other process exits with one line naming it.

When one process of a multi-process job dies (a host failure, a spot worker reclaimed, an
out-of-memory kill), the others must not wait in a collective while the slice bills. Two parts:

* ``PeerWatch``, a daemon thread in every process, once the processes are joined: every
  ``interval_s`` it writes a counter under ``mempo/peers/<i>`` in the coordination service's
  key-value store and reads every other process's. A process whose counter this process has
  watched, without a gap of its own, for ``peer_timeout_s`` without seeing it move is lost (after
  a gap in this process's own looks, e.g. a starved host, every clock starts again: processes
  that stall together are not taken for lost): this process prints
  ``error: process J of N was lost (…); ending the run. Last complete checkpoint: …`` on stderr and
  exits with ``EXIT_PEER_LOST``, wherever its main thread is (a rollout, a collective, a save).
  A store that cannot be reached means process 0, which hosts it, is lost. ``settle()`` (on an
  exception leaving the run, and at interpreter exit) marks this process as leaving and waits
  until every other process has left or is lost, so a finished or failing process is never taken
  for a lost one and a failure that is only the echo of a lost peer (a collective whose peer
  vanished) is reported as that loss, once.
* A guardian, a small child process without JAX (``python -m mempo_jax.core.peers``), which
  reads the watch's messages on a pipe. JAX's own coordination client ends the process at once
  (``abort``) when process 0's service disappears, before any Python code runs; when the pipe
  closes without the watch's goodbye, the guardian prints the line instead: process 0 lost when
  its address no longer accepts connections, else this process ended abruptly.

JAX's heartbeat and shutdown timeouts (``jax.distributed.initialize``) are set to twice
``peer_timeout_s`` by ``distributed.maybe_initialize``, a backstop behind the watch.

The last complete checkpoint is the newest step folder (a name of digits: orbax renames a save's
temporary folder to it only once every process has written its shards) of ``RUN/checkpoints``,
else of ``RUN/sft_checkpoint``. This module imports no JAX (the guardian runs it).
"""

from __future__ import annotations

import atexit
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Optional

from mempo_jax.core.paths import complete_steps, run_path

EXIT_PEER_LOST = 5
KEY_PREFIX = "mempo/peers/"
RUNNING, LEFT = "run", "left"


def last_complete_checkpoint(run_dir: Optional[str]) -> str:
    """The newest complete checkpoint folder of a run folder, local or ``gs://…``
    (``RUN/checkpoints/N``, else ``RUN/sft_checkpoint/N``; ``paths.complete_steps``), or a phrase
    saying there is none."""
    if not run_dir:
        return "unknown (no run folder)"
    run = run_path(run_dir)
    for folder in ("checkpoints", "sft_checkpoint"):
        steps = complete_steps(run / folder)
        if steps:
            return str(run / folder / str(max(steps)))
    return f"none under {run} (the run starts afresh)"


def lost_line(lost: int, count: int, why: str, run_dir: Optional[str]) -> str:
    """The one line a surviving process prints."""
    who = f"process {lost} of {count}" + (" (the coordinator)" if lost == 0 else "")
    return (f"error: {who} was lost ({why}); ending the run on every process. Last complete checkpoint: "
            f"{last_complete_checkpoint(run_dir)}; run the same command on every worker to resume")


def _say(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class PeerWatch:
    """Heartbeats through the coordination service's key-value store; see the module docstring.

    Args:
      client: the joined JAX distributed client (``key_value_set`` / ``key_value_dir_get``).
      process_index, process_count: this process and the job's size.
      peer_timeout_s: seconds without a heartbeat after which a process is lost.
      run_dir: the run folder (its last complete checkpoint is named in the line).
      coordinator: ``host:port`` of process 0 (for the guardian's check), or None.
      interval_s: seconds between heartbeats (default ``peer_timeout_s / 10``, at most 1).
      guardian: start the guardian process.
      exit_fn: how the process ends when a peer is lost (default ``os._exit``).
    """

    def __init__(self, client: Any, process_index: int, process_count: int, peer_timeout_s: float,
                 run_dir: Optional[str] = None, coordinator: Optional[str] = None,
                 interval_s: Optional[float] = None, guardian: bool = True,
                 exit_fn: Callable[[int], None] = os._exit):
        self.client, self.index, self.count = client, int(process_index), int(process_count)
        self.timeout_s = float(peer_timeout_s)
        self.interval_s = min(1.0, self.timeout_s / 10) if interval_s is None else float(interval_s)
        self.run_dir, self.coordinator, self._exit = run_dir, coordinator, exit_fn
        self._state, self._beats = RUNNING, 0
        self._seen: dict[int, tuple[str, float]] = {}  # peer -> (last value, when it changed)
        self._left: set[int] = set()
        self._last_look: Optional[float] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._reported = False
        self._pipe: Optional[IO[bytes]] = None  # the guardian's stdin, once it runs
        self._guardian = self._start_guardian() if guardian else None
        self._thread = threading.Thread(target=self._loop, name="mempo-peer-watch", daemon=True)

    def start(self) -> "PeerWatch":
        """Send the first heartbeat, start the thread and register ``settle`` at interpreter exit."""
        self._beat()
        self._thread.start()
        atexit.register(self.settle)
        return self

    # -- the thread ------------------------------------------------------------------------------
    def _beat(self) -> None:
        self._beats += 1
        self.client.key_value_set(f"{KEY_PREFIX}{self.index}", f"{self._beats} {self._state}", allow_overwrite=True)

    def poll(self) -> Optional[tuple[int, str]]:
        """One heartbeat and one look at the others: ``(lost process, why)`` or None."""
        try:
            self._beat()
            values = dict(self.client.key_value_dir_get(KEY_PREFIX))
        except Exception as e:  # noqa: BLE001 - the client raises its own runtime errors
            if self.index == 0:  # the store is this process's own: nothing to conclude
                return None
            return 0, f"its coordination service stopped answering: {' '.join(str(e).split())[:120]}"
        now = time.monotonic()
        if self._last_look is not None and now - self._last_look > 3 * self.interval_s + 0.5:
            self._seen.clear()  # this process did not look for a while: it cannot blame anyone for it
        self._last_look = now
        for peer in range(self.count):
            if peer == self.index:
                continue
            value = values.get(f"{KEY_PREFIX}{peer}", "")
            if value.endswith(" " + LEFT):
                self._left.add(peer)
                continue
            last = self._seen.get(peer)
            if last is None or last[0] != value:
                self._seen[peer] = (value, now)
                continue
            if now - last[1] > self.timeout_s:
                return peer, f"no heartbeat for {now - last[1]:.0f} s, limit DistributedConfig.peer_timeout_s"
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            lost = self.poll()
            if lost is not None:
                self.report(*lost)

    def report(self, lost: int, why: str) -> None:
        """Print the line for ``lost`` and end this process with ``EXIT_PEER_LOST`` (once)."""
        with self._lock:
            if self._reported:
                return
            self._reported = True
        self._tell("reported")
        _say(lost_line(lost, self.count, why, self.run_dir))
        self._exit(EXIT_PEER_LOST)

    # -- leaving ---------------------------------------------------------------------------------
    def settle(self, wait_s: Optional[float] = None) -> None:
        """Mark this process as leaving; wait until every other one has left or is lost (then
        ``report`` ends the process). Returns when all have left, or after ``wait_s`` (default
        ``peer_timeout_s`` plus two heartbeats). Idempotent."""
        if self._state == LEFT:
            return
        self._state = LEFT
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        deadline = time.monotonic() + (self.timeout_s + 2 * self.interval_s if wait_s is None else wait_s)
        while True:
            lost = self.poll()
            if lost is not None:
                self.report(*lost)
                return
            if len(self._left) == self.count - 1 or time.monotonic() > deadline:
                break
            time.sleep(self.interval_s)
        self._tell("bye")

    def on_exit(self, exc_type, exc, tb) -> bool:
        """``ExitStack.push`` hook: when an exception leaves the run, ``settle`` first, so a
        failure caused by a lost peer ends with the lost-process line instead. Never swallows."""
        if exc_type is not None and not issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            self.settle()
        return False

    # -- the guardian ----------------------------------------------------------------------------
    def _start_guardian(self) -> Optional[subprocess.Popen]:
        try:
            proc = subprocess.Popen([sys.executable, "-m", "mempo_jax.core.peers"], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, start_new_session=True,
                                    cwd=str(pathlib.Path(__file__).resolve().parents[2]))
        except OSError as e:
            _say(f"[mempo] warning: no guardian process ({e})")
            return None
        self._pipe = proc.stdin
        self._tell(f"hello {self.index} {self.count} {self.coordinator or '-'} {self.run_dir or ''}")
        return proc

    def _tell(self, message: str) -> None:
        pipe = self._pipe
        if pipe is None:
            return
        try:
            pipe.write((message + "\n").encode())
            pipe.flush()
        except (OSError, ValueError):
            pass


def _coordinator_answers(address: str, timeout_s: float = 3.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def guard(stream) -> int:
    """The guardian: read the watch's messages until the pipe closes; without a ``bye`` or
    ``reported`` before that, print the line for the abrupt end. Returns 0."""
    index, count, coordinator, run_dir, quiet = 0, 1, "-", None, False
    for raw in stream:
        words = raw.decode(errors="replace").rstrip("\n").split(" ", 4)
        if words[0] == "hello" and len(words) >= 4:
            index, count, coordinator = int(words[1]), int(words[2]), words[3]
            run_dir = words[4] if len(words) > 4 and words[4] else None
        elif words[0] in ("bye", "reported"):
            quiet = True
    if quiet:
        return 0
    if index != 0 and coordinator != "-" and not _coordinator_answers(coordinator):
        _say(lost_line(0, count, f"{coordinator} no longer accepts connections; JAX ended process {index}",
                       run_dir))
    else:
        _say(f"error: process {index} of {count} ended abruptly (see the lines above); the other processes "
             f"end within DistributedConfig.peer_timeout_s. Last complete checkpoint: "
             f"{last_complete_checkpoint(run_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(guard(sys.stdin.buffer))
