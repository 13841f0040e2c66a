"""Full-precision cache (fp32 / bf16 / fp16): the baseline every quantized scheme is compared with."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.cache.interface import CacheScheme
from kvquant_jax.cache.schema import CacheSchema, TensorFormat

DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}


@struct.dataclass
class FullLayerState:
    """k, v: ``[B, Hkv, C, D]`` in the scheme's dtype."""

    k: jax.Array
    v: jax.Array


def scatter_rows(buf: jax.Array, rows: jax.Array, start: jax.Array, num_new: jax.Array) -> jax.Array:
    """Write ``rows[b, :, t]`` to ``buf[b, :, start[b] + t]`` for ``t < num_new[b]``; other slots unchanged.

    buf: ``[B, H, C, ...]``; rows: ``[B, H, T, ...]`` (same trailing dims); start, num_new: int32 ``[B]``.
    Positions past capacity are dropped (the caller checks capacity on the host).
    """
    t = rows.shape[2]
    cap = buf.shape[2]
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]            # [B, T]
    pos = jnp.where(jnp.arange(t)[None, :] < num_new[:, None], pos, cap)       # padding -> out of bounds (dropped)
    b_idx = jnp.arange(buf.shape[0])[:, None]
    moved = jnp.moveaxis(rows, 2, 1)                                           # [B, T, H, ...]
    out = jnp.moveaxis(buf, 2, 1).at[b_idx, pos].set(moved.astype(buf.dtype), mode="drop")
    return jnp.moveaxis(out, 1, 2)


def valid_rows(lengths: jax.Array, capacity: int) -> jax.Array:
    """bool ``[B, C]``: row ``i`` of sequence ``b`` is committed."""
    return jnp.arange(capacity, dtype=jnp.int32)[None, :] < lengths[:, None]


@dataclasses.dataclass(frozen=True)
class FullPrecisionScheme(CacheScheme):
    """Store K and V unquantized in ``dtype`` ("fp32", "bf16" or "fp16")."""

    dtype: str = "fp32"
    rope_theta: float = 10000.0
    rope_pairing: str = "half_split"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"full-precision cache dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload=self.dtype, signed=True, zero="none", axis="tensor", qparam_dtype="none",
                           qparam_order="none")
        return CacheSchema(scheme="full", key=fmt, value=fmt, residual_dtype=self.dtype,
                           rope_theta=self.rope_theta, rope_pairing=self.rope_pairing)

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        z = jnp.zeros((batch, num_kv_heads, capacity, head_dim), DTYPES[self.dtype])
        return FullLayerState(k=z, v=z)

    def append_layer(self, state, lengths, k, v, num_new):
        kt = jnp.swapaxes(k, 1, 2)  # [B, Hkv, T, D]
        vt = jnp.swapaxes(v, 1, 2)
        return FullLayerState(k=scatter_rows(state.k, kt, lengths, num_new),
                              v=scatter_rows(state.v, vt, lengths, num_new))

    def materialize_layer(self, state, lengths):
        valid = valid_rows(lengths, state.k.shape[2])
        m = valid[:, None, :, None]
        k = jnp.where(m, state.k.astype(jnp.float32), jnp.float32(0))
        v = jnp.where(m, state.v.astype(jnp.float32), jnp.float32(0))
        return k, v, valid

    def layer_nbytes(self, state):
        return {"residual": int(state.k.nbytes + state.v.nbytes)}
