"""Pallas decode attention that reads quantized KV codes + qparams where they lie (design notes 0x03, 0x06C, 0x09D).

One new query token per sequence (``q: [B, Hq, D]``) attends over a list of regions
(:mod:`kvquant_jax.abi.regions`: explicit arrays in the physical layouts of docs/architecture.md, live rows
``[start[b], end[b])``) plus, optionally, the exact K/V of the token the forward just produced (``k_new, v_new:
[B, Hkv, D]``).  All of it is ONE softmax: every region yields split-K partials ``(acc, m, l)`` that a combine step
merges with the usual max/sum rescaling, so the result equals the softmax over the concatenated keys.

Where the scales go (0x03A-0x03C)
---------------------------------
* K per-token scale (``scale="token"``, one group): the code dot ``q . (u - c)`` is scaled after the dot,
  ``logit_t = s_t * (q . u_t - o_t * sum(q))`` for QServe's floating offset, ``(u - 2^(b-1))`` re-centred codes for
  symmetric INT.  With G_d < D groups the query is split into per-group masked copies and each group's partial dot
  is scaled by its own ``s_tg``.
* K per-channel scale (KIVI, ``scale="channel"``): folded into the query before the dot, per G-token group j:
  ``logit_t = (q * s_j) . u_t + q . min_j`` (the min term is one constant per group and query head).
* V per-token scale: folded into the probabilities before the PV product, ``acc += (p * s_t) @ u`` and the zero
  term ``sum_t p_t z_t`` is a per-row scalar accumulated beside ``acc`` (``z = min`` or ``-o * s``); with G_d < D
  each group of columns has its own accumulator.
* Per-head scales (fp8, static INT) and the softmax scale multiply the logits after the dot (a per-query-row
  ``qs``), and the V per-head scale multiplies the region's partial output outside the kernel.
Codes stay exact integers in the dot operands (``bf16`` holds 0..255 exactly).  The other operand is exact when it
can be (a bf16 query against bf16 codes: one pass); otherwise (a float32 query, ``q * s_j`` for KIVI, the
probabilities) ``precision="bf16x2"`` splits it into bf16 hi + lo parts -- for the probabilities inside ONE dot:
the query rows are duplicated into the tensor-core padding rows, the duplicates carry lo(p) and the wrapper adds
the two row blocks (~16 significant bits, ~1e-5 relative: not full float32) -- ``"bf16"`` rounds it once
(flash-attention practice, ~1e-3 relative error) and ``"f32"`` keeps float32 operands (the interpreted default).  No dequantized K/V is ever written.

Unpacking (``unpack``): ``"asm"`` (GPU) drops each code byte into the mantissa of a bf16 with a PTX ``prmt`` and
re-centres two lanes per packed ``fma``; ``"magic"`` ORs the code into the mantissa of float32 2^23 and subtracts;
``"convert"`` uses integer->float conversion.  Measured on the H200 in docs/benchmarks_decode.md.

Packed codes are never interleaved in registers: a byte of INT4/INT2 holds channels ``j*P + r`` (``P`` codes per
byte, ``r`` = bit plane), so the query is de-interleaved into ``P`` planes outside the kernel, each plane of codes
is one shift+mask of the loaded bytes, logits are the sum of ``P`` plane dots, and the output comes back as ``P``
planes that the wrapper re-interleaves.

GQA: one program handles all ``Hq / Hkv`` query heads of a KV head against one read of each KV block (the head
rows are padded to 16 on GPU, the smallest tensor-core M, and to 8 on TPU).  Ragged lengths: each program masks
rows outside ``[start, end)`` and skips whole blocks outside it.  Split-K: the live blocks of each sequence are cut
into ``num_splits`` contiguous chunks, one program each; partials are merged in :func:`_combine`.

Backends (``backend=None`` picks by :func:`pallas_kernels.backend.platform`):

* ``"gpu"``: Pallas Triton.  Grid ``(B, Hkv, num_splits)``; each program loops (``fori_loop`` -> ``scf.for``,
  software-pipelined with ``num_stages``) over its blocks of ``block_t`` rows.  On CPU the same kernel runs with
  ``interpret=True`` (the CI path).
* ``"tpu"``: Mosaic TPU BlockSpecs with scalar-prefetched ``start/end``: grid ``(B, Hkv, num_splits, blocks)``, the
  last axis "arbitrary", VMEM scratch accumulators, block index clamped so skipped blocks re-use the last DMA.
  Validated in the TPU interpreter (``pltpu.InterpretParams()``) only.
Both share the block-update body (:func:`_block`).

Requirements of the kernel path (the dispatcher falls back to the reference otherwise): a region's row count is a
multiple of ``block_t`` (chosen automatically as a power of two dividing it), ``D`` and the plane widths are powers
of two, KIVI key groups G are powers of two.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvquant_jax.abi.reference import decode_attention_jnp, dequantize_operand
from kvquant_jax.abi.regions import KVFormat, Region, check_query
from pallas_kernels.backend import platform, resolve

__all__ = ["decode_attention", "decode_attention_reference", "KernelConfig", "default_config", "PRECISIONS",
           "KIVI_UPDATES", "kernel_unsupported", "mma_too_small", "MMA_MIN", "MMA_MIN_N"]

PRECISIONS = ("f32", "bf16x2", "bf16")
#: ``KernelConfig.kivi_update``: "group" = one online-softmax update + one PV per G-row key group (the default),
#: "block" = the logits of every group of a block in one [Mp, bt] tile, ONE update and ONE PV per block
#: (:func:`_logits_channel_block`).  Only changes anything for per-channel (KIVI) K scales.
KIVI_UPDATES = ("group", "block")
_NEG = -1e30          # finite "minus infinity": keeps exp(m_old - m_new) NaN-free for empty splits
_F32 = jnp.float32


# --------------------------------------------------------------------------------------------------------------
# Static configuration
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tuning knobs of one region's kernel (all static).

    Attributes:
      block_t: rows per loop step (shrunk to a power of two dividing the region; a multiple of the KIVI key group).
      num_splits: split-K programs per (sequence, KV head); partials are merged by the combine step.
      precision: "bf16x2" (hi + lo bf16 parts: ~16 mantissa bits, ~1e-5 relative), "bf16" (probabilities rounded
        once, ~1e-3) or "f32" (float32 operands; the default when interpreted).
      num_warps, num_stages: Triton launch parameters (GPU only).
      unpack: "magic", "convert" or "asm" (GPU inline PTX; the interpreter falls back to "magic").
      kivi_update: per-channel (KIVI) K scales only: "group" (default) runs one online-softmax update and one PV
        product per G-row key group; "block" assembles the logits of all ``block_t / G`` groups into one
        ``[Mp, block_t]`` tile (same per-group folded math) and runs ONE update and ONE PV over the whole block
        (:func:`_logits_channel_block`; opt-in, not yet timed on a device).  Ignored for other K formats.
    """

    block_t: int = 128
    num_splits: int = 1
    precision: str = "bf16x2"
    num_warps: int | None = None
    num_stages: int | None = None
    unpack: str = "magic"
    kivi_update: str = "group"


