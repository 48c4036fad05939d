"""Progress bars: tqdm's, redrawn in place on a terminal; where stderr is not one (a log file, CI, `make demo >
log`), at most one line a minute besides the first and the last, so that a log holds a few summary lines per bar
rather than one per redraw."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

LOG_INTERVAL_S = 60.0  # seconds between a bar's lines in a log


def progress_bar(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """`tqdm(iterable, **kwargs)`, its redraws spaced `LOG_INTERVAL_S` apart when stderr is not a terminal."""
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", LOG_INTERVAL_S)
        kwargs.setdefault("maxinterval", LOG_INTERVAL_S)
    return tqdm(iterable, **kwargs)
