"""`ggml`: a weight held as llama.cpp's own blocks (K-quants Q2_K–Q6_K, Q4_0, Q5_0, Q5_1, Q8_0).

Stored tensor
  blocks  uint8 [out, in/block · bytes]   each row's blocks exactly as a GGUF file stores them
                                          (`formats.ggml_blocks`), so export copies them and reading
                                          the file back gives the same bytes

Meta: the block type's name (`type`) and `in_features`. Ŵ is ggml's dequantization, bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch

from bitquilt.formats.base import WeightFormat, register_format
from bitquilt.formats.ggml_blocks import Blocks, BlockType, block_type, pack, unpack
from bitquilt.formats.uniform import check_shapes


@register_format
class GGMLFormat(WeightFormat):
    name = "ggml"
    supported_bits = (2, 3, 4, 5, 6, 8)
    supported_group_sizes = (32, 256)
    default_group_size = 256

    def __init__(self, blocks: torch.Tensor, type_name: str, in_features: int):
        self.type = block_type(type_name)
        if in_features % self.type.block:
            raise ValueError(f"{type_name} needs rows of a multiple of {self.type.block} values, got {in_features}")
        out = blocks.shape[0]
        check_shapes({"blocks": blocks}, {"blocks": (out, in_features // self.type.block * self.type.nbytes)},
                     f"{type_name}, in_features {in_features}")
        if blocks.dtype != torch.uint8:
            raise ValueError(f"ggml blocks must be uint8, got {blocks.dtype}")
        self.blocks = blocks
        self.out_features, self.in_features = out, in_features

    @classmethod
    def from_fields(cls, t: BlockType, fields: Blocks) -> GGMLFormat:
        return cls(pack(t, fields).contiguous(), t.name, fields.q.shape[1] * t.block)

    def fields(self) -> Blocks:
        return unpack(self.type, self.blocks)

    def dequantize(self, selector: Any = None) -> torch.Tensor:
        return self.fields().dequantize(self.type)

    def dequantize_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (indices of any shape) of `dequantize()`, [*rows.shape, in], unpacking only those rows."""
        part = unpack(self.type, self.blocks[rows.reshape(-1)]).dequantize(self.type)
        return part.reshape(*rows.shape, self.in_features)

    def permute_rows(self, order: torch.Tensor) -> GGMLFormat:
        return GGMLFormat(self.blocks[order], self.type.name, self.in_features)

    rows_apart = True

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"blocks": self.blocks}

    def meta(self) -> dict[str, Any]:
        return {"type": self.type.name, "in_features": self.in_features}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> GGMLFormat:
        return cls(tensors["blocks"], str(meta["type"]), int(meta["in_features"]))

    def describe(self) -> str:
        return f"ggml {self.type.name}"
