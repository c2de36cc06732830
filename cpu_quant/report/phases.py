"""Wall time and peak anonymous memory (RssAnon, shared/MEASURING.md rule 1) of each CLI phase.

``with meter.phase("quantize"): ...`` samples this process's RssAnon every 0.2 s on a daemon
thread; ``meter.as_dict()`` is ``{phase: {"seconds", "peak_rss_anon_mib"}}``, stored in
``quantization_report.json`` under ``phases`` and plotted by ``cpu-quant report``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from ..core.memory import anon_rss_bytes


class PhaseMeter:
    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.phases: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        peak = [anon_rss_bytes(tree=False)]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(self.interval):
                peak[0] = max(peak[0], anon_rss_bytes(tree=False))

        thread = threading.Thread(target=sample, daemon=True)
        t0 = time.perf_counter()
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
            peak[0] = max(peak[0], anon_rss_bytes(tree=False))
            self.phases[name] = {"seconds": round(time.perf_counter() - t0, 2),
                                 "peak_rss_anon_mib": round(peak[0] / 2**20, 1)}

    def as_dict(self) -> dict[str, dict[str, float]]:
        return dict(self.phases)
