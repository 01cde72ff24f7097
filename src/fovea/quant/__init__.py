"""Quantized checkpoints: the formats fovea runs, the canonical weight layouts, and the checkpoint readers."""

from fovea.quant.formats import SUPPORTED_FORMATS, QuantFormat, read_format
from fovea.quant.readers import QUANT_SUFFIXES, quantized_prefixes, read_linear, tensor_suffixes
from fovea.quant.weights import Fp8Weight, Int4Weight, QuantWeight, dequantized_linear

__all__ = [
    "QUANT_SUFFIXES", "SUPPORTED_FORMATS", "Fp8Weight", "Int4Weight", "QuantFormat", "QuantWeight",
    "dequantized_linear", "quantized_prefixes", "read_format", "read_linear", "tensor_suffixes",
]
