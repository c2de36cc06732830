"""SIGINT and SIGTERM during a run: a flag the layer loop reads at the next layer boundary."""

from __future__ import annotations

import signal
import threading


class StopRequest:
    """SIGINT/SIGTERM set a flag; the layer loop stops at the next layer boundary."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        # a second Ctrl-C interrupts at once
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
