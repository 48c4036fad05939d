"""Progress bars: tqdm's, redrawn in place on a terminal; where stderr is not one (a log file, CI, `make demo >
log`), at most one line a minute besides the first and the last, so that a log holds a few summary lines per bar
rather than one per redraw. There a new postfix or description (a block's time) waits for the next line drawn
instead of drawing one, and transformers' own bars (loading weights) follow the same rule once
`route_transformers_bars` has run."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

LOG_INTERVAL_S = 60.0  # seconds between a bar's lines in a log


class _LogBar(tqdm):
    """A bar in a log: changing its postfix or description draws no line of its own."""

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        super().set_description(desc, refresh=False)


def progress_bar(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """`tqdm(iterable, **kwargs)`, its redraws spaced `LOG_INTERVAL_S` apart when stderr is not a terminal."""
    if sys.stderr.isatty():
        return tqdm(iterable, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    kwargs.setdefault("maxinterval", LOG_INTERVAL_S)
    return _LogBar(iterable, **kwargs)


def route_transformers_bars() -> None:
    """Let transformers draw its bars with `progress_bar` (its empty stand-in, when its bars are off, stays); a
    transformers without `set_tqdm_hook` keeps drawing its own."""
    from transformers.utils import logging as hf_logging

    def hook(factory: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return factory(*args, **kwargs) if factory is hf_logging.EmptyTqdm else progress_bar(*args, **kwargs)

    if hasattr(hf_logging, "set_tqdm_hook"):
        hf_logging.set_tqdm_hook(hook)
