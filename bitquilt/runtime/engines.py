"""The one place that chooses how a torch model generates: the engine, and the decode call built on it.

Engines, fastest first (docs/runtime.md draws the whole ladder):

- "fused": `LeanDecoder` with every decoder layer of a one-token step in one compiled call
  (`bitquilt.runtime.fused`), for weight-only models whose linears a CPU kernel takes;
- "lean": `LeanDecoder` (`bitquilt.runtime.lean`): a static KV cache and the model's own modules, one op at a time;
- "transformers": the transformers forward with its cache (any family transformers runs);
- "auto": the first of fused, lean, transformers that supports the model.

The decode loop itself (prompt, then one token at a time, timed apart) is `bitquilt.runtime.loop.run_decode`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bitquilt.runtime.lean import LeanDecoder, unsupported_reason
from bitquilt.runtime.loop import DecodeRun, check_generation, run_decode
from bitquilt.runtime.module_tree import ModuleTreeLM

ENGINES = ("auto", "fused", "lean", "transformers")


def _next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
                top_p: float = 1.0) -> int:
    """The next token of `logits`, greedy or sampled (from the smallest set of most likely tokens whose probability
    reaches `top_p`); -1 when they are not all finite (`run_decode` says so)."""
    if not bool(torch.isfinite(logits).all()):
        return -1
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p  # the mass before them already reaches top_p
        probs = probs.index_fill(0, order[outside], 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def sampler(temperature: float, top_p: float = 1.0, seed: int = 0) -> Callable[[torch.Tensor], int]:
    """One sequence's pick of its next token from its logits [vocab]: greedy at temperature 0, else sampled with its
    own generator seeded by `seed` (so a sequence draws the same tokens whatever runs beside it); -1 for logits that
    are not all finite."""
    generator = torch.Generator().manual_seed(seed) if temperature > 0 else None
    return lambda logits: _next_token(logits, temperature, generator, top_p)


def stepper(model: nn.Module, max_len: int, engine: str = "auto") -> Callable[[torch.Tensor], torch.Tensor]:
    """A function from the next input ids [1, T] to the logits [vocab] of their last position, the
    sequence's KV cache kept between calls. Engines: "lean" is `LeanDecoder` (bitquilt.runtime.lean:
    static KV cache, the model's own modules), "fused" the same with every decoder layer of a one-token
    step in one compiled call, "transformers" the transformers forward with its cache; "auto" takes the
    first of fused, lean, transformers that supports the model."""
    if engine not in ENGINES:
        raise ValueError(f"unknown decode engine {engine!r}; engines: {', '.join(ENGINES)}")
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if positions is not None and max_len > positions:  # too long for every engine: say so, not "unsupported"
        raise ValueError(f"a sequence of {max_len} positions (prompt + new tokens) does not fit the model's "
                         f"{positions}; shorten the prompt or ask for fewer new tokens")
    tree = isinstance(model, ModuleTreeLM)  # no transformers forward to fall back on
    if engine == "transformers" and tree:
        raise ValueError("the transformers engine runs the transformers model; this one was loaded in the bitquilt "
                         "runtime (load it with runtime='transformers', or pick engine auto, fused or lean)")
    reason = unsupported_reason(model, max_len) if engine != "transformers" else "transformers requested"
    if reason is None:
        decoder = LeanDecoder(model, max_len, fuse=engine in ("auto", "fused"))
        if engine == "fused" and decoder.fused is None:
            raise ValueError(f"fused decoding does not support this model: {decoder.fused_reason}")
        return decoder.forward
    if engine in ("lean", "fused") or tree:
        which = "fused decoding (lean decoding with fused layers)" if engine == "fused" else f"{engine} decoding"
        raise ValueError(f"{which} does not support this model: {reason}")
    state: dict[str, Any] = {}

    def step(ids: torch.Tensor) -> torch.Tensor:
        out = model(ids, cache=state.get("cache"), use_cache=True, logits_to_keep=1)
        state["cache"] = out.cache
        return out.logits[0, -1]

    return step


def engine_of(step: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """The engine a `stepper` runs: fused, lean or transformers."""
    decoder = getattr(step, "__self__", None)
    if isinstance(decoder, LeanDecoder):
        return "lean" if decoder.fused is None else "fused"
    return "transformers"


@torch.no_grad()
def decode(model: nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
           seed: int = 0, stop_ids: set[int] | None = None, engine: str = "auto", top_p: float = 1.0,
           on_token: Callable[[int], bool | None] | None = None) -> DecodeRun:
    """Greedy (temperature 0) or sampled continuation of prompt_ids [1, T], with the KV cache
    (`stepper` says which engine runs it, the run's `engine` which ran; `bitquilt.runtime.loop.run_decode` the loop,
    its timing and `on_token`)."""
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"decode needs token ids as an integer tensor [1, T], got {type(prompt_ids).__name__}"
                         + (f" of {prompt_ids.dtype}" if isinstance(prompt_ids, torch.Tensor) else ""))
    if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1 or prompt_ids.shape[1] == 0:
        raise ValueError(f"decode needs one non-empty prompt [1, T], got shape {tuple(prompt_ids.shape)}")
    check_generation(max_new_tokens, temperature, top_p)
    step = stepper(model, prompt_ids.shape[1] + max_new_tokens, engine)
    run = run_decode(lambda ids: step(torch.tensor([list(ids)])), prompt_ids[0].tolist(), max_new_tokens,
                     sampler(temperature, top_p, seed), stop_ids, on_token)
    run.engine = engine_of(step)
    return run
