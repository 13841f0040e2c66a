"""QServe-style per-(token, head) asymmetric INT4 K/V cache with a floating fp16 offset (design notes 0x09C).

Every head vector of every K and V row gets its own fp16 ``(scale, offset)``; an append writes new metadata slots
and never touches old ones (append-local)::

    scale  = fp16((max - min) / 15);  offset = fp16(-min / ideal_scale)   (floating: not rounded, not clamped)
    u      = clip(rint(x / scale + offset), 0, 15);    x_hat = (u - offset) * scale

(``kvquant_jax.quant.qserve``).  Degenerate heads use the quantizer's ``"sentinel"`` policy (a kvquant_jax
extension, not QServe's): a constant or too-narrow head stores scale 1, offset ``-(min+max)/2`` and zero codes,
decoding to its midpoint.  Overflowing scales / non-finite offsets are hard failures (``ok = False``).

Layout: ``k_codes, v_codes: uint8 [B, Hkv, C, D/2]`` (u in [0, 15], two per byte, element ``i`` at bit ``4*(i%2)``);
``k_scale, k_offset, v_scale, v_offset: fp16 [B, Hkv, C]``.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.abi.regions import KVFormat, KVOperand, region
from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import SchemeBase
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.dtypes import DTYPE_BYTES
from kvquant_jax.quant.ledger import packed_bytes
from kvquant_jax.quant.packing import pack_bits, unpack_bits
from kvquant_jax.quant.qserve import dequantize_qserve, quantize_qserve_with_status

BITS = 4


@struct.dataclass
class QServeLayerState:
    k_codes: jax.Array
    v_codes: jax.Array
    k_scale: jax.Array
    k_offset: jax.Array
    v_scale: jax.Array
    v_offset: jax.Array


def dequantized_layer(ku, vu, kq, vq, lengths):
    """Float32 ``(k, v, valid)`` of a QServe layer from its unsigned codes ``ku, vu [B, Hkv, C, D]`` and ``kq, vq =
    (scale, offset)`` ``[B, Hkv, C]`` each: ``x = (u - offset) * scale``, rows at or past ``lengths`` zero."""
    valid = _rows.valid_rows(lengths, ku.shape[2])
    m = valid[:, None, :, None]
    k = jnp.where(m, dequantize_qserve(ku, *kq, axis=-1), jnp.float32(0))
    v = jnp.where(m, dequantize_qserve(vu, *vq, axis=-1), jnp.float32(0))
    return k, v, valid


def validate_qparams(what: str, kq, vq, lengths) -> None:
    """Visible QServe qparams ``(scale, offset)`` ``[B, Hkv, C]`` of K and V: scales finite positive normals,
    offsets finite (``what`` names the scheme in the error)."""
    for name, (scale, offset) in (("K", kq), ("V", vq)):
        checks.positive_normal(f"{what} {name} scale", scale[..., None], lengths)
        checks.finite_rows(f"{what} {name} offset", offset[..., None], lengths)


@dataclasses.dataclass(frozen=True)
class QServeScheme(SchemeBase):
    """QServe KV4: unsigned INT4 codes with fp16 scale + floating fp16 offset per (token, head)."""

    family = "qserve"

    def supports_window_append(self) -> bool:
        """Positions enter the append only as row indices: the default shifted window append is exact."""
        return True

    presets = {"qserve4": {}}

    def __post_init__(self):
        self._check_identity()

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload="uint4", signed=False, zero="float", axis="token", group_size=0,
                           qparam_dtype="fp16", qparam_order="scale,offset")
        return CacheSchema(scheme="qserve", key=fmt, value=fmt, residual_dtype="none",
                           extra=(("degenerate", "sentinel"),), **self._identity())

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        if head_dim % 2:
            raise ValueError(f"qserve: head_dim {head_dim} must be even (two INT4 codes per byte)")
        codes = jnp.zeros((batch, num_kv_heads, capacity, head_dim // 2), jnp.uint8)
        one = jnp.ones((batch, num_kv_heads, capacity), jnp.float16)
        zero = jnp.zeros((batch, num_kv_heads, capacity), jnp.float16)
        return QServeLayerState(k_codes=codes, v_codes=codes, k_scale=one, k_offset=zero, v_scale=one,
                                v_offset=zero)

    @staticmethod
    def _encode(x, mask):
        q, status = quantize_qserve_with_status(x, axis=-1, degenerate="sentinel", qparam_dtype=jnp.float16)
        _, hard = _rows.split_status(status)
        return pack_bits(q.codes, BITS, axis=-1), q.scale, q.offset, _rows.any_bad_rows(hard, mask)

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        t = k.shape[1]
        mask = _rows.new_row_mask(num_new, t)
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]
        kc, ks, ko, kbad = self._encode(_rows.head_major(k), mask)
        vc, vs, vo, vbad = self._encode(_rows.head_major(v), mask)
        w = _rows.write_rows
        new = QServeLayerState(
            k_codes=w(state.k_codes, kc, pos, mask), v_codes=w(state.v_codes, vc, pos, mask),
            k_scale=w(state.k_scale, ks, pos, mask), k_offset=w(state.k_offset, ko, pos, mask),
            v_scale=w(state.v_scale, vs, pos, mask), v_offset=w(state.v_offset, vo, pos, mask))
        return new, ~(kbad | vbad)

    def append_layer(self, state, lengths, k, v, num_new):
        return self.append_layer_with_status(state, lengths, k, v, num_new)[0]

    def materialize_layer(self, state, lengths):
        d = state.k_codes.shape[-1] * 2
        ku, vu = (unpack_bits(c, BITS, axis=-1, count=d) for c in (state.k_codes, state.v_codes))
        return dequantized_layer(ku, vu, (state.k_scale, state.k_offset), (state.v_scale, state.v_offset), lengths)

    def validate_layer(self, state, lengths):
        validate_qparams(self.family, (state.k_scale, state.k_offset), (state.v_scale, state.v_offset), lengths)

    def layer_nbytes(self, state):
        return {"codes": _rows.nbytes(state.k_codes, state.v_codes),
                "qparams": _rows.nbytes(state.k_scale, state.k_offset, state.v_scale, state.v_offset)}

    def decode_regions(self, state, lengths):
        """One region: INT4 codes, per-(token, head) scale and floating offset passed as ``[B, Hkv, C, 1]``."""
        f = KVFormat("int4", "token", "offset")
        return [region(KVOperand(state.k_codes, state.k_scale[..., None], state.k_offset[..., None], f),
                       KVOperand(state.v_codes, state.v_scale[..., None], state.v_offset[..., None], f),
                       lengths)], 0

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        return _rows.per_row_ledger(batch, heads, rows, packed_bytes(head_dim, BITS),
                                    2 * DTYPE_BYTES["fp16"])                           # (scale, offset)
