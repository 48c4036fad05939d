"""Generation and end-to-end speed: prefill and batch-1 decode tokens/s, and the model's memory.

One decode loop serves both `bitquilt generate` (text out) and `bitquilt bench` (timings):
the prompt goes through the model once (prefill, KV cache filled), then one token per
forward pass (decode) with the cache. The first call on a quantized model also builds each
kernel's packed layout, so `measure_speed` runs an untimed warm-up first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from bitquilt.decoding import DecodeRun, check_generation, check_speed_settings, median_rates, run_decode
from bitquilt.flag_checks import MAX_SEED, is_integer
from bitquilt.resources import peak_rss_mb


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


def _next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


ENGINES = ("auto", "fused", "lean", "transformers")


def stepper(model: nn.Module, max_len: int, engine: str = "auto") -> Callable[[torch.Tensor], torch.Tensor]:
    """A function from the next input ids [1, T] to the logits [vocab] of their last position, the
    sequence's KV cache kept between calls. Engines: "lean" is `LeanDecoder` (bitquilt.models.lean_decode:
    static KV cache, the model's own modules), "fused" the same with every decoder layer of a one-token
    step in one compiled call, "transformers" the transformers forward with its cache; "auto" takes the
    first of fused, lean, transformers that supports the model."""
    from bitquilt.models.lean_decode import LeanDecoder, unsupported_reason
    from bitquilt.models.native import NativeCausalLM

    if engine not in ENGINES:
        raise ValueError(f"unknown decode engine {engine!r}; engines: {', '.join(ENGINES)}")
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if positions is not None and max_len > positions:  # too long for every engine: say so, not "unsupported"
        raise ValueError(f"a sequence of {max_len} positions (prompt + new tokens) does not fit the model's "
                         f"{positions}; shorten the prompt or ask for fewer new tokens")
    native = isinstance(model, NativeCausalLM)  # no transformers forward to fall back on
    if engine == "transformers" and native:
        raise ValueError("the transformers engine runs the transformers model; this one was loaded in the native "
                         "runtime (load it with runtime='transformers', or pick engine auto, fused or lean)")
    reason = unsupported_reason(model, max_len) if engine != "transformers" else "transformers requested"
    if reason is None:
        decoder = LeanDecoder(model, max_len, fuse=engine in ("auto", "fused"))
        if engine == "fused" and decoder.fused is None:
            raise ValueError(f"fused decoding does not support this model: {decoder.fused_reason}")
        return decoder.forward
    if engine in ("lean", "fused") or native:
        raise ValueError(f"{engine} decoding does not support this model: {reason}")
    state: dict[str, Any] = {}

    def step(ids: torch.Tensor) -> torch.Tensor:
        out = model(ids, cache=state.get("cache"), use_cache=True, logits_to_keep=1)
        state["cache"] = out.cache
        return out.logits[0, -1]

    return step


@torch.no_grad()
def decode(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
           seed: int = 0, stop_ids: set[int] | None = None, engine: str = "auto") -> DecodeRun:
    """Greedy (temperature 0) or sampled continuation of prompt_ids [1, T], with the KV cache
    (`stepper` says which engine runs it; `bitquilt.decoding.run_decode` the loop and its timing)."""
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"decode needs token ids as an integer tensor [1, T], got {type(prompt_ids).__name__}"
                         + (f" of {prompt_ids.dtype}" if isinstance(prompt_ids, torch.Tensor) else ""))
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] == 0:
        raise ValueError(f"decode needs one non-empty prompt [1, T], got shape {tuple(prompt_ids.shape)}")
    check_generation(max_new_tokens, temperature)
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    step = stepper(model, prompt_ids.shape[1] + max_new_tokens, engine)
    return run_decode(lambda ids: step(torch.tensor([list(ids)])), prompt_ids[0].tolist(), max_new_tokens,
                      lambda logits: _next_token(logits, temperature, generator), stop_ids)


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
