"""The run's exclusive phase clock (``cpu_quant/quantize/clock.py``): a nested phase's time is
counted in it alone, so the phases add up to the time they cover. Driven by a fake clock, so
the test is exact whatever the machine's load."""

from __future__ import annotations

from cpu_quant.quantize.clock import PhaseClock


class FakeTime:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def spend(self, seconds: float) -> None:
        self.t += seconds


def test_nested_phases_are_counted_once():
    now = FakeTime()
    clock = PhaseClock(now=now)
    with clock.phase("forward"):
        now.spend(1.0)
        with clock.phase("hessians"):
            now.spend(4.0)
        now.spend(2.0)
    now.spend(8.0)  # outside every phase
    assert clock.seconds == {"forward": 3.0, "hessians": 4.0}


def test_timed_iter_counts_producing_not_consuming():
    now = FakeTime()
    clock = PhaseClock(now=now)

    def produce():
        for i in range(3):
            now.spend(0.5)
            yield i

    got = []
    for item in clock.timed_iter("forward", produce()):
        now.spend(10.0)  # the consumer's time belongs to no phase
        got.append(item)
    assert got == [0, 1, 2] and clock.seconds == {"forward": 1.5}


def test_timed_wraps_a_function_and_adds_to_the_given_totals():
    now = FakeTime()
    totals = {"quantize": 1.0}
    clock = PhaseClock(totals, now=now)

    def work(x):
        now.spend(2.0)
        return 2 * x

    assert clock.timed("quantize", work)(3) == 6
    assert totals == {"quantize": 3.0}
