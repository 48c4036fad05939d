"""Elastic mode's controller (`bitquilt.serve.elastic`), fed step timings by hand: no clock, no model."""

from __future__ import annotations

import pytest

from bitquilt.serve.elastic import ElasticController

LOW, HIGH = 2.0, 8.0


def _plant(streams: int, level: float) -> float:
    """A step's seconds on a made-up machine: a fixed cost plus a part that grows with the bits and the streams."""
    return 0.004 + 0.0015 * level * streams


def _in_band(target: float, streams: int, level: float) -> bool:
    """Whether `level` gives `streams` streams at least `target` tokens/s each (or is the lowest) and no more than the
    band above it (or is the highest)."""
    speed = 1 / _plant(streams, level)
    return (speed >= target or level == LOW) and (speed <= target * 1.2 or level == HIGH)


def _run(controller: ElasticController, streams: int, steps: int) -> list[float]:
    """The level after each of `steps` decode steps of `streams` sequences on `_plant`."""
    return [controller.observe(_plant(streams, controller.level)) for _ in range(steps)]


def test_slow_steps_lower_the_level_and_fast_ones_raise_it_again():
    c = ElasticController(10.0, LOW, HIGH)
    assert c.level == HIGH
    levels = [c.observe(0.2) for _ in range(8)]  # 5 tokens/s per stream, half the target
    assert levels[:7] == [HIGH] * 7 and levels[7] == 7.0  # once `settle` steps are seen; by at most 1 bit
    assert [c.observe(0.2) for _ in range(8)][-1] == 6.0
    levels = [c.observe(0.02) for _ in range(8)]  # 50 tokens/s: load dropped
    assert levels[:7] == [6.0] * 7 and levels[7] == 7.0 and c.speed == pytest.approx(50.0)


def test_a_move_aims_at_the_middle_of_the_band():
    c = ElasticController(10.0, LOW, HIGH, max_move=HIGH)
    assert [c.observe(0.2) for _ in range(8)][-1] == 3.625  # 8 bits × 5 / (10 × 1.1), rounded down to 1/8 bit


def test_the_level_stays_within_the_checkpoints_range():
    fast, slow = ElasticController(1e9, LOW, HIGH), ElasticController(0.0, LOW, HIGH, start=3.0)
    for _ in range(100):
        fast.observe(0.01)
        slow.observe(10.0)
    assert fast.level == LOW and slow.level == HIGH  # target 0: never too slow, so the highest bits


def test_a_prompt_chunk_now_and_then_counts_at_its_share():
    """One step in 16 at 5 tokens/s (a prompt chunk read beside the streams), the others at 12.5: the mean of the last
    16 steps decides (11.4 tokens/s, in the band), not the slow step alone: no move."""
    c = ElasticController(10.0, LOW, HIGH)
    assert {c.observe(0.2 if i % 16 == 0 else 0.08) for i in range(200)} == {HIGH}


def test_a_speed_inside_the_band_moves_nothing():
    c = ElasticController(10.0, LOW, HIGH, start=5.0)
    assert {c.observe(1 / 11) for _ in range(50)} == {5.0}  # 11 tokens/s: above the target, below 12 (band 0.2)


@pytest.mark.parametrize("streams", [1, 4, 16])
def test_the_level_settles_where_the_target_holds_and_does_not_oscillate(streams):
    c = ElasticController(15.0, LOW, HIGH)
    levels = _run(c, streams, 200)
    settled = levels[100:]
    assert len(set(settled)) == 1 and _in_band(15.0, streams, settled[0])  # hysteresis: in the band, no move


def test_rising_then_falling_load_lowers_then_restores_the_bits():
    c = ElasticController(20.0, LOW, HIGH)
    stages = [_run(c, n, 80)[-1] for n in (1, 4, 16, 4, 1)]
    assert stages[0] == HIGH and stages[0] > stages[1] > stages[2] == LOW
    assert stages[2] < stages[3] < HIGH and _in_band(20.0, 4, stages[3]) and stages[4] == HIGH


@pytest.mark.parametrize("kwargs", [{"target": -1.0}, {"start": 9.0}, {"settle": 0}, {"settle": 17},
                                    {"quantum": 0.0}, {"max_move": 0.1}])
def test_bad_settings_are_refused(kwargs):
    settings = {"target": 10.0, "low": LOW, "high": HIGH, **kwargs}
    with pytest.raises(ValueError, match="elastic: needs"):
        ElasticController(**settings)
