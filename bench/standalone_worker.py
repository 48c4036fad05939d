"""`bench/e2e.py`'s worker for its *[standalone]* rows: one measurement of a standalone export (`bitquilt export
--to standalone`) run by `bitquilt.runtime.standalone`, in a process that imports no torch, as llama.cpp's
worker imports none: load (map) the export, the untimed warm-up, one timed greedy prefill + decode
(`llamacpp.timed_decode`).

    python bench/standalone_worker.py '{"export": DIR, "prompt": [...], "new_tokens": 32, "threads": 1,
                                        "vocab_size": V}'
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import llamacpp

from bitquilt.runtime.standalone.generate import picker
from bitquilt.runtime.standalone.model import StandaloneModel, set_threads

WARMUP_TOKENS = 2  # as e2e.py's bitquilt rows


def measure(export: str, prompt: list[int], new_tokens: int, threads: int, vocab_size: int) -> dict[str, Any]:
    set_threads(threads)
    t0 = time.perf_counter()
    model = StandaloneModel(export)
    setup_s = time.perf_counter() - t0

    def start(max_len: int):
        model.begin(max_len)
        greedy = picker()
        return lambda ids: greedy(model.forward(ids))

    llamacpp.timed_decode(start, llamacpp.warmup_prompt(prompt, vocab_size), WARMUP_TOKENS)
    ready_s = time.perf_counter() - t0
    result = llamacpp.timed_decode(start, prompt, new_tokens)
    assert "torch" not in sys.modules and "numpy" not in sys.modules, "the standalone runtime imported torch or numpy"
    return {**result, "peak_rss_mb": llamacpp.peak_rss_mb(), "setup_s": setup_s, "ready_s": ready_s,
            "weights_mb": model.size_mb(), "kernel_layout_mb": 0.0, "bits_per_weight": model.bits_per_weight(),
            "torch_threads": threads}


if __name__ == "__main__":
    print(json.dumps(measure(**json.loads(sys.argv[1]))), flush=True)