def default_config(fmt_k: KVFormat, rows: int, batch: int, num_kv_heads: int, *, backend: str,
                   interpret: bool, query_dtype=None) -> KernelConfig:
    """Per-backend defaults (GPU values were picked on an H200, see docs/benchmarks_decode.md).

    A float32 query (``query_dtype``: a float32 model) gets ``precision="f32"`` on every backend: a float32 model
    keeps float32 parity with the reference path (issue I), the same reason as below.

    Interpreted runs (CPU) use ``precision="f32"``: there the kernel is the correctness path that serving compares
    against the float32 reference, and ``"bf16x2"`` is NOT float32-grade -- hi + lo bf16 parts carry ~16 mantissa
    bits, ~1e-5 relative error per attention layer on SmolLM2-135M (vs ~5e-7 for f32), which INT4 re-quantization
    of the next tokens' K/V amplifies into diverging greedy decodes.  Speed is no reason for bf16 operands there.
    """
    if interpret and backend == "gpu":
        return KernelConfig(block_t=32, num_splits=2, precision="f32")
    if query_dtype is not None and jnp.dtype(query_dtype) == jnp.float32:
        return dataclasses.replace(default_config(fmt_k, rows, batch, num_kv_heads, backend=backend,
                                                  interpret=interpret), precision="f32")
    if backend == "tpu":
        return KernelConfig(block_t=128 if interpret is False else 32, num_splits=1,
                            precision="bf16x2" if interpret is False else "f32")
    # H200 sweep at T=32K, B*Hkv=64 (docs/benchmarks_decode.md): 64-row blocks, ~1-2K programs, 4 warps.
    bt = 64
    nb = max(rows // bt, 1)
    programs = batch * num_kv_heads
    splits = max(1, min(nb, -(-(2048 if fmt_k.is_int else 1024) // programs)))
    unpack = "asm" if fmt_k.is_int and fmt_k.bits < 8 else "magic"
    return KernelConfig(block_t=bt, num_splits=splits, num_warps=4, num_stages=4 if fmt_k.is_int else 3,
                        unpack=unpack)


@dataclasses.dataclass(frozen=True)
class _Spec:
    kf: KVFormat
    vf: KVFormat
    d: int
    mp: int            # padded query-head rows per KV head
    bt: int            # rows per loop step
    sub: int           # rows per softmax update (G for KIVI keys, else bt)
    ns: int            # splits
    nb: int            # blocks in the region (rows // bt)
    precision: str
    unpack: str        # "magic" (exponent-bias bit trick), "convert" (int -> float) or "asm" (GPU PRMT unpack)
    q_exact: bool      # the query is exactly representable in the K operand dtype (no hi/lo split needed)
    dup: int = 0       # > 0: query rows [dup, 2 dup) repeat rows [0, dup); PV feeds them the lo part of p
    kblock: bool = False   # KIVI keys, kivi_update="block": sub == bt, logits from _logits_channel_block

    @property
    def gpb(self):     # K channel-scale rows per block (1 when the K scales are not per channel)
        return self.bt // self.kf.group if self.kf.scale == "channel" else self.bt // self.sub

    @property
    def npk(self):
        return self.kf.codes_per_byte

    @property
    def ngk(self):
        return self.kf.token_groups(self.d)

    @property
    def npv(self):
        return self.vf.codes_per_byte

    @property
    def ngv(self):
        return self.vf.token_groups(self.d)

    @property
    def gbv(self):     # plane columns per V group
        return self.d // (self.npv * self.ngv)

    @property
    def nbps(self):    # grid steps per split (TPU)
        return -(-self.nb // self.ns)

    @property
    def v_zero(self):
        return self.vf.zero in ("offset", "min")

    def op_dtype(self, f: KVFormat):
        return _op_dtype(f, self.precision)


def _op_dtype(f: KVFormat, precision: str):
    """Dot operand dtype for a payload: one that holds every code / stored value exactly."""
    if precision == "f32" or f.payload == "fp32":
        return _F32
    return jnp.float16 if f.payload == "fp16" else jnp.bfloat16


def _names(kf: KVFormat, vf: KVFormat) -> tuple[str, ...]:
    out = []
    for p, f in (("k", kf), ("v", vf)):
        out.append(p)
        if f.scale in ("token", "channel"):
            out.append(p + "s")
        if f.has_zero_array:
            out.append(p + "z")
    return tuple(out)


# --------------------------------------------------------------------------------------------------------------
# Shared kernel body
# --------------------------------------------------------------------------------------------------------------
class _Tile:
    """Reads the tiles of one block: ``lead`` indexes (b, h) on whole-array refs (GPU) or is empty (TPU blocks)."""

    def __init__(self, refs, lead, row_base, grp_base):
        self.refs, self.lead, self.row_base, self.grp_base = refs, lead, row_base, grp_base

    def rows(self, name, row, n, cols=slice(None)):
        return self.refs[name][self.lead + (pl.ds(self.row_base + row, n), cols)]

    def group_row(self, name, j, cols):
        return self.refs[name][self.lead + (pl.ds(self.grp_base + j, 1), cols)]


def _split(a, op_dtype, precision):
    """The non-code operand as a list of pieces whose dots sum to the float32 product."""
    if op_dtype == _F32:
        return [a]
    hi = a.astype(op_dtype)
    if precision == "bf16":
        return [hi]
    return [hi, (a - hi.astype(_F32)).astype(op_dtype)]


def _p_pieces(p, op_dtype, sp: _Spec):
    """Probability-side operand of the PV dot.  With ``dup`` the hi and lo parts share ONE dot: rows
    ``[0, dup)`` carry hi(p), the duplicate rows ``[dup, 2 dup)`` (same query, so same p) carry lo(p), and the
    wrapper adds the two row blocks: float32-grade accuracy at the cost of a single bf16 pass."""
    if not sp.dup:
        return _split(p, op_dtype, sp.precision)
    hi = p.astype(op_dtype)
    lo = (p - hi.astype(_F32)).astype(op_dtype)
    rows = lax.broadcasted_iota(jnp.int32, p.shape, 0)
    return [jnp.where(rows < sp.dup, hi, lo)]


def _mm(pieces, b, trans_b):
    dims = (((1,), (1,) if trans_b else (0,)), ((), ()))
    out = None
    for a in pieces:
        prec = lax.Precision.HIGHEST if a.dtype == _F32 else None
        t = lax.dot_general(a, b, dims, precision=prec, preferred_element_type=_F32)
        out = t if out is None else out + t
    return out


_MAGIC_BITS = 0x4B000000   # float32 2**23: OR-ing an integer u < 2**23 into its mantissa gives 2**23 + u exactly


def _asm_planes(codes_u8, f: KVFormat, centre: int):
    """GPU only: each plane of 4 code bytes -> 4 bf16 in one PTX block (shift, mask, 2 byte permutes, 2 packed fma).

    ``prmt`` drops each masked code byte u into the low byte of a bf16 whose high byte is 0x43, i.e. the exact
    value 128 + u (u < 128); one ``fma.rn.bf16x2`` by 1 then subtracts ``128 + centre`` two lanes at a time.
    (One call per plane: JAX's lowering of a multi-result inline asm returns a single value.)
    """
    from jax.experimental.pallas import triton as plgpu

    mask = (2 ** f.bits - 1) * 0x01010101
    neg = 0xC300 | centre                                  # bf16 bits of -(128 + centre)
    out = jax.ShapeDtypeStruct(codes_u8.shape, jnp.bfloat16)
    planes = []
    for r in range(f.codes_per_byte):
        shift = f"shr.b32 t, $2, {r * f.bits};\nand.b32 t, t, {mask};" if r else f"and.b32 t, $2, {mask};"
        asm = ("{\n.reg .b32 t, k, one, nc;\n" + shift + "\nmov.b32 k, 0x43434343;\nmov.b32 one, 0x3F803F80;\n"
               f"mov.b32 nc, {neg | (neg << 16)};\nprmt.b32 $0, t, k, 0x5140;\nprmt.b32 $1, t, k, 0x7362;\n"
               "fma.rn.bf16x2 $0, $0, one, nc;\nfma.rn.bf16x2 $1, $1, one, nc;\n}")
        planes.append(plgpu.elementwise_inline_asm(asm, args=[codes_u8], constraints="=r,=r,r", pack=4,
                                                   result_shape_dtypes=[out])[0])
    return planes


def _planes(codes_u8, f: KVFormat, op_dtype, unpack: str):
    """uint8 ``[n, w]`` -> ``codes_per_byte`` planes ``[n, w]`` in ``op_dtype`` (re-centred if symmetric).

    ``unpack="magic"`` avoids the slow integer->float conversion units: ``bitcast(u | 0x4B000000) - (2**23 + c)``
    is the exact float32 value ``u - c`` from one logic op and one float add.  ``"asm"``: :func:`_asm_planes`.
    """
    centre = 2 ** (f.bits - 1) if f.zero == "symmetric" else 0
    if unpack == "asm" and f.bits < 8 and op_dtype == jnp.bfloat16:
        return _asm_planes(codes_u8, f, centre)
    c = codes_u8.astype(jnp.int32)
    if f.bits == 8:
        ps = [c]
    else:
        mask = 2 ** f.bits - 1
        ps = [(c >> (r * f.bits)) & mask if r else c & mask for r in range(f.codes_per_byte)]
    if unpack in ("magic", "asm"):
        ps = [lax.bitcast_convert_type(p | _MAGIC_BITS, _F32) - float(2 ** 23 + centre) for p in ps]
    elif centre:
        ps = [p - centre for p in ps]
    return [p.astype(op_dtype) for p in ps]


def _as_row(col):
    """``[n, 1]`` qparam column -> float32 ``[1, n]`` row."""
    return col.astype(_F32).reshape(1, col.shape[0])


def _query_values(get_q, qs, sp: _Spec):
    """Per-program query state: raw planes, their dot pieces, per-group sums and the logit scale ``qs [Mp, 1]``."""
    q = [[get_q(g, r) for r in range(sp.npk)] for g in range(sp.ngk)]
    op = sp.op_dtype(sp.kf)
    prec = "bf16" if sp.q_exact else sp.precision
    pieces = [[_split(x, op, prec) for x in row] for row in q]
    qsum = [functools.reduce(jnp.add, [jnp.sum(x, axis=1, keepdims=True) for x in row]) for row in q]
    return q, pieces, qsum, qs


def _logits(qv, tile: _Tile, rr: int, j: int, sp: _Spec):
    """Logits of ``sub`` rows before the per-row scale ``qs``: ``[Mp, sub]`` float32."""
    q, pieces, qsum, _ = qv
    f, n = sp.kf, sp.sub
    op = sp.op_dtype(f)
    if not f.is_int:
        kt = tile.rows("k", rr, n).astype(op)
        return _mm(pieces[0][0], kt, True)
    planes = _planes(tile.rows("k", rr, n), f, op, sp.unpack)
    if f.scale == "head":             # static per-head scale: folded into qs outside
        return functools.reduce(jnp.add, [_mm(pieces[0][r], planes[r], True) for r in range(sp.npk)])
    if f.scale == "channel":          # fold the group's channel scales into the query (0x03B, option 2)
        return _channel_group_logits(q, tile, j, planes, sp)
    s = None                          # per-token scales applied after the dot (0x03A)
    for g in range(sp.ngk):
        raw = functools.reduce(jnp.add, [_mm(pieces[g][r], planes[r], True) for r in range(sp.npk)])
        ks = _as_row(tile.rows("ks", rr, n, pl.ds(g, 1)))
        if f.zero == "offset":
            t = ks * (raw - qsum[g] * _as_row(tile.rows("kz", rr, n, pl.ds(g, 1))))
        elif f.zero == "min":
            t = ks * raw + qsum[g] * _as_row(tile.rows("kz", rr, n, pl.ds(g, 1)))
        else:
            t = ks * raw
        s = t if s is None else s + t
    return s


def _channel_group_logits(q, tile: _Tile, j: int, planes, sp: _Spec):
    """Key group ``j``'s per-channel scales folded into the query (0x03B, option 2), dotted with ``planes`` (the
    unpacked code planes of the rows to score, ``[n, D/P]`` each): ``(q * s_j) . u_t + q . min_j``, ``[Mp, n]``."""
    f, op = sp.kf, sp.op_dtype(sp.kf)
    s = None
    const = None
    for r in range(sp.npk):
        cols = pl.ds(r, sp.d // sp.npk, stride=sp.npk) if sp.npk > 1 else slice(None)
        ks = tile.group_row("ks", j, cols).astype(_F32)                      # [1, D/P]
        t = _mm(_split(q[0][r] * ks, op, sp.precision), planes[r], True)
        s = t if s is None else s + t
        if f.zero == "min":
            km = tile.group_row("kz", j, cols).astype(_F32)
            c = jnp.sum(q[0][r] * km, axis=1, keepdims=True)               # [Mp, 1]
            const = c if const is None else const + c
    return s if const is None else s + const


def _check_kivi_update(kivi_update: str) -> None:
    if kivi_update not in KIVI_UPDATES:
        raise ValueError(f"kivi_update must be one of {KIVI_UPDATES}, got {kivi_update!r}")


def _key_update(kf: KVFormat, bt: int, kivi_update: str) -> tuple[int, bool]:
    """``(sub, kblock)`` of a block of ``bt`` rows: the rows per online-softmax update and whether KIVI keys take the
    whole-block path (``kivi_update="block"``; other K formats update once per block either way).  Shared by the
    contiguous and the paged kernel (each checks ``kivi_update`` first: :func:`_check_kivi_update`)."""
    kblock = kivi_update == "block" and kf.scale == "channel"
    return (kf.group if kf.scale == "channel" and not kblock else bt), kblock


def _logits_channel_block(qv, tile: _Tile, sp: _Spec):
    """KIVI keys, ``kivi_update="block"``: logits of ALL ``bt`` rows of the block, ``[Mp, bt]`` float32 before
    ``qs``, from the same per-group folded math as :func:`_logits` (``(q * s_j) . u_t + q . min_j``; codes stay
    exact integers in the dot operands, the folded query is split per ``precision`` as there).

    How the tile is assembled: Pallas Triton cannot concatenate the ``[Mp, G]`` group tiles along the columns
    (its ``concatenate_p`` rule takes two ``[..., 1]`` operands only: a ``tt.join``), so each group's folded query
    is dotted against the codes of ALL ``bt`` rows and an iota mask keeps that group's own columns
    ``[j G, (j + 1) G)`` (a select, no data movement; lowers for Triton and Mosaic alike).  MMA cost: ``bt / G``
    times the K-side tensor-core work of the per-group path (each group dot is ``[Mp, D/P] x [D/P, bt]`` instead of
    ``[D/P, G]``; 2x at bt = 64, 4x at bt = 128, G = 32) -- traded for ONE online-softmax update and ONE PV per
    block instead of ``bt / G`` of each (the V dots then contract over ``bt`` rows, so the 16 tiny V dots per group
    become 16 per block).  The codes are unpacked once per block either way.
    """
    q, _, _, _ = qv
    f, n, g = sp.kf, sp.bt, sp.kf.group
    planes = _planes(tile.rows("k", 0, n), f, sp.op_dtype(f), sp.unpack)         # all bt rows, once
    col = lax.broadcasted_iota(jnp.int32, (1, n), 1)
    s = None
    for j in range(n // g):
        t = _channel_group_logits(q, tile, j, planes, sp)                        # [Mp, bt]: every row
        if s is None:                  # group 0 also fills the other columns; groups j > 0 overwrite theirs
            s = t
        else:
            s = jnp.where((col >= j * g) & (col < (j + 1) * g), t, s)
    return s


def _pv(accs, zaccs, p, valid_row, valid_col, tile: _Tile, rr: int, sp: _Spec):
    f, n = sp.vf, sp.sub
    op = sp.op_dtype(f)
    if not f.is_int:
        vt = tile.rows("v", rr, n).astype(op)
        vt = jnp.where(valid_col, vt, jnp.zeros_like(vt))     # unspecified rows may hold NaN
        accs[0][0] = accs[0][0] + _mm(_p_pieces(p, op, sp), vt, False)
        return accs, zaccs
    gbytes = sp.vf.data_dim(sp.d) // sp.ngv
    for g in range(sp.ngv):
        cols = pl.ds(g * gbytes, gbytes) if sp.ngv > 1 else slice(None)
        planes = _planes(tile.rows("v", rr, n, cols), f, op, sp.unpack)
        if f.scale == "head":         # static per-head scale: applied to the region's output outside
            vs = None
            pieces = _p_pieces(jnp.where(valid_row, p, 0.0), op, sp)
        else:
            vs = _as_row(tile.rows("vs", rr, n, pl.ds(g, 1)))
            pieces = _p_pieces(jnp.where(valid_row, p * vs, 0.0), op, sp)      # V scales into p (0x03C)
        for r in range(sp.npv):
            accs[g][r] = accs[g][r] + _mm(pieces, planes[r], False)
        if sp.v_zero:
            z = _as_row(tile.rows("vz", rr, n, pl.ds(g, 1)))
            z = -(z * vs) if f.zero == "offset" else z
            zaccs[g] = zaccs[g] + jnp.sum(jnp.where(valid_row, p * z, 0.0), axis=1, keepdims=True)
    return accs, zaccs


def _init_state(sp: _Spec):
    m = jnp.full((sp.mp, 1), _NEG, _F32)
    l = jnp.zeros((sp.mp, 1), _F32)
    accs = [[jnp.zeros((sp.mp, sp.gbv), _F32) for _ in range(sp.npv)] for _ in range(sp.ngv)]
    zaccs = [jnp.zeros((sp.mp, 1), _F32) for _ in range(sp.ngv)]
    return m, l, accs, zaccs


def _block(state, qv, tile: _Tile, pos0, start, end, sp: _Spec):
    """Online-softmax update over one block of ``bt`` rows (``bt // sub`` updates of ``sub`` rows; ONE update with
    ``sp.kblock``, whose logits come from :func:`_logits_channel_block`)."""
    m, l, accs, zaccs = state
    accs = [list(a) for a in accs]
    zaccs = list(zaccs)
    for j in range(sp.bt // sp.sub):
        rr = j * sp.sub
        pos_row = pos0 + rr + lax.broadcasted_iota(jnp.int32, (1, sp.sub), 1)
        pos_col = pos0 + rr + lax.broadcasted_iota(jnp.int32, (sp.sub, 1), 0)
        valid_row = (pos_row >= start) & (pos_row < end)
        valid_col = (pos_col >= start) & (pos_col < end)
        raw = _logits_channel_block(qv, tile, sp) if sp.kblock else _logits(qv, tile, rr, j, sp)
        s = jnp.where(valid_row, raw * qv[3], _NEG)
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid_row, jnp.exp(s - m_new), 0.0)
        l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        accs = [[a * alpha for a in row] for row in accs]
        zaccs = [z * alpha for z in zaccs]
        accs, zaccs = _pv(accs, zaccs, p, valid_row, valid_col, tile, rr, sp)
        m = m_new
    return m, l, accs, zaccs


def _outputs(state, sp: _Spec):
    m, l, accs, zaccs = state
    if sp.v_zero and sp.dup:      # the wrapper adds rows [dup, 2 dup) to rows [0, dup): count z once
        rows = lax.broadcasted_iota(jnp.int32, (sp.mp, 1), 0)
        zaccs = [jnp.where(rows < sp.dup, z, 0.0) for z in zaccs]
    outs = [[a + zaccs[g] if sp.v_zero else a for a in row] for g, row in enumerate(accs)]
    return m, l, outs


def _split_range(start, end, s, sp: _Spec):
    """Blocks ``[lo, hi)`` of split ``s``: the live blocks of the sequence cut into ``ns`` contiguous chunks."""
    bt = jnp.int32(sp.bt)
    first = lax.div(start, bt)
    last = lax.div(end + (bt - 1), bt)
    per = lax.div(jnp.maximum(last - first, 0) + jnp.int32(sp.ns - 1), jnp.int32(sp.ns))
    lo = first + s * per
    return lo, jnp.minimum(lo + per, last)


# --------------------------------------------------------------------------------------------------------------
# GPU (Pallas Triton) kernel: whole-array refs, one program per (b, kv head, split), loop over blocks
# --------------------------------------------------------------------------------------------------------------
def _loop_kernel(start_ref, end_ref, q_ref, qs_ref, *refs, sp: _Spec, names, tile_of=None):
    """``tile_of(ins, b, h, blk) -> _Tile``: where block ``blk`` of sequence ``b`` lies (default: rows
    ``[blk * bt, (blk + 1) * bt)`` of the contiguous arrays; the paged kernel passes its page-table lookup)."""
    ins = dict(zip(names, refs[:len(names)]))
    o_ref, m_ref, l_ref = refs[len(names):]
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, end = start_ref[b], end_ref[b]
    lo, hi = _split_range(start, end, s, sp)
    qv = _query_values(lambda g, r: q_ref[b, h, g, r], qs_ref[b, h], sp)
    if tile_of is None:
        def tile_of(ins, b, h, blk):
            return _Tile(ins, (b, h), blk * sp.bt, blk * sp.gpb)

    def body(blk, state):
        return _block(state, qv, tile_of(ins, b, h, blk), blk * sp.bt, start, end, sp)

    m, l, outs = _outputs(lax.fori_loop(lo, hi, body, _init_state(sp)), sp)
    for g in range(sp.ngv):
        for r in range(sp.npv):
            o_ref[b, h, s, g, r] = outs[g][r]
    m_ref[b, h, s] = m
    l_ref[b, h, s] = l


def _gpu_call(start, end, qk, qs, arrays, sp: _Spec, names, cfg: KernelConfig, interpret):
    b, hkv = qk.shape[:2]
    out_shape = _out_shapes(b, hkv, sp)
    kw = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        kw["compiler_params"] = plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return pl.pallas_call(
        functools.partial(_loop_kernel, sp=sp, names=names),
        out_shape=out_shape,
        grid=(b, hkv, sp.ns),
        interpret=interpret,
        name=f"decode_attention_{sp.kf.payload}_{sp.vf.payload}",
        **kw,
    )(start, end, qk, qs, *arrays)


def _out_shapes(b, hkv, sp: _Spec):
    return (jax.ShapeDtypeStruct((b, hkv, sp.ns, sp.ngv, sp.npv, sp.mp, sp.gbv), _F32),
            jax.ShapeDtypeStruct((b, hkv, sp.ns, sp.mp, 1), _F32),
            jax.ShapeDtypeStruct((b, hkv, sp.ns, sp.mp, 1), _F32))


# --------------------------------------------------------------------------------------------------------------
# TPU (Mosaic) kernel: BlockSpec-delivered tiles, scalar-prefetched bounds, VMEM scratch accumulators
# --------------------------------------------------------------------------------------------------------------
def _grid_kernel(start_sref, end_sref, q_ref, qs_ref, *refs, sp: _Spec, names):
    n_in = len(names)
    ins = dict(zip(names, refs[:n_in]))
    o_ref, m_ref, l_ref, m_scr, l_scr, acc_scr, zacc_scr = refs[n_in:]
    b, s, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    start, end = start_sref[b], end_sref[b]
    lo, hi = _split_range(start, end, s, sp)
    blk = lo + j

    @pl.when(j == 0)
    def _init():
        m0, l0, accs0, zaccs0 = _init_state(sp)
        m_scr[...] = m0
        l_scr[...] = l0
        acc_scr[...] = jnp.zeros(acc_scr.shape, _F32)
        zacc_scr[...] = jnp.zeros(zacc_scr.shape, _F32)

    @pl.when(blk < hi)
    def _step():
        qv = _query_values(lambda g, r: q_ref[g, r], qs_ref[...], sp)
        state = (m_scr[...], l_scr[...],
                 [[acc_scr[g * sp.npv + r] for r in range(sp.npv)] for g in range(sp.ngv)],
                 [zacc_scr[g] for g in range(sp.ngv)])
        m, l, accs, zaccs = _block(state, qv, _Tile(ins, (), 0, 0), blk * sp.bt, start, end, sp)
        m_scr[...] = m
        l_scr[...] = l
        for g in range(sp.ngv):
            zacc_scr[g] = zaccs[g]
            for r in range(sp.npv):
                acc_scr[g * sp.npv + r] = accs[g][r]

    @pl.when(j == sp.nbps - 1)
    def _finish():
        state = (m_scr[...], l_scr[...],
                 [[acc_scr[g * sp.npv + r] for r in range(sp.npv)] for g in range(sp.ngv)],
                 [zacc_scr[g] for g in range(sp.ngv)])
        m, l, outs = _outputs(state, sp)
        for g in range(sp.ngv):
            for r in range(sp.npv):
                o_ref[g, r] = outs[g][r]
        m_ref[...] = m
        l_ref[...] = l


def _tpu_call(start, end, qk, qs, arrays, sp: _Spec, names, interpret):
    from jax.experimental.pallas import tpu as pltpu

    b, hkv = qk.shape[:2]

    def blk_index(bi, si, ji, st, en):
        lo, hi = _split_range(st[bi], en[bi], si, sp)
        return jnp.clip(jnp.minimum(lo + ji, hi - 1), 0, sp.nb - 1)

    def tile_spec(arr, rows):
        return pl.BlockSpec((None, None, rows, arr.shape[-1]),
                            lambda bi, hi_, si, ji, st, en: (bi, hi_, blk_index(bi, si, ji, st, en), 0))

    in_specs = [pl.BlockSpec((None, None) + qk.shape[2:], lambda bi, hi_, si, ji, st, en: (bi, hi_, 0, 0, 0, 0)),
                pl.BlockSpec((None, None, sp.mp, 1), lambda bi, hi_, si, ji, st, en: (bi, hi_, 0, 0))]
    for name, arr in zip(names, arrays):
        f = sp.kf if name[0] == "k" else sp.vf
        rows = sp.bt // f.group if (f.scale == "channel" and len(name) == 2) else sp.bt
        in_specs.append(tile_spec(arr, rows))
    out_shape = _out_shapes(b, hkv, sp)
    out_specs = [
        pl.BlockSpec((None, None, None) + out_shape[0].shape[3:],
                     lambda bi, hi_, si, ji, st, en: (bi, hi_, si, 0, 0, 0, 0)),
        pl.BlockSpec((None, None, None, sp.mp, 1), lambda bi, hi_, si, ji, st, en: (bi, hi_, si, 0, 0)),
        pl.BlockSpec((None, None, None, sp.mp, 1), lambda bi, hi_, si, ji, st, en: (bi, hi_, si, 0, 0)),
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, hkv, sp.ns, sp.nbps),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((sp.mp, 1), _F32), pltpu.VMEM((sp.mp, 1), _F32),
                        pltpu.VMEM((sp.ngv * sp.npv, sp.mp, sp.gbv), _F32), pltpu.VMEM((sp.ngv, sp.mp, 1), _F32)],
    )
    if interpret is True:
        interpret = pltpu.InterpretParams()
    return pl.pallas_call(
        functools.partial(_grid_kernel, sp=sp, names=names),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret if interpret else False,
        name=f"decode_attention_{sp.kf.payload}_{sp.vf.payload}",
    )(start, end, qk, qs, *arrays)


# --------------------------------------------------------------------------------------------------------------
# Wrapper: query planes, per-region partials, combine
# --------------------------------------------------------------------------------------------------------------
def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pick_block(rows: int, want: int, multiple: int) -> int:
    """Largest power of two <= max(want, multiple) that divides ``rows`` and is a multiple of ``multiple``."""
    bt = 1 << max(int(max(want, multiple)).bit_length() - 1, 0)
    while bt >= multiple:
        if rows % bt == 0 and bt % multiple == 0:
            return bt
        bt //= 2
    raise ValueError(f"no block size: {rows} rows is not a multiple of a power of two >= {multiple}")


def _query_planes(q4, kf: KVFormat, mp: int):
    """``[B, Hkv, G, D]`` -> ``[B, Hkv, NGk, P, Mp, D/P]`` (de-interleaved planes, per-group masked copies)."""
    b, hkv, g, d = q4.shape
    p = kf.codes_per_byte
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, mp - g), (0, 0)))
    planes = jnp.moveaxis(q4.reshape(b, hkv, mp, d // p, p), -1, 2)           # [B, Hkv, P, Mp, D/P]
    ng = kf.token_groups(d)
    if ng == 1:
        return planes[:, :, None]
    col_group = jnp.arange(d // p, dtype=jnp.int32) // (kf.group // p)
    return jnp.stack([jnp.where(col_group == gi, planes, 0.0) for gi in range(ng)], axis=2)


#: smallest CONTRACTION dimension of a compiled Triton dot with bf16 operands (the tensor-core MMA is m16n8k16:
#: K >= 16, N >= 8).  On the H200 (2026-12-01, ``experiments/check_paged_gpu.py``, the paged form of this kernel)
#: every bf16-operand run that contracted over fewer than 16 (8-row blocks in P @ V, K code planes of 4 or 8
#: columns in Q @ K^T, 4-row KIVI key groups) was wrong (rel err 0.6-10), while the same shapes with float32
#: operands, and every shape contracting over >= 16, were right; V planes of 8 output columns were right (KIVI-2,
#: docs/benchmarks_decode.md, rel err 7e-6).  Applied to every compiled GPU run (the precision is chosen after the
#: region is accepted, so float32-operand runs, which would be right, take the plain-JAX path too).
MMA_MIN = 16
#: smallest output (N) dimension of such a dot: V code planes are the N of P @ V.
MMA_MIN_N = 8


def mma_too_small(reg: Region, head_dim: int, block_rows: int | None = None) -> str | None:
    """Why a compiled GPU (Triton) run cannot take ``reg`` because a dot dimension is too small: the block (page)
    rows and a KIVI key group (contracted in P @ V), the K code-plane width (contracted in Q @ K^T) below
    :data:`MMA_MIN`, a V code-plane width (the N of P @ V) below :data:`MMA_MIN_N`.  None when every dimension is
    large enough.  (Interpreted runs take any size.)"""
    kf, vf = reg.k.fmt, reg.v.fmt
    if block_rows is not None and block_rows < MMA_MIN:
        return f"blocks of {block_rows} rows: the compiled GPU kernel needs >= {MMA_MIN}"
    if kf.scale == "channel" and kf.group < MMA_MIN:
        return f"channel group {kf.group}: the compiled GPU kernel needs key groups of >= {MMA_MIN} rows"
    for f, least, what in ((kf, MMA_MIN, "K"), (vf, MMA_MIN_N, "V")):
        if f.is_int:
            width = head_dim // f.codes_per_byte // f.token_groups(head_dim)
            if width < least:
                return f"{what} {f}: code-plane width {width} < {least} (the compiled GPU kernel's dots)"
    return None


def kernel_unsupported(reg: Region, head_dim: int, backend: str = "gpu", *, compiled_gpu: bool = False
                       ) -> str | None:
    """Why the kernel cannot take this region (None when it can); the dispatcher then uses the reference.
    ``compiled_gpu``: the kernel would be compiled by Triton for a GPU (not interpreted): :func:`mma_too_small`."""
    kf, vf = reg.k.fmt, reg.v.fmt
    rows = reg.k.data.shape[2]
    if compiled_gpu and backend == "gpu":
        why = mma_too_small(reg, head_dim)
        if why:
            return why
    if not _pow2(head_dim):
        return f"head_dim {head_dim} is not a power of two"
    if vf.scale == "channel":
        return "per-channel V scales"
    if kf.scale == "channel" and not _pow2(kf.group):
        return f"channel group {kf.group} is not a power of two"
    for f in (kf, vf):
        if f.is_int and not _pow2(head_dim // f.codes_per_byte // f.token_groups(head_dim)):
            return f"{f}: plane width is not a power of two"
    try:
        _pick_block(rows, 16 if backend == "gpu" else 8, kf.group if kf.scale == "channel" else 16)
    except ValueError as e:
        return str(e)
    return None


def _region_partial(q4, qs, q_dtype, reg: Region, cfg: KernelConfig, backend: str, interpret):
    """Split-K partials of one region: ``acc [B, Hkv, S, G, D]``, ``m, l [B, Hkv, S, G]`` (float32).

    ``q4``: unscaled float32 query ``[B, Hkv, G, D]``; ``qs``: float32 ``[B, Hkv, G]`` logit scale.
    """
    b, hkv, g, d = q4.shape
    kf, vf = reg.k.fmt, reg.v.fmt
    rows = reg.k.data.shape[2]
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {cfg.precision!r}")
    if cfg.unpack not in ("magic", "convert", "asm"):
        raise ValueError(f"unpack must be 'magic', 'convert' or 'asm', got {cfg.unpack!r}")
    _check_kivi_update(cfg.kivi_update)
    why = kernel_unsupported(reg, d, backend, compiled_gpu=not interpret)
    if why:
        raise ValueError(f"decode-attention kernel: {why}")
    op_k, dup, mp = _query_rows(g, kf, vf, cfg.precision, backend)
    group = kf.group if kf.scale == "channel" else 1
    mult = group
    if backend == "tpu" and kf.scale == "channel":   # the [bt / G, D] scale tile needs 8 sublanes (or all rows)
        mult = group * 8 if rows % (group * 8) == 0 else rows
    bt = _pick_block(rows, cfg.block_t, mult)
    ns = max(1, min(cfg.num_splits, rows // bt))
    unpack = cfg.unpack if (backend == "gpu" and not interpret) or cfg.unpack != "asm" else "magic"
    sub, kblock = _key_update(kf, bt, cfg.kivi_update)
    sp = _Spec(kf=kf, vf=vf, d=d, mp=mp, bt=bt, sub=sub, ns=ns,
               nb=rows // bt, precision=cfg.precision, unpack=unpack,
               q_exact=kf.scale != "channel" and jnp.dtype(q_dtype) == jnp.dtype(op_k), dup=dup, kblock=kblock)
    qk, qs, names, arrays = _launch_operands(q4, qs, reg, dup, mp)
    start = jnp.clip(reg.start.astype(jnp.int32), 0, rows)
    end = jnp.clip(reg.end.astype(jnp.int32), 0, rows)
    if backend == "tpu":
        o, m, l = _tpu_call(start, end, qk, qs, arrays, sp, names, interpret)
    else:
        o, m, l = _gpu_call(start, end, qk, qs, arrays, sp, names, cfg, interpret)
    return _kernel_partials(o, m, l, reg, g, dup)


def _query_rows(g: int, kf: KVFormat, vf: KVFormat, precision: str, backend: str):
    """``(K operand dtype, dup, mp)``: ``dup`` > 0 duplicates the G query rows for the hi / lo parts of p
    (bf16x2 with a 16-bit V operand); ``mp`` = query rows per KV head padded to the backend's tile."""
    op_k = _op_dtype(kf, precision)
    dup = g if precision == "bf16x2" and _op_dtype(vf, precision) != _F32 else 0
    rows_needed = 2 * g if dup else g
    mp = max(16, 1 << (rows_needed - 1).bit_length()) if backend == "gpu" else -(-rows_needed // 8) * 8
    return op_k, dup, mp


def _launch_operands(q4, qs, reg: Region, dup: int, mp: int):
    """Kernel inputs of one region: query planes ``[B, Hkv, ..., mp, ...]``, logit scales ``[B, Hkv, mp, 1]``
    (K per-head scale folded in), the operand names and arrays in :func:`_names` order."""
    kf, vf = reg.k.fmt, reg.v.fmt
    if kf.scale == "head":
        qs = qs * reg.k.scale.astype(_F32)[None, :, None]
    if dup:
        q4 = jnp.concatenate([q4, q4], axis=2)
        qs = jnp.concatenate([qs, qs], axis=2)
    qk = _query_planes(q4, kf, mp)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, mp - qs.shape[2])))[..., None]
    arrays = []
    for op in (reg.k, reg.v):
        arrays.append(op.data)
        if op.fmt.scale in ("token", "channel"):
            arrays.append(op.scale)
        if op.fmt.has_zero_array:
            arrays.append(op.zero)
    return qk, qs, _names(kf, vf), arrays


def _kernel_partials(o, m, l, reg: Region, g: int, dup: int):
    """Kernel outputs ``o [B, Hkv, S, NGv, P, Mp, Gb]``, ``m, l [B, Hkv, S, Mp, 1]`` -> the partials
    ``acc [B, Hkv, S, G, D]``, ``m, l [B, Hkv, S, G]`` (hi + lo rows added, V per-head scale applied)."""
    b, hkv, ns, _, _, mp, _ = o.shape
    # [B, Hkv, S, NGv, P, Mp, Gb] -> [B, Hkv, S, Mp, D]: channel d = (group * Gb + col) * P + plane
    o = jnp.transpose(o, (0, 1, 2, 5, 3, 6, 4)).reshape(b, hkv, ns, mp, -1)
    if dup:
        o = o[:, :, :, :g] + o[:, :, :, g:2 * g]
    if reg.v.fmt.scale == "head":
        o = o * reg.v.scale.astype(_F32)[None, :, None, None, None]
    return o[:, :, :, :g], m[:, :, :, :g, 0], l[:, :, :, :g, 0]


def _dense_partial(q4, qs, k, v, valid):
    """Partial of a small full-precision block in plain JAX: k, v ``[B, Hkv, N, D]`` f32, valid ``[B, N]``."""
    s = jnp.einsum("bhgd,bhnd->bhgn", q4, k, precision=lax.Precision.HIGHEST) * qs[..., None]
    s = jnp.where(valid[:, None, None, :], s, _NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.where(valid[:, None, None, :], jnp.exp(s - m[..., None]), 0.0)
    acc = jnp.einsum("bhgn,bhnd->bhgd", p, jnp.where(valid[:, None, :, None], v, 0.0),
                     precision=lax.Precision.HIGHEST)
    return acc[:, :, None], m[:, :, None], jnp.sum(p, axis=-1)[:, :, None]


def _small_region_partial(q4, qs, reg: Region):
    d = q4.shape[-1]
    rows = jnp.arange(reg.k.data.shape[2], dtype=jnp.int32)[None, :]
    valid = (rows >= reg.start[:, None]) & (rows < reg.end[:, None])
    k = dequantize_operand(reg.k, d, jnp, jnp.float32)
    v = dequantize_operand(reg.v, d, jnp, jnp.float32)
    return _dense_partial(q4, qs, k, v, valid)


def _combine(parts):
    """Merge split-K partials ``(acc, m, l)`` along the split axis into normalized outputs ``[B, Hkv, G, D]``."""
    acc = jnp.concatenate([p[0] for p in parts], axis=2)
    m = jnp.concatenate([p[1] for p in parts], axis=2)
    l = jnp.concatenate([p[2] for p in parts], axis=2)
    m_all = jnp.max(m, axis=2, keepdims=True)
    w = jnp.exp(m - m_all)
    den = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * acc, axis=2)
    return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def _resolve(backend, interpret):
    backend, interpret = resolve(backend, interpret)
    if backend == "tpu" and platform() != "tpu" and not interpret:
        raise ValueError("backend='tpu' needs a TPU or interpret=True")
    if backend == "gpu" and platform() != "gpu" and not interpret:
        raise ValueError("backend='gpu' needs a GPU or interpret=True")
    return backend, interpret


def decode_attention(q, regions: Sequence[Region] = (), *, k_new=None, v_new=None, sm_scale: float | None = None,
                     backend: str | None = None, interpret: Any = None,
                     config: KernelConfig | Sequence[KernelConfig | None] | None = None, small_rows: int = 0,
                     out_dtype=None):
    """Attention of one new token over quantized/full-precision regions (+ the exact current token), ONE softmax.

    Args:
      q: ``[B, Hq, D]`` query of the new token (Hq a multiple of Hkv; head h reads KV head ``h // (Hq/Hkv)``).
      regions: :class:`~kvquant_jax.abi.regions.Region` list (position-disjoint).
      k_new, v_new: optional ``[B, Hkv, D]`` exact K/V of the current token (always live).
      sm_scale: logit scale, default ``1/sqrt(D)``.
      backend: ``"gpu"`` (Pallas Triton; the interpreted kernel on CPU), ``"tpu"`` (Mosaic), None = by platform.
      interpret: None -> :func:`pallas_kernels.backend.default_interpret`; True -> interpreter (the TPU interpreter
        for ``backend="tpu"``); an ``InterpretParams`` is passed through.
      config: one :class:`KernelConfig` for every region, a per-region sequence, or None for
        :func:`default_config`.
      small_rows: regions of at most this many rows (a residual tail, sink rows) and regions the kernel cannot
        take (:func:`kernel_unsupported`) are attended in plain JAX and merged into the same softmax.
      out_dtype: output dtype (default ``q.dtype``).
    Returns ``[B, Hq, D]``.
    """
    regions = list(regions)
    b, hq, hkv, d = check_query(q, regions, k_new, v_new)
    g = hq // hkv
    backend, interpret = _resolve(backend, interpret)
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    q4 = q.astype(_F32).reshape(b, hkv, g, d)
    qs = jnp.full((b, hkv, g), scale, _F32)
    if config is None or isinstance(config, KernelConfig):
        configs = [config] * len(regions)
    else:
        configs = list(config)
        if len(configs) != len(regions):
            raise ValueError(f"{len(configs)} configs for {len(regions)} regions")
    parts = []
    for reg, cfg in zip(regions, configs):
        rows = reg.k.data.shape[2]
        if rows <= small_rows or kernel_unsupported(reg, d, backend, compiled_gpu=not interpret):
            parts.append(_small_region_partial(q4, qs, reg))
            continue
        if cfg is None:
            cfg = default_config(reg.k.fmt, rows, b, hkv, backend=backend, interpret=bool(interpret),
                                     query_dtype=q.dtype)
        parts.append(_region_partial(q4, qs, q.dtype, reg, cfg, backend, interpret))
    if k_new is not None:
        parts.append(_dense_partial(q4, qs, k_new.astype(_F32)[:, :, None], v_new.astype(_F32)[:, :, None],
                                    jnp.ones((b, 1), jnp.bool_)))
    return _combine(parts).reshape(b, hq, d).astype(out_dtype or q.dtype)


def decode_attention_reference(q, regions: Sequence[Region] = (), *, k_new=None, v_new=None,
                               sm_scale: float | None = None, backend: str | None = None, interpret: Any = None,
                               config: KernelConfig | Sequence[KernelConfig | None] | None = None,
                               small_rows: int = 0, out_dtype=None):
    """Plain-JAX twin of :func:`decode_attention` (same signature; the kernel-only arguments are ignored)."""
    del backend, interpret, config, small_rows
    return decode_attention_jnp(q, regions, k_new=k_new, v_new=v_new, sm_scale=sm_scale, out_dtype=out_dtype)
