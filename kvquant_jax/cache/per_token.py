"""Per-token symmetric INTb cache (INT8 / INT4 / INT2), optionally grouped along head_dim (design notes 0x05B).

Each K and V row of each head is quantized on its own (append-local: a new row never changes an old row's scale)::

    scale = max|x_group| / qmax  rounded to the qparam dtype   (qmax = 2^(b-1) - 1; all-zero group: scale 1)
    q     = clip(rint(x / scale), -qmax, qmax)                  (kvquant_jax.quant.symmetric)
    u     = q + 2^(b-1)   stored offset-binary, packed little-endian along head_dim

Layout (``layout_version`` 1): ``k_codes, v_codes: uint8 [B, Hkv, C, D*b/8]``; ``k_scale, v_scale:
[B, Hkv, C, D // G_d]`` in the qparam dtype (``G_d = group_size`` or ``D`` when 0); ``x = (u - 2^(b-1)) * scale``.
Too-narrow rows (stored scale would be subnormal) keep the sentinel scale 1 and zero codes (see
``_rows.split_status``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import SchemeBase
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.dtypes import DTYPE_BYTES, DTYPES
from kvquant_jax.quant.ledger import packed_bytes
from kvquant_jax.quant.packing import from_offset_binary, pack_bits, to_offset_binary, unpack_bits
from kvquant_jax.quant.symmetric import dequantize_symmetric, quantize_symmetric_with_status

QPARAM_DTYPES = DTYPES          # qparam storage names (the one table, kvquant_jax.quant.dtypes)


@struct.dataclass
class PerTokenLayerState:
    """Codes ``uint8 [B, Hkv, C, D*bits/8]`` (offset-binary, packed) and scales ``[B, Hkv, C, D // G_d]``."""

    k_codes: jax.Array
    v_codes: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


def check_packable(head_dim: int, bits: int, group: int, what: str) -> int:
    """Resolve the head-dim group size and check the packed layout is whole bytes."""
    g = group or head_dim
    if head_dim % g:
        raise ValueError(f"{what}: head_dim {head_dim} is not a multiple of the head-dim group size {g}")
    if (head_dim * bits) % 8:
        raise ValueError(f"{what}: head_dim {head_dim} * {bits} bits does not fill whole bytes")
    return g


@dataclasses.dataclass(frozen=True)
class PerTokenScheme(SchemeBase):
    """Per-token symmetric integer K and V.

    Attributes:
      bits: 2..8 (registry names "int8", "int4").
      group_size: head-dim elements sharing one scale (0: the whole head vector).
      qparam_dtype: "fp16" (default), "bf16" or "fp32" scale storage.
    """

    family = "per_token"

    def supports_window_append(self) -> bool:
        """Positions enter the append only as row indices: the default shifted window append is exact."""
        return True

    presets = {"int8": {"bits": 8}, "int4": {"bits": 4}, "int2": {"bits": 2}}
    aliases = {"head_dim_group_size": ("group_size",)}

    bits: int = 8
    group_size: int = 0
    qparam_dtype: str = "fp16"

    def __post_init__(self):
        if self.bits not in (2, 4, 8):
            raise ValueError(f"per_token: bits must be 2, 4 or 8 (whole-byte packing), got {self.bits!r}")
        if self.group_size < 0:
            raise ValueError(f"per_token: group_size must be >= 0, got {self.group_size}")
        if self.qparam_dtype not in QPARAM_DTYPES:
            raise ValueError(f"per_token: qparam_dtype must be one of {sorted(QPARAM_DTYPES)}")
        self._check_identity()

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload=f"int{self.bits}", signed=True, zero="none", axis="token",
                           group_size=self.group_size, qparam_dtype=self.qparam_dtype, qparam_order="scale")
        return CacheSchema(scheme="per_token", key=fmt, value=fmt, residual_dtype="none", **self._identity())

    def _group(self, head_dim: int) -> int:
        return check_packable(head_dim, self.bits, self.group_size, "per_token")

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        g = self._group(head_dim)
        half = 2 ** (self.bits - 1)
        codes = jnp.full((batch, num_kv_heads, capacity, head_dim * self.bits // 8),
                         _packed_byte(half, self.bits), jnp.uint8)
        scale = jnp.ones((batch, num_kv_heads, capacity, head_dim // g), QPARAM_DTYPES[self.qparam_dtype])
        return PerTokenLayerState(k_codes=codes, v_codes=codes, k_scale=scale, v_scale=scale)

    def _encode(self, x, mask):
        """x ``[B, H, T, D]`` -> (packed codes, scale, hard-bad ``[B]``)."""
        g = self._group(x.shape[-1])
        q, status = quantize_symmetric_with_status(x, self.bits, axis=-1, group_size=g,
                                                   qparam_dtype=QPARAM_DTYPES[self.qparam_dtype])
        narrow, hard = _rows.split_status(status)
        codes = pack_bits(to_offset_binary(q.codes, self.bits), self.bits, axis=-1)
        return codes, _rows.sentinel_scale(q.scale, narrow), _rows.any_bad_rows(hard, mask)

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        t = k.shape[1]
        mask = _rows.new_row_mask(num_new, t)
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]
        kc, ks, kbad = self._encode(_rows.head_major(k), mask)
        vc, vs, vbad = self._encode(_rows.head_major(v), mask)
        new = PerTokenLayerState(
            k_codes=_rows.write_rows(state.k_codes, kc, pos, mask),
            v_codes=_rows.write_rows(state.v_codes, vc, pos, mask),
            k_scale=_rows.write_rows(state.k_scale, ks, pos, mask),
            v_scale=_rows.write_rows(state.v_scale, vs, pos, mask))
        return new, ~(kbad | vbad)

    def append_layer(self, state, lengths, k, v, num_new):
        return self.append_layer_with_status(state, lengths, k, v, num_new)[0]

    def _decode(self, codes, scale, head_dim):
        u = unpack_bits(codes, self.bits, axis=-1, count=head_dim)
        return dequantize_symmetric(from_offset_binary(u, self.bits), scale, axis=-1, group_size=self._group(head_dim))

    def materialize_layer(self, state, lengths):
        return _rows.materialize_packed(state, lengths, self.bits, self._decode)

    def validate_layer(self, state, lengths):
        qmax = 2 ** (self.bits - 1) - 1
        half = 2 ** (self.bits - 1)
        for name, codes, scale in (("K", state.k_codes, state.k_scale), ("V", state.v_codes, state.v_scale)):
            u = checks.unpack_codes(codes, self.bits)
            checks.codes_in_range(f"per_token {name} codes", u, lengths, half - qmax, half + qmax)
            checks.positive_normal(f"per_token {name} scale", scale, lengths)

    def layer_nbytes(self, state):
        return _rows.packed_layer_nbytes(state)

    def decode_regions(self, state, lengths):
        """One region of packed symmetric codes with per-token scales (the materialize view for odd widths)."""
        return (_rows.packed_decode_regions(state, lengths, self.bits, "token", self.group_size)
                or super().decode_regions(state, lengths))

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        gd = self.group_size or head_dim
        return _rows.per_row_ledger(batch, heads, rows, packed_bytes(head_dim, self.bits),
                                    (head_dim // gd) * DTYPE_BYTES[self.qparam_dtype])


def _packed_byte(code: int, bits: int) -> int:
    """The byte holding ``8 // bits`` copies of ``code`` (so empty slots decode to q = 0)."""
    out = 0
    for i in range(8 // bits):
        out |= code << (i * bits)
    return out
