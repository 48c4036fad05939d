"""bitquilt: post-training quantization of LLMs with real packed formats and kernels."""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "load": "bitquilt.io",
    "fetch": "bitquilt.api",
    "quantize": "bitquilt.api",
    "quantize_streaming": "bitquilt.api",
    "save": "bitquilt.api",
    "Recipe": "bitquilt.recipes",
    "CalibConfig": "bitquilt.recipes",
    "perplexity": "bitquilt.eval.ppl",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'bitquilt' has no attribute {name!r}")
