"""Preemption: SIGTERM saves a checkpoint and exits 0 within a grace period.

Preemptible TPU VMs (and most schedulers) send SIGTERM, wait a grace period (about 30 s on
Google Cloud), then SIGKILL. The training loop cooperates with a ``Preemption`` object:

* outside any region, a SIGTERM only sets ``requested``; the loop calls ``check()`` at step
  boundaries, after it has saved a checkpoint, and ``check()`` raises ``Preempted``;
* inside ``interruptible()`` (work that changes no training state: building, rollouts, scoring,
  evaluation) the signal handler raises ``Preempted`` at once, so a long rollout does not delay
  the save; ``commit()`` ends the interruptible part of a region (it is called when the optimizer
  update begins), after which the step is finished before the loop saves;
* a watchdog thread started by the first SIGTERM ends the process with ``EXIT_GRACE_EXCEEDED``
  when ``grace_s`` passes before ``done()``: a partial checkpoint is never committed, so the
  next run resumes from the last complete one.

Signals are handled in the main thread only (Python's rule); the handler writes with
``os.write`` (no buffered I/O inside a handler).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Iterator, Optional

EXIT_GRACE_EXCEEDED = 4


class Preempted(Exception):
    """Raised when the run stops for a SIGTERM; the caller saves (if needed) and exits 0."""


class Preemption:
    """SIGTERM handling with interruptible regions and a grace-period watchdog.

    Args:
      grace_s: seconds from the first SIGTERM to a forced ``os._exit(EXIT_GRACE_EXCEEDED)``.
      signals: the signals handled (default SIGTERM).

    Raises:
      ValueError: ``grace_s <= 0``.
    """

    def __init__(self, grace_s: float, signals: tuple[int, ...] = (signal.SIGTERM,)):
        if not grace_s > 0:
            raise ValueError(f"grace_s must be > 0, got {grace_s}")
        self.grace_s = float(grace_s)
        self.signals = tuple(signals)
        self.requested = False
        self.received_at: Optional[float] = None
        self._raise = False
        self._old: dict[int, object] = {}
        self._watchdog: Optional[threading.Timer] = None

    def install(self) -> "Preemption":
        """Install the handlers (main thread only; elsewhere a no-op, as Python allows no other)."""
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._old[s] = signal.signal(s, self._handler)
        return self

    def uninstall(self) -> None:
        """Restore the previous handlers and stop the watchdog."""
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
        self.done()

    def __enter__(self) -> "Preemption":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A region whose work may be abandoned: a SIGTERM inside raises ``Preempted`` at once
        (also on entry when one is already pending), until ``commit()``."""
        self.check()
        self._raise = True
        try:
            yield
        finally:
            self._raise = False

    def commit(self) -> None:
        """From here to the end of the current region, a SIGTERM waits for the next ``check()``."""
        self._raise = False

    def check(self) -> None:
        """Raise ``Preempted`` when a SIGTERM has arrived."""
        if self.requested:
            raise Preempted(f"signal received {time.monotonic() - (self.received_at or 0.0):.1f} s ago")

    def done(self) -> None:
        """The save is complete: stop the watchdog."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    # -- internals ---------------------------------------------------------------------------
    def _handler(self, signum, frame) -> None:
        first = not self.requested
        self.requested = True
        if first:
            self.received_at = time.monotonic()
            self._watchdog = threading.Timer(self.grace_s, self._expire)
            self._watchdog.daemon = True
            self._watchdog.start()
            _say(f"[mempo] {signal.Signals(signum).name}: saving a checkpoint, then exiting "
                 f"(grace {self.grace_s:g} s)")
        if self._raise:
            self._raise = False
            raise Preempted(f"{signal.Signals(signum).name} during an interruptible region")

    def _expire(self) -> None:
        _say(f"error: the checkpoint was not saved within the {self.grace_s:g} s grace period; exiting "
             f"with status {EXIT_GRACE_EXCEEDED} (the previous complete checkpoint is kept)")
        os._exit(EXIT_GRACE_EXCEEDED)


def _say(line: str) -> None:
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


__all__ = ["EXIT_GRACE_EXCEEDED", "Preempted", "Preemption"]
