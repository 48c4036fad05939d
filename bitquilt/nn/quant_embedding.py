"""`QuantEmbedding`: a drop-in `nn.Embedding` whose table is a packed weight format.

The table [num_embeddings, embedding_dim] is held like a `QuantLinear`'s weight (its rows are the tokens, its
columns the hidden dimension, grouped along it), as buffers named by `formats.base.buffer_name`. The forward
dequantizes only the rows it looks up (`fmt.dequantize_rows`), so the full-precision table is never built. With
tied embeddings the LM head is a `QuantLinear` over the same format object: one packed tensor serves both, and is
stored once (`bitquilt.io`). A scaled embedding (Gemma's `embed_scale`, a non-persistent buffer) keeps its scale.
"""

from __future__ import annotations

import torch
from torch import nn

from bitquilt.formats.base import WeightFormat, buffer_name, split_buffers


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
        return rows if self.embed_scale is None else rows * self.embed_scale.to(rows.dtype)

    def extra_repr(self) -> str:
        bpw = self.fmt.bits_per_weight()
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt.describe()}, {bpw:.3f} bpw"
