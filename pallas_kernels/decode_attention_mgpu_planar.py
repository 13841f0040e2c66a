"""Mosaic GPU (Hopper) decode attention over per-token INT2 / INT4 K and V: the token-planar kernel, per-token keys.

Issue J.  Per-token INT2 (``KVFormat("int2", "token", "symmetric")``) and QServe's INT4 with a floating offset
(``KVFormat("int4", "token", "offset")``) had only the Pallas Triton kernel, which unpacks every code through
shared memory (int2 1.71x cuDNN at 32K on the H200, QServe 1.03x, both slower than cuDNN at 4K there).  Mosaic GPU
has no 2-bit register type, so ``pallas_kernels.decode_attention_mgpu`` (v1) cannot read 2-bit codes; the KIVI
kernel (:mod:`pallas_kernels.decode_attention_mgpu_kivi`) can -- its token-planar bytes hold ``P = 8 / bits``
tokens each and one AND per plane turns a byte tile into ``P`` wgmma M tiles -- and its V side (per-token
scale + min over ``Gv``-channel groups, ``p * sv`` as the PV operand, the min term beside the denominator) is
already the per-token V algebra.  This module runs that kernel with per-token keys (``_KiviSpec.k_zero``)::

    k[t, d] = u[t, d] s_t + m_t          logit_t / ln 2 = s_t (u_t . q') + m_t sum_d q'[d]

``B = q'`` (bf16 hi + lo) is stored to SMEM once per program instead of once per K group, the scale row is applied
to the logits after the dot (one FMA per logit), and ``sum_d q'`` is reduced once in the kernel.  The kernel reads
the qparams as stored and forms the min of each zero convention per row: symmetric ``m = -2^(bits-1) s`` (no zero
array: fewer bytes), QServe's offset ``m = -o s``, min ``m`` as read (so no rounding is added on the way).

Operands (``prepare_token_planar_region``; the codes in the KIVI kernel's token-planar layout, 64-token planes)::

    k         int8 [BH, T/P, D]   token-planar K codes (byte row b*64 + i: tokens b*64P + 64r + i at bits r*bits)
    v         int8 [BH, D, T/P]   token-planar V^T codes
    k_qparams      [BH, R, T]     row 0 the K scale s_t, row 1 (R = 2) its zero (offset o_t or min m_t); R = 1:
                                  symmetric
    v_scale        [BH, C, T]     sv per V channel group (C = D / Gv), tokens contiguous (one TMA tile per block)
    v_zero         [BH, C, T]     V's offset or min per group, or None (symmetric)

in the region's qparam dtype (fp16 in a serving cache).

Requirements: K and V of the same bit width (2 or 4); K one scale per (token, head) (``group`` 0 or D); V groups
``Gv`` 0 or a power of two >= 16 dividing D; D a multiple of 64; rows a multiple of the block (256 tokens for
2-bit, 128 for 4-bit).  :func:`token_planar_unsupported` says why not (the dispatcher keeps the Triton kernel).

Interpret mode runs :func:`_partials_jnp` (the kernel's algebra on the prepared operands in plain JAX: the
planes read as the kernel reads them); only a Hopper GPU runs the kernel (``experiments/check_mgpu_planar.py``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from kvquant_jax.abi import token_planar as tp
from kvquant_jax.abi.reference import decode_attention_reference as _oracle_f64
from kvquant_jax.abi.reference import unpack_codes
from kvquant_jax.abi.regions import KVFormat, Region, check_query
from pallas_kernels.backend import default_interpret
from pallas_kernels.decode_attention_mgpu import _merge_partials, hopper_unsupported
from pallas_kernels.decode_attention_mgpu_kivi import (_F32, _M, KiviMgpuConfig, _config_unsupported,
                                                       _kernel_partials, _kivi_call, _PlanarOperandShape,
                                                       _planes_as_kernel, _pow2,
                                                       _scaled_query_block, _spec_for, _top_plane_rows,
                                                       _twin_softmax_pv, pack_token_planar, zero_min)

__all__ = ["TokenPlanarOperands", "token_formats_unsupported", "token_planar_unsupported",
           "prepare_token_planar_region", "token_planar_layer_unsupported", "token_planar_layout_unsupported",
           "token_planar_operands", "decode_attention_token_planar", "decode_attention_mgpu_planar_partials",
           "decode_attention_mgpu_planar_prepared", "decode_attention_mgpu_planar",
           "decode_attention_mgpu_planar_reference", "decode_attention_mgpu_planar_reference_f64"]

#: the zero conventions of a per-token INT operand this kernel reads (``KVFormat.zero``)
ZEROS = ("symmetric", "offset", "min")


@struct.dataclass
class TokenPlanarOperands(_PlanarOperandShape):
    """One per-token INT2 / INT4 region in the token-planar layout (module docstring); shapes in the comments."""

    k: jax.Array                    # int8 [BH, T/P, D]
    v: jax.Array                    # int8 [BH, D, T/P]
    k_qparams: jax.Array            # [BH, R, T]: scale (+ the zero of k_zero with R = 2)
    v_scale: jax.Array              # [BH, C, T]
    v_zero: Optional[jax.Array]     # [BH, C, T] (the zero of v_zero) or None (symmetric)
    start: jax.Array                # int32 [B]
    end: jax.Array                  # int32 [B]
    bits: int = struct.field(pytree_node=False, default=2)
    k_zero: str = struct.field(pytree_node=False, default="symmetric")   # ZEROS
    v_zero_kind: str = struct.field(pytree_node=False, default="symmetric")
    v_group: int = struct.field(pytree_node=False, default=0)   # Gv channels per V scale (resolved: never 0)
    num_kv_heads: int = struct.field(pytree_node=False, default=1)

    @property
    def k_group(self) -> int:       # (the KIVI spec's K group: unused with per-token keys)
        return self.block_t


# --------------------------------------------------------------------------------------------------------------
# Support matrix and pack-time layout (CPU-checkable)
# --------------------------------------------------------------------------------------------------------------
def token_formats_unsupported(kf: KVFormat, vf: KVFormat, head_dim: int, rows: int) -> Optional[str]:
    """Why the kernel cannot read a per-token K/V format pair of this shape (None when it can)."""
    if kf.payload not in ("int2", "int4") or kf.scale != "token" or kf.zero not in ZEROS:
        return (f"K {kf}: this kernel reads per-token 2/4-bit keys (KVFormat(int2|int4, 'token', "
                f"{'|'.join(ZEROS)}))")
    if kf.group not in (0, head_dim):
        return f"K group {kf.group}: per-token keys need one scale per (token, head) (group 0 or {head_dim})"
    if vf.payload != kf.payload or vf.scale != "token" or vf.zero not in ZEROS:
        return f"V {vf}: this kernel reads per-token values of K's bit width ({kf.payload})"
    if head_dim % 64:
        return f"head_dim {head_dim} is not a multiple of 64"
    gv = vf.group or head_dim
    if not (_pow2(gv) and gv >= 16 and head_dim % gv == 0):
        return f"V group {vf.group} must be 0 or a power of two >= 16 dividing head_dim {head_dim}"
    bt = _M * (8 // kf.bits)
    if rows % bt:
        return f"{rows} rows is not a multiple of the {kf.bits}-bit block of {bt} tokens"
    return None


def token_planar_unsupported(reg: Region, head_dim: int, config: KiviMgpuConfig | None = None) -> Optional[str]:
    """Why the kernel cannot take the layout-v1 region (None when it can)."""
    why = token_formats_unsupported(reg.k.fmt, reg.v.fmt, head_dim, reg.k.data.shape[2])
    if why:
        return why
    return _config_unsupported(config or KiviMgpuConfig())


def _min_form(scale, zero, kind: str, bits: int):
    """``(s, m)`` float32 ``[..., X]`` of ``x = u s + m`` for one zero convention (:func:`zero_min`, what the
    kernel forms per row) from the stored scale and zero (``zero`` None when symmetric)."""
    s = scale.astype(_F32)
    return s, zero_min(s, None if zero is None else zero.astype(_F32), kind, bits)


def prepare_token_planar_region(reg: Region, num_kv_heads: int | None = None) -> TokenPlanarOperands:
    """layout_version-1 per-token region -> :class:`TokenPlanarOperands` (jit-able; one pass over the codes).

    ``reg.k.data / reg.v.data``: ``[B, Hkv, T, D*bits/8]`` uint8 offset-binary codes packed along D; ``scale /
    zero``: ``[B, Hkv, T, D/G]`` (K: one group).  The qparams keep their dtype and convention (module docstring)."""
    kf, vf = reg.k.fmt, reg.v.fmt
    b, hkv, t = reg.k.data.shape[:3]
    d = reg.k.data.shape[3] * 8 // kf.bits
    why = token_formats_unsupported(kf, vf, d, t)
    if why:
        raise NotImplementedError(f"decode_attention_mgpu_planar: {why}")
    bh = b * hkv
    uk = unpack_codes(reg.k.data, kf.bits, jnp).reshape(bh, t, d)
    uv = unpack_codes(reg.v.data, vf.bits, jnp).reshape(bh, t, d)
    ks = reg.k.scale.reshape(bh, 1, t)
    kq = ks if kf.zero == "symmetric" else jnp.concatenate([ks, reg.k.zero.reshape(bh, 1, t).astype(ks.dtype)], 1)
    c = reg.v.scale.shape[-1]
    tr = lambda a: jnp.swapaxes(a.reshape(bh, t, c), 1, 2)  # noqa: E731
    return TokenPlanarOperands(
        k=pack_token_planar(uk, kf.bits), v=jnp.swapaxes(pack_token_planar(uv, vf.bits), 1, 2),
        k_qparams=kq, v_scale=tr(reg.v.scale), v_zero=None if vf.zero == "symmetric" else tr(reg.v.zero),
        start=reg.start.astype(jnp.int32), end=reg.end.astype(jnp.int32), bits=kf.bits, v_group=d // c,
        num_kv_heads=num_kv_heads or hkv, k_zero=kf.zero, v_zero_kind=vf.zero)


# --------------------------------------------------------------------------------------------------------------
# Partials: the kernel (GPU) or its plain-JAX twin (interpret)
# --------------------------------------------------------------------------------------------------------------
def _check_operands(ops: TokenPlanarOperands) -> None:
    for name, kind in (("k_zero", ops.k_zero), ("v_zero_kind", ops.v_zero_kind)):
        if kind not in ZEROS:
            raise ValueError(f"{name} must be one of {ZEROS}, got {kind!r}")
    rows = tp.zero_rows(ops.k_zero)
    if ops.k_qparams.shape != (ops.k.shape[0], rows, ops.rows):
        raise ValueError(f"k_qparams must be [BH, {rows}, {ops.rows}] for {ops.k_zero} keys, "
                         f"got {list(ops.k_qparams.shape)}")
    want = (ops.k.shape[0], ops.head_dim // ops.v_group, ops.rows)
    if ops.v_scale.shape != want:
        raise ValueError(f"v_scale must be {list(want)}, got {list(ops.v_scale.shape)}")
    if (ops.v_zero is None) != (ops.v_zero_kind == "symmetric"):
        raise ValueError(f"v_zero must be None exactly when the values are symmetric ({ops.v_zero_kind})")
    if ops.v_zero is not None and ops.v_zero.shape != want:
        raise ValueError(f"v_zero must be {list(want)}, got {list(ops.v_zero.shape)}")


def decode_attention_mgpu_planar_partials(q, ops: TokenPlanarOperands, *, sm_scale: float | None = None,
                                          config: KiviMgpuConfig | None = None, interpret: Any = False):
    """Split-K partials of one prepared per-token region.  ``q``: ``[B, Hq, D]``.  Returns ``acc [B, Hkv, S, G,
    D], m, l [B, Hkv, S, G]`` float32 (natural-log ``m``).  ``config.offsets`` is not read (no K groups)."""
    cfg = config or KiviMgpuConfig()
    why = _config_unsupported(cfg)
    if why:
        raise ValueError(why)
    _check_operands(ops)
    if interpret:
        return _partials_jnp(q, ops, sm_scale)
    b, hq, d = q.shape
    hkv = ops.num_kv_heads
    sp = dataclasses.replace(_spec_for(ops, hq // hkv, cfg), k_zero=ops.k_zero, v_zero=ops.v_zero_kind)
    qb = _scaled_query_block(q, hkv, sp.n, sp.dup, sm_scale)                       # [BH, N, D]
    out = _kivi_call(ops.start.astype(jnp.int32), ops.end.astype(jnp.int32), jnp.swapaxes(qb, 1, 2), None,
                     ops.k, ops.v, ops.k_qparams, ops.v_scale, ops.v_zero, sp)
    return _kernel_partials(out, sp, b, hkv)


def _partials_jnp(q, ops: TokenPlanarOperands, sm_scale):
    """Plain-JAX partials (one split) in the kernel's algebra: the planes read as the kernel reads them (K's top
    plane shifted back to ``u``, V's re-centred), ``s_t (u . q') + m_t sum q'``, ``p * sv`` and the V min term with
    the top plane's shifted min, all float32."""
    b, hq, d = q.shape
    hkv = ops.num_kv_heads
    g = hq // hkv
    t, bits = ops.rows, ops.bits
    hp = lax.Precision.HIGHEST
    half = 2.0 ** (bits - 1)
    qb = _scaled_query_block(q, hkv, g, 0, sm_scale)                                 # [BH, G, D] (log2 units)
    uk = _planes_as_kernel(ops.k, bits, unshift_top=True)                            # [BH, T, D]
    uv = _planes_as_kernel(jnp.swapaxes(ops.v, 1, 2), bits)                          # [BH, T, D]
    kz = None if ops.k_zero == "symmetric" else ops.k_qparams[:, 1]
    st, mt = _min_form(ops.k_qparams[:, 0], kz, ops.k_zero, bits)                   # [BH, T]
    s = (jnp.einsum("xgd,xtd->xgt", qb, uk, precision=hp) * st[:, None, :]
         + mt[:, None, :] * jnp.sum(qb, axis=-1)[..., None])
    top = jnp.asarray(_top_plane_rows(t, bits))[None, :, None]
    sv, mv = _min_form(ops.v_scale, ops.v_zero, ops.v_zero_kind, bits)               # [BH, C, T]
    sv = jnp.repeat(jnp.swapaxes(sv, 1, 2), ops.v_group, 2)                         # [BH, T, D]
    mv = jnp.repeat(jnp.swapaxes(mv, 1, 2), ops.v_group, 2)
    mv = jnp.where(top, mv + half * sv, mv)
    return _twin_softmax_pv(s, uv, sv, mv, ops.start, ops.end, b, hkv)


