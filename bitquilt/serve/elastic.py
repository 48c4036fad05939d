"""Elastic mode's controller (`bitquilt serve --elastic TARGET`): the average bits per weight the running sequences of
a MoBiQuant model route at, moved so that each stream keeps about TARGET decode tokens per second as the batch grows
and shrinks.

Fed the seconds of each step that gave the running streams a token, end to end (a prompt chunk read in it and the
time between steps included: the streams wait for them too), it keeps an exponential moving average of those seconds,
restarted whenever the level moves (steps at another level say nothing of this one); the per-stream speed is
1 / that average. Once `settle` steps have been seen at the current
level, a speed below TARGET lowers the level and one above TARGET × (1 + `band`) raises it (the band between is the
hysteresis: no move there); the new level assumes speed ∝ 1 / bits and aims at the middle of the band,
level × speed / (TARGET × (1 + band / 2)), rounded down to a multiple of `quantum` bits, moves by at least `quantum`
and stays within [low, high]. Pure arithmetic: no clock, no model."""

from __future__ import annotations

import math

SMOOTHING = 0.3  # the newest step's weight in the moving average of step seconds
BAND = 0.2  # raise only above TARGET × (1 + BAND)
SETTLE_STEPS = 4  # decode steps seen at a level before it may move again
QUANTUM = 0.125  # bits: levels are multiples of this (or the range's ends)


class ElasticController:
    """The elastic level (module docstring): starts at `start` (default `high`), stays within [low, high]."""

    def __init__(self, target: float, low: float, high: float, start: float | None = None, *,
                 smoothing: float = SMOOTHING, band: float = BAND, settle: int = SETTLE_STEPS,
                 quantum: float = QUANTUM):
        start = high if start is None else start
        if not (target >= 0 and low <= start <= high and 0 < smoothing <= 1 and band >= 0 and settle >= 1
                and quantum > 0):
            raise ValueError(f"elastic: needs target ≥ 0, low ≤ start ≤ high, 0 < smoothing ≤ 1, band ≥ 0, "
                             f"settle ≥ 1, quantum > 0; got {target}, {low}, {start}, {high}, {smoothing}, {band}, "
                             f"{settle}, {quantum}")
        self.target, self.low, self.high, self.level = target, low, high, start
        self.smoothing, self.band, self.settle, self.quantum = smoothing, band, settle, quantum
        self.seconds = 0.0  # the moving average of step seconds at this level
        self.seen = 0  # steps seen since the level last moved

    @property
    def speed(self) -> float:
        """Tokens per second each stream gets, by the moving average (0 before any step)."""
        return 1.0 / self.seconds if self.seconds > 0 else 0.0

    def observe(self, seconds: float) -> float:
        """A step took `seconds`: the level after it."""
        seconds = max(seconds, 1e-9)
        self.seconds = seconds if self.seen == 0 else self.seconds + self.smoothing * (seconds - self.seconds)
        self.seen += 1
        if self.seen < self.settle:
            return self.level
        if self.speed < self.target:
            level = max(self.low, min(self.level - self.quantum, self._aim()))
        elif self.speed > self.target * (1 + self.band):
            level = min(self.high, max(self.level + self.quantum, self._aim()))
        else:
            return self.level
        if level != self.level:
            self.level, self.seen = level, 0
        return self.level

    def _aim(self) -> float:
        """The level at which speed ∝ 1 / bits puts the stream speed mid-band, rounded down to a multiple of
        `quantum` (TARGET 0: no level is too high)."""
        if self.target == 0:
            return math.inf
        bits = self.level * self.speed / (self.target * (1 + self.band / 2))
        return math.floor(bits / self.quantum) * self.quantum
