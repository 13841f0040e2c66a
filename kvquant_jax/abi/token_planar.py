"""The token-planar per-token layout: per-token INT2 / INT4 stored the way the Mosaic GPU planar kernel reads it.

Per-token quantization -- symmetric (``kvquant_jax.cache.per_token``: one scale per token and KV head, ``q =
clip(rint(x / s), -qmax, qmax)``, ``qmax = 2^(bits-1) - 1``) or QServe's INT4 with a floating offset
(``kvquant_jax.cache.qserve``: ``x = (u - o) s``) -- with the codes arranged like the token-planar KIVI
layout (:mod:`kvquant_jax.abi.kivi_planar`, whose pack / write / take functions this layout shares): unsigned
offset-binary codes ``u = q + 2^(bits-1)`` packed along *tokens*, planar in blocks of ``BT = plane_rows * 8/bits``
tokens (byte row ``block * plane_rows + t % plane_rows``, bits ``[bits*r, bits*(r+1))`` for plane ``r``, the top
plane stored ``u XOR 2^(bits-1)``), so that ``pallas_kernels.decode_attention_mgpu_planar`` turns one byte tile
into ``P = 8/bits`` wgmma M tiles with one AND each.  One layer (``[B, Hkv, ...]`` head-major, ``C`` a multiple of
``BT``)::

    k_codes  uint8 [B, Hkv, C / P, D]   K codes (the kernel's K operand, [tokens, channels])
    v_codes  uint8 [B, Hkv, D, C / P]   V codes transposed (tokens contiguous: the PV A operand is V^T)
    k_scale  [B, Hkv, C]                per-(token, head) K scale in the qparam dtype, tokens contiguous (one TMA
                                        tile per block); QServe: ``k_qparams [B, Hkv, 2, C]``, row 0 the scale,
                                        row 1 the offset (one tile for both)
    v_scale  [B, Hkv, C]                V scale (same dtype and order)
    v_offset [B, Hkv, C]                V offset (QServe only)

Symmetric: ``x = (u - 2^(bits-1)) * scale``; QServe (``zero = "offset"``): ``x = (u - offset) * scale``.

An empty slot holds byte 0 and scale 1 (every reader masks rows past the frontier).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
from flax import struct

from kvquant_jax.abi.kivi_planar import PlaneBlocks

__all__ = ["LAYOUT_TAG", "ZEROS", "zero_rows", "TokenPlanarFormat", "TokenPlanarOperand"]

#: the physical-layout tag every schema of this layout records (``CacheSchema.extra``)
LAYOUT_TAG = "per_token_planar_k+v_token_minor"
#: the zero conventions of the layout (``TokenPlanarFormat.zero``)
ZEROS = ("symmetric", "offset")


def zero_rows(kind: str) -> int:
    """Qparam rows per token of a per-token operand with zero convention ``kind`` (a ``KVFormat.zero``): the scale,
    then (not when symmetric) its offset or min."""
    return 1 if kind == "symmetric" else 2


@dataclasses.dataclass(frozen=True)
class TokenPlanarFormat(PlaneBlocks):
    """Static description of one layer in the token-planar per-token layout (hashable: a jit static / dispatch key).

    Attributes:
      bits: code width of K and V (2 or 4).
      zero: "symmetric" (per-token symmetric) or "offset" (QServe's floating offset; INT4).
      plane_rows: tokens per plane of a block (64 for the Mosaic GPU kernel; smaller values are for CPU tests).
      qparam_dtype: scale storage ("fp16", "bf16" or "fp32").
    """

    bits: int
    zero: str = "symmetric"
    plane_rows: int = 64
    qparam_dtype: str = "fp16"

    def __post_init__(self):
        self._check_planes("token-planar layout")
        if self.zero not in ZEROS:
            raise ValueError(f"token-planar layout: zero must be one of {ZEROS}, got {self.zero!r}")

    @property
    def payload(self) -> str:
        return f"int{self.bits}_planar" if self.zero == "symmetric" else f"qserve{self.bits}_planar"

    @property
    def qparam_rows(self) -> int:
        """Rows of the K qparams (scale; scale + offset)."""
        return zero_rows(self.zero)


@struct.dataclass
class TokenPlanarOperand:
    """One layer of a token-planar per-token cache as the fused decode kernel reads it: the stored arrays in place
    and ``end int32 [B]`` (rows ``[0, end)`` are live: the committed lengths)."""

    k_codes: jax.Array      # uint8 [B, Hkv, C/P, D]
    v_codes: jax.Array      # uint8 [B, Hkv, D, C/P]
    k_qparams: jax.Array    # [B, Hkv, C] scale (symmetric) or [B, Hkv, 2, C] scale, offset
    v_scale: jax.Array      # [B, Hkv, C]
    v_offset: Optional[jax.Array]   # [B, Hkv, C] (zero "offset") or None
    end: jax.Array          # int32 [B]
