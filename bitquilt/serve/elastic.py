"""Elastic mode's controller (`bitquilt serve --elastic TARGET`): the average bits per weight the running sequences of
a MoBiQuant model route at, moved so that each stream keeps about TARGET decode tokens per second as the batch grows
and shrinks.

Fed the seconds of each step that gave the running streams a token, end to end (a prompt chunk read in it and the
time between steps included: the streams wait for them too), it averages the last `window` of them seen at the
current level (forgotten whenever the level moves: steps at another level say nothing of this one); the per-stream
speed is 1 / that mean, and a prompt chunk now and then counts at its share. Once `settle` steps have been seen at a
level, a speed below TARGET lowers it and one above TARGET × (1 + `band`) raises it (the band between is the
hysteresis: no move there). The new level assumes speed ∝ 1 / bits and aims at the middle of the band,
level × speed / (TARGET × (1 + band / 2)), rounded down to a multiple of `quantum` bits; it moves by at least
`quantum`, at most `max_move`, and stays within [low, high]. Pure arithmetic: no clock, no model."""

from __future__ import annotations

import math
from collections import deque

WINDOW = 16  # steps averaged
SETTLE_STEPS = 8  # steps seen at a level before it may move again
BAND = 0.2  # raise only above TARGET × (1 + BAND)
QUANTUM = 0.125  # bits: levels are multiples of this (or the range's ends)
MAX_MOVE = 1.0  # bits: the most one move changes the level by


class ElasticController:
    """The elastic level (module docstring): starts at `start` (default `high`), stays within [low, high]."""

    def __init__(self, target: float, low: float, high: float, start: float | None = None, *,
                 window: int = WINDOW, settle: int = SETTLE_STEPS, band: float = BAND, quantum: float = QUANTUM,
                 max_move: float = MAX_MOVE):
        start = high if start is None else start
        if not (target >= 0 and low <= start <= high and 1 <= settle <= window and band >= 0
                and 0 < quantum <= max_move):
            raise ValueError(f"elastic: needs target ≥ 0, low ≤ start ≤ high, 1 ≤ settle ≤ window, band ≥ 0, "
                             f"0 < quantum ≤ max_move; got {target}, {low}, {start}, {high}, {settle}, {window}, "
                             f"{band}, {quantum}, {max_move}")
        self.target, self.low, self.high, self.level = target, low, high, start
        self.settle, self.band, self.quantum, self.max_move = settle, band, quantum, max_move
        self.steps: deque[float] = deque(maxlen=window)  # the last steps' seconds at this level
        self.speed = 0.0  # tokens per second each stream gets, by the mean of `steps` (0 before any step)

    def observe(self, seconds: float) -> float:
        """A step took `seconds`: the level after it."""
        self.steps.append(max(seconds, 1e-9))
        self.speed = len(self.steps) / sum(self.steps)
        if len(self.steps) < self.settle:
            return self.level
        if self.speed < self.target:
            level = max(self.low, self.level - self.max_move, min(self.level - self.quantum, self._aim()))
        elif self.speed > self.target * (1 + self.band):
            level = min(self.high, self.level + self.max_move, max(self.level + self.quantum, self._aim()))
        else:
            return self.level
        if level != self.level:
            self.level = level
            self.steps.clear()
        return self.level

    def _aim(self) -> float:
        """The level at which speed ∝ 1 / bits puts the stream speed mid-band, rounded down to a multiple of
        `quantum` (TARGET 0: no level is too high)."""
        if self.target == 0:
            return math.inf
        bits = self.level * self.speed / (self.target * (1 + self.band / 2))
        return math.floor(bits / self.quantum) * self.quantum
