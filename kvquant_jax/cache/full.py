"""Full-precision cache (fp32 / bf16 / fp16): the baseline every quantized scheme is compared with."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.abi.regions import dense_operand, region
from kvquant_jax.cache import _rows
from kvquant_jax.cache import checks
from kvquant_jax.cache._rows import valid_rows  # noqa: F401  (re-exported)
from kvquant_jax.cache.interface import SchemeBase
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.dtypes import DTYPE_BYTES, DTYPES


@struct.dataclass
class FullLayerState:
    """k, v: ``[B, Hkv, C, D]`` in the scheme's dtype."""

    k: jax.Array
    v: jax.Array


def scatter_rows(buf: jax.Array, rows: jax.Array, start: jax.Array, num_new: jax.Array) -> jax.Array:
    """Write ``rows[b, :, t]`` to ``buf[b, :, start[b] + t]`` for ``t < num_new[b]``; other slots unchanged.

    buf: ``[B, H, C, ...]``; rows: ``[B, H, T, ...]`` (same trailing dims); start, num_new: int32 ``[B]``.
    Positions past capacity are dropped (the caller checks capacity on the host).  One in-place scatter.
    """
    t = rows.shape[2]
    pos = start[:, None] + _rows.arange_rows(t)[None, :]
    return _rows.write_rows(buf, rows, pos, _rows.new_row_mask(num_new, t))


@dataclasses.dataclass(frozen=True)
class FullPrecisionScheme(SchemeBase):
    """Store K and V unquantized in ``dtype`` ("fp32", "bf16" or "fp16")."""

    family = "full"

    def supports_window_append(self) -> bool:
        """Positions enter the append only as row indices: the default shifted window append is exact."""
        return True

    presets = {"fp32": {"dtype": "fp32"}, "bf16": {"dtype": "bf16"}, "fp16": {"dtype": "fp16"}}

    dtype: str = "fp32"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"full-precision cache dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self._check_identity()

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload=self.dtype, signed=True, zero="none", axis="tensor", qparam_dtype="none",
                           qparam_order="none")
        return CacheSchema(scheme="full", key=fmt, value=fmt, residual_dtype=self.dtype, **self._identity())

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        z = jnp.zeros((batch, num_kv_heads, capacity, head_dim), DTYPES[self.dtype])
        return FullLayerState(k=z, v=z)

    def append_layer(self, state, lengths, k, v, num_new):
        return FullLayerState(k=scatter_rows(state.k, _rows.head_major(k), lengths, num_new),
                              v=scatter_rows(state.v, _rows.head_major(v), lengths, num_new))

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        new = self.append_layer(state, lengths, k, v, num_new)
        # a finite fp32 row can overflow fp16 / bf16 storage: that row would decode to inf
        mask = _rows.new_row_mask(num_new, k.shape[1])[:, :, None, None]
        dt = DTYPES[self.dtype]
        fin = jnp.where(mask, jnp.isfinite(k.astype(dt)) & jnp.isfinite(v.astype(dt)), True)
        return new, jnp.all(fin, axis=(1, 2, 3))

    def materialize_layer(self, state, lengths):
        valid = valid_rows(lengths, state.k.shape[2])
        m = valid[:, None, :, None]
        k = jnp.where(m, state.k.astype(jnp.float32), jnp.float32(0))
        v = jnp.where(m, state.v.astype(jnp.float32), jnp.float32(0))
        return k, v, valid

    def validate_layer(self, state, lengths):
        checks.finite_rows("full-precision K", state.k, lengths)
        checks.finite_rows("full-precision V", state.v, lengths)

    def layer_nbytes(self, state):
        return {"residual": _rows.nbytes(state.k, state.v)}

    def decode_regions(self, state, lengths):
        """One dense region, rows ``[0, len)`` read in place."""
        return [region(dense_operand(state.k), dense_operand(state.v), lengths)], 0

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        n = batch * heads * rows * head_dim * DTYPE_BYTES[self.dtype]
        return {("residual", "k"): n, ("residual", "v"): n}
