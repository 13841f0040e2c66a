"""Mosaic GPU (Hopper) decode attention over one KIVI region: per-channel K groups folded into the query in SMEM.

Issue J.  KIVI stores K per channel over groups of ``G`` tokens (``k = u * s[g, d] + mn[g, d]``) and V per token
in groups of ``Gv`` channels (``v = u * sv[t, c] + mv[t, c]``), 2- or 4-bit codes ``u``, fp16 qparams.  The Pallas
Triton kernel (:mod:`pallas_kernels.decode_attention`) runs it at 0.16x cuDNN on the H200 (255 registers, 3 % of
DRAM bandwidth); this kernel keeps the swap-AB structure of :mod:`pallas_kernels.decode_attention_mgpu` (KV
tokens = wgmma M, the query-head group = N, one warpgroup, split-K partials merged by that module's
``_merge_partials``) and moves every per-group factor out of the per-code work.

Where the qparams go (per program: one ``(sequence, KV head)``, one split)
-------------------------------------------------------------------------
With ``q' = q * sm_scale * log2(e)`` (float32, outside the kernel)::

    logit_t / ln 2 = sum_d u[t, d] * (q'[d] s[g, d])  +  c[g]          c[g] = sum_d q'[d] mn[g, d]
    o[d]           = sum_t u[t, d] * (p_t sv[t, c(d)]) + z[c(d)]       z[c] = sum_t p_t mv[t, c]

* ``B_g = q' * s_g`` (``[D, N]``) is built per token group in registers and stored to SMEM as the wgmma B operand
  (bf16 hi + lo parts with ``precision="bf16x2"``: two wgmmas on the same code registers, ~1e-5 relative).
* ``c[g]`` (one scalar per group and query column) is ``q' . mn_g``: an einsum in the wrapper (float32, reads
  ``mn`` once, writes ``T/G x N`` floats; the kernel reads that instead of ``mn``).  The top plane's K codes are
  stored re-centred (below); the kernel reads them back as ``u`` with one bf16 add of ``_TOP_SHIFT`` per code, so
  ``c`` needs no per-plane correction (until 2026-12-06 ``c`` carried ``2^(bits-1) q' . s_g`` for the top plane's
  groups: a second einsum, a gather and a scatter in the wrapper).
* The wrapper's epilogue (:func:`_merge_partials`) merges the split partials, the dense tail and the current
  token in one softmax without concatenating them.
* ``p * sv[:, c]`` is the PV B operand, one per V channel group (hi/lo in the duplicated query columns, the v1
  kernel's "dup" trick); the V min term ``z`` is accumulated elementwise beside the softmax denominator (per-row
  partial sums ``[64, N]`` rescaled with it) and reduced once per split; the wrapper adds it to its channels.
* Codes stay exact integers in bf16; accumulation is float32.

Rows of one wgmma M tile (64 tokens, or 64 channels for the PV product) that belong to different groups take
different B operands: with ``G = 32`` the tile's two groups each get a wgmma (N = 8 each: free) and the rows pick
their group's result (warps 0-1 hold rows 0-31, warps 2-3 rows 32-63), so no scale is ever broadcast per row
group in registers.

Pack-time layout ("kivi mgpu layout": :func:`prepare_kivi_region`)
-----------------------------------------------------------------
Codes are packed along TOKENS, planar within a block of ``BT = 64 * P`` tokens (``P = 8 / bits`` codes per byte:
BT = 256 for 2-bit, 128 for 4-bit): byte ``i`` of block ``b`` holds tokens ``b*BT + 64*r + i`` at bits
``[bits*r, bits*(r+1))``, ``r < P``.  One loaded byte tile is then ``P`` wgmma M tiles (one shift + mask each)::

    k        int8 [BH, T/P, D]     K codes (byte rows = 64 token slots per block)
    v        int8 [BH, D, T/P]     V codes transposed (tokens contiguous: the PV A operand is V^T)
    k_scale  [BH, T/G, D]          s (the region's dtype: fp16 in a serving cache, f32 in tests)
    k_min    [BH, T/G, D]          mn (read by the wrapper's einsum, not by the kernel)
    v_scale, v_min  [BH, C, T]     sv, mv transposed (C = D / Gv channel groups; tokens contiguous for TMA)

Requirements: K ``KVFormat(int2|int4, "channel", "min", G)`` with ``16 <= G <= 64`` a power of two; V
``KVFormat(same bits, "token", "min", Gv)`` with ``Gv`` (0 = D) a power of two >= 16 dividing D; D a multiple of
64; T a multiple of BT.  :func:`kivi_mgpu_unsupported` says why not; the caller keeps the Triton kernel then.

Measured (H200, JAX 0.11.2, 2026-12-04, one run, docs/benchmarks_decode.md "2026-12-04 (evening)"): parity vs the
float64 oracle 2.8e-6 at worst (``bf16x2``) over 24 cases; B 8 Hq 32 Hkv 8 D 128, G = Gv = 32: KIVI-2 63.6 us at 4K
(0.61x cuDNN) and 397 us at 32K (0.62x), KIVI-4 56.0 us at 4K (0.69x), against the Triton kernel's 226 / 1554 us.
At 0.56 TB/s the kernel is bound neither by bytes nor by its instruction count.  Profiled on an H100 (2026-12-05,
"The limit, measured" / "The spill fixed" there): latency-bound at two warpgroups per SM; KIVI-2 spilled 507 MB
per call at 255 registers until ``wgmma_inflight=2`` (now its default): 1.07-1.09x cuDNN at 32K, KIVI-4 1.11x.
Through the dispatcher on a ``kivi2_planar`` / ``kivi4_planar`` cache, with this module's wrapper (H100,
2026-12-06, "2026-12-06 (later)" there): 1.05-1.08x / 1.10-1.11x cuDNN at 32K, 0.80-0.81x at 4K, where the kernel
takes 40-41 of 65-66 us.

Precision: the two split sums ``sum_t u*(p*sv)`` and ``z`` are each O(softmax mass) while ``o`` is an average, so
their float32 difference loses digits as T grows on flat attention (1.4e-4 / 3.4e-4 relative at 32K on random
data, ~3.6e-6 of max |v|); ``experiments/probe_kivi_cancellation.py`` shows the mechanism on CPU and that
re-centred codes would cut it 4-14x.

Per-token keys: with ``_KiviSpec.k_zero`` set the same kernel reads per-token K (a scale row and an optional zero
row per block instead of K groups; ``B = q'`` built once per program, the scale applied to the logits, ``m_t sum
q'`` added): :mod:`pallas_kernels.decode_attention_mgpu_planar` (per-token INT2 / INT4, QServe) is that entry.

Interpret mode runs :func:`_partials_jnp` (the same arithmetic on the prepared operands, plain JAX); only the H200
runs the kernel (``experiments/check_mgpu_kivi.py``: parity against the float64 oracle + timing).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax
from jax.experimental import pallas as pl

from kvquant_jax.abi import kivi_planar as kp
from kvquant_jax.abi.token_planar import zero_rows
from kvquant_jax.abi.reference import decode_attention_reference as _oracle_f64
from kvquant_jax.abi.reference import unpack_codes
from kvquant_jax.abi.regions import KVFormat, Region, check_query
from pallas_kernels.backend import default_interpret
from pallas_kernels.decode_attention_mgpu import (BARRIER_MODES, _auto_splits, _merge_partials, _tile_transforms,
                                                  barrier_compiler_params, hopper_unsupported, release_stage)

__all__ = ["KiviMgpuConfig", "KiviMgpuOperands", "kivi_mgpu_unsupported", "prepare_kivi_region",
           "kivi_planar_unsupported", "kivi_planar_layout_unsupported", "planar_operands", "decode_attention_kivi_planar",
           "pack_token_planar", "decode_attention_mgpu_kivi", "decode_attention_mgpu_kivi_prepared",
           "decode_attention_mgpu_kivi_partials", "decode_attention_mgpu_kivi_reference",
           "decode_attention_mgpu_kivi_reference_f64"]

_F32 = jnp.float32
_NEG = -1e30
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_M = 64                                  # wgmma M tile (tokens of a plane, channels of a PV tile)


#: KiviMgpuConfig.wgmma_inflight=None resolves per bit width (H100 measurement of 2026-12-05, the field's docstring)
DEFAULT_INFLIGHT = {2: 2, 4: 0}


@dataclasses.dataclass(frozen=True)
class KiviMgpuConfig:
    """Static knobs.

    num_splits: split-K programs per (sequence, KV head); None -> ~2 CTAs per SM.
    max_concurrent_steps: TMA pipeline depth (stages in SMEM).
    precision: "bf16x2" (hi + lo parts of q*s and of p*sv, ~1e-5 relative) or "bf16" (rounded once, ~1e-3).
    wgmma_inflight: wgmmas left in flight after each one is issued (a ``wgmma_wait`` after every issue), so the
        register A operands (64 x 64 bf16 code tiles, 16 registers per thread each) of completed wgmmas can be
        reused; 0 = no wait until the block's QK (or PV) wgmmas are all issued (every plane's codes live at once).
        None = per bit width (``DEFAULT_INFLIGHT``): 2 for KIVI-2, where on H100 it removed the register spills
        (507 MB -> 0 of local traffic per call at 32K) and cut the time 13-15 %; 0 for KIVI-4, which does not
        spill and ran 7 % slower with 2 (docs/benchmarks_decode.md, 2026-12-05).
    qk_plane_batch: planes whose QK accumulators (64 x N float32 each) share one scope; the scope ends with a
        wait for its wgmmas and the logits of its planes are formed before the next scope starts; 0 = all planes
        of a block in one scope.
    offsets: how the wrapper computes the logit offsets ``c = q' . mn`` (:func:`_group_offsets`, one of
        ``OFFSETS``): "highest" (a float32 ``einsum(precision=HIGHEST)``: 17.4 us at 32K on an H100, ~3x the time
        to read ``mn``); "bf16x3" (ONE bf16 GEMM with float32 accumulation over K = 3D: ``[qh | qh | ql] .
        [mh | ml | mh]``, the hi / lo bf16 parts of ``q'`` and ``mn``; ~1e-5 relative, CPU-tested, not yet timed);
        "rows" (one float32 multiply + sum over D per query column: sibling reductions that share ``mn``, not yet
        timed).  ``einsum(precision=HIGH)`` (8.5 us) and one multiply + sum over a ``[BH, T/G, N, D]`` product
        (29.8 us) were measured and refused (docs/benchmarks_decode.md, 2026-12-06 (third session)).
    barriers: what orders the kernel's shared memory (:data:`BARRIER_MODES`): ``"auto"``: Pallas's warpgroup
        barrier before and after every SMEM store (the B operands ``q' s_g`` and the ``p sv`` tiles: ~40 stores
        per KIVI-2 step at D 128, two barriers each) and before every TMA load; ``"explicit"`` (default;
        ``unsafe_no_auto_barriers``): the kernel's own ``commit_smem`` calls only -- after the B stores (before
        the QK wgmma), after the P stores (before the PV wgmma), one at the end of each step (every read of the
        pipeline stage done before the pipeline refills it) and the epilogue's; the previous step's wgmmas were
        waited for (their SMEM reads done) before the next stores, and ``a_smem`` is read between two of the
        softmax max's cross-warp barriers.  The same arithmetic: bit-identical outputs when the ordering is right
        (H100, JAX 0.11.2, 2026-12-07, T = 32K: identical errors; KIVI-2 312.7 -> 303.2 us, KIVI-4 299.3 -> 276.1,
        the token-planar bf16 kernel 1-2 % faster; docs/benchmarks_decode.md).
    """

    num_splits: Optional[int] = None
    max_concurrent_steps: int = 2
    precision: str = "bf16x2"
    wgmma_inflight: Optional[int] = None
    qk_plane_batch: int = 0
    offsets: str = "highest"
    barriers: str = "explicit"


#: the ways :func:`_group_offsets` can compute ``c`` (``KiviMgpuConfig.offsets``)
OFFSETS = ("highest", "bf16x3", "rows")


class _PlanarOperandShape:
    """Shape properties of token-planar kernel operands (``k: int8 [BH, T/P, D]`` and a static ``bits``): this
    module's KIVI operands and ``decode_attention_mgpu_planar.TokenPlanarOperands``."""

    @property
    def planes(self) -> int:
        return 8 // self.bits

    @property
    def block_t(self) -> int:
        return _M * self.planes

    @property
    def rows(self) -> int:
        return self.k.shape[1] * self.planes

    @property
    def head_dim(self) -> int:
        return self.k.shape[2]


