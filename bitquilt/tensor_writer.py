"""Writing a safetensors file one tensor at a time, giving each mapped tensor's pages back once it is written.

The safetensors library writes every tensor of a file from memory in one call: a model whose tensors are views of
mapped files (a loaded model's packed weights, streaming quantization's spilled blocks) would have all their pages
resident at once by the end of the write. `write_tensors` writes the same layout (`bitquilt.tensor_header`
describes it) tensor by tensor and drops each mapped tensor's pages right after (`bitquilt.mapped.release`), so a
save holds at most one tensor's pages beyond what the model already holds. Tensors go widest element first, so each
starts aligned to its element size (the header is padded to 8 bytes), as the library lays them out.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from bitquilt.mapped import release

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (CPU, none sharing memory) and string `metadata` to the safetensors file `path`."""
    unknown = sorted({str(t.dtype) for t in tensors.values() if t.dtype not in SAFETENSORS_DTYPES})
    if unknown:
        raise ValueError(f"safetensors cannot hold dtype(s) {', '.join(unknown)}")
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            t = tensors[name]
            if t.numel():
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            release([t])
