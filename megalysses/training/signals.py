"""Stop requests by signal: SIGTERM and SIGUSR1 ask for a checkpoint and a clean exit (status 0).

    stop = StopSignals()        # early in the entry point, so a signal during start-up is not lost
    ...                         # the training loop reads stop.signalled after every step
    stop.restore()

SIGTERM comes from a launcher shutting down, from the scheduler at preemption or at the time limit,
and from the kernel when the launcher dies (see distributed.die_with_launcher); SIGUSR1 is the usual
Slurm warning signal (`--signal`, forwarded to the workers by examples/slurm/torchrun_node.sh).

SIGINT (Ctrl-C) still interrupts at once (KeyboardInterrupt), and is recorded: an error that it causes
on the way (a collective whose peer was interrupted first) is then the interruption, not a failure.
"""
from __future__ import annotations

import signal
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Installs the handlers (main thread only) and records the first stop signal received."""

    def __init__(self) -> None:
        self.received: Optional[str] = None
        self.interrupted = False
        self.previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:   # not where SIGINT is ignored
                self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)

    @property
    def signalled(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name

    def _interrupt(self, signum: int, frame: object) -> None:
        self.interrupted = True
        raise KeyboardInterrupt

    def restore(self) -> None:
        """Put back the handlers that were there before, where ours are still installed."""
        for sig, handler in self.previous.items():
            if signal.getsignal(sig) in (self._handle, self._interrupt):
                signal.signal(sig, handler)
        self.previous = {}
