"""Continuous batching: sequences, each with its own KV cache, position and pick of the next token, advance together
one step at a time, and join or leave the batch between steps.

A step of `Batch` feeds every decoding sequence its last token and the first sequence still reading its prompt the next
chunk of it (`chunk` tokens: a long prompt holds the running streams up for one chunk per step, not for the whole
prompt; `idle_chunk` while no sequence decodes). The module-by-module layers take all their rows through each linear in
one call (`LeanLayers.run`), attention per sequence over its own cache; a sequence that has read all of its input gets
its next token. Where the model allows the fused step (`bitquilt.runtime.fused`, engines auto and fused), the decoding
sequences and the reading one's chunk take it together instead: every decoder layer in one compiled call, each linear
once for all their rows (a chunk shares the decoding rows' weight reads), attention per sequence over its own cache.
Nothing a sequence computes depends on what else runs (its chunks, its ops, its pick: the kernels compute each row as
alone, the LM head's too where the fused layers hold it), so it gets the same logits, and tokens, batched as alone. (On
the lean layers, an fp32 head's GEMM over several sequences' last rows may round a logit otherwise than over one.)
A model the lean layers do not run (engine "transformers", another family) steps its sequences one after another
through their own `stepper`, the prompt whole.

A MoBiQuant model's sequences may each carry their own precision (`add(..., avg_bits=B)`): the fused step routes
each row at its sequence's threshold, the module-by-module layers run the sequences of one threshold together with
the routers set to it (`bitquilt.nn.slice_router.routed_at`); the others route at the routers' own thresholds. A
running sequence's precision may change between steps (`route`). Each sequence counts the bits per weight its tokens
used (`Sequence.avg_bits`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from bitquilt import kernels
from bitquilt.nn.slice_router import has_routers, precision_range, realised_bits, routed_at, threshold_for
from bitquilt.runtime.engines import ENGINES, sampler, stepper
from bitquilt.runtime.lean import KVCache, LeanLayers, fuse_layers, fused_cache, fused_logits, unsupported_reason
from bitquilt.runtime.loop import IDLE_CHUNK, PREFILL_CHUNK, picked, prompt_chunk


@dataclass(eq=False)
class Sequence:
    """A sequence of a batch: the ids it has still to read (the rest of its prompt, then its last new token), its new
    tokens and how it picks the next one from its logits [vocab] (-1: not all finite)."""

    pending: list[int]
    pick: Callable[[torch.Tensor], int]
    cache: KVCache | None = None  # lean layers: its cache, and that cache for the fused step where the model allows
    fused: Any = None
    step: Callable[[torch.Tensor], torch.Tensor] | None = None  # else: its own stepper
    new_ids: list[int] = field(default_factory=list)
    threshold: float | None = None  # a routed model's: its routers' threshold (None: the routers' own)
    bits: float = 0.0  # bits per weight its tokens used in the routed linears, summed over them
    tokens: int = 0  # those tokens

    @property
    def avg_bits(self) -> float | None:
        """The bits per weight its tokens used on average (routed models; None before any or without routers)."""
        return self.bits / self.tokens if self.tokens else None

    def count_bits(self, avg_bits: float, tokens: int) -> None:
        """`tokens` more of its tokens used `avg_bits` bits per weight on average."""
        if not math.isnan(avg_bits):
            self.bits, self.tokens = self.bits + avg_bits * tokens, self.tokens + tokens


class Batch:
    """The running sequences of one model (module docstring); positions up to `max_len` per sequence. `routed_range`:
    a routed model's (low, high) average bits per weight, else None; `sampler`: a sequence's pick of its next token
    (`bitquilt.runtime.engines.sampler`)."""

    sampler = staticmethod(sampler)

    def __init__(self, model: nn.Module, max_len: int, engine: str = "auto", chunk: int = PREFILL_CHUNK,
                 idle_chunk: int = IDLE_CHUNK):
        if engine not in ENGINES:
            raise ValueError(f"unknown decode engine {engine!r}; engines: {', '.join(ENGINES)}")
        self.model, self.engine, self.chunk, self.idle_chunk = model, engine, chunk, idle_chunk
        lean = engine != "transformers" and unsupported_reason(model, max_len) is None
        self.layers = LeanLayers(model, max_len) if lean else None
        fuse = lean and engine in ("auto", "fused")
        self.fused = fuse_layers(self.layers)[0] if fuse else None
        self.routed = has_routers(model)
        self.routed_range = precision_range(model) if self.routed else None
        self.sequences: list[Sequence] = []

    def add(self, prompt: list[int], length: int, pick: Callable[[torch.Tensor], int],
            avg_bits: float | None = None) -> Sequence:
        """A new sequence of `prompt` and up to `length` positions in all, joining at the next step; a routed model's
        tokens routed to `avg_bits` bits per weight on average (None: at the routers' own thresholds). ValueError
        for avg_bits on a model without routers or outside its range."""
        if not prompt or len(prompt) >= length:
            raise ValueError(f"a prompt of 1 to {length - 1} tokens for {length} positions, got {len(prompt)}")
        seq = Sequence(list(prompt), pick, threshold=None if avg_bits is None else threshold_for(self.model, avg_bits))
        if self.layers is None:
            seq.step = stepper(self.model, length, self.engine)
        else:
            seq.cache = self.layers.new_cache(length)
            seq.fused = None if self.fused is None else fused_cache(self.fused, seq.cache)
        self.sequences.append(seq)
        return seq

    def route(self, seqs: list[Sequence], avg_bits: float) -> None:
        """A routed model's `seqs` at `avg_bits` bits per weight on average from their next step on (the bits they
        used so far stay counted); ValueError outside the checkpoint's range."""
        threshold = threshold_for(self.model, avg_bits)
        for seq in seqs:
            seq.threshold = threshold

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the batch (finished, stopped or cancelled); its cache is freed with it."""
        self.sequences.remove(seq)

    @torch.no_grad()
    def step(self) -> list[tuple[Sequence, int]]:
        """One step (module docstring): (sequence, its new token) for each sequence that got one, -1 for logits
        that are not all finite."""
        if self.layers is None:
            return [picked(s, self._counted([s], [len(s.pending)],
                                            functools.partial(s.step, torch.tensor([s.pending]))))
                    for s in list(self.sequences)]
        decoding = [s for s in self.sequences if s.new_ids]
        reading = next((s for s in self.sequences if not s.new_ids), None)
        chunk = 0 if reading is None else \
            prompt_chunk(len(reading.pending), bool(decoding), self.chunk, self.idle_chunk)
        together = [s for s in [*decoding, reading] if s is not None and s.fused is not None] \
            if kernels.options().enabled else []
        out = self._fused_step(together, [chunk if s is reading else 1 for s in together]) if together else []
        batch = [s for s in decoding if s not in together]
        counts = [1] * len(batch)
        if reading is not None and reading not in together:
            batch.append(reading)
            counts.append(chunk)
        groups: dict[float | None, list[int]] = {}  # rows of one threshold run together
        for i, seq in enumerate(batch):
            groups.setdefault(seq.threshold, []).append(i)
        for rows in groups.values():
            out += self._module_step([batch[i] for i in rows], [counts[i] for i in rows])
        return out

    def _module_step(self, batch: list[Sequence], counts: list[int]) -> list[tuple[Sequence, int]]:
        """`counts[i]` pending ids of each of `batch` (sequences of one threshold) through the lean layers together,
        and the picks of those that read all of theirs."""
        ids = torch.tensor([[t for s, n in zip(batch, counts) for t in s.pending[:n]]])
        x = self._counted(batch, counts, lambda: self.layers.run(ids, [s.cache for s in batch], counts)[0])
        return self._advanced(batch, counts, x, self.layers.logits)

    def _advanced(self, seqs: list[Sequence], counts: list[int], x: torch.Tensor,
                  logits_of: Callable[[torch.Tensor], torch.Tensor]) -> list[tuple[Sequence, int]]:
        """`counts[i]` pending ids of each of `seqs` read (hidden states x, their rows in order): the picks of those
        that read all of theirs (logits of their last rows), the rest of the others' prompts left pending."""
        ends = torch.tensor(counts).cumsum(0) - 1
        done = [i for i, (s, n) in enumerate(zip(seqs, counts)) if n == len(s.pending)]
        for i, s in enumerate(seqs):
            if i not in done:
                del s.pending[:counts[i]]
        logits = logits_of(x[ends[done]]) if done else None
        return [picked(seqs[i], logits[j]) for j, i in enumerate(done)]

    def _counted(self, seqs: list[Sequence], counts: list[int], run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """`run()` module by module with the routers at the threshold of `seqs` (one for all), the bits it used
        counted to each (the average of the call's tokens: per sequence where it runs alone)."""
        if not self.routed:
            return run()
        with routed_at(self.model, seqs[0].threshold), realised_bits(self.model) as used:
            out = run()
        for s, n in zip(seqs, counts):
            s.count_bits(used["avg_bits"], n)
        return out

    def _fused_step(self, seqs: list[Sequence], counts: list[int]) -> list[tuple[Sequence, int]]:
        """`counts[i]` pending ids of each of `seqs` (a token, or a prompt chunk) through the fused layers together,
        each weight read once for all their rows, and the picks of those that read all of theirs; the head takes their
        last rows in one call too (`fused_logits`)."""
        ids = torch.tensor([[t for s, n in zip(seqs, counts) for t in s.pending[:n]]])
        thresholds = [math.nan if s.threshold is None else s.threshold for s in seqs]
        x = self.fused.step(self.model.model.embed_tokens(ids)[0], [s.cache.pos for s in seqs], [s.fused for s in seqs],
                            thresholds if any(s.threshold is not None for s in seqs) else None, counts)
        row_bits = self.fused.step_bits()
        first = 0
        for s, n in zip(seqs, counts):
            s.cache.pos += n
            if row_bits:
                s.count_bits(sum(row_bits[first:first + n]) / n, n)
            first += n
        return self._advanced(seqs, counts, x, functools.partial(fused_logits, self.layers, self.fused))
