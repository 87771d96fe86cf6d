"""The trainer's throughput window: the training steps since the last log and the time they
took, with the hooks' time (evaluation, checkpoints, samples, a GRPO run's engine sync)
left out, so ``steps_per_second`` measures training whichever hooks run between logs.

    window = ThroughputWindow(clock)
    window.open()                      # after the first step (its compile is not counted)
    window.count_step()                # after each step
    window.hooks_start(); ...hooks...; window.hooks_end()
    steps, seconds = window.measure()  # in the log hook; the window then opens again
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ThroughputWindow:
    """Steps and their seconds since :meth:`open`, less the time between each
    :meth:`hooks_start` and :meth:`hooks_end` (the caller waits for the device before each
    reading, so that time is the hooks', not the step's that is still running)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._start: float | None = None
        self._steps = 0
        self._excluded = 0.0
        self._hooks_started: float | None = None
        self.measured = False  # whether measure() ran since open(): the window is then spent

    @property
    def is_open(self) -> bool:
        return self._start is not None

    def open(self) -> None:
        self._start, self._steps, self._excluded, self._hooks_started = self._clock(), 0, 0.0, None
        self.measured = False

    def count_step(self) -> None:
        if self.is_open:
            self._steps += 1

    def hooks_start(self) -> None:
        self._hooks_started = self._clock()

    def hooks_end(self) -> None:
        if self._hooks_started is not None:
            self._excluded += self._clock() - self._hooks_started
            self._hooks_started = None

    def measure(self) -> tuple[int, float]:
        """``(steps, seconds)`` of training since :meth:`open` (up to the hooks now running);
        ``(0, 0.0)`` when the window is not open."""
        if not self.is_open:
            return 0, 0.0
        end = self._hooks_started if self._hooks_started is not None else self._clock()
        self.measured = True
        return self._steps, end - self._start - self._excluded


__all__ = ["ThroughputWindow"]
