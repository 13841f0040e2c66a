"""The KVQuant layer layout, its static kernel format and its float32 decode (the kernel ABI of ``kvquant``).

Layout (``layout_version`` 1; head-major ``[B, Hkv, C, ...]``, row ``i`` = logical position ``i``; see
:mod:`kvquant_jax.cache.kvquant` for the quantizer that writes it)::

    k_codes   uint8 [B, Hkv, C, D*b_k/8]     codes packed along D (kvquant_jax.quant.packing stream layout)
    k_sp_idx  uint8 [B, Hkv, C, cap_k]       outlier channels, ascending; 255 = unused slot (so D <= 255)
    k_sp_val  sparse_dtype [B, Hkv, C, cap_k] full stored-stage values (0 in unused slots)
    v_codes   uint8 [B, Hkv, C, D*b_v/8]
    v_scale, v_offset  qparam_dtype [B, Hkv, C, 1]
    v_sp_idx, v_sp_val [B, Hkv, C, v_outliers]   as for keys
    k_sink, v_sink     residual_dtype [B, Hkv, sink, D]
    pos       int32 [B, C]                   logical position of every row (the RoPE angle of a pre-RoPE key)
    k_scale, k_zero    float32 [Hkv, D]      calibrated per-channel state (unbatched)
    k_codebook float32 [2**b_k], v_codebook float32 [2**b_v]   per-layer signposts (unbatched)

Decoded: ``x_k = codebook_k[u] * scale_c + zero_c``, ``x_v = codebook_v[u] * scale_t + offset_t``, then the
sparse slots REPLACE their coordinates (exact holes); sink rows ``p < sink`` are read from ``k_sink / v_sink``.
With ``KVQuantFormat.rope != "none"`` the stored keys are pre-RoPE and a consumer rotates row ``n`` at ``pos[n]``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.abi.rope import apply_rope
from kvquant_jax.quant.nuq import dequantize_nuq, nuq_decode
from kvquant_jax.quant.packing import unpack_bits
from kvquant_jax.quant.sparse import SparseOutliers, merge_dense_sparse

__all__ = ["KVQuantLayerState", "KVQuantFormat", "UNUSED", "sparse_from", "decode_stored", "rotate_keys",
           "materialize"]

UNUSED = 255                      # sparse index of an unused slot
ROPES = ("half_split", "interleaved", "none")


@struct.dataclass
class KVQuantLayerState:
    """One KVQuant layer (see the module docstring for shapes and meaning)."""

    k_codes: jax.Array
    k_sp_idx: jax.Array
    k_sp_val: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array
    v_offset: jax.Array
    v_sp_idx: jax.Array
    v_sp_val: jax.Array
    k_sink: jax.Array
    v_sink: jax.Array
    pos: jax.Array
    k_scale: jax.Array
    k_zero: jax.Array
    k_codebook: jax.Array
    v_codebook: jax.Array


@dataclasses.dataclass(frozen=True)
class KVQuantFormat:
    """Static description of a KVQuant layer for a consumer (hashable: a static jit argument).

    Attributes:
      k_bits, v_bits: code widths (1..4).
      k_sparse_capacity, v_outliers: sparse slots per row (K, V).
      sink: leading positions stored full precision in ``k_sink / v_sink``.
      rope: RoPE pairing of the rotation a consumer applies to stored keys at ``pos`` ("half_split",
        "interleaved"), or "none" when the stored keys are already post-RoPE.
      rope_theta: the model's RoPE base.
    """

    k_bits: int
    v_bits: int
    k_sparse_capacity: int = 0
    v_outliers: int = 0
    sink: int = 0
    rope: str = "half_split"
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.rope not in ROPES:
            raise ValueError(f"KVQuantFormat.rope must be one of {ROPES}, got {self.rope!r}")


def sparse_from(indices_u8, values) -> SparseOutliers:
    """Stored (uint8 index, value) slots -> :class:`SparseOutliers` (int32 indices, -1 unused)."""
    idx = indices_u8.astype(jnp.int32)
    used = idx != UNUSED
    z = jnp.zeros(idx.shape[:-1], jnp.int32)
    return SparseOutliers(jnp.where(used, idx, -1), jnp.where(used, values.astype(jnp.float32), 0.0), z, z)


def rotate_keys(k_bhcd, pos_bc, theta, pairing, inverse=False):
    """RoPE of head-major keys ``[B, H, C, D]`` at per-row positions ``[B, C]``."""
    k = jnp.swapaxes(k_bhcd, 1, 2)
    return jnp.swapaxes(apply_rope(k, pos_bc, theta, pairing, inverse=inverse), 1, 2)


def decode_stored(fmt: KVQuantFormat, state: KVQuantLayerState, lengths):
    """Stored-stage view: ``(k, v, valid, pos)``; ``k`` PRE-RoPE when ``fmt.rope != "none"``.

    float32 ``[B, Hkv, C, D]`` twice, bool ``[B, C]``, int32 ``[B, C]``; rows at or past ``lengths`` are zero.
    """
    d = state.k_sink.shape[-1]
    capacity = state.k_codes.shape[2]
    k = (nuq_decode(unpack_bits(state.k_codes, fmt.k_bits, axis=-1, count=d), state.k_codebook)
         * state.k_scale[None, :, None, :] + state.k_zero[None, :, None, :])
    v = dequantize_nuq(unpack_bits(state.v_codes, fmt.v_bits, axis=-1, count=d), state.v_scale,
                       state.v_offset, state.v_codebook, axis=-1)
    if fmt.k_sparse_capacity:
        k = merge_dense_sparse(k, sparse_from(state.k_sp_idx, state.k_sp_val))
    if fmt.v_outliers:
        v = merge_dense_sparse(v, sparse_from(state.v_sp_idx, state.v_sp_val))
    rows = jnp.arange(capacity, dtype=jnp.int32)
    if fmt.sink:
        n = min(fmt.sink, capacity)
        in_sink = (rows < n)[None, None, :, None]
        pad = [(0, 0), (0, 0), (0, capacity - n), (0, 0)]
        k = jnp.where(in_sink, jnp.pad(state.k_sink[:, :, :n].astype(jnp.float32), pad), k)
        v = jnp.where(in_sink, jnp.pad(state.v_sink[:, :, :n].astype(jnp.float32), pad), v)
    valid = rows[None, :] < lengths[:, None]
    m = valid[:, None, :, None]
    return jnp.where(m, k, 0.0), jnp.where(m, v, 0.0), valid, jnp.where(valid, state.pos, 0)


def materialize(fmt: KVQuantFormat, state: KVQuantLayerState, lengths):
    """POST-RoPE keys (stored pre-RoPE keys rotated at their positions), values, valid rows: float32
    ``[B, Hkv, C, D]`` twice and bool ``[B, C]``."""
    k, v, valid, pos = decode_stored(fmt, state, lengths)
    if fmt.rope != "none":
        k = jnp.where(valid[:, None, :, None], rotate_keys(k, pos, fmt.rope_theta, fmt.rope), 0.0)
    return k, v, valid