@struct.dataclass
class KiviMgpuOperands(_PlanarOperandShape):
    """One KIVI region in the kivi mgpu layout (module docstring); shapes in the field comments."""

    k: jax.Array          # int8 [BH, T/P, D] token-planar K codes
    v: jax.Array          # int8 [BH, D, T/P] token-planar V^T codes
    k_scale: jax.Array    # [BH, T/G, D]
    k_min: jax.Array      # [BH, T/G, D]
    v_scale: jax.Array    # [BH, C, T]
    v_min: jax.Array      # [BH, C, T]
    start: jax.Array      # int32 [B]
    end: jax.Array        # int32 [B]
    bits: int = struct.field(pytree_node=False, default=2)
    k_group: int = struct.field(pytree_node=False, default=32)   # G tokens per K scale row
    v_group: int = struct.field(pytree_node=False, default=32)   # Gv channels per V scale
    num_kv_heads: int = struct.field(pytree_node=False, default=1)


# --------------------------------------------------------------------------------------------------------------
# Support matrix and pack-time layout (CPU-checkable)
# --------------------------------------------------------------------------------------------------------------
def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def kivi_formats_unsupported(kf: KVFormat, vf: KVFormat, head_dim: int, rows: int) -> Optional[str]:
    """Why this kernel cannot read a K/V format pair of this shape (None when it can)."""
    if kf.payload not in ("int2", "int4") or (kf.scale, kf.zero) != ("channel", "min"):
        return f"K {kf}: the KIVI kernel reads 2/4-bit per-channel min/scale keys (KVFormat(intN, 'channel', 'min'))"
    if vf.payload != kf.payload or (vf.scale, vf.zero) != ("token", "min"):
        return f"V {vf}: the KIVI kernel reads per-token min/scale values of K's bit width ({kf.payload})"
    bt = _M * (8 // kf.bits)
    if head_dim % 64:
        return f"head_dim {head_dim} is not a multiple of 64"
    if not (_pow2(kf.group) and 16 <= kf.group <= _M):
        return (f"K group {kf.group} must be a power of two in [16, 64] (a group lies inside one 64-token plane "
                "of the block)")
    gv = vf.group or head_dim
    if not (_pow2(gv) and gv >= 16 and head_dim % gv == 0):
        return f"V group {vf.group} must be 0 or a power of two >= 16 dividing head_dim {head_dim}"
    if rows % bt:
        return f"{rows} rows is not a multiple of the {kf.bits}-bit block of {bt} tokens"
    return None


def _config_unsupported(cfg: KiviMgpuConfig) -> Optional[str]:
    if cfg.precision not in ("bf16x2", "bf16"):
        return f"precision must be 'bf16x2' or 'bf16', got {cfg.precision!r}"
    if cfg.offsets not in OFFSETS:
        return f"offsets must be one of {OFFSETS}, got {cfg.offsets!r}"
    if cfg.barriers not in BARRIER_MODES:
        return f"barriers must be one of {BARRIER_MODES}, got {cfg.barriers!r}"
    for name, none_ok in (("wgmma_inflight", True), ("qk_plane_batch", False)):
        v = getattr(cfg, name)
        if v is None and none_ok:
            continue                                   # wgmma_inflight=None: DEFAULT_INFLIGHT of the bit width
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            return f"{name} must be an int >= 0{' or None' if none_ok else ''}, got {v!r}"
    return None


def kivi_mgpu_unsupported(reg: Region, head_dim: int, config: KiviMgpuConfig | None = None) -> Optional[str]:
    """Why this kernel cannot take the region (None when it can)."""
    why = kivi_formats_unsupported(reg.k.fmt, reg.v.fmt, head_dim, reg.k.data.shape[2])
    if why:
        return why
    return _config_unsupported(config or KiviMgpuConfig())


def pack_token_planar(u, bits: int, xp=jnp):
    """Unsigned codes ``[..., T/P * P, X]`` -> the kernel's token-planar bytes ``[..., T/P, X]`` as int8: the
    layout of :func:`kvquant_jax.abi.kivi_planar.pack_token_planar` with 64-token planes (byte row ``b*64 + i``
    holds tokens ``b*64P + 64r + i`` at bits ``bits*r``; the top plane's codes re-centred)."""
    byte = kp.pack_token_planar(u, bits, _M, xp=xp)
    return lax.bitcast_convert_type(byte, jnp.int8) if xp is jnp else byte.view(np.int8)


def unpack_token_planar(packed, bits: int, xp=np):
    """Inverse of :func:`pack_token_planar`: ``[..., T/P, X]`` int8 -> ``[..., T, X]`` int32 codes."""
    return kp.unpack_token_planar(packed, bits, _M, xp=xp)


def _top_plane_rows(t: int, bits: int, group: int = 1):
    """bool ``[T / group]``: which rows (or row groups of ``group`` <= 64 tokens) lie in a block's top plane."""
    p = 8 // bits
    rows = np.arange(0, t, group) % (_M * p)
    return rows >= _M * (p - 1)


def prepare_kivi_region(reg: Region, num_kv_heads: int | None = None) -> KiviMgpuOperands:
    """layout_version-1 KIVI region -> :class:`KiviMgpuOperands` (jit-able; one pass over the codes).

    ``reg.k.data``: ``[B, Hkv, T, D*bits/8]`` uint8 (offset-binary codes packed along D), ``reg.k.scale /
    reg.k.zero``: ``[B, Hkv, T/G, D]``; ``reg.v.data`` the same code layout, ``reg.v.scale / reg.v.zero``:
    ``[B, Hkv, T, C]``.
    """
    kf, vf = reg.k.fmt, reg.v.fmt
    b, hkv, t = reg.k.data.shape[:3]
    d = reg.k.data.shape[3] * 8 // kf.bits
    why = kivi_formats_unsupported(kf, vf, d, t)
    if why:
        raise NotImplementedError(f"decode_attention_mgpu_kivi: {why}")
    bh = b * hkv
    uk = unpack_codes(reg.k.data, kf.bits, jnp).reshape(bh, t, d)
    uv = unpack_codes(reg.v.data, vf.bits, jnp).reshape(bh, t, d)
    k = pack_token_planar(uk, kf.bits)                                   # [BH, T/P, D]
    v = jnp.swapaxes(pack_token_planar(uv, vf.bits), 1, 2)               # [BH, D, T/P]
    c = reg.v.scale.shape[-1]
    return KiviMgpuOperands(
        k=k, v=v, k_scale=reg.k.scale.reshape(bh, t // kf.group, d), k_min=reg.k.zero.reshape(bh, t // kf.group, d),
        v_scale=jnp.swapaxes(reg.v.scale.reshape(bh, t, c), 1, 2),
        v_min=jnp.swapaxes(reg.v.zero.reshape(bh, t, c), 1, 2),
        start=reg.start.astype(jnp.int32), end=reg.end.astype(jnp.int32), bits=kf.bits, k_group=kf.group,
        v_group=d // c, num_kv_heads=hkv)


# --------------------------------------------------------------------------------------------------------------
# The Mosaic GPU kernel
# --------------------------------------------------------------------------------------------------------------
class _PlaneBlock:
    """A kernel spec's block geometry from its static ``bits``: ``P = 8 / bits`` planes of 64 tokens per block."""

    @property
    def planes(self) -> int:
        return 8 // self.bits

    @property
    def bt(self) -> int:
        return _M * self.planes


@dataclasses.dataclass(frozen=True)
class _KiviSpec(_PlaneBlock):
    d: int
    g: int             # query heads per KV head
    n: int             # padded wgmma N (2g rounded up to 8 with bf16x2)
    dup: int           # > 0: columns [dup, 2 dup) carry lo(p * sv)
    bits: int
    kg: int            # K group (tokens)
    vg: int            # V group (channels)
    ns: int
    nbs: int           # blocks per split
    stages: int
    parts: int         # 2: B = q*s as bf16 hi + lo (two QK wgmmas); 1: rounded once
    inflight: int = 0  # > 0: wgmma_wait(inflight) after each issue (KiviMgpuConfig.wgmma_inflight)
    qk_batch: int = 0  # planes per QK accumulator scope (KiviMgpuConfig.qk_plane_batch); 0 = all
    hkv: int = 1       # KV heads (program pid reads the bounds of sequence pid // hkv)
    k_zero: str = ""   # "": KIVI keys (per-channel groups); per-token keys (``ks`` rows: scale [, zero]) with
                       # the zero convention "symmetric" (m = -2^(bits-1) s), "offset" (row 1 = o, m = -o s) or
                       # "min" (row 1 = m): ``k = u s_t + m_t``
    v_zero: str = "min"  # V's ``vm`` operand: "min" (mv as read), "offset" (o: mv = -o sv), "symmetric" (not
                         # read: mv = -2^(bits-1) sv)
    barriers: str = "explicit"  # KiviMgpuConfig.barriers

    @property
    def k_token(self) -> bool:        # per-token keys (decode_attention_mgpu_planar), not KIVI's channel groups
        return bool(self.k_zero)

    @property
    def k_rows(self) -> int:          # rows of the per-token ``ks`` operand
        return zero_rows(self.k_zero)

    @property
    def kgroups(self) -> int:         # K scale rows per block (KIVI keys)
        return self.bt // self.kg

    @property
    def vgroups(self) -> int:         # V channel groups
        return self.d // self.vg


def zero_min(s, z, kind: str, bits: int):
    """The min ``m`` of ``x = u s + m`` (``u`` the unsigned code) for one zero convention, from float32 scales ``s``
    and zeros ``z`` (None when symmetric): symmetric ``-2^(bits-1) s``, offset ``-z s``, min ``z``.  Elementwise: the
    kernel forms it per row from the stored rows, the plain-JAX twin per array."""
    if kind == "symmetric":
        return s * -(2.0 ** (bits - 1))
    return z if kind == "min" else -z * s


def _plane_mask(r: int, bits: int) -> int:
    """The int8 mask of plane ``r``: ``(2^bits - 1) << bits*r`` as a signed byte."""
    m = (2 ** bits - 1) << (bits * r)
    return m - 256 if m >= 128 else m


#: what the top plane's signed read is shifted by to give ``u * 2^(bits*r)`` back: ``2^(bits-1) * 2^(8-bits)``
_TOP_SHIFT = 128.0


def _plane(x, r: int, bits: int, unshift_top: bool = False):
    """Plane ``r`` of token-planar int8 bytes -> ``code * 2^(bits*r)`` as bf16 (exact), one AND + the signed
    int8 -> bf16 conversion (Mosaic GPU has no 8-bit shifts; the top plane comes out sign-extended, which the
    pack-time re-centring of its codes turns into ``(u - 2^(bits-1)) * 2^(bits*r)``).  ``unshift_top``: on the
    top plane add ``_TOP_SHIFT`` (one bf16 add, exact: the sum is ``u * 2^(8-bits) <= 255``) so the read is ``u``
    again -- the K planes, so the logit offsets need no top-plane term."""
    y = (x & jnp.full(x.shape, _plane_mask(r, bits), x.dtype)).astype(jnp.bfloat16)
    if unshift_top and r == 8 // bits - 1:
        y = y + jnp.full(y.shape, _TOP_SHIFT, jnp.bfloat16)
    return y


def _tile_groups(start: int, group: int) -> list[tuple[int, int]]:
    """Groups of ``group`` rows met by the 64-row tile starting at row ``start``: ``[(group index, first row of
    it inside the tile)]``."""
    if group >= _M:
        return [(start // group, 0)]
    return [((start + o) // group, o) for o in range(0, _M, group)]


def _kivi_call(start, end, qt, c, k, v, ks, vs, vm, sp: _KiviSpec):
    """Launch.  ``start, end``: int32 [B] (program ``pid`` reads entry ``pid // hkv``); ``qt``: f32 [BH, D, N] (q'
    transposed, dup'd, padded); ``k``: int8 [BH, T/P, D]; ``v``: int8 [BH, D, T/P]; ``vs, vm``: [BH, C, T].
    KIVI keys (``sp.k_zero == ""``): ``c`` f32 [BH, T/G, N], ``ks`` [BH, T/G, D].  Per-token keys: ``c`` None,
    ``ks`` [BH, k_rows, T] (scale, then the zero of ``sp.k_zero``), and ``B = q'`` is built once per program
    instead of once per K group.  ``vm`` (``sp.v_zero``: min or offset rows) is None when symmetric.
    Returns ``o [BH, S, D, N], z [BH, S, C, N], m [BH, S, N] (log2), l [BH, S, N]`` float32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bh = qt.shape[0]
    d, n, bt, ns, nbs, pln = sp.d, sp.n, sp.bt, sp.ns, sp.nbs, sp.planes
    nvg, parts, tok = sp.vgroups, sp.parts, sp.k_token
    bf16 = jnp.bfloat16
    wg = plgpu.Layout.WGMMA
    k_tf = _tile_transforms(jnp.int8, d)
    v_tf = _tile_transforms(jnp.int8, _M)
    b_tf = _tile_transforms(bf16, 64)
    dch = d // 64                     # 64-wide chunks of D (QK contraction; PV M tiles)
    # K groups met by each plane's 64 tokens (one slot: the whole plane, for per-token keys)
    kslots = [[(0, 0)] if tok else _tile_groups(r * _M, sp.kg) for r in range(pln)]
    vslots = [_tile_groups(j * _M, sp.vg) for j in range(dch)]     # V channel groups met by each d-tile
    nsl, nvs = len(kslots[0]), len(vslots[0])
    nq = parts * nsl * n                                           # QK wgmma N
    nb_planes = 1 if tok else pln                                  # B operands in SMEM (per plane for KIVI)
    # the pipelined inputs in order, and which are present
    names = ["k", "v", "ks", "vs"] + ([] if tok else ["c"]) + ([] if sp.v_zero == "symmetric" else ["vm"])
    half = 2.0 ** (sp.bits - 1)
    arrays = dict(k=k, v=v, ks=ks, vs=vs, c=c, vm=vm)

    def b_parts(bg):
        """f32 [D, N] -> the bf16 part(s) of a B operand (hi, then lo with bf16x2)."""
        hi16 = bg.astype(bf16)
        return [hi16] if parts == 1 else [hi16, (bg - hi16.astype(_F32)).astype(bf16)]

    def store_b(b_smem, r, si, halves):
        for pi, h in enumerate(halves):
            off = (pi * nsl + si) * n
            for j in range(dch):
                b_smem.at[r, j, pl.ds(off, n)].T[...] = plgpu.layout_cast(
                    h[j * 64:(j + 1) * 64], plgpu.Layout.WGMMA_TRANSPOSED)

    def body(start_ref, end_ref, qt_ref, *refs):
        in_refs = dict(zip(names, refs[:len(names)]))
        o_ref, z_ref, m_ref, l_ref = refs[len(names):]
        pid, sid, lo, hi, base = _program_rows(start_ref, end_ref, sp.hkv, nbs)

        def scoped(qt_smem, b_smem, p_smem, a_smem, o_smem, z_smem, m_smem, l_smem, q_bar):
            plgpu.copy_gmem_to_smem(qt_ref.at[pid], qt_smem, q_bar)
            plgpu.barrier_wait(q_bar)
            qt = plgpu.load(qt_smem, (), layout=wg, optimized=False)          # q'^T [D, N] f32
            qsum = None
            if tok:                     # B = q' for every block; sum_d q' for the per-token min term
                store_b(b_smem, 0, 0, b_parts(qt))
                plgpu.commit_smem()
                for j in range(dch):
                    part = qt[j * 64:(j + 1) * 64].sum(axis=0)
                    qsum = part if qsum is None else qsum + part

            def step(indices, *args):
                (i,) = indices
                sm = dict(zip(names, args[:len(names)]))
                k_smem, v_smem, ks_smem, vs_smem = sm["k"], sm["v"], sm["ks"], sm["vs"]
                accs, m_i, l_i, zs = args[len(names)]
                row0 = (base + i) * bt
                if not tok:
                    # 1. B = q' * s_g of the groups each plane meets, stacked along N (hi parts, then lo parts):
                    #    b_smem[r, j] rows [(pi * nsl + si) * n, +n) = part pi of slot si's group, D chunk j
                    for r in range(pln):
                        for si, (gidx, _) in enumerate(kslots[r]):
                            sg = plgpu.load(ks_smem.at[gidx], (), layout=wg.reduce(1), optimized=False).astype(_F32)
                            store_b(b_smem, r, si, b_parts(qt * lax.broadcast_in_dim(sg, (d, n), [0])))
                    plgpu.commit_smem()

                # 2. S^T per plane: ONE wgmma per D chunk (N = parts * slots * n), rows pick their group's columns
                #    (planes in batches of sp.qk_batch: one accumulator scope each, so only a batch's
                #    accumulators are live)
                def qk(planes, *acc_refs):
                    kbytes = k_smem[...]                                         # [64, D] int8, P planes
                    for acc_ref, r in zip(acc_refs, planes):
                        kr = _plane(kbytes, r, sp.bits, unshift_top=True)       # [64, D] bf16 codes u
                        for j in range(dch):
                            plgpu.wgmma(acc_ref, kr[:, j * 64:(j + 1) * 64], b_smem.at[0 if tok else r, j].T)
                            if sp.inflight:
                                plgpu.wgmma_wait(sp.inflight)
                    return [a_[...] for a_ in acc_refs]

                rows_t = plgpu.broadcasted_iota(jnp.int32, (_M, n), 0, layout=wg)
                ss, valids = [], []
                qb = sp.qk_batch or pln
                for b0 in range(0, pln, qb):
                    planes = tuple(range(b0, min(pln, b0 + qb)))
                    raw = pl.run_scoped(functools.partial(qk, planes),
                                        *[plgpu.ACC((_M, nq), _F32) for _ in planes])
                    for raw_r, r in zip(raw, planes):
                        s = None
                        for si, (gidx, off) in enumerate(kslots[r]):
                            sg = sum(raw_r[:, (pi * nsl + si) * n:(pi * nsl + si + 1) * n] for pi in range(parts))
                            sg = sg * (2.0 ** (-sp.bits * r))
                            if tok:             # logit = s_t (u . q') + m_t sum(q')
                                rows_ = pl.ds(r * _M, _M)
                                st, *zt = [plgpu.load(ks_smem.at[row, rows_], (), layout=wg.reduce(1),
                                                      optimized=False).astype(_F32) for row in range(sp.k_rows)]
                                mt = zero_min(st, zt[0] if zt else None, sp.k_zero, sp.bits)
                                sg = (sg * lax.broadcast_in_dim(st, (_M, n), [0])
                                      + lax.broadcast_in_dim(mt, (_M, n), [0]) * lax.broadcast_in_dim(qsum, (_M, n), [1]))
                            else:
                                cg = plgpu.load(sm["c"].at[gidx, pl.ds(0, n)], (), layout=wg.reduce(0),
                                                optimized=False)
                                sg = sg + lax.broadcast_in_dim(cg, (_M, n), [1])
                            s = sg if s is None else jnp.where(rows_t >= off, sg, s)
                        rows = rows_t + (row0 + r * _M)
                        valid = (rows >= lo) & (rows < hi)
                        ss.append(jnp.where(valid, s, _NEG))
                        valids.append(valid)

                # 3. online softmax: ONE cross-warp max for the block
                m_new, alpha = _online_max(ss, m_i)
                alpha_t = lax.broadcast_in_dim(alpha, (_M, n), [1])
                l_i = l_i * alpha_t
                zs = [z * alpha_t for z in zs]
                cols = plgpu.broadcasted_iota(jnp.int32, (_M, n), 1, layout=wg)
                for r in range(pln):
                    p = jnp.where(valids[r], jnp.exp2(ss[r] - lax.broadcast_in_dim(m_new, (_M, n), [1])), 0.0)
                    l_i = l_i + p
                    pvs = {}
                    for ci in range(nvg):
                        sv = plgpu.load(vs_smem.at[ci, pl.ds(r * _M, _M)], (), layout=wg.reduce(1),
                                        optimized=False).astype(_F32)
                        if sp.v_zero == "symmetric" and r == pln - 1:
                            mv = None           # symmetric: mv + 2^(b-1) sv below is 0 on the re-centred top plane
                        else:
                            zv = None if sp.v_zero == "symmetric" else plgpu.load(
                                sm["vm"].at[ci, pl.ds(r * _M, _M)], (), layout=wg.reduce(1), optimized=False
                            ).astype(_F32)
                            mv = zero_min(sv, zv, sp.v_zero, sp.bits)
                            if r == pln - 1:    # re-centred top-plane codes: v = (u - 2^(b-1)) sv + (mv + 2^(b-1) sv)
                                mv = mv + half * sv
                        sv = sv * (2.0 ** (-sp.bits * r))   # the plane's codes come out times 2^(bits*r)
                        if mv is not None:
                            zs[ci] = zs[ci] + jnp.where(valids[r], p * lax.broadcast_in_dim(mv, (_M, n), [0]), 0.0)
                        pv = jnp.where(valids[r], p * lax.broadcast_in_dim(sv, (_M, n), [0]), 0.0)
                        if sp.dup:
                            pv = jnp.where(cols < sp.dup, pv, pv - pv.astype(bf16).astype(_F32))
                        pvs[ci] = plgpu.layout_cast(pv.astype(bf16), plgpu.Layout.WGMMA_TRANSPOSED)
                    for j in range(dch):
                        for si, (ci, _) in enumerate(vslots[j]):
                            p_smem.at[r, j, pl.ds(si * n, n)].T[...] = pvs[ci]
                if nvs > 1:             # alpha tiled over the PV slots (no concatenate in Mosaic GPU): via SMEM
                    for si in range(nvs):
                        a_smem.at[pl.ds(si * n, n)][...] = alpha
                plgpu.commit_smem()     # (a fence + warpgroup barrier)
                alpha_w = alpha if nvs == 1 else plgpu.load(a_smem, (), layout=wg.reduce(0), optimized=False)

                # 4. O^T[d-tile j] += V^T plane r [64, 64] @ P chunk (r, j): ONE wgmma per (plane, d-tile),
                #    N = the tile's channel-group slots * n
                accs = [a_ * lax.broadcast_in_dim(alpha_w, a_.shape, [1]) for a_ in accs]

                def pv_fn(acc_refs):
                    for j in range(dch):
                        vbytes = v_smem[pl.ds(j * _M, _M), :]
                        for r in range(pln):
                            plgpu.wgmma(acc_refs[j], _plane(vbytes, r, sp.bits), p_smem.at[r, j].T)
                            if sp.inflight:
                                plgpu.wgmma_wait(sp.inflight)

                accs = list(pl.run_state(pv_fn)([plgpu.ACC.init(a_) for a_ in accs]))
                release_stage(sp.barriers)
                return accs, m_new, l_i, zs

            blk = lambda i: (base + i, 0)            # noqa: E731  (token rows first)
            blk_t = lambda i: (0, base + i)          # noqa: E731  (tokens last)
            spec_of = {
                "k": plgpu.BlockSpec((_M, d), blk, transforms=k_tf),
                "v": plgpu.BlockSpec((d, _M), blk_t, transforms=v_tf),
                "ks": plgpu.BlockSpec((sp.k_rows, bt), blk_t) if tok else plgpu.BlockSpec((sp.kgroups, d), blk),
                "vs": plgpu.BlockSpec((nvg, bt), blk_t),
                "c": None if tok else plgpu.BlockSpec((sp.kgroups, arrays["c"].shape[-1]), blk),
                "vm": plgpu.BlockSpec((nvg, bt), blk_t)}
            specs = [spec_of[nm] for nm in names]
            refs_in = [in_refs[nm].at[pid] for nm in names]
            zero_t = lambda w=n: plgpu.layout_cast(jnp.full((_M, w), 0.0, _F32), wg)  # noqa: E731
            accs0 = [zero_t(nvs * n) for _ in range(dch)]
            m0 = plgpu.layout_cast(jnp.full((n,), _NEG, _F32), wg.reduce(0))
            carry0 = (accs0, m0, zero_t(), [zero_t() for _ in range(nvg)])
            accs, m_i, l_i, zs = plgpu.emit_pipeline(
                step, grid=(nbs,), in_specs=specs, max_concurrent_steps=min(sp.stages, nbs),
                init_carry=carry0)(*refs_in)
            rows_t = plgpu.broadcasted_iota(jnp.int32, (_M, n), 0, layout=wg)
            for j in range(dch):
                o = None
                for si, (_, off) in enumerate(vslots[j]):
                    a = accs[j][:, si * n:(si + 1) * n]
                    o = a if o is None else jnp.where(rows_t >= off, a, o)
                o_smem.at[pl.ds(j * _M, _M)][...] = o
            _write_split_outputs((o_smem, z_smem, m_smem, l_smem), (o_ref, z_ref, m_ref, l_ref), zs, m_i, l_i,
                                 pid, sid)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((d, n), _F32),
            plgpu.SMEM((nb_planes, dch, nq, 64), bf16, transforms=b_tf),
            plgpu.SMEM((pln, dch, nvs * n, 64), bf16, transforms=b_tf),
            plgpu.SMEM((nvs * n,), _F32),
            plgpu.SMEM((d, n), _F32),
            plgpu.SMEM((nvg, n), _F32),
            plgpu.SMEM((n,), _F32),
            plgpu.SMEM((n,), _F32),
            plgpu.Barrier(num_arrivals=1),
        )

    fn = plgpu.kernel(body, out_type=_split_out_types(bh, ns, d, n, nvg), grid=(bh, ns), grid_names=("bh", "split"),
                      compiler_params=plgpu.CompilerParams(approx_math=True, **barrier_compiler_params(sp.barriers)))
    return fn(start, end, qt, *[arrays[nm] for nm in names])


def _program_rows(start_ref, end_ref, hkv: int, nbs: int):
    """A split-K token-planar kernel program's place (inside the kernel; grid ``("bh", "split")``): ``(pid, sid,
    lo, hi, base)`` -- its (sequence, KV head) and split, the live rows ``[lo, hi)`` of sequence ``pid // hkv``, and
    its first block ``sid * nbs``."""
    pid = lax.axis_index("bh")
    sid = lax.axis_index("split")
    return pid, sid, start_ref[pid // hkv], end_ref[pid // hkv], sid * nbs


def _online_max(ss, m_i):
    """The online softmax's step over one block (inside a kernel): the new running max ``m_new`` (``[N]``, log2
    units) of ``m_i`` and the planes' logits ``ss`` (``[64, N]`` each; ONE cross-warp max for the block) and the
    rescale ``alpha = 2^(m_i - m_new)`` of what was accumulated before."""
    smax = ss[0]
    for s in ss[1:]:
        smax = jnp.maximum(smax, s)
    m_new = jnp.maximum(m_i, smax.max(axis=0))
    return m_new, jnp.exp2(m_i - m_new)


def _split_out_types(bh: int, ns: int, d: int, n: int, nvg: int):
    """The token-planar kernels' outputs: ``o [BH, S, D, N], z [BH, S, C, N], m, l [BH, S, N]`` float32."""
    return (jax.ShapeDtypeStruct((bh, ns, d, n), _F32), jax.ShapeDtypeStruct((bh, ns, nvg, n), _F32),
            jax.ShapeDtypeStruct((bh, ns, n), _F32), jax.ShapeDtypeStruct((bh, ns, n), _F32))


def _write_split_outputs(smem, out_refs, zs, m_i, l_i, pid, sid) -> None:
    """A token-planar kernel's epilogue (inside the kernel, ``o`` already in ``smem[0]``): the V min sums ``zs`` (one
    ``[64, N]`` per channel group), the running max ``m_i`` and the row sums of ``l_i`` to ``smem[1:]`` (``z, m,
    l`` SMEM refs), then all four to the outputs ``out_refs`` at ``[pid, sid]``."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    o_smem, z_smem, m_smem, l_smem = smem
    for ci, z in enumerate(zs):
        z_smem.at[ci][...] = z.sum(axis=0)
    m_smem[...] = m_i
    l_smem[...] = l_i.sum(axis=0)
    plgpu.commit_smem()
    for sm, ref in zip(smem, out_refs):
        plgpu.copy_smem_to_gmem(sm, ref.at[pid, sid])
    plgpu.wait_smem_to_gmem(0)


def _spec_for(ops: KiviMgpuOperands, g: int, cfg: KiviMgpuConfig | None) -> _KiviSpec:
    cfg = cfg or KiviMgpuConfig()
    why = _config_unsupported(cfg)
    if why:
        raise ValueError(why)
    dup = g if cfg.precision == "bf16x2" else 0
    n = max(8, -(-(2 * g if dup else g) // 8) * 8)
    bt = ops.block_t
    if ops.rows % bt:
        raise ValueError(f"{ops.rows} rows is not a multiple of the {ops.bits}-bit block of {bt} tokens")
    nb = ops.rows // bt
    ns = cfg.num_splits or _auto_splits(ops.k.shape[0], nb)
    if nb % ns:
        raise ValueError(f"num_splits={ns} does not divide the {nb} blocks")
    return _KiviSpec(d=ops.head_dim, g=g, n=n, dup=dup, bits=ops.bits, kg=ops.k_group, vg=ops.v_group, ns=ns,
                     nbs=nb // ns, stages=cfg.max_concurrent_steps, parts=2 if dup else 1,
                     inflight=DEFAULT_INFLIGHT[ops.bits] if cfg.wgmma_inflight is None else cfg.wgmma_inflight,
                     qk_batch=cfg.qk_plane_batch, hkv=ops.num_kv_heads, barriers=cfg.barriers)


def _scaled_query_block(q, hkv: int, n: int, dup: int, sm_scale):
    """``[B, Hq, D]`` -> ``q'`` ``[B*Hkv, N, D]`` float32: times ``sm_scale * log2 e``, rows duplicated for
    bf16x2, zero-padded to N."""
    b, hq, d = q.shape
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    q4 = q.astype(_F32).reshape(b, hkv, hq // hkv, d) * (scale * _LOG2E)
    if dup:
        q4 = jnp.concatenate([q4, q4], axis=2)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, n - q4.shape[2]), (0, 0)))
    return q4.reshape(b * hkv, n, d)


def decode_attention_mgpu_kivi_partials(q, ops: KiviMgpuOperands, *, sm_scale: float | None = None,
                                        config: KiviMgpuConfig | None = None, interpret: Any = False):
    """Split-K partials of one prepared KIVI region.  ``q``: ``[B, Hq, D]``.  Returns ``acc [B, Hkv, S, G, D], m,
    l [B, Hkv, S, G]`` float32 (natural-log ``m``), the format of ``decode_attention._combine``'s inputs."""
    cfg = config or KiviMgpuConfig()
    if interpret:
        why = _config_unsupported(cfg)
        if why:
            raise ValueError(why)
        return _partials_jnp(q, ops, sm_scale, cfg.offsets)
    b, hq, d = q.shape
    hkv = ops.num_kv_heads
    g = hq // hkv
    sp = _spec_for(ops, g, cfg)
    qb = _scaled_query_block(q, hkv, sp.n, sp.dup, sm_scale)                       # [BH, N, D]
    c = _group_offsets(qb, ops.k_min, cfg.offsets)
    cn = max(sp.n, 128 // (4 * sp.kgroups))         # a TMA tile of >= 128 bytes (one per thread of the warpgroup)
    c = jnp.pad(c, ((0, 0), (0, 0), (0, cn - sp.n)))
    out = _kivi_call(ops.start.astype(jnp.int32), ops.end.astype(jnp.int32), jnp.swapaxes(qb, 1, 2), c,
                     ops.k, ops.v, ops.k_scale, ops.v_scale, ops.v_min, sp)
    return _kernel_partials(out, sp, b, hkv)


def _kernel_partials(out, sp: _KiviSpec, b: int, hkv: int):
    """The kernel's outputs ``(o [BH, S, D, N], z [BH, S, C, N], m, l [BH, S, N])`` -> the partials ``acc [B, Hkv,
    S, G, D], m, l [B, Hkv, S, G]`` (natural-log ``m``): V's min term ``z`` added to its channels (once: not in the
    lo columns), the hi + lo column halves of ``bf16x2`` summed, the padding columns dropped."""
    o, z, m, l = out
    ns, d, g = o.shape[1], sp.d, sp.g
    z_cols = jnp.arange(sp.n) < (sp.dup or sp.n)                                  # z once (not in lo columns)
    o = o + jnp.where(z_cols, jnp.repeat(z, sp.vg, axis=2), 0.0)
    o = jnp.swapaxes(o, 2, 3).reshape(b, hkv, ns, sp.n, d)
    acc = o[:, :, :, :g] + (o[:, :, :, g:2 * g] if sp.dup else 0.0)
    return acc, (m.reshape(b, hkv, ns, sp.n) * _LN2)[..., :g], l.reshape(b, hkv, ns, sp.n)[..., :g]


def _group_offsets(qb, k_min, method: str = "highest"):
    """``c [BH, T/G, N]`` float32: per K group and query column, ``q' . mn_g`` (no per-group correction: the kernel
    reads the top plane's re-centred K codes back as ``u``).  ``qb``: ``q' [BH, N, D]`` float32; ``k_min``: ``mn
    [BH, T/G, D]`` (fp16 in a serving cache, float32 in tests); ``method``: ``KiviMgpuConfig.offsets``."""
    mn = k_min.astype(_F32)
    if method == "highest":
        return jnp.einsum("xnd,xgd->xgn", qb, mn, precision=lax.Precision.HIGHEST)
    if method == "bf16x3":
        # x = hi + lo with hi = bf16(x), lo = bf16(x - hi): exact for an fp16 mn, ~2^-16 relative for float32;
        # q'.mn = qh.(mh + ml) + ql.mh, dropping ql.ml (~2^-16 of the sum of |q'_d mn_d|), as one GEMM over 3D
        qh = qb.astype(jnp.bfloat16)
        ql = (qb - qh.astype(_F32)).astype(jnp.bfloat16)
        mh = mn.astype(jnp.bfloat16)
        ml = (mn - mh.astype(_F32)).astype(jnp.bfloat16)
        return jnp.einsum("xnd,xgd->xgn", jnp.concatenate([qh, qh, ql], axis=-1),
                          jnp.concatenate([mh, ml, mh], axis=-1), preferred_element_type=_F32)
    if method == "rows":
        return jnp.stack([jnp.sum(mn * qb[:, None, j, :], axis=-1) for j in range(qb.shape[1])], axis=-1)
    raise ValueError(f"offsets must be one of {OFFSETS}, got {method!r}")


def _masked_planes(packed, bits: int):
    """Token-planar bytes ``[BH, T/P, X]`` -> per plane ``byte & mask`` as a signed int32 ``[BH, T, X]`` (what the
    kernels read: ``u 2^(bits r)``, the top plane ``(u - 2^(bits-1)) 2^(bits r)``)."""
    p = 8 // bits
    bh, tp, x = packed.shape
    b = packed.reshape(bh, tp // _M, 1, _M, x)
    masks = jnp.asarray([_plane_mask(r, bits) for r in range(p)], jnp.int8).reshape(p, 1, 1)
    return (b & masks).astype(jnp.int32).reshape(bh, tp * p, x)


def _planes_as_kernel(packed, bits: int, unshift_top: bool = False):
    """The bf16 kernels' reading of token-planar bytes ``[BH, T/P, X]``: :func:`_masked_planes` (plus
    ``_TOP_SHIFT`` on the top plane with ``unshift_top``: the K read), times ``2^(-bits*r)`` -> ``[BH, T, X]``
    float32 (``u``; ``u - 2^(bits-1)`` on the top plane without ``unshift_top``: the V read)."""
    p = 8 // bits
    bh, tp, x = packed.shape
    shift = jnp.asarray([_TOP_SHIFT if unshift_top and r == p - 1 else 0.0 for r in range(p)], _F32)
    scale = jnp.asarray([2.0 ** (-bits * r) for r in range(p)], _F32)
    per_row = lambda a: jnp.tile(jnp.repeat(a, _M), tp // _M)[None, :, None]  # noqa: E731  (row -> its plane)
    return (_masked_planes(packed, bits).astype(_F32) + per_row(shift)) * per_row(scale)


def _partials_jnp(q, ops: KiviMgpuOperands, sm_scale, offsets: str = "highest"):
    """Plain-JAX partials (one split) in the kernel's algebra, from the prepared operands: the planes read as the
    kernel reads them, the logit offsets ``c`` of :func:`_group_offsets` (``offsets``: its method), ``p * sv`` and
    the V min term with the top plane's shifted min, all float32."""
    b, hq, d = q.shape
    hkv = ops.num_kv_heads
    g = hq // hkv
    t, bits = ops.rows, ops.bits
    hp = lax.Precision.HIGHEST
    qb = _scaled_query_block(q, hkv, g, 0, sm_scale)                                 # [BH, G, D] (log2 units)
    uk = _planes_as_kernel(ops.k, bits, unshift_top=True)                            # [BH, T, D]
    uv = _planes_as_kernel(jnp.swapaxes(ops.v, 1, 2), bits)                          # [BH, T, D]
    ks = jnp.repeat(ops.k_scale.astype(_F32), ops.k_group, 1)                        # [BH, T, D]
    c = jnp.repeat(_group_offsets(qb, ops.k_min, offsets), ops.k_group, 1)          # [BH, T, G]
    s = jnp.einsum("xgd,xtd->xgt", qb, uk * ks, precision=hp) + jnp.swapaxes(c, 1, 2)
    top = jnp.asarray(_top_plane_rows(t, bits))[None, :, None]
    sv = jnp.repeat(jnp.swapaxes(ops.v_scale.astype(_F32), 1, 2), ops.v_group, 2)   # [BH, T, D]
    mv = jnp.repeat(jnp.swapaxes(ops.v_min.astype(_F32), 1, 2), ops.v_group, 2)
    mv = jnp.where(top, mv + (2.0 ** (bits - 1)) * sv, mv)
    return _twin_softmax_pv(s, uv, sv, mv, ops.start, ops.end, b, hkv)


def _twin_softmax_pv(s, uv, sv, mv, start, end, b: int, hkv: int):
    """The plain-JAX twins' second half (one split): ``s [BH, G, T]`` log2-unit logits, ``uv`` the V planes as the
    kernel reads them, ``sv, mv [BH, T, D]`` (``mv`` with the top plane's shift), live rows ``[start, end)`` (``[B]``
    each) -> ``acc [B, Hkv, 1, G, D], m, l [B, Hkv, 1, G]`` float32 (natural-log ``m``)."""
    hp = lax.Precision.HIGHEST
    g, t = s.shape[1], s.shape[2]
    rows = jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.repeat((rows >= start[:, None]) & (rows < end[:, None]), hkv, 0)[:, None, :]
    s = jnp.where(valid, s, _NEG)
    m = jnp.max(s, axis=-1)                                                          # [BH, G]
    p = jnp.where(valid, jnp.exp2(s - m[..., None]), 0.0)
    live = valid[:, 0, :, None]
    acc = (jnp.einsum("xgt,xtd->xgd", p, jnp.where(live, uv * sv, 0.0), precision=hp)
           + jnp.einsum("xgt,xtd->xgd", p, jnp.where(live, mv, 0.0), precision=hp))
    sh = (b, hkv, 1, g)
    return acc.reshape(sh + (uv.shape[-1],)), (m * _LN2).reshape(sh), jnp.sum(p, axis=-1).reshape(sh)


def decode_attention_mgpu_kivi_prepared(q, ops: KiviMgpuOperands, *, k_new=None, v_new=None,
                                        sm_scale: float | None = None, config: KiviMgpuConfig | None = None,
                                        interpret: Any = False, out_dtype=None):
    """Attention of the new token over one prepared KIVI region (+ the exact current token), ONE softmax.
    ``q [B, Hq, D]``; ``k_new, v_new`` optional ``[B, Hkv, D]``; returns ``[B, Hq, D]`` (``out_dtype``, default
    ``q.dtype``)."""
    part = decode_attention_mgpu_kivi_partials(q, ops, sm_scale=sm_scale, config=config, interpret=interpret)
    return _merge_partials(q, part, ops.num_kv_heads, sm_scale, k_new=k_new, v_new=v_new,
                           out_dtype=out_dtype or q.dtype)


def kivi_planar_unsupported(q, fmt: kp.KiviPlanarFormat, operand: kp.KiviPlanarOperand) -> Optional[str]:
    """Why this kernel cannot read a token-planar KIVI cache layer in place on this device (None when it can): the
    dispatcher's refusal check (``attention.dispatch.FUSED_KERNELS``): not a Hopper GPU, or
    :func:`kivi_planar_layout_unsupported` (float32 queries are fine: ``bf16x2`` keeps ~1e-5)."""
    return hopper_unsupported() or kivi_planar_layout_unsupported(q, fmt, operand)


def kivi_planar_layout_unsupported(q, fmt: kp.KiviPlanarFormat, operand: kp.KiviPlanarOperand) -> Optional[str]:
    """Why the kernel cannot read this token-planar layer's shapes (any device; None when it can)."""
    if fmt.plane_rows != _M:
        return f"plane_rows {fmt.plane_rows}: the kernel reads 64-token planes (one wgmma M tile)"
    kf = KVFormat(f"int{fmt.bits}", "channel", "min", fmt.group)
    vf = KVFormat(f"int{fmt.bits}", "token", "min", fmt.v_group)
    return kivi_formats_unsupported(kf, vf, q.shape[-1], operand.k_codes.shape[2] * fmt.planes)


def planar_operands(fmt: kp.KiviPlanarFormat, operand: kp.KiviPlanarOperand) -> KiviMgpuOperands:
    """A token-planar cache layer as the kernel's operands, with no pass over the codes (reshapes and a uint8 ->
    int8 bitcast of the stored arrays): the cache stores exactly the kivi mgpu layout, ``[B, Hkv, ...]`` ->
    ``[B*Hkv, ...]``; the region is ``[0, operand.end)``."""
    b, hkv, nr, d = operand.k_codes.shape
    bh = b * hkv
    as_i8 = lambda a, shape: lax.bitcast_convert_type(a.reshape(shape), jnp.int8)  # noqa: E731
    c, rows = operand.v_scale.shape[2:]
    return KiviMgpuOperands(
        k=as_i8(operand.k_codes, (bh, nr, d)), v=as_i8(operand.v_codes, (bh, d, nr)),
        k_scale=operand.k_scale.reshape(bh, -1, d), k_min=operand.k_min.reshape(bh, -1, d),
        v_scale=operand.v_scale.reshape(bh, c, rows), v_min=operand.v_min.reshape(bh, c, rows),
        start=jnp.zeros_like(operand.end), end=operand.end.astype(jnp.int32), bits=fmt.bits, k_group=fmt.group,
        v_group=d // c, num_kv_heads=hkv)


def decode_attention_kivi_planar(q, fmt: kp.KiviPlanarFormat, operand: kp.KiviPlanarOperand, lengths=None,
                                 k_new=None, v_new=None, *, sm_scale: float | None = None,
                                 config: KiviMgpuConfig | None = None, interpret: Any = None, out_dtype=None):
    """Decode attention over one token-planar KIVI cache layer read in place (the dispatcher's fused-kernel entry
    for :class:`~kvquant_jax.abi.kivi_planar.KiviPlanarFormat`): the kernel over the quantized rows ``[0,
    operand.end)``, the dense tail (``operand.tail_k / tail_v``, ``tail_len`` rows) and the exact current token
    (``k_new, v_new [B, Hkv, D]``) in ONE softmax.  ``q [B, Hq, D]``; returns ``[B, Hq, D]`` in ``out_dtype``,
    default float32 (not ``q.dtype``: the dispatcher casts to what its caller asked for, so a bf16 query with a
    float32 ``out_dtype`` is not rounded to bf16 on the way).  ``lengths`` is not read (the operand's bounds come
    from them already).  ``interpret`` (None: off on a GPU only) runs the plain-JAX partials (CPU tests)."""
    del lengths
    interpret = bool(interpret) if interpret is not None else default_interpret()
    why = kivi_planar_layout_unsupported(q, fmt, operand)
    if why:
        raise NotImplementedError(f"decode_attention_kivi_planar: {why}")
    ops = planar_operands(fmt, operand)
    part = decode_attention_mgpu_kivi_partials(q, ops, sm_scale=sm_scale, config=config, interpret=interpret)
    nt = operand.tail_k.shape[2]
    tail = None
    if nt:
        live = jnp.arange(nt, dtype=jnp.int32)[None, :] < operand.tail_len[:, None]
        tail = (operand.tail_k, operand.tail_v, live)
    return _merge_partials(q, part, ops.num_kv_heads, sm_scale, tail=tail, k_new=k_new, v_new=v_new,
                           out_dtype=out_dtype or _F32)


def decode_attention_mgpu_kivi(q, region: Region, *, k_new=None, v_new=None, sm_scale: float | None = None,
                               config: KiviMgpuConfig | None = None, interpret: Any = False, out_dtype=None):
    """Layout-v1 entry point: :func:`prepare_kivi_region` (a pass over the codes) then the kernel."""
    check_query(q, [region], k_new, v_new)
    why = kivi_mgpu_unsupported(region, q.shape[-1], config)
    if why:
        raise NotImplementedError(f"decode_attention_mgpu_kivi: {why}")
    ops = prepare_kivi_region(region)
    return decode_attention_mgpu_kivi_prepared(q, ops, k_new=k_new, v_new=v_new, sm_scale=sm_scale, config=config,
                                               interpret=interpret, out_dtype=out_dtype)


def decode_attention_mgpu_kivi_reference(q, region: Region, *, k_new=None, v_new=None,
                                         sm_scale: float | None = None, config: KiviMgpuConfig | None = None,
                                         interpret: Any = False, out_dtype=None):
    """Plain-JAX float32 twin (kernel-only args ignored): converts to the kivi mgpu layout and runs the same
    partial arithmetic, so it also checks :func:`prepare_kivi_region`."""
    del config, interpret
    return decode_attention_mgpu_kivi(q, region, k_new=k_new, v_new=v_new, sm_scale=sm_scale, interpret=True,
                                      out_dtype=out_dtype)


def decode_attention_mgpu_kivi_reference_f64(q, region: Region, *, k_new=None, v_new=None,
                                             sm_scale: float | None = None) -> np.ndarray:
    """The float64 NumPy oracle (``kvquant_jax.abi.reference``) on the same layout-v1 inputs."""
    return _oracle_f64(q, [region], k_new=k_new, v_new=v_new, sm_scale=sm_scale)