# --------------------------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------------------------
def decode_attention_mgpu_planar_prepared(q, ops: TokenPlanarOperands, *, k_new=None, v_new=None,
                                          sm_scale: float | None = None, config: KiviMgpuConfig | None = None,
                                          interpret: Any = None, out_dtype=None):
    """Attention of the new token over one prepared per-token region (+ the exact current token), ONE softmax.
    ``q [B, Hq, D]``; ``k_new, v_new`` optional ``[B, Hkv, D]``; returns ``[B, Hq, D]`` (``out_dtype``, default
    ``q.dtype``).  ``interpret`` None: the plain-JAX partials off a GPU."""
    interpret = bool(interpret) if interpret is not None else default_interpret()
    part = decode_attention_mgpu_planar_partials(q, ops, sm_scale=sm_scale, config=config, interpret=interpret)
    return _merge_partials(q, part, ops.num_kv_heads, sm_scale, k_new=k_new, v_new=v_new,
                           out_dtype=out_dtype or q.dtype)


def token_planar_layout_unsupported(q, fmt: tp.TokenPlanarFormat, operand: tp.TokenPlanarOperand) -> Optional[str]:
    """Why the kernel cannot read this token-planar cache layer's shapes (any device; None when it can)."""
    if fmt.plane_rows != _M:
        return f"plane_rows {fmt.plane_rows}: the kernel reads 64-token planes (one wgmma M tile)"
    f = KVFormat(f"int{fmt.bits}", "token", fmt.zero)
    return token_formats_unsupported(f, f, q.shape[-1], operand.k_qparams.shape[-1])


