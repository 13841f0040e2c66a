"""FP8 (E4M3 / E5M2) K/V in the transposed-V layout the Mosaic GPU decode kernels read in place.

The same codes and per-head scales as :class:`kvquant_jax.cache.fp8.FP8Scheme` (every scale source: uncalibrated,
warm-up, calibrated; per tensor or per KV head; the same saturating quantizer), stored the way the Mosaic GPU
swap-AB kernels (``pallas_kernels.decode_attention_mgpu`` v1 and the warp-specialized one) take their operands:
the FP8 bytes as uint8, K rows token-major, V token-minor (:mod:`kvquant_jax.abi.transposed_v`, ``fp8`` formats)::

    k_codes  uint8 [B, Hkv, C, D]    row t = token t; the FP8 bytes of k[t, :] / k_scale[h]
    v_codes  uint8 [B, Hkv, D, C]    column t = token t (tokens contiguous: the PV product's A operand is V^T)
    k_scale, v_scale  float32 [Hkv]  one scale per KV head and tensor, shared by every sequence (unbatched)

Registry names ``fp8_e4m3_vt`` / ``fp8_e5m2_vt``.  Why a separate layout: the FP8 layout-1 cache is read by the
Pallas Triton region kernel (0.84x cuDNN at 4K and 0.93x at 32K on the H200, device clock, 2026-12-04), and the
Mosaic kernels need V^T; converting every step would rewrite the layer, so the cache pays at append time instead:
one K row plus one strided V column per head and token (one byte per code, no read-modify-write).

Decode: ``attention.dispatch`` routes the layer by its format type (:meth:`fused_decode_operand`, a
:class:`~kvquant_jax.abi.transposed_v.TransposedVFormat` with ``fp8`` set) like ``int8_vt`` / ``int4_vt``: Mosaic v1
or the warp-specialized kernel as the tuning table measured, on a Hopper GPU; anywhere else the materialize view,
exact.  An empty slot holds byte 0 (FP8 +0.0).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.abi import transposed_v as tv
from kvquant_jax.cache import _rows
from kvquant_jax.cache.fp8 import FP8Scheme
from kvquant_jax.cache.per_token_vt import _write_token_columns
from kvquant_jax.cache.schema import CacheSchema
from kvquant_jax.quant.fp8 import quantize_fp8


@struct.dataclass
class FP8TransposedVLayerState:
    """``k_codes uint8 [B, Hkv, C, D]`` and ``v_codes uint8 [B, Hkv, D, C]`` (FP8 bytes; V token-minor),
    ``k_scale, v_scale`` float32 ``[Hkv]`` (unbatched)."""

    k_codes: jax.Array
    v_codes: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


@dataclasses.dataclass(frozen=True)
class FP8TransposedVScheme(FP8Scheme):
    """FP8 K/V with :class:`FP8Scheme`'s scales and quantizer, stored for the Mosaic GPU kernels (module doc).

    Changes only the storage hooks (``init_layer``, ``_encode``, ``_stored_codes``, ``field_axes``,
    ``layer_nbytes``) and the decode route.  Attributes: those of :class:`FP8Scheme` (``fmt``, ``scales``,
    ``scale_axis``, ``k_scales``, ``v_scales``, ``calibration_id``); ``kernel_family`` "mosaic_gpu_swap_ab"
    (recorded in the schema).
    """

    family = "fp8_vt"
    presets = {"fp8_e4m3_vt": {"fmt": "e4m3"}, "fp8_e5m2_vt": {"fmt": "e5m2"}}

    kernel_family: str = "mosaic_gpu_swap_ab"

    @property
    def kernel_format(self) -> tv.TransposedVFormat:
        return tv.TransposedVFormat(bits=8, qparam_dtype="fp32", fp8=self.fmt)

    @property
    def schema(self) -> CacheSchema:
        base = super().schema
        return dataclasses.replace(base, scheme=self.family,
                                   extra=base.extra + (("physical_layout", tv.FP8_LAYOUT_TAG),))

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        return FP8TransposedVLayerState(
            k_codes=jnp.zeros((batch, num_kv_heads, capacity, head_dim), jnp.uint8),
            v_codes=jnp.zeros((batch, num_kv_heads, head_dim, capacity), jnp.uint8),
            k_scale=self._initial(self.k_scales, num_kv_heads), v_scale=self._initial(self.v_scales, num_kv_heads))

    def _encode(self, state, first_row, k, v, num_new):
        """Valid rows ``t < num_new[b]`` of ``k, v [B, T, Hkv, D]`` written at rows ``first_row[b] + t`` (K rows,
        V columns) under the scales of ``state``: the bytes of :class:`FP8Scheme`'s codes."""
        t = k.shape[1]
        mask = _rows.new_row_mask(num_new, t)
        pos = first_row[:, None] + _rows.arange_rows(t)[None, :]
        kc = tv.fp8_bytes(quantize_fp8(_rows.head_major(k), state.k_scale, self.fmt, head_axis=1))
        vc = tv.fp8_bytes(quantize_fp8(_rows.head_major(v), state.v_scale, self.fmt, head_axis=1))
        return state.replace(k_codes=_rows.write_rows(state.k_codes, kc, pos, mask),
                             v_codes=_write_token_columns(state.v_codes, vc, pos, mask, 8))

    def _stored_codes(self, state):
        """The stored bytes as FP8 ``[B, Hkv, C, D]`` (V transposed back): what :class:`FP8Scheme`'s
        ``materialize_layer`` and ``validate_layer`` read."""
        return tv.fp8_codes(state.k_codes, self.fmt), jnp.swapaxes(tv.fp8_codes(state.v_codes, self.fmt), 2, 3)

    def field_axes(self, state):
        """:meth:`FP8Scheme.field_axes` under this state's field names (codes ``[B, Hkv, ...]``, scales ``[Hkv]``)."""
        axes = super().field_axes(state)
        return {"k_codes": axes["k"], "v_codes": axes["v"], "k_scale": axes["k_scale"], "v_scale": axes["v_scale"]}

    def layer_nbytes(self, state):
        return {"codes": _rows.nbytes(state.k_codes, state.v_codes),
                "qparams": _rows.nbytes(state.k_scale, state.v_scale)}

    def decode_regions(self, state, lengths):
        """The materialize view (the layer's V is token-minor: no layout-1 region reads it in place); a GPU reads
        the layer through :meth:`fused_decode_operand` instead."""
        return super(FP8Scheme, self).decode_regions(state, lengths)

    def fused_decode_operand(self, state, lengths):
        """``(TransposedVFormat(fp8=fmt), state)``: the Mosaic GPU kernels read the layer in place."""
        del lengths
        return self.kernel_format, state


__all__ = ["FP8TransposedVScheme", "FP8TransposedVLayerState"]
