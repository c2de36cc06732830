"""Exclusive wall time per phase of a quantization run, for ``phase_seconds`` in the report.

Phases nest: the Hessian products run inside a layer's forward (hooks on its linears), the
sinks write inside a sweep's hand-off. Each second is counted once, in the innermost phase
running at that moment, so the phases add up to the time they cover, and a phase's
time is measured, not left over from a subtraction.

Phases: ``calibration`` (tokenizing, the embedding capture), ``smoothing`` (its statistics
pass and the choice of strengths), ``forward`` (the decoder layers' own compute on the
calibration batches, norms and attention included), ``hessians`` (the products ``XᵀX``),
``quantize`` (the GPTQ or round-to-nearest sweeps, scale search included), ``write`` (handing
results to the format sinks and their files) and ``final_write`` (finishing every format and
renaming the artifact into place).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class PhaseClock:
    def __init__(self, seconds: dict[str, float] | None = None,
                 now: Callable[[], float] = time.perf_counter) -> None:
        self.seconds: dict[str, float] = seconds if seconds is not None else {}
        self._now = now
        self._stack: list[list] = []  # [phase, start of its current exclusive span]

    def _add(self, phase: str, dt: float) -> None:
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + dt, 3)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        now = self._now()
        if self._stack:  # the enclosing phase pauses
            outer = self._stack[-1]
            self._add(outer[0], now - outer[1])
        self._stack.append([name, now])
        try:
            yield
        finally:
            now = self._now()
            self._add(name, now - self._stack.pop()[1])
            if self._stack:
                self._stack[-1][1] = now

    def timed(self, name: str, fn: Callable[..., T]) -> Callable[..., T]:
        def run(*args, **kwargs) -> T:
            with self.phase(name):
                return fn(*args, **kwargs)
        return run

    def timed_iter(self, name: str, items: Iterable[T]) -> Iterator[T]:
        """``items`` with the time spent producing each one counted in ``name``."""
        it = iter(items)
        while True:
            with self.phase(name):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item