def token_planar_layer_unsupported(q, fmt: tp.TokenPlanarFormat, operand: tp.TokenPlanarOperand) -> Optional[str]:
    """Why the kernel cannot read a token-planar cache layer in place on this device (None when it can): the
    dispatcher's refusal check (``attention.dispatch.FUSED_KERNELS``): not a Hopper GPU, or
    :func:`token_planar_layout_unsupported` (float32 queries are fine: ``bf16x2`` keeps ~1e-5)."""
    return hopper_unsupported() or token_planar_layout_unsupported(q, fmt, operand)


def token_planar_operands(fmt: tp.TokenPlanarFormat, operand: tp.TokenPlanarOperand) -> TokenPlanarOperands:
    """A token-planar cache layer as the kernel's operands with no pass over the codes (reshapes and a uint8 ->
    int8 bitcast of the stored arrays): ``[B, Hkv, ...]`` -> ``[B*Hkv, ...]``; rows ``[0, operand.end)``."""
    b, hkv, nr, d = operand.k_codes.shape
    bh = b * hkv
    as_i8 = lambda a, shape: lax.bitcast_convert_type(a.reshape(shape), jnp.int8)  # noqa: E731
    c = operand.v_scale.shape[-1]
    v_zero = None if operand.v_offset is None else operand.v_offset.reshape(bh, 1, c)
    return TokenPlanarOperands(
        k=as_i8(operand.k_codes, (bh, nr, d)), v=as_i8(operand.v_codes, (bh, d, nr)),
        k_qparams=operand.k_qparams.reshape(bh, fmt.qparam_rows, c), v_scale=operand.v_scale.reshape(bh, 1, c),
        v_zero=v_zero, start=jnp.zeros_like(operand.end), end=operand.end.astype(jnp.int32), bits=fmt.bits,
        v_group=d, num_kv_heads=hkv, k_zero=fmt.zero, v_zero_kind=fmt.zero)


