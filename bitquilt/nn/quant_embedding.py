"""`QuantEmbedding`: a drop-in `nn.Embedding` whose table is a packed weight format.

The table [num_embeddings, embedding_dim] is held like a `QuantLinear`'s weight (its rows are the tokens, its
columns the hidden dimension, grouped along it), as buffers named by `formats.base.buffer_name`. The forward
dequantizes only the rows it looks up (`fmt.dequantize_rows`), so the full-precision table is never built. With
tied embeddings the LM head is a `QuantLinear` over the same format object: one packed tensor serves both, and is
stored once (`bitquilt.io`). A scaled embedding (Gemma's `embed_scale`, a non-persistent buffer) keeps its scale.

A table loaded as a view of its mapped file (`bitquilt.mapped`) is read a few rows per call, yet each touch can map
far more than the row: Linux maps the file's page-cache folio, up to 2 MB (qwen2.5-1.5b: 128 looked-up rows left
117 MB of its 223 MB table resident). With `returns_pages` set (by `bitquilt.io.load_quantized` when no LM head
reads the table in place) the table's pages are given back after each lookup, whose rows are copies by then.
"""

from __future__ import annotations

import torch
from torch import nn

from bitquilt.formats.base import WeightFormat, buffer_name, split_buffers
from bitquilt.mapped import release


class QuantEmbedding(nn.Module):
    """e(ids) = Ŵ[ids] (· embed_scale), with Ŵ held packed in `fmt` (a format with `dequantize_rows`)."""

    def __init__(self, fmt: WeightFormat, padding_idx: int | None = None, embed_scale: torch.Tensor | None = None):
        super().__init__()
        if not hasattr(fmt, "dequantize_rows"):
            raise TypeError(f"a quantized embedding needs a format that dequantizes single rows; {fmt.name!r} "
                            "cannot (use the uniform grid)")
        self.fmt = fmt
        self.num_embeddings, self.embedding_dim = fmt.out_features, fmt.in_features
        self.padding_idx = padding_idx
        self.returns_pages = False  # give the table's mapped pages back after each lookup (module docstring)
        for name, t in fmt.tensors().items():
            self.register_buffer(buffer_name(name), t)
        self.register_buffer("embed_scale", None if embed_scale is None else embed_scale.detach().clone(),
                             persistent=False)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, fmt: WeightFormat) -> QuantEmbedding:
        """The quantized counterpart of `embedding` (its padding index and scale, if any) holding `fmt`."""
        if (fmt.out_features, fmt.in_features) != (embedding.num_embeddings, embedding.embedding_dim):
            raise ValueError(f"a {fmt.out_features}×{fmt.in_features} format cannot replace a "
                             f"{embedding.num_embeddings}×{embedding.embedding_dim} embedding")
        scale = getattr(embedding, "embed_scale", None)
        return cls(fmt, embedding.padding_idx, scale if isinstance(scale, torch.Tensor) else None)

    @property
    def weight(self) -> torch.Tensor:
        """The whole dequantized table (fp32, built on each access), for code that inspects `.weight`."""
        return self.fmt.dequantize()

    def _apply(self, fn, recurse=True):
        # keep the format's tensors the same objects as the buffers after .to()
        super()._apply(fn, recurse)
        tensors = split_buffers(dict(self.named_buffers(recurse=False)))
        self.fmt = type(self.fmt).from_tensors(tensors, self.fmt.meta())
        return self

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.fmt.dequantize_rows(input_ids)
        if self.returns_pages:
            release(self.fmt.tensors().values())
        return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.dtype)

    def extra_repr(self) -> str:
        bpw = self.fmt.bits_per_weight()
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt.describe()}, {bpw:.3f} bpw"
