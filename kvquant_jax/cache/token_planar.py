"""Per-token INT2 / INT4 (symmetric; QServe's floating offset) in the token-planar layout the Mosaic GPU kernel reads.

Same quantizer, codes and scales as :class:`kvquant_jax.cache.per_token.PerTokenScheme` with ``group_size=0`` (one
scale per token and head: ``q = clip(rint(x / s), -qmax, qmax)``, stored offset-binary ``u = q + 2^(bits-1)``); only
the bytes are arranged differently (:mod:`kvquant_jax.abi.token_planar`): codes packed along *tokens*, planar in
blocks of ``BT = plane_rows * 8/bits`` tokens, V codes transposed, one scale per (token, head) in ``[B, Hkv, C]`` (tokens contiguous).  Registry names
``int2_planar`` / ``int4_planar``.  :class:`QServePlanarScheme` (``qserve4_planar``) does the same for
:class:`kvquant_jax.cache.qserve.QServeScheme`'s codes, scales and floating offsets.

Why a separate layout: Mosaic GPU has no 2-bit register type, so the layout-1 INT2 cache (codes packed along
head_dim) is read only by the Pallas Triton kernel, which unpacks every code through shared memory (1.71x cuDNN at
32K on the H200, slower than cuDNN at 4K); the token-planar kernel (``pallas_kernels.decode_attention_mgpu_planar``)
turns each byte tile into 8/bits wgmma tiles with one AND per plane.  Converting layout-1 codes every step would
read and write every code again, so the cache pays at append time: one token writes one plane of a byte row of K
and one plane of a strided byte column per channel of V^T (a read-modify-write of that plane's bits: the other
planes' tokens, possibly committed, keep their value) and one column of each scale row.

Decode: :meth:`fused_decode_operand` hands the layer to ``attention.dispatch``, which routes it by format type to the
Mosaic GPU kernel on a GPU with Mosaic GPU (sm_90) where the kernel takes the shape; anywhere else the layer is
read through its exact materialize view.

Shapes: the capacity (and a paged cache's page size) must be a multiple of ``BT`` (256 tokens for INT2, 128 for
INT4 with the kernel's ``plane_rows = 64``).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.abi import kivi_planar as kp
from kvquant_jax.abi import token_planar as tp
from kvquant_jax.cache import _rows, checks
from kvquant_jax.cache.interface import SchemeBase
from kvquant_jax.cache.kivi_planar import _write_columns
from kvquant_jax.cache.qserve import dequantized_layer, validate_qparams
from kvquant_jax.cache.schema import CacheSchema, TensorFormat
from kvquant_jax.quant.dtypes import DTYPE_BYTES, DTYPES
from kvquant_jax.quant.ledger import packed_bytes
from kvquant_jax.quant.qserve import quantize_qserve_with_status
from kvquant_jax.quant.symmetric import quantize_symmetric_with_status


@struct.dataclass
class TokenPlanarLayerState:
    """``k_codes uint8 [B, Hkv, C/P, D]``, ``v_codes uint8 [B, Hkv, D, C/P]`` (token-planar, see
    :mod:`kvquant_jax.abi.token_planar`), ``k_scale, v_scale [B, Hkv, C]`` in the qparam dtype."""

    k_codes: jax.Array
    v_codes: jax.Array
    k_scale: jax.Array
    v_scale: jax.Array


@dataclasses.dataclass(frozen=True)
class TokenPlanarScheme(SchemeBase):
    """Per-token symmetric INT2 / INT4 K and V, stored token-planar for the Mosaic GPU kernel (module doc).

    Attributes:
      bits: 2 or 4 (registry names "int2_planar", "int4_planar").
      qparam_dtype: "fp16" (default), "bf16" or "fp32" scale storage.
      plane_rows: tokens per plane of a block (64 for the Mosaic GPU kernel; smaller values are for tests).
    """

    family = "token_planar"
    presets = {"int2_planar": {"bits": 2}, "int4_planar": {"bits": 4}}

    bits: int = 2
    qparam_dtype: str = "fp16"
    plane_rows: int = 64
    kernel_family: str = "mosaic_gpu_token_planar"

    def __post_init__(self):
        if self.bits not in (2, 4):
            raise ValueError(f"token_planar: bits must be 2 or 4, got {self.bits!r}")
        if self.qparam_dtype not in DTYPES:
            raise ValueError(f"token_planar: qparam_dtype must be one of {sorted(DTYPES)}")
        if not isinstance(self.plane_rows, int) or self.plane_rows < 1:
            raise ValueError(f"token_planar: plane_rows must be an int >= 1, got {self.plane_rows!r}")
        self._check_identity()

    def supports_window_append(self) -> bool:
        """Positions enter the append only as row indices: the default shifted window append is exact."""
        return True

    @property
    def block_t(self) -> int:
        return self.kernel_format.block_t

    @property
    def kernel_format(self) -> tp.TokenPlanarFormat:
        return tp.TokenPlanarFormat(bits=self.bits, plane_rows=self.plane_rows, qparam_dtype=self.qparam_dtype)

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload=f"int{self.bits}", signed=True, zero="none", axis="token", group_size=0,
                           qparam_dtype=self.qparam_dtype, qparam_order="scale")
        return CacheSchema(scheme=self.family, key=fmt, value=fmt, residual_dtype="none",
                           extra=(("physical_layout", tp.LAYOUT_TAG), ("plane_rows", str(self.plane_rows))),
                           **self._identity())

    # ----- state -----
    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        why = self.kernel_format.capacity_unsupported(capacity)
        if why:
            raise ValueError(f"{self.family}: {why}")
        nr = capacity * self.bits // 8
        k = jnp.zeros((batch, num_kv_heads, nr, head_dim), jnp.uint8)
        v = jnp.zeros((batch, num_kv_heads, head_dim, nr), jnp.uint8)
        scale = jnp.ones((batch, num_kv_heads, capacity), DTYPES[self.qparam_dtype])
        return TokenPlanarLayerState(k_codes=k, v_codes=v, k_scale=scale, v_scale=scale)

    def _quantize(self, x, mask):
        """x ``[B, H, T, D]`` -> (offset-binary codes ``u`` int32, scale ``[B, H, T, 1]``, hard-bad ``[B]``)."""
        q, status = quantize_symmetric_with_status(x, self.bits, axis=-1, group_size=x.shape[-1],
                                                   qparam_dtype=DTYPES[self.qparam_dtype])
        narrow, hard = _rows.split_status(status)
        u = q.codes.astype(jnp.int32) + 2 ** (self.bits - 1)
        return u, _rows.sentinel_scale(q.scale, narrow), _rows.any_bad_rows(hard, mask)

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        t = k.shape[1]
        mask = _rows.new_row_mask(num_new, t)
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]
        ku, ks, kbad = self._quantize(_rows.head_major(k), mask)
        vu, vs, vbad = self._quantize(_rows.head_major(v), mask)
        b, r = self.bits, self.plane_rows
        new = TokenPlanarLayerState(
            k_codes=kp.write_planar(state.k_codes, ku, pos, mask, b, r, token_axis=2),
            v_codes=kp.write_planar(state.v_codes, vu, pos, mask, b, r, token_axis=3),
            k_scale=_rows.write_rows(state.k_scale, ks[..., 0], pos, mask),
            v_scale=_rows.write_rows(state.v_scale, vs[..., 0], pos, mask))
        return new, ~(kbad | vbad)

    def append_layer(self, state, lengths, k, v, num_new):
        return self.append_layer_with_status(state, lengths, k, v, num_new)[0]

    def _codes(self, state):
        """The unsigned codes ``u [B, H, C, D]`` int32 of K and V, token-major."""
        return (kp.unpack_token_planar(state.k_codes, self.bits, self.plane_rows, xp=jnp),
                kp.unpack_token_planar(jnp.swapaxes(state.v_codes, 2, 3), self.bits, self.plane_rows, xp=jnp))

    def _signed(self, state):
        """Signed codes ``[B, H, C, D]`` int32 of K and V (token-major) and their scales ``[B, H, C, 1]``."""
        half = 2 ** (self.bits - 1)
        ku, vu = self._codes(state)
        return ku - half, vu - half, state.k_scale[..., None], state.v_scale[..., None]

    def materialize_layer(self, state, lengths):
        kq, vq, ks, vs = self._signed(state)
        valid = _rows.valid_rows(lengths, kq.shape[2])
        m = valid[:, None, :, None]
        f32 = jnp.float32
        k = jnp.where(m, kq.astype(f32) * ks.astype(f32), f32(0))
        v = jnp.where(m, vq.astype(f32) * vs.astype(f32), f32(0))
        return k, v, valid

    def validate_layer(self, state, lengths):
        qmax = 2 ** (self.bits - 1) - 1
        kq, vq, ks, vs = self._signed(state)
        for name, codes, scale in (("K", kq, ks), ("V", vq, vs)):
            checks.codes_in_range(f"token_planar {name} codes", codes, lengths, -qmax, qmax)
            checks.positive_normal(f"token_planar {name} scale", scale, lengths)

    def layer_nbytes(self, state):
        return _rows.packed_layer_nbytes(state)

    def fused_decode_operand(self, state, lengths):
        """``(TokenPlanarFormat, TokenPlanarOperand)``: the stored layer read in place, rows ``[0, lengths)``."""
        return self.kernel_format, tp.TokenPlanarOperand(
            k_codes=state.k_codes, v_codes=state.v_codes, k_qparams=state.k_scale, v_scale=state.v_scale,
            v_offset=None, end=lengths.astype(jnp.int32))

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        return _rows.per_row_ledger(batch, heads, rows, packed_bytes(head_dim, self.bits),
                                    DTYPE_BYTES[self.qparam_dtype])



@struct.dataclass
class QServePlanarLayerState:
    """``k_codes uint8 [B, Hkv, C/2, D]``, ``v_codes uint8 [B, Hkv, D, C/2]`` (token-planar INT4),
    ``k_qparams fp16 [B, Hkv, 2, C]`` (row 0 scale, row 1 offset), ``v_scale, v_offset fp16 [B, Hkv, C]``."""

    k_codes: jax.Array
    v_codes: jax.Array
    k_qparams: jax.Array
    v_scale: jax.Array
    v_offset: jax.Array


@dataclasses.dataclass(frozen=True)
class QServePlanarScheme(TokenPlanarScheme):
    """QServe KV4 (unsigned INT4 codes, fp16 scale + floating fp16 offset per (token, head): the quantizer, sentinel
    policy and status of :class:`kvquant_jax.cache.qserve.QServeScheme`) stored token-planar for the Mosaic GPU
    planar kernel (registry name ``qserve4_planar``); ``x = (u - offset) * scale``.  The K scale and offset share
    one array (one TMA tile per block); V's are two rows of their own."""

    family = "qserve_planar"
    presets = {"qserve4_planar": {}}

    bits: int = 4
    qparam_dtype: str = "fp16"

    def __post_init__(self):
        if (self.bits, self.qparam_dtype) != (4, "fp16"):
            raise ValueError(f"qserve_planar: QServe KV4 is 4-bit with fp16 qparams, got bits {self.bits!r}, "
                             f"qparam_dtype {self.qparam_dtype!r}")
        super().__post_init__()

    @property
    def kernel_format(self) -> tp.TokenPlanarFormat:
        return tp.TokenPlanarFormat(bits=4, zero="offset", plane_rows=self.plane_rows, qparam_dtype="fp16")

    @property
    def schema(self) -> CacheSchema:
        fmt = TensorFormat(payload="uint4", signed=False, zero="float", axis="token", group_size=0,
                           qparam_dtype="fp16", qparam_order="scale,offset")
        return CacheSchema(scheme=self.family, key=fmt, value=fmt, residual_dtype="none",
                           extra=(("degenerate", "sentinel"), ("physical_layout", tp.LAYOUT_TAG),
                                  ("plane_rows", str(self.plane_rows))), **self._identity())

    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        st = super().init_layer(batch, capacity, num_kv_heads, head_dim)
        zero = jnp.zeros_like(st.k_scale)
        return QServePlanarLayerState(k_codes=st.k_codes, v_codes=st.v_codes,
                                      k_qparams=jnp.stack([st.k_scale, zero], axis=2), v_scale=st.v_scale,
                                      v_offset=zero)

    @staticmethod
    def _encode(x, mask):
        """x ``[B, H, T, D]`` -> (codes ``u`` uint8, scale, offset ``[B, H, T, 1]`` fp16, hard-bad ``[B]``)."""
        q, status = quantize_qserve_with_status(x, axis=-1, degenerate="sentinel", qparam_dtype=jnp.float16)
        _, hard = _rows.split_status(status)
        return q.codes, q.scale[..., None], q.offset[..., None], _rows.any_bad_rows(hard, mask)

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        t = k.shape[1]
        mask = _rows.new_row_mask(num_new, t)
        pos = lengths[:, None] + _rows.arange_rows(t)[None, :]
        ku, ks, ko, kbad = self._encode(_rows.head_major(k), mask)
        vu, vs, vo, vbad = self._encode(_rows.head_major(v), mask)
        r = self.plane_rows
        new = QServePlanarLayerState(
            k_codes=kp.write_planar(state.k_codes, ku, pos, mask, 4, r, token_axis=2),
            v_codes=kp.write_planar(state.v_codes, vu, pos, mask, 4, r, token_axis=3),
            k_qparams=_write_columns(state.k_qparams, jnp.concatenate([ks, ko], axis=-1), pos, mask),
            v_scale=_rows.write_rows(state.v_scale, vs[..., 0], pos, mask),
            v_offset=_rows.write_rows(state.v_offset, vo[..., 0], pos, mask))
        return new, ~(kbad | vbad)

    @staticmethod
    def _qparams(state):
        """``(scale, offset)`` ``[B, H, C]`` of K and of V."""
        return (state.k_qparams[:, :, 0], state.k_qparams[:, :, 1]), (state.v_scale, state.v_offset)

    def materialize_layer(self, state, lengths):
        return dequantized_layer(*self._codes(state), *self._qparams(state), lengths)

    def validate_layer(self, state, lengths):
        validate_qparams(self.family, *self._qparams(state), lengths)

    def layer_nbytes(self, state):
        return {"codes": _rows.nbytes(state.k_codes, state.v_codes),
                "qparams": _rows.nbytes(state.k_qparams, state.v_scale, state.v_offset)}

    def fused_decode_operand(self, state, lengths):
        """``(TokenPlanarFormat(zero="offset"), TokenPlanarOperand)``: the stored layer read in place."""
        return self.kernel_format, tp.TokenPlanarOperand(
            k_codes=state.k_codes, v_codes=state.v_codes, k_qparams=state.k_qparams, v_scale=state.v_scale,
            v_offset=state.v_offset, end=lengths.astype(jnp.int32))

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        return _rows.per_row_ledger(batch, heads, rows, packed_bytes(head_dim, 4),
                                    2 * DTYPE_BYTES["fp16"])                           # (scale, offset)
