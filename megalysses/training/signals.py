"""Stop requests by signal: SIGTERM and SIGUSR1 ask for a checkpoint and a clean exit (status 0).

    stop = StopSignals()        # early in the entry point, so a signal during start-up is not lost
    ...                         # the training loop reads stop.signalled after every step
    stop.restore()

SIGTERM comes from a launcher shutting down, from the scheduler at preemption or at the time limit,
and from the kernel when the launcher dies (see distributed.die_with_launcher); SIGUSR1 is the usual
Slurm warning signal (`--signal`, forwarded to the workers by examples/slurm/torchrun_node.sh).
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
        self.previous: dict = {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    @property
    def signalled(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: object) -> None:
        self.received = self.received or signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}
