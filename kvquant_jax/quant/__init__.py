"""Number formats of live-data quantization: pure, jit-able JAX primitives (one scheme per module).

Every quantizer has a raising public form and a jit-safe ``*_with_status`` form returning per-group
:class:`QuantStatus` flags; see :mod:`kvquant_jax.quant._common` for the split.
"""
from kvquant_jax.quant._common import QuantStatus, canonical_qparam_dtype, describe_status, raise_for_status
from kvquant_jax.quant.affine import (AffineQuantized, affine_qmax, dequantize_affine, quantize_affine,
                                      quantize_affine_with_status)
from kvquant_jax.quant.fp8 import (Fp8Scale, dequantize_fp8, fp8_dtype, fp8_max, fp8_scale_from_absmax,
                                   observe_absmax, quantize_fp8, uncalibrated_fp8_scale)
from kvquant_jax.quant.nuq import (NuqQuantized, check_codebook, dequantize_nuq, nuq_decode, nuq_encode,
                                   quantize_nuq, quantize_nuq_with_status, uniform_codebook)
from kvquant_jax.quant.packing import (from_offset_binary, pack_bits, pack_bits_u32, packed_length,
                                       to_offset_binary, unpack_bits, unpack_bits_u32)
from kvquant_jax.quant.qserve import QServeQuantized, dequantize_qserve, quantize_qserve, quantize_qserve_with_status
from kvquant_jax.quant.sparse import (DenseSparseSplit, SparseOutliers, apply_holes, magnitude_thresholds,
                                      merge_dense_sparse, outlier_mask, sparse_to_dense, split_dense_sparse)
from kvquant_jax.quant.symmetric import (SymmetricQuantized, dequantize_symmetric, dequantize_symmetric_rows,
                                         quantize_symmetric, quantize_symmetric_rows,
                                         quantize_symmetric_rows_with_status, quantize_symmetric_with_status,
                                         symmetric_qmax)
from kvquant_jax.quant.w8a8 import affine_matmul_i32, affine_w8a8_linear, int8_matmul_i32, w8a8_linear

__all__ = [
    "QuantStatus", "canonical_qparam_dtype", "describe_status", "raise_for_status",
    "AffineQuantized", "affine_qmax", "dequantize_affine", "quantize_affine", "quantize_affine_with_status",
    "Fp8Scale", "dequantize_fp8", "fp8_dtype", "fp8_max", "fp8_scale_from_absmax", "observe_absmax", "quantize_fp8",
    "uncalibrated_fp8_scale",
    "NuqQuantized", "check_codebook", "dequantize_nuq", "nuq_decode", "nuq_encode", "quantize_nuq",
    "quantize_nuq_with_status", "uniform_codebook",
    "from_offset_binary", "pack_bits", "pack_bits_u32", "packed_length", "to_offset_binary", "unpack_bits",
    "unpack_bits_u32",
    "QServeQuantized", "dequantize_qserve", "quantize_qserve", "quantize_qserve_with_status",
    "DenseSparseSplit", "SparseOutliers", "apply_holes", "magnitude_thresholds", "merge_dense_sparse",
    "outlier_mask", "sparse_to_dense", "split_dense_sparse",
    "SymmetricQuantized", "dequantize_symmetric", "dequantize_symmetric_rows", "quantize_symmetric",
    "quantize_symmetric_rows", "quantize_symmetric_rows_with_status", "quantize_symmetric_with_status",
    "symmetric_qmax",
    "affine_matmul_i32", "affine_w8a8_linear", "int8_matmul_i32", "w8a8_linear",
]
