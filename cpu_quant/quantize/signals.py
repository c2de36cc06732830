"""SIGINT and SIGTERM during a run, and the testing hook that kills a run at a named event.

While a run computes (calibration, the layers, the output head) the first SIGINT or SIGTERM
raises :class:`~cpu_quant.core.errors.Interrupted` at once, wherever the main thread is: the resume
point on disk only ever advances by whole layers (the state file is written after the layer's
shards and activations, each by rename), so stopping mid-layer loses at most that layer's
work, like a ``kill -9``, and the message says which layers are saved. While the finished
artifact is written (seconds) a signal is only noted, so a complete artifact is not thrown
away; the noted signal is raised (``KeyboardInterrupt``) once the block ends, for the caller,
who knows the artifact is in place, to say so. A second Ctrl-C falls back to Python's default
(``KeyboardInterrupt``). :func:`signals_held` notes them only, for the moment it takes to
finish a model card and report.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

from ..core.errors import Interrupted


class StopRequest:
    """SIGINT/SIGTERM raise :class:`Interrupted` with ``describe()``'s message, except inside
    :meth:`deferred`, where they only set ``requested``."""

    def __init__(self, describe: Callable[[], str] = lambda: "interrupted") -> None:
        self.requested = False
        self.describe = describe
        self._deferred = False
        self._previous: dict = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        first = not self.requested
        self.requested = True
        # a second Ctrl-C interrupts at once
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))
        if first and not self._deferred:
            raise Interrupted(self.describe())

    def defer(self) -> None:
        """From now on a signal only sets ``requested`` (the finished artifact is being written)."""
        self._deferred = True

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self.requested and self._deferred and exc_type is None:
            raise KeyboardInterrupt  # noted while the artifact was written: stop now


@contextlib.contextmanager
def signals_held() -> Iterator[list[int]]:
    """Within the block SIGINT and SIGTERM are only noted (in the list yielded), so that what
    it writes (a model card, a report: a moment) is finished. Only in the main thread."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield noted
        return
    previous = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def sigterm_as_ctrl_c() -> Iterator[None]:
    """Within the block SIGTERM does what Ctrl-C does (``KeyboardInterrupt``), so a command
    stopped by a service manager or ``kill`` cleans up and says so instead of dying where it
    stands. Only in the main thread (where signal handlers live)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        # only if the block left ours in place: a distributed rank that failed keeps SIGTERM
        # ignored (``distributed.joined``) so that it lives to print its error
        if signal.getsignal(signal.SIGTERM) is raise_interrupt:
            signal.signal(signal.SIGTERM, previous)


# -- the testing hook ------------------------------------------------------------------------
KILL_AT_ENV = "CPU_QUANT_KILL_AT"
KILL_STAMP_ENV = "CPU_QUANT_KILL_STAMP"  # a file the hook writes the signal's time.time() to
KILL_RANK_ENV = "CPU_QUANT_KILL_RANK"
_counts: dict[str, int] = {}


def kill_point(event: str) -> None:
    """Testing hook, inert unless ``CPU_QUANT_KILL_AT=EVENT:N[:SIGNAL]`` is set: at the Nth
    time the run reaches ``event`` it sends itself SIGNAL (default SIGKILL; SIGSTOP lets a test
    time a signal of its own). Used by ``benchmarks/kill_resume.py`` and the signal tests to
    stop a run at a chosen point instead of after a guessed delay. Events: ``calibration``
    (the calibration activations captured), ``layer-start``, ``layer-computed`` (a layer
    quantized, before its outputs replace the activations), ``layer-end`` (its state handed
    to the resume point), ``resume-activations`` (inside the in-memory resume point's write:
    activations renamed into place, state not yet written), ``resume-state`` (state written,
    previous activations not yet deleted), ``head`` (before the output head's quantization),
    ``final-write`` (before the artifact's files are written), ``commit`` (before the
    staging directory is renamed to the output) and ``committed`` (just after). With
    ``CPU_QUANT_KILL_STAMP=FILE`` the hook writes the time it sends the signal to FILE, so a
    benchmark can time the stop. In a distributed run ``CPU_QUANT_KILL_RANK=R`` limits it to
    rank R (torch's ``RANK``)."""
    spec = os.environ.get(KILL_AT_ENV)
    if not spec:
        return
    rank = os.environ.get(KILL_RANK_ENV)
    if rank is not None and rank != os.environ.get("RANK", "0"):
        return
    parts = spec.split(":")
    if parts[0] != event:
        return
    _counts[event] = _counts.get(event, 0) + 1
    if _counts[event] == int(parts[1]):
        sig = getattr(signal, parts[2]) if len(parts) > 2 else signal.SIGKILL
        stamp = os.environ.get(KILL_STAMP_ENV)
        if stamp:
            with open(stamp, "w") as fh:
                fh.write(repr(time.time()))
        os.kill(os.getpid(), sig)