def decode_attention_token_planar(q, fmt: tp.TokenPlanarFormat, operand: tp.TokenPlanarOperand, lengths=None,
                                  k_new=None, v_new=None, *, sm_scale: float | None = None,
                                  config: KiviMgpuConfig | None = None, interpret: Any = None, out_dtype=None):
    """Decode attention over one token-planar per-token cache layer read in place (the dispatcher's fused-kernel
    entry for :class:`~kvquant_jax.abi.token_planar.TokenPlanarFormat`): the kernel over rows ``[0, operand.end)``
    and the exact current token (``k_new, v_new [B, Hkv, D]``) in ONE softmax.  ``q [B, Hq, D]``; returns ``[B,
    Hq, D]`` in ``out_dtype``, default float32 (the dispatcher casts).  ``lengths`` is not read (``operand.end``
    holds them).  ``interpret`` (None: off on a GPU only) runs the plain-JAX partials (CPU tests)."""
    del lengths
    why = token_planar_layout_unsupported(q, fmt, operand)
    if why:
        raise NotImplementedError(f"decode_attention_token_planar: {why}")
    return decode_attention_mgpu_planar_prepared(q, token_planar_operands(fmt, operand), k_new=k_new, v_new=v_new,
                                                 sm_scale=sm_scale, config=config, interpret=interpret,
                                                 out_dtype=out_dtype or _F32)


