"""Worked example of adding a cache scheme (docs/architecture.md, "Adding a scheme"): ONE new file.

``K16V8Scheme``: keys in float16, values INT8 per token (symmetric, one fp16 scale per row and head).  The class
owns everything a consumer needs -- its schema, its state, append / materialize, its decode regions (kernel ABI),
its byte formula and its registry presets -- so the only other edit is one entry in
``kvquant_jax.cache.registry.SCHEME_CLASSES``; dispatch, the ledger and serialization then serve it unchanged.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.abi.regions import KVFormat, KVOperand, dense_operand, region
from kvquant_jax.cache.interface import SchemeBase, rows_finite
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.packing import from_offset_binary, to_offset_binary
from kvquant_jax.quant.symmetric import dequantize_symmetric, quantize_symmetric


@struct.dataclass
class K16V8LayerState:
    """``k: float16 [B, Hkv, C, D]``; ``v_codes: uint8 [B, Hkv, C, D]`` (offset-binary INT8);
    ``v_scale: float16 [B, Hkv, C, 1]``."""

    k: jax.Array
    v_codes: jax.Array
    v_scale: jax.Array


def _write(buf, rows, lengths, num_new):
    """``buf[b, :, lengths[b] + t] = rows[b, :, t]`` for ``t < num_new[b]`` (``rows [B, H, T, ...]``)."""
    b, h, n = buf.shape[:3]
    t = jnp.arange(rows.shape[2], dtype=jnp.int32)[None, :]
    idx = jnp.where(t < num_new[:, None], lengths[:, None] + t, n)
    return buf.at[jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None], idx[:, None, :]].set(
        rows.astype(buf.dtype), mode="drop")


@dataclasses.dataclass(frozen=True)
class K16V8Scheme(SchemeBase):
    """FP16 keys, INT8 per-token values (a toy scheme: the contract, not a recommendation)."""

    family = "k16v8"
    presets = {"k16v8": {}}

    @property
    def schema(self) -> CacheSchema:
        key = TensorFormat(payload="fp16", signed=True, zero="none", axis="tensor", qparam_dtype="none",
                           qparam_order="none")
        value = TensorFormat(payload="int8", signed=True, zero="none", axis="token", qparam_dtype="fp16")
        return CacheSchema(scheme="k16v8", key=key, value=value, residual_dtype="fp16", **self._identity())

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        lead = (batch, num_kv_heads, capacity)
        return K16V8LayerState(k=jnp.zeros(lead + (head_dim,), jnp.float16),
                               v_codes=jnp.full(lead + (head_dim,), 128, jnp.uint8),
                               v_scale=jnp.ones(lead + (1,), jnp.float16))

    def append_layer(self, state, lengths, k, v, num_new):
        q = quantize_symmetric(jnp.swapaxes(v, 1, 2), 8, axis=-1, qparam_dtype=jnp.float16)
        return K16V8LayerState(k=_write(state.k, jnp.swapaxes(k, 1, 2), lengths, num_new),
                               v_codes=_write(state.v_codes, to_offset_binary(q.codes, 8), lengths, num_new),
                               v_scale=_write(state.v_scale, q.scale, lengths, num_new))

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        return self.append_layer(state, lengths, k, v, num_new), rows_finite(k, v, num_new)

    def materialize_layer(self, state, lengths):
        valid = jnp.arange(state.k.shape[2])[None, :] < lengths[:, None]
        m = valid[:, None, :, None]
        v = dequantize_symmetric(from_offset_binary(state.v_codes, 8), state.v_scale, axis=-1)
        return jnp.where(m, state.k.astype(jnp.float32), 0.0), jnp.where(m, v, 0.0), valid

    def layer_nbytes(self, state):
        return {"residual": int(state.k.nbytes), "codes": int(state.v_codes.nbytes),
                "qparams": int(state.v_scale.nbytes)}

    # --- the consumers' part of the contract ---
    def decode_regions(self, state, lengths):
        """One region read in place: dense fp16 keys, INT8 values with their per-token scales."""
        v = KVOperand(state.v_codes, state.v_scale, None, KVFormat("int8", "token", "symmetric"))
        return [region(dense_operand(state.k), v, lengths)], 0

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        n = batch * heads * rows
        return {("residual", "k"): n * head_dim * 2, ("codes", "v"): n * head_dim, ("qparams", "v"): n * 2}
