"""The transposed-V byte layout: per-token symmetric INT8 / INT4 stored the way the Mosaic GPU kernel reads it.

The Mosaic GPU decode kernel (``pallas_kernels.decode_attention_mgpu``, swap-AB wgmma) converts code tiles in
registers straight into the wgmma register-A layout.  For ``S^T = K @ Q^T`` the A operand is K with head_dim as
the contraction axis (rows as stored); for ``O^T = V^T @ P^T`` it is V^T, whose contraction axis is the *token*
axis, so V must be stored with tokens contiguous.  Both hold two's-complement codes so that the bytes reinterpret
as ``int8`` / ``int4`` arrays for free (on the H200 the ``uint8 -> int4`` bitcast feeding the kernel costs
nothing: ``experiments/probe_subbyte_append.py``, 2026-12-01).  One layer (``[B, Hkv, ...]`` head-major)::

    k_codes  uint8 [B, Hkv, C, D*bits/8]   row t = token t; codes q[d] (two's complement, ``q & (2^bits - 1)``)
                                           packed little-endian along D (element 2i in the low nibble for INT4)
    v_codes  uint8 [B, Hkv, D, C*bits/8]   column block = token axis: for each (head, d) the tokens' codes
                                           packed little-endian along C (token 2j in the low nibble for INT4)
    k_scale, v_scale  [B, Hkv, C, 1]       per-(token, head) scale in the qparam dtype; ``x = q * scale``

with ``q = clip(rint(x / scale), -qmax, qmax)``, ``qmax = 2^(bits-1) - 1`` (the per-token quantizer of
``kvquant_jax.cache.per_token``; only the byte layout differs from ``layout_version`` 1, whose codes are
offset-binary and whose V rows are token-major).  An empty slot holds code 0 (byte 0) and scale 1.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvquant_jax.quant.packing import pack_bits, unpack_bits

__all__ = ["TransposedVFormat", "pack_signed", "unpack_signed", "materialize"]

#: the physical-layout tag every schema of this layout records (``CacheSchema.extra``)
LAYOUT_TAG = "k_rows_signed+v_token_minor_signed"


@dataclasses.dataclass(frozen=True)
class TransposedVFormat:
    """Static description of one layer in the transposed-V layout (hashable: a jit static / dispatch key).

    Attributes:
      bits: 8 or 4.
      qparam_dtype: scale storage ("fp16", "bf16" or "fp32").
    """

    bits: int
    qparam_dtype: str = "fp16"

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"transposed-V layout: bits must be 4 or 8, got {self.bits!r}")

    @property
    def payload(self) -> str:
        return f"int{self.bits}"


def pack_signed(q: jax.Array, bits: int, axis: int = -1) -> jax.Array:
    """Signed codes (any int dtype, values in ``[-2^(bits-1), 2^(bits-1))``) -> uint8 two's-complement bytes packed
    little-endian along ``axis`` (its length must be a multiple of ``8 // bits``)."""
    mask = (1 << bits) - 1
    return pack_bits(jnp.bitwise_and(q.astype(jnp.int32), mask).astype(jnp.uint8), bits, axis=axis)


def unpack_signed(codes: jax.Array, bits: int, axis: int = -1, count: int | None = None) -> jax.Array:
    """Inverse of :func:`pack_signed`: uint8 bytes -> int32 signed codes along ``axis`` (``count`` elements)."""
    half = 1 << (bits - 1)
    u = unpack_bits(codes, bits, axis=axis, count=count).astype(jnp.int32)
    return jnp.bitwise_xor(u, half) - half


def materialize(fmt: TransposedVFormat, k_codes, v_codes, k_scale, v_scale, lengths):
    """Float32 ``(k, v, valid)``: ``k, v [B, Hkv, C, D]`` (rows at or past ``lengths[b]`` zero), ``valid [B, C]``.

    The reference view of the layout (transposes V back to token-major: for the oracle and the CPU path only)."""
    b, h, c, packed_d = k_codes.shape
    d = packed_d * 8 // fmt.bits
    k = unpack_signed(k_codes, fmt.bits, axis=-1, count=d).astype(jnp.float32) * k_scale.astype(jnp.float32)
    vt = unpack_signed(v_codes, fmt.bits, axis=-1, count=c).astype(jnp.float32)          # [B, H, D, C]
    v = jnp.swapaxes(vt, 2, 3) * v_scale.astype(jnp.float32)
    valid = jnp.arange(c, dtype=jnp.int32)[None, :] < lengths[:, None]
    m = valid[:, None, :, None]
    return jnp.where(m, k, 0.0), jnp.where(m, v, 0.0), valid
