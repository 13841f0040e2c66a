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

FP8 variant (``TransposedVFormat(fp8="e4m3" | "e5m2")``, ``kvquant_jax.cache.fp8_vt``): the same two code arrays
hold FP8 bytes, one per element (``k_codes uint8 [B, Hkv, C, D]``, ``v_codes uint8 [B, Hkv, D, C]``; a bitcast of
the ``float8_e4m3fn`` / ``float8_e5m2`` codes of ``kvquant_jax.cache.fp8``), and the scales are float32 ``[Hkv]``,
one per KV head and tensor: ``x = float(code) * scale[h]``.  An empty slot holds byte 0 (+0.0).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from kvquant_jax.abi.regions import FP8_PAYLOADS
from kvquant_jax.quant.fp8 import fp8_dtype
from kvquant_jax.quant.packing import pack_bits, unpack_bits

__all__ = ["TransposedVFormat", "pack_signed", "unpack_signed", "materialize", "fp8_codes", "fp8_bytes",
           "FP8_PAYLOADS", "FP8_LAYOUT_TAG"]

#: the physical-layout tag every schema of this layout records (``CacheSchema.extra``)
LAYOUT_TAG = "k_rows_signed+v_token_minor_signed"
#: the tag of the FP8 variant (FP8 bytes, K rows token-major, V token-minor)
FP8_LAYOUT_TAG = "k_rows_fp8+v_token_minor_fp8"


@dataclasses.dataclass(frozen=True)
class TransposedVFormat:
    """Static description of one layer in the transposed-V layout (hashable: a jit static / dispatch key).

    Attributes:
      bits: 8 or 4.
      qparam_dtype: scale storage ("fp16", "bf16" or "fp32"; "fp32" for FP8).
      fp8: "" (integer codes) or "e4m3" / "e5m2": FP8 codes (``bits`` 8), stored as their bytes (uint8, a bitcast
        of ``float8_e4m3fn`` / ``float8_e5m2``) in the same two arrays, with ONE float32 scale per KV head and
        tensor instead of per-token scales (the FP8 layout below).
    """

    bits: int
    qparam_dtype: str = "fp16"
    fp8: str = ""

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"transposed-V layout: bits must be 4 or 8, got {self.bits!r}")
        if self.fp8 not in FP8_PAYLOADS + ("",):
            raise ValueError(f"transposed-V layout: fp8 must be '' or one of {FP8_PAYLOADS}, got {self.fp8!r}")
        if self.fp8 and (self.bits, self.qparam_dtype) != (8, "fp32"):
            raise ValueError(f"transposed-V layout: FP8 codes are 8 bits with float32 per-head scales, got bits "
                             f"{self.bits}, qparam_dtype {self.qparam_dtype!r}")

    @property
    def payload(self) -> str:
        return self.fp8 or f"int{self.bits}"


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


def fp8_codes(codes_u8: jax.Array, fp8: str) -> jax.Array:
    """FP8 bytes (uint8) -> the ``float8_e4m3fn`` / ``float8_e5m2`` array they are (a bitcast, same shape)."""
    return jax.lax.bitcast_convert_type(codes_u8, fp8_dtype(fp8))


def fp8_bytes(codes: jax.Array) -> jax.Array:
    """Inverse of :func:`fp8_codes`: an FP8 array -> its bytes (uint8)."""
    return jax.lax.bitcast_convert_type(codes, jnp.uint8)



def materialize(fmt: TransposedVFormat, k_codes, v_codes, k_scale, v_scale, lengths):
    """Float32 ``(k, v, valid)``: ``k, v [B, Hkv, C, D]`` (rows at or past ``lengths[b]`` zero), ``valid [B, C]``.

    The reference view of the INT layout (transposes V back to token-major: for the oracle and the CPU path only;
    the FP8 variant's view is ``FP8Scheme.materialize_layer`` over :func:`fp8_codes`)."""
    b, h, c, packed_d = k_codes.shape
    d = packed_d * 8 // fmt.bits
    k = unpack_signed(k_codes, fmt.bits, axis=-1, count=d).astype(jnp.float32) * k_scale.astype(jnp.float32)
    vt = unpack_signed(v_codes, fmt.bits, axis=-1, count=c).astype(jnp.float32)          # [B, H, D, C]
    v = jnp.swapaxes(vt, 2, 3) * v_scale.astype(jnp.float32)
    valid = jnp.arange(c, dtype=jnp.int32)[None, :] < lengths[:, None]
    m = valid[:, None, :, None]
    return jnp.where(m, k, 0.0), jnp.where(m, v, 0.0), valid
