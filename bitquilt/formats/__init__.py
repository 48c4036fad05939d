"""Low-bit weight representations. Importing this package registers every format."""

from bitquilt.formats.base import FORMATS, MatmulContext, WeightFormat, format_class, register_format
from bitquilt.formats.bitplane import BitplaneFormat
from bitquilt.formats.composite import CompositeFormat
from bitquilt.formats.ggml import GGMLFormat
from bitquilt.formats.mxint import MXIntFormat
from bitquilt.formats.sparse_blocks import SparseBlockFormat
from bitquilt.formats.uniform import UniformFormat, UniformGrid

__all__ = [
    "FORMATS", "MatmulContext", "WeightFormat", "format_class", "register_format", "UniformFormat", "UniformGrid",
    "BitplaneFormat", "CompositeFormat", "GGMLFormat", "MXIntFormat", "SparseBlockFormat",
]
