"""Continuous batching in the standalone runtime: the interface of `bitquilt.runtime.batch.Batch` (what `bitquilt
serve`'s worker uses) over the C library's batched step, `bq_step`, with no torch.

Each sequence is a model of the export's one mapping with caches of its own (`StandaloneModel.open_sequence`). A step
feeds every decoding sequence its last token and the first sequence still reading its prompt the next chunk of it
(`bitquilt.runtime.loop.prompt_chunk`), all in one `bq_step`: each linear once for all their rows, attention per
sequence over its own cache, each row of a MoBiQuant export routed at its own sequence's threshold. The kernels compute
each row as alone, so a sequence gets the logits, and tokens, it gets alone. The library counts the bits per weight each
sequence's tokens used.
"""

from __future__ import annotations

import ctypes
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from bitquilt.errors import UserError
from bitquilt.runtime.loop import IDLE_CHUNK, PREFILL_CHUNK, picked, prompt_chunk
from bitquilt.runtime.standalone.generate import picker
from bitquilt.runtime.standalone.library import last_error, library
from bitquilt.runtime.standalone.model import StandaloneModel


@dataclass(eq=False)
class Sequence:
    """A sequence of a batch: the ids it has still to read (the rest of its prompt, then its last new token), its new
    tokens, how it picks the next one from its logits (-1: not all finite), and its handle in the library (None once
    out of the batch)."""

    pending: list[int]
    pick: Callable[[array], int]
    handle: int | None
    new_ids: list[int] = field(default_factory=list)
    pos: int = 0  # positions its cache holds
    left_bits: float | None = None  # its avg_bits when it left the batch

    @property
    def avg_bits(self) -> float | None:
        """The bits per weight its tokens used on average (routed exports; None before any or without routers)."""
        if self.handle is None:
            return self.left_bits
        bits = library().bq_routed_bits(self.handle)
        return None if math.isnan(bits) else bits


class StandaloneBatch:
    """The running sequences of a standalone export (module docstring); `routed_range` is the export's (low, high)
    average bits per weight, None without routers."""

    def __init__(self, model: StandaloneModel, chunk: int = PREFILL_CHUNK, idle_chunk: int = IDLE_CHUNK):
        self.model, self.chunk, self.idle_chunk = model, chunk, idle_chunk
        self.routed_range = model.routed_range()
        self.sequences: list[Sequence] = []
        self._lib = library()

    @staticmethod
    def sampler(temperature: float, top_p: float = 1.0, seed: int = 0) -> Callable[[array], int]:
        """A sequence's pick of its next token (`bitquilt.runtime.standalone.generate.picker`)."""
        return picker(temperature, seed, top_p)

    def add(self, prompt: list[int], length: int, pick: Callable[[array], int],
            avg_bits: float | None = None) -> Sequence:
        """A new sequence of `prompt` and up to `length` positions in all, joining at the next step; a routed export's
        tokens routed to `avg_bits` bits per weight on average (None: at the model's threshold, `set_avg_bits`).
        UserError for avg_bits on an export without routers or outside its range."""
        if not prompt or len(prompt) >= length:
            raise ValueError(f"a prompt of 1 to {length - 1} tokens for {length} positions, got {len(prompt)}")
        threshold = self.model.routing_threshold if avg_bits is None else self.model.threshold(avg_bits)
        seq = Sequence(list(prompt), pick, self.model.open_sequence(length))
        self._lib.bq_set_threshold(seq.handle, threshold)
        self.sequences.append(seq)
        return seq

    def route(self, seqs: list[Sequence], avg_bits: float) -> None:
        """`seqs` at `avg_bits` bits per weight on average from their next step on (the bits they used so far stay
        counted); UserError outside the export's range."""
        threshold = self.model.threshold(avg_bits)
        for seq in seqs:
            self._lib.bq_set_threshold(seq.handle, threshold)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the batch; its caches are freed, its avg_bits kept."""
        self.sequences.remove(seq)
        seq.left_bits = seq.avg_bits
        self._lib.bq_free(seq.handle)
        seq.handle = None

    def step(self) -> list[tuple[Sequence, int]]:
        """One step (module docstring): (sequence, its new token) for each sequence that got one, -1 for logits that
        are not all finite; UserError where the library refuses the step."""
        batch = [s for s in self.sequences if s.new_ids]
        reading = next((s for s in self.sequences if not s.new_ids), None)
        counts = [1] * len(batch)
        if reading is not None:
            counts.append(prompt_chunk(len(reading.pending), bool(batch), self.chunk, self.idle_chunk))
            batch.append(reading)
        if not batch:
            return []
        vocab = self.model.vocab_size
        ids = array("q", [t for s, n in zip(batch, counts) for t in s.pending[:n]])
        handles = (ctypes.c_void_p * len(batch))(*[s.handle for s in batch])
        sizes, positions = array("q", counts), array("q", [s.pos for s in batch])
        logits = array("f", bytes(4 * vocab * len(batch)))
        if self._lib.bq_step(handles, len(batch), ids.buffer_info()[0], sizes.buffer_info()[0],
                             positions.buffer_info()[0], logits.buffer_info()[0]) < 0:
            raise UserError(f"{self.model.directory}: {last_error()}")
        out = []
        for i, (seq, n) in enumerate(zip(batch, counts)):
            seq.pos += n
            if n < len(seq.pending):  # a prompt chunk with more to read
                del seq.pending[:n]
                continue
            out.append(picked(seq, logits[i * vocab:(i + 1) * vocab]))
        return out