def decode_attention_mgpu_planar(q, region: Region, *, k_new=None, v_new=None, sm_scale: float | None = None,
                                 config: KiviMgpuConfig | None = None, interpret: Any = None, out_dtype=None):
    """Layout-v1 entry point: :func:`prepare_token_planar_region` (a pass over the codes) then the kernel."""
    check_query(q, [region], k_new, v_new)
    why = token_planar_unsupported(region, q.shape[-1], config)
    if why:
        raise NotImplementedError(f"decode_attention_mgpu_planar: {why}")
    ops = prepare_token_planar_region(region)
    return decode_attention_mgpu_planar_prepared(q, ops, k_new=k_new, v_new=v_new, sm_scale=sm_scale,
                                                 config=config, interpret=interpret, out_dtype=out_dtype)


def decode_attention_mgpu_planar_reference(q, region: Region, *, k_new=None, v_new=None,
                                           sm_scale: float | None = None, config: KiviMgpuConfig | None = None,
                                           interpret: Any = False, out_dtype=None):
    """Plain-JAX float32 twin (kernel-only args ignored): the token-planar conversion and the kernel's algebra."""
    del config, interpret
    return decode_attention_mgpu_planar(q, region, k_new=k_new, v_new=v_new, sm_scale=sm_scale, interpret=True,
                                        out_dtype=out_dtype)


def decode_attention_mgpu_planar_reference_f64(q, region: Region, *, k_new=None, v_new=None,
                                               sm_scale: float | None = None) -> np.ndarray:
    """The float64 NumPy oracle (``kvquant_jax.abi.reference``) on the same layout-v1 inputs."""
    return _oracle_f64(q, [region], k_new=k_new, v_new=v_new, sm_scale=sm_scale)
