"""Stop requests by signal: SIGTERM and SIGUSR1 ask for a checkpoint and a clean exit (status 0).

    stop = StopSignals()        # early in the entry point, so a signal during start-up is not lost
    ...                         # the training loop reads stop.signalled after every step
    stop.restore()

SIGTERM comes from a launcher shutting down, from the scheduler at preemption or at the time limit,
and from the kernel when the launcher dies (see distributed.die_with_launcher); SIGUSR1 is the usual
Slurm warning signal (`--signal`, forwarded to the workers by examples/slurm/torchrun_node.sh).

SIGINT (Ctrl-C) still interrupts at once (KeyboardInterrupt), and is recorded: an error that it causes
on the way (a collective whose peer was interrupted first) is then the interruption, not a failure.
Python runs a signal's handler only when the main thread is back in Python: a main thread waiting inside
torch (for a peer that was interrupted first and has left, at a store rendezvous or in a collective) would
hold a Ctrl-C until the wait's timeout. With `on_stuck`, a thread of its own learns of every SIGINT at once
(signal.set_wakeup_fd) and calls `on_stuck` (which ends the process) when the main thread has not taken it
within STUCK_SECONDS.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Callable, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STUCK_SECONDS = 5.0
"""How long a Ctrl-C may wait for the main thread before `on_stuck` ends the process without it."""


class StopSignals:
    """Installs the handlers (main thread only) and records the first stop signal received. `on_stuck`: what
    ends the process when a Ctrl-C has waited STUCK_SECONDS for the main thread (the module docstring)."""

    def __init__(self, on_stuck: Optional[Callable[[], None]] = None) -> None:
        self.received: Optional[str] = None
        self.interrupted = False
        self.previous: dict = {}
        self._wakeup: Optional[tuple[int, int, int]] = None
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # not where SIGINT is ignored
                self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
                if on_stuck is not None:
                    self._watch(on_stuck)

    @property
    def signalled(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name

    def _interrupt(self, signum: int, frame: object) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def _watch(self, on_stuck: Callable[[], None]) -> None:
        """Every signal's number is written to a pipe the moment it arrives, whatever the main thread does; a
        daemon thread reads it and gives a SIGINT STUCK_SECONDS to reach the handler."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._wakeup = (read, write, previous)

        def watch() -> None:
            while received := os.read(read, 64):
                if signal.SIGINT in received and not self.interrupted:
                    threading.Event().wait(STUCK_SECONDS)
                    if not self.interrupted and self._wakeup is not None:
                        on_stuck()
            os.close(read)

        threading.Thread(target=watch, name="megalysses-interrupt", daemon=True).start()

    def restore(self) -> None:
        """Put back the handlers that were there before, where ours are still installed."""
        for sig, handler in self.previous.items():
            if signal.getsignal(sig) in (self._handle, self._interrupt):
                signal.signal(sig, handler)
        self.previous = {}
        if self._wakeup is not None:
            _, write, previous = self._wakeup
            signal.set_wakeup_fd(previous)
            os.close(write)             # the thread reads the end of the pipe and leaves
            self._wakeup = None
