"""GGML block-quantized weights: formats, the weight container, and their products."""

from specserve.engine.quant.formats import FORMATS, BlockFormat, GGMLType, block_format, dequantize
from specserve.engine.quant.weight import QuantizedWeight

__all__ = ["FORMATS", "BlockFormat", "GGMLType", "QuantizedWeight", "block_format", "dequantize"]
