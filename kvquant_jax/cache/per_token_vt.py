"""Per-token symmetric INT8 / INT4 in the transposed-V layout the Mosaic GPU decode kernel reads in place.

Same quantizer and the same codes and scales as :class:`kvquant_jax.cache.per_token.PerTokenScheme` with
``group_size=0`` (one scale per token and head); only the bytes are arranged differently
(:mod:`kvquant_jax.abi.transposed_v`): two's-complement codes, K rows token-major ``[B, Hkv, C, D*b/8]``, V
token-minor ``[B, Hkv, D, C*b/8]``.  Registry names ``int8_vt`` / ``int4_vt``.

Why a separate layout: the Pallas Triton kernel (``layout_version`` 1, offset-binary, V token-major) unpacks each
code and sends it through shared memory; the Mosaic GPU kernel wants V^T as the wgmma register-A operand, which needs
tokens contiguous.  Converting layout-1 codes every step would read and write the whole cache again, so the cache
stores the kernel's layout and pays at append time instead: one token is one K row (a byte-aligned row write, as
before) plus one strided V column per head; for INT4 two tokens share a V byte, so the append is a nibble
read-modify-write of that byte (even and odd positions in two passes, so no two writes of a pass meet; the old
token's nibble is preserved, hence no slot visible at the old length changes value).

Decode: ``attention.dispatch`` routes the layer by its format type (:meth:`fused_decode_operand`) to
``pallas_kernels.decode_attention_mgpu.decode_attention_transposed_v`` on a GPU with Mosaic GPU (sm_90), or to the
warp-specialized ``decode_attention_mgpu_ws.decode_attention_transposed_v_ws`` where the tuning table
(``pallas_kernels.decode_tuning``) measured it faster; anywhere else (CPU, other shapes) the layer is read through
its materialize view, exact.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.abi import transposed_v as tv
from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import SchemeBase
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.dtypes import DTYPE_BYTES, DTYPES
from kvquant_jax.quant.ledger import packed_bytes
from kvquant_jax.quant.symmetric import quantize_symmetric_with_status


@struct.dataclass
class TransposedVLayerState:
    """``k_codes uint8 [B, Hkv, C, D*b/8]``, ``v_codes uint8 [B, Hkv, D, C*b/8]`` (two's complement, see
    :mod:`kvquant_jax.abi.transposed_v`), ``k_scale, v_scale [B, Hkv, C, 1]`` in the qparam dtype."""

    k_codes: jax.Array
    v_codes: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


def _write_token_columns(buf: jax.Array, q: jax.Array, pos: jax.Array, keep: jax.Array, bits: int) -> jax.Array:
    """Write signed codes ``q [B, H, T, D]`` of tokens at positions ``pos [B, T]`` (where ``keep``) into the
    token-minor buffer ``buf uint8 [B, H, D, C*bits/8]``; every other code keeps its value.

    The buffer is viewed as ``[B*H*D, bytes]`` (a bitcast) and written by scatters of single bytes indexed on
    both axes, so every write stays in place in the donated buffer."""
    b, h, d, nbytes = buf.shape
    t = q.shape[2]
    per = 8 // bits
    mask = (1 << bits) - 1
    flat = buf.reshape(b * h * d, nbytes)
    u = jnp.swapaxes(jnp.bitwise_and(q.astype(jnp.int32), mask).astype(jnp.uint8), 2, 3)   # [B, H, D, T] (new rows)
    row = jnp.arange(b * h * d, dtype=jnp.int32).reshape(b, h, d, 1)
    row = jnp.broadcast_to(row, (b, h, d, t))
    for lane in range(per):                       # one pass per nibble lane: the bytes a pass writes are distinct
        sel = keep & (pos % per == lane) if per > 1 else keep
        col = jnp.broadcast_to(jnp.where(sel, pos // per, jnp.int32(nbytes))[:, None, None, :], (b, h, d, t))
        if per == 1:
            flat = flat.at[row, col].set(u, mode="drop")
            continue
        # clear the lane's nibble, then add the code into it: two in-place scatters that read nothing but their
        # own operand (a gather + set of the same bytes fuses into one scatter that copies the whole buffer)
        keep_bits = ~(mask << (lane * bits)) & 0xFF
        flat = flat.at[row, col].apply(lambda x, kb=keep_bits: jnp.bitwise_and(x, np.uint8(kb)), mode="drop")
        flat = flat.at[row, col].add(jnp.left_shift(u, jnp.uint8(lane * bits)), mode="drop")
    return flat.reshape(b, h, d, nbytes)


@dataclasses.dataclass(frozen=True)
class TransposedVPerTokenScheme(SchemeBase):
    """Per-token symmetric INT K and V, stored for the Mosaic GPU kernel (module doc).

    Attributes:
      bits: 8 or 4 (registry names "int8_vt", "int4_vt").
      qparam_dtype: "fp16" (default), "bf16" or "fp32" scale storage.
    """

    family = "per_token_vt"

    def supports_window_append(self) -> bool:
        """Positions enter the append only as row indices: the default shifted window append is exact."""
        return True

    presets = {"int8_vt": {"bits": 8}, "int4_vt": {"bits": 4}}

    bits: int = 4
    qparam_dtype: str = "fp16"
    kernel_family: str = "mosaic_gpu_swap_ab"

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"per_token_vt: bits must be 4 or 8, got {self.bits!r}")
        if self.qparam_dtype not in DTYPES:
            raise ValueError(f"per_token_vt: qparam_dtype must be one of {sorted(DTYPES)}")
        self._check_identity()

    @property
    def kernel_format(self) -> tv.TransposedVFormat:
        return tv.TransposedVFormat(bits=self.bits, qparam_dtype=self.qparam_dtype)

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload=f"int{self.bits}", signed=True, zero="none", axis="token", group_size=0,
                           qparam_dtype=self.qparam_dtype, qparam_order="scale")
        return CacheSchema(scheme=self.family, key=fmt, value=fmt, residual_dtype="none",
                           extra=(("physical_layout", tv.LAYOUT_TAG),), **self._identity())

    def _check_dims(self, head_dim: int, capacity: int) -> None:
        per = 8 // self.bits
        if head_dim % per or capacity % per:
            raise ValueError(f"per_token_vt: head_dim {head_dim} and capacity {capacity} must be multiples of "
                             f"{per} (INT{self.bits} packs {per} codes per byte along D for K and along the "
                             "token axis for V)")

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        self._check_dims(head_dim, capacity)
        nb = 8 // self.bits
        k = jnp.zeros((batch, num_kv_heads, capacity, head_dim // nb), jnp.uint8)
        v = jnp.zeros((batch, num_kv_heads, head_dim, capacity // nb), jnp.uint8)
        scale = jnp.ones((batch, num_kv_heads, capacity, 1), DTYPES[self.qparam_dtype])
        return TransposedVLayerState(k_codes=k, v_codes=v, k_scale=scale, v_scale=scale)

    def _quantize(self, x, mask):
        """x ``[B, H, T, D]`` -> (signed codes int8, scale ``[B, H, T, 1]``, hard-bad ``[B]``)."""
        q, status = quantize_symmetric_with_status(x, self.bits, axis=-1, group_size=x.shape[-1],
                                                   qparam_dtype=DTYPES[self.qparam_dtype])
        narrow, hard = _rows.split_status(status)
        return q.codes, _rows.sentinel_scale(q.scale, narrow), _rows.any_bad_rows(hard, mask)

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        t = k.shape[1]
        mask = _rows.new_row_mask(num_new, t)
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]
        kq, ks, kbad = self._quantize(_rows.head_major(k), mask)
        vq, vs, vbad = self._quantize(_rows.head_major(v), mask)
        new = TransposedVLayerState(
            k_codes=_rows.write_rows(state.k_codes, tv.pack_signed(kq, self.bits, axis=-1), pos, mask),
            v_codes=_write_token_columns(state.v_codes, vq, pos, mask, self.bits),
            k_scale=_rows.write_rows(state.k_scale, ks, pos, mask),
            v_scale=_rows.write_rows(state.v_scale, vs, pos, mask))
        return new, ~(kbad | vbad)

    def append_layer(self, state, lengths, k, v, num_new):
        return self.append_layer_with_status(state, lengths, k, v, num_new)[0]

    def materialize_layer(self, state, lengths):
        return tv.materialize(self.kernel_format, state.k_codes, state.v_codes, state.k_scale, state.v_scale,
                              lengths)

    def validate_layer(self, state, lengths):
        qmax = 2 ** (self.bits - 1) - 1
        c = state.k_codes.shape[-2]
        kq = tv.unpack_signed(state.k_codes, self.bits, axis=-1)
        vq = jnp.swapaxes(tv.unpack_signed(state.v_codes, self.bits, axis=-1, count=c), -1, -2)
        for name, codes, scale in (("K", kq, state.k_scale), ("V", vq, state.v_scale)):
            checks.codes_in_range(f"per_token_vt {name} codes", codes, lengths, -qmax, qmax)
            checks.positive_normal(f"per_token_vt {name} scale", scale, lengths)

    def layer_nbytes(self, state):
        return _rows.packed_layer_nbytes(state)

    def fused_decode_operand(self, state, lengths):
        """``(TransposedVFormat, state)``: the Mosaic GPU kernel reads the layer in place."""
        del lengths
        return self.kernel_format, state

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        return _rows.per_row_ledger(batch, heads, rows, packed_bytes(head_dim, self.bits),
                                    DTYPE_BYTES[self.qparam_dtype])
