"""End-to-end speed of a torch model: prefill and batch-1 decode tokens/s, and the model's memory.

`measure_speed` times the decode that `bitquilt generate` runs (`bitquilt.runtime.engines.decode`): the prompt
through the model once (prefill, KV cache filled), then one token per forward pass. The first call on a quantized
model also builds each kernel's packed layout, so it runs an untimed warm-up first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from bitquilt.flag_checks import MAX_SEED, is_integer
from bitquilt.resources import peak_rss_mb
from bitquilt.runtime.engines import decode
from bitquilt.runtime.loop import check_speed_settings, median_rates


@dataclass
class SpeedResult:
    prompt_tokens: int
    new_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    weights_mb: float  # stored size of the model's tensors (packed formats as stored)
    kernel_layout_mb: float  # extra copies the CPU kernels keep in their own layout
    peak_rss_mb: float  # peak resident memory of the process
    threads: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def kernel_layout_bytes(model: nn.Module) -> int:
    """Bytes of the kernel-side layouts built so far for the model's QuantLinear formats."""
    from bitquilt import kernels
    from bitquilt.nn.quant_linear import QuantLinear

    return sum(kernels.kernel_layout_bytes(m.fmt) for m in model.modules() if isinstance(m, QuantLinear))


@torch.no_grad()
def measure_speed(model: nn.Module, vocab_size: int, prompt_tokens: int = 128, new_tokens: int = 32,
                  repeats: int = 3, seed: int = 0, engine: str = "auto") -> SpeedResult:
    """Median prefill and decode throughput over `repeats` runs on a random-token prompt.

    Decode runs exactly `new_tokens` steps (no stop token); its rate excludes the prefill.
    """
    from bitquilt.io import model_nbytes

    check_speed_settings(prompt_tokens, new_tokens, repeats, vocab_size)
    if not is_integer(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be an integer in 0..{MAX_SEED}, got {seed!r}")
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab_size, (1, prompt_tokens), generator=gen)
    decode(model, prompt[:, : min(8, prompt_tokens)], 2, engine=engine)  # warm-up: kernel layouts, allocator
    runs = [decode(model, prompt, new_tokens, engine=engine) for _ in range(repeats)]
    return SpeedResult(prompt_tokens, new_tokens, *median_rates(runs, prompt_tokens),
                       model_nbytes(model) / 2**20, kernel_layout_bytes(model) / 2**20, peak_rss_mb(),
                       torch.get_num_threads())
