"""Mosaic GPU (Hopper) decode attention over per-token INT2 / INT4 token-planar K and V on INTEGER tensor cores.

Issue J.  The token-planar kernel (:mod:`pallas_kernels.decode_attention_mgpu_planar`, bf16 wgmma) is issue-bound:
ncu counted ~5 thread instructions per code element at T = 32K on an H100 (one AND, then Mosaic's signed
int8 -> bf16 conversion of every code), 25 % of DRAM peak, so INT2, INT4 and QServe all take the same time.  But
one AND per plane already leaves each code as a SIGNED INT8 (``u * 2^(bits*r)``, the top plane re-centred): the
wgmma's own operand type.  This kernel feeds the masked bytes to ``wgmma ... .s32.s8.s8`` as the register A
operand (``Layout.WGMMA_8BIT``: 4 codes per 32-bit register, so one ``lop3`` masks four codes) and moves the
float side into a few integer limbs:

* **QK** (per 64-token plane ``r``; B = the query as limbs, built once per call in the wrapper)::

      q'[d, c] ~= qs_c * (l0 + 2^7 l1 + 2^14 l2)[d, c]        l0, l1 in [0, 127], l2 in [-128, 127] (int8)

  ``qs_c = max_d |q'[d, c]| / LIM`` (``LIM = 2^21 - 1``: 21-bit query, ~5e-7 of the column's largest entry).  The
  three limbs are stacked along the wgmma N (``3 x 8`` columns), so ONE s8 wgmma per plane and D chunk gives the
  three partial dots in int32 (exact); ``dot = a0 + 2^7 a1 + 2^14 a2`` is formed in float32 per logit.  Then
  ``logit_t = s_t dot_t 2^(-bits*r) qs_c + m_t sum_d q'_deq`` (the top plane's re-centred codes read ``u -
  2^(bits-1)``, so its min is ``m_t + 2^(bits-1) s_t``).
* **PV** (per block of ``64 P`` tokens): ``x[t, c] = p[t, c] sv_t 2^(-bits*r(t))`` (float32, in registers) is
  quantized per query column with ``S_c = max_t |x[t, c]|`` over the block (one cross-warp max), to ``LIM`` and
  the same three limbs; the limbs go to SMEM as the wgmma B operand (``[32, 64]`` int8 per plane: 24 rows of limbs,
  8 of padding), through a 16-bit transposed store and one converting load (Mosaic GPU transposes 16- and
  32-bit fragments, not 8-bit ones; the 32-bit path gives wrong numbers: :data:`WRONG_LIMB_PATHS`).  ONE s8
  wgmma per (plane, 64-channel tile) accumulates ``V^T x`` over the block in
  int32 (``|acc| < 2^23``: exact); the float accumulator takes ``S_c / LIM (a0 + 2^7 a1 + 2^14 a2)`` once per block,
  after the softmax rescale.  Precision: 21 bits per block and column, fewer on the upper planes
  (``21 - bits*r``: the bytes carry ``2^(bits*r)``), i.e. ~1.5e-5 of the block's largest ``p sv`` on INT2's top
  plane, rounded to nearest (``x >= 0``: ``+ 0.5`` before the truncating conversion); the V min term
  (``sum_t p_t mv_t``) stays float32 beside the denominator, as in the bf16 kernel.  ``PlanarS8Config.pv_limbs=2``:
  14 bits and two limbs (16 B rows per INT2 plane), the planes in accumulator groups (:func:`pv_plane_group`).

What each code element costs: one ``lop3`` per four codes (K) and per four codes (V) plus its share of the s8
wgmma; what each (token, query column) costs: a few float32 ops and the limb split (32 x 64 int32 -> int8 per
plane, through SMEM).

Operands: :class:`~pallas_kernels.decode_attention_mgpu_planar.TokenPlanarOperands` (the same caches:
``int2_planar``, ``int4_planar``, ``qserve4_planar``).  Requirements beyond the bf16 kernel's: one V channel group
per 64-channel tile (``Gv`` 0 or a multiple of 64), query groups of at most 8 heads.  :func:`s8_unsupported`.

Interpret mode runs :func:`_partials_jnp` (the same limb quantization, int32 dots, plain JAX); only a Hopper GPU runs
the kernel (``experiments/check_mgpu_planar.py --impls mgpu_s8``).  H100, JAX 0.11.2, 2026-12-07: parity cases 0, 1,
3, 5 within 4.4e-6 (bound 5e-5) on both 16-bit limb paths; at T = 32K (B 8, Hq 32, Hkv 8, D 128) with the
explicit barriers (4 runs) INT2 94.9-96.4 µs = 3.60-3.73x cuDNN (the bf16 planar kernel 182-188 µs), QServe
127.4-130.3 µs = 2.70-2.75x, INT4 123.5-126.6 µs = 2.79-2.81x; with ``pv_limbs=2`` INT2 85.4-86.6 µs = 4.02-4.15x
(docs/results/decode_mgpu/2026-12-07-s8-barriers-h100).  Later that night (docs/results/decode_mgpu/
2026-12-07-s8-pack-h100) the defaults became packed plane pairs where g <= 4, the early loads, unmasked full
blocks and (INT4 / QServe) two blocks per step: INT2 76.1-76.8 µs = 4.51-4.53x (2 runs), QServe 110.6 µs = 3.12x
and INT4 107.9 µs = 3.20x (1 run each); parity cases 0, 1, 3, 5 within 2.9e-6.  2026-12-08 (docs/results/
decode_mgpu/2026-12-08-s8-int2-steps-h100), 3 runs: two blocks per step for INT2 too, its loads late (INT2 72.7-73.0
µs = 4.75-4.77x), QServe 110.5-110.9 µs = 3.13-3.14x, INT4 107.7-108.0 µs = 3.20-3.23x.  The dispatcher serves
token-planar layers with it where
:func:`token_planar_s8_layout_unsupported` allows (``attention.dispatch``).  ``experiments/debug_mgpu_s8.py``
checks each integer step on its own.
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvquant_jax.abi import token_planar as tp
from pallas_kernels.backend import default_interpret
from pallas_kernels.decode_attention_mgpu import (_auto_splits, _merge_partials, _tile_transforms,
                                                  barrier_compiler_params, hopper_unsupported, release_stage)
from pallas_kernels.decode_attention_mgpu_kivi import (_F32, _LN2, _M, _NEG, _kernel_partials, _masked_planes,
                                                       _online_max, _PlaneBlock, _plane_mask, _program_rows,
                                                       _scaled_query_block, _split_out_types, _top_plane_rows,
                                                       _write_split_outputs, zero_min)
from pallas_kernels.decode_attention_mgpu_planar import (TokenPlanarOperands, _check_operands,
                                                         token_planar_layout_unsupported, token_planar_operands)

__all__ = ["PlanarS8Config", "LIM", "LIMB_PATHS", "PROFILE_PHASES", "PROFILE_SUBPHASES", "SMEM_BUDGET", "smem_bytes_estimate", "s8_unsupported", "query_limbs", "limbs",
           "decode_attention_mgpu_planar_s8_partials", "decode_attention_mgpu_planar_s8_prepared", "token_planar_s8_layout_unsupported",
           "token_planar_s8_layer_unsupported", "decode_attention_token_planar_s8"]

#: the largest |integer| a 3-limb value takes: 21 bits (l0, l1 in [0, 127], l2 = x >> 14 in [-128, 127])
LIM = 2 ** 21 - 1
_LIMBS = 3
_NL = 8                    # query columns per limb (one 8-column wgmma N tile per limb)
_NQ = _LIMBS * _NL         # QK wgmma N
#: the kernel's named phases per pipeline step, in order (what ``PlanarS8Config.profile_dir`` records)
PROFILE_PHASES = ("s8_qk", "s8_softmax", "s8_limbs", "s8_copy", "s8_pv", "s8_acc")
#: finer named scopes inside those phases (what the profiler records beside them): phase -> its sub-phases, in
#: order (``experiments/profile_mgpu_s8.py --subphases``)
PROFILE_SUBPHASES = {
    "s8_qk": ("qk_issue", "qk_wait"),          # K bytes load, plane masks, wgmma issue / the wait and the reads
    "s8_softmax": ("sm_logits", "sm_max", "sm_p"),   # logits per plane (ks loads) / online max / p, l, V min, x
    "s8_limbs": ("lb_amax", "lb_store"),       # per-column max |x| (cross-warp) / rounding, limb split, stores
    "s8_copy": ("cp_commit1", "cp_convert", "cp_commit2"),
    "s8_pv": ("pv_issue", "pv_wait", "pv_release"),
}
#: :class:`PlanarS8Config.barriers` -> what orders this kernel's shared memory (the modes of
#: ``decode_attention_mgpu.BARRIER_MODES``)
BARRIERS = {
    "auto": "Pallas's automatic warpgroup barriers around every SMEM store and before every TMA load",
    "explicit": "the kernel's commit_smem calls only: after the scratch's zero fill (before any limb store), after "
                "the limb stores (before the converting load reads them), after the converting copy (before the PV "
                "wgmma reads the B operand; also: every load of the scratch done before the next step's limb "
                "stores), and at the end of each step (every read of the pipeline stage done before the pipeline "
                "refills it); the epilogue's commit_smem before its TMA stores"}
#: the ways :class:`PlanarS8Config.pv_limbs` may take: 3 (21-bit ``p sv``, the default) or 2 (14-bit)
PV_LIMBS = (3, 2)


def lim_of(n_limbs: int) -> int:
    """The largest |integer| ``n_limbs`` 7-bit limbs (the top one a signed int8) carry: ``2^(7 n) - 1``."""
    return 2 ** (7 * n_limbs) - 1


def pv_plane_group(n_limbs: int, bits: int) -> int:
    """Planes that share one PV accumulator: all of them with 3 limbs (plane ``r`` keeps ``21 - bits r`` bits);
    with 2 limbs ``max(1, 4 // bits)`` (INT2: planes {0, 1} and {2, 3}; INT4: one each), and each group's ``p sv``
    is scaled by ``2^(bits r0)`` of its first plane ``r0`` so that no plane keeps fewer than ``14 - 2`` bits.  The
    float side multiplies group ``g``'s dot by ``2^(-bits r0)``."""
    return 8 // bits if n_limbs == 3 else max(1, 4 // bits)


def pv_rows_per_plane(n_limbs: int, planes: int) -> int:
    """PV B-operand rows per plane: ``8 n_limbs`` limb rows, padded with zero rows so that the planes together
    fill whole 64-row tiles (the converting copy loads the scratch in the 64-row ``WGMMA`` layout): INT2 (4
    planes) 32 rows with 3 limbs, 16 with 2; INT4 (2 planes) 32 either way.  At least the PV wgmma's N (3 limbs:
    32, the 8 rows past the limbs zero), so that the last plane's B operand stays inside the scratch."""
    rows = _NL * 4 if n_limbs == 3 else _NL * n_limbs
    while (rows * planes) % _M:
        rows += _NL
    return rows


@dataclasses.dataclass(frozen=True)
class PlanarS8Config:
    """Static knobs of the s8 kernel.

    num_splits: split-K programs per (sequence, KV head); None -> ~2 CTAs per SM.
    max_concurrent_steps: TMA pipeline depth (stages in SMEM).
    limb_path: how the ``p sv`` limbs reach the int8 B operand of the PV wgmma (:data:`LIMB_PATHS`; the values are
        the same, exact in every path: ``|limb| <= 128``): a 16-bit transposed store into a tiled, swizzled scratch
        (the bf16 kernels' own P store), then a ``WGMMA``-layout load converted to int8; ``"i16"`` (default) stores
        int16, ``"bf16"`` bfloat16 (H100, T = 32K, 2026-12-07: INT2 101 vs 122 µs).  ``"i32"`` (a 32-bit store into
        an untiled scratch, then an ``SMEM_GMEM_COPY``-layout load) is refused: :data:`WRONG_LIMB_PATHS`.
    pv_limbs: 7-bit limbs per ``p sv`` value (:data:`PV_LIMBS`): 3 (default) quantizes ``p sv`` per block and
        column to 21 bits; 2 to 14 bits, with two thirds of the limb stores, 16 instead of 32 B rows per INT2
        plane (half the converting copy and the PV wgmma's N).  The bytes of plane ``r`` carry ``2^(bits r)``, so
        plane ``r`` keeps ``bits r`` fewer bits: with 3 limbs INT2's top plane keeps 15; with 2 limbs the planes
        share accumulators in groups (:func:`pv_plane_group`) so that every plane keeps >= 12 (one accumulator would
        leave INT2's top plane 8).  H100, T = 32K: 8.9e-6 (INT2), 9.1e-6 (INT4), 1.3e-4 (QServe: its unsigned codes
        make ``sum p sv u`` ~8x the output) against <= 7e-6 with 3 limbs, 10-12 % faster on INT2.
    barriers: ``"auto"``: Pallas puts a warpgroup barrier before and after every shared-memory store and before
        every TMA load (two per limb store: 24 per INT2 step with 3 limbs); ``"explicit"`` (default;
        ``unsafe_no_auto_barriers``): only the kernel's own ``commit_smem`` calls order its shared memory
        (:data:`BARRIERS` lists which hazard each one covers), plus one at the end of every step before the
        pipeline refills the stage just read.  The same arithmetic: the outputs are bit-identical when the ordering
        is right (H100, T = 32K, 2026-12-07: identical for INT2 / INT4 / QServe in three calls; INT2 101-102 ->
        94.9-96.4 us, INT4 129-131 -> 123.5-126.6, QServe 133-135 -> 127.4-130.3).
    profile_dir: when set, Mosaic GPU's in-kernel profiler records the kernel's named phases (``s8_qk``,
        ``s8_softmax``, ``s8_limbs``, ``s8_copy``, ``s8_pv``, ``s8_acc``) per warpgroup in SM clock cycles and writes
        one Perfetto trace per call there (``experiments/profile_mgpu_s8.py``); a diagnostic (the timer reads cost
        a few cycles each), not for serving.
    qparams_early: load every plane's K and V qparams (scales, zeros) from the stage right after issuing the QK
        wgmmas, while they run, instead of where the softmax uses them (more registers live across the QK wait).
        ``None`` (default): :func:`auto_early_loads` (on, but for INT2 with more than one block per step).
    v_early: load the V codes (the PV wgmma's register operand) right after issuing the QK wgmmas instead of before
        the PV wgmmas; the stage's last read then precedes the B-operand copy's second ``commit_smem``, which also
        releases the stage (under ``barriers="explicit"`` the end-of-step barrier goes: one warpgroup barrier per
        step fewer).  16 more registers live through the softmax and the limb split.  ``None`` (default): as
        ``qparams_early``.
    unmasked_full_blocks: (default on) a block wholly inside the live rows ``[lo, hi)`` (every block of a sequence but its
        first and last) takes a branch without the row masks (four ``where`` per logit and the row compares); the
        other blocks the masked path.  The same numbers (the masks select nothing there).  These three together,
        in-kernel profile, H100, INT2, T = 32K, 2026-12-07: kernel 92.1 -> 85.5 us unpacked, 76.9 -> 71.0 packed.
    pack_planes: with at most 4 query heads per KV head (LLaMA-3-8B, Gemma-3, SmolLM2), half of the 8 query
        columns are padding; packed, a plane PAIR shares one ``[64, 8]`` float tile: the even plane's logits in
        columns ``[0, 4)``, the odd plane's in ``[4, 8)`` (two QK wgmmas into one accumulator, the query's limbs in
        one column half each), so the softmax, the limb split and the B-operand copy run on half the tiles.  Each
        column half keeps its own online softmax and ``p sv`` scale (an "even" and an "odd" partial per head,
        merged outside like two splits); the PV wgmmas accumulate per plane parity.  3 PV limbs only.  ``None``
        (default): packed wherever the shape allows it (g <= 4 and 3 PV limbs), unpacked otherwise; ``True`` refuses
        the other shapes by name, ``False`` never packs.  H100, T = 32K, LLaMA-3-8B shape, 2026-12-07 (the three
        flags above on): INT2 96.0 -> 76.8 us (x3.61 -> x4.51 cuDNN), QServe 127.9 -> 125.2, INT4 123.7 -> 122.1.
    step_blocks: token blocks per pipeline step (each its own TMA per array, as for one): the step's softmax max,
        ``p sv`` scale (one per column over the step's tokens), commits, accumulator update and pipeline wait are
        paid once for ``step_blocks`` blocks, at ``step_blocks`` times the tiles in registers and the stage's
        shared memory.  It must divide the blocks per split.  ``None`` (default): :data:`AUTO_STEP_BLOCKS` by
        code width (2 for INT2, INT4 and QServe) where that divides the split's blocks and its shared memory
        still lets as many CTAs share an SM as one block's would (:func:`ctas_per_sm_by_smem`: at D 256 two
        blocks would leave room for one CTA per SM instead of two), else 1.
    merged_pv: (packed planes only) both plane parities' PV wgmmas accumulate into ONE ``[64, 32]`` int32
        accumulator per 64-channel tile instead of one per parity: the converting copy writes the int8 B operands
        twice, once with the odd plane's columns zero (the even planes' wgmmas read it) and once with the even
        plane's zero, so a wgmma adds nothing to the other parity's columns.  The sums are the same integers
        (bit-identical outputs); 16 accumulator registers per channel tile fewer and no parity select after the
        PV, for a second int8 store in the copy and twice the int8 B-operand rows (INT2, 1 block per step: +4 KB).
        Refused without packed planes.
    """

    num_splits: Optional[int] = None
    max_concurrent_steps: int = 2
    limb_path: str = "i16"
    pv_limbs: int = 3
    barriers: str = "explicit"
    profile_dir: str = ""
    qparams_early: Optional[bool] = None
    v_early: Optional[bool] = None
    unmasked_full_blocks: bool = True
    pack_planes: Optional[bool] = None
    step_blocks: Optional[int] = None
    merged_pv: bool = False


#: the ways :class:`PlanarS8Config.limb_path` may take (the default first)
LIMB_PATHS = ("i16", "bf16")
#: limb paths that lower and run but give WRONG numbers on a Hopper GPU, refused by :class:`PlanarS8Config` users
#: (kept, private, so that ``experiments/debug_mgpu_s8.py`` can show the fault): path -> what goes wrong
WRONG_LIMB_PATHS = {
    "i32": "its converting copy (an SMEM_GMEM_COPY-layout int32 load, converted to int8, stored into the swizzled "
           "int8 B operand) swaps 4-byte groups of the rows (H100, JAX 0.11.2, 2026-12-07: parity 0.45-0.87 "
           "relative; experiments/debug_mgpu_s8.py 'limbs i32')"}
_LIMB_DTYPES = {"i32": jnp.int32, "i16": jnp.int16, "bf16": jnp.bfloat16}


def _limb_scratch(rows: int, path: str):
    """The SMEM scratch ``[rows, 64]`` the limbs of ``path`` are stored to (transposed) before the int8 copy:
    untiled int32 for ``"i32"``, tiled and swizzled 16-bit otherwise."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    dt = _LIMB_DTYPES[path]
    return plgpu.SMEM((rows, _M), dt, transforms=() if path == "i32" else _tile_transforms(dt, _M))


def _limb_zeros(rows: int, path: str):
    """Zeros for the whole scratch (its padding rows stay 0), in a layout its store takes (inside a kernel)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    zeros = jnp.zeros((rows, _M), _LIMB_DTYPES[path])
    return zeros if path == "i32" else plgpu.layout_cast(zeros, plgpu.Layout.WGMMA)


def _limb_value(limb, path: str):
    """int32 limbs ``[64, 8]`` in ``[-128, 127]`` -> the scratch's dtype (exact), inside a kernel."""
    if path == "bf16":
        return limb.astype(_F32).astype(jnp.bfloat16)
    return limb.astype(_LIMB_DTYPES[path])


def _limb_scratch_to_i8(x_rows, path: str):
    """Scratch rows ``[R, 64]`` (a ref; R a multiple of 64) -> int8 registers for the B operand's store, inside a
    kernel: one ``SMEM_GMEM_COPY``-layout load (``"i32"``) or one ``WGMMA``-layout load (16-bit)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if path == "i32":
        copy_layout = plgpu.Layout.SMEM_GMEM_COPY((x_rows.shape[0], _M), jnp.int8, 64)
        return plgpu.load(x_rows, (), layout=copy_layout, optimized=False).astype(jnp.int8)
    return _limb_scratch_wide(x_rows, path).astype(jnp.int8)


def _limb_scratch_wide(x_rows, path: str):
    """Scratch rows ``[R, 64]`` (16-bit paths) -> ``WGMMA``-layout registers of the exact limbs in a type wider than
    8 bits (Mosaic GPU computes on 8-bit registers only bitwise): int16 (``"i16"``) or int32 (``"bf16"``)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    xv = plgpu.load(x_rows, (), layout=plgpu.Layout.WGMMA)
    return xv.astype(_F32).astype(jnp.int32) if path == "bf16" else xv


def _group_unsupported(g: int) -> Optional[str]:
    if g > _NL:
        return f"{g} query heads per KV head: the s8 kernel takes at most {_NL} (one 8-column limb tile)"
    return None


def s8_unsupported(ops: TokenPlanarOperands, g: int) -> Optional[str]:
    """Why the s8 kernel cannot take these operands with ``g`` query heads per KV head (None when it can)."""
    if _group_unsupported(g):
        return _group_unsupported(g)
    if ops.v_group % _M:
        return f"V group {ops.v_group}: the s8 kernel needs one V channel group per 64-channel tile (Gv 0 or k*64)"
    if ops.head_dim % _M:
        return f"head_dim {ops.head_dim} is not a multiple of 64"
    if ops.rows % ops.block_t:
        return f"{ops.rows} rows is not a multiple of the {ops.bits}-bit block of {ops.block_t} tokens"
    return None


def limbs(xi, n_limbs: int = _LIMBS):
    """int32 ``x`` in ``[-lim_of(n), lim_of(n)]`` -> ``n`` int32 limbs with ``x = sum_i 2^(7 i) l_i``: the lower
    ones in ``[0, 127]``, the top one in ``[-128, 127]`` (arithmetic shifts: exact for negative ``x`` too).  The
    default 3: ``(l0, l1, l2)`` with ``x = l0 + 2^7 l1 + 2^14 l2`` over ``[-LIM, LIM]``."""
    return tuple((xi >> (7 * i)) & 127 for i in range(n_limbs - 1)) + (xi >> (7 * (n_limbs - 1)),)


def _from_limbs(*parts):
    """float32 ``sum_i 2^(7 i) a_i`` of int32 limb dots (the same split as :func:`limbs`; 3 parts: ``a0 + 2^7 a1 +
    2^14 a2``)."""
    out = parts[0].astype(_F32)
    for i, a in enumerate(parts[1:], 1):
        out = out + a.astype(_F32) * float(2 ** (7 * i))
    return out


def query_limbs(q, hkv: int, sm_scale, packed: bool = False):
    """``q [B, Hq, D]`` -> ``(qb int8 [B*Hkv, 3*8, D], qs f32 [B*Hkv, 8], qsum f32 [B*Hkv, 8])``: ``q' = q *
    sm_scale * log2 e`` per KV group, columns padded to 8, quantized per column to ``LIM`` (``q'_deq = qs *
    int``), split into limbs stacked along rows (``[l0 | l1 | l2]``, 8 columns each); ``qsum = sum_d q'_deq``.
    ``packed`` (at most 4 heads): the 4 columns twice (``qs``, ``qsum`` too), and ``qb [B*Hkv, 2, 24, D]``: the
    limbs with only the low column half kept, then with only the high half (``PlanarS8Config.pack_planes``)."""
    qp = _scaled_query_block(q, hkv, _NL, 0, sm_scale)                               # [BH, 8, D]
    if packed:
        qp = jnp.concatenate([qp[:, :_NL // 2], qp[:, :_NL // 2]], axis=1)
    amax = jnp.max(jnp.abs(qp), axis=-1)
    qs = jnp.where(amax > 0, amax / LIM, 1.0)
    qi = jnp.clip(jnp.round(qp / qs[..., None]), -LIM, LIM).astype(jnp.int32)
    qsum = jnp.sum(qi.astype(_F32), axis=-1) * qs
    ql = limbs(qi)
    if not packed:
        return jnp.concatenate([x.astype(jnp.int8) for x in ql], axis=1), qs, qsum     # [BH, 24, D]
    low = (jnp.arange(_NL) < _NL // 2)[None, :, None]
    halves = [jnp.concatenate([jnp.where(keep, x, 0).astype(jnp.int8) for x in ql], axis=1) for keep in (low, ~low)]
    return jnp.stack(halves, axis=1), qs, qsum                                        # [BH, 2, 24, D]


def _round_to_lim(y, lim: int = LIM):
    """float32 ``y`` (``x * LIM / S``, never negative) -> int32 in ``[-LIM, LIM]``: rounded to nearest (``+ 0.5``,
    then the truncating conversion; truncation alone biased every token the same way: INT2 1.4e-4 of the output
    -> 2.5e-5 on CPU), clamped (an approximate ``LIM / S`` rounded up must not carry the top limb past 127).  The
    kernel and its twin both call this."""
    return jnp.clip((y + 0.5).astype(jnp.int32), -lim, lim)


def _quantize_pv(x, cmax, lim: int = LIM):
    """float32 ``x [..., T, C]`` (``p sv 2^(-bits r)``: never negative) and its per-column bound ``cmax [..., 1, C]``
    -> int32 in ``[-LIM, LIM]`` (the kernel's rounding: ``+ 0.5`` then the truncating conversion, clamped: ``x *
    (LIM / cmax)`` may round past ``LIM``) and the dequantization factor ``cmax / LIM``."""
    safe = jnp.where(cmax > 0, cmax, 1.0)
    return _round_to_lim(x * (lim / safe), lim), safe * (1.0 / lim)


# --------------------------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _S8Spec(_PlaneBlock):
    d: int
    g: int             # query heads per KV head (<= 8)
    bits: int
    ns: int
    nbs: int
    stages: int
    hkv: int
    k_zero: str
    v_zero: str
    vg: int
    limb_path: str = "i16"
    pv_limbs: int = 3
    barriers: str = "explicit"
    profile_dir: str = ""
    qparams_early: bool = False
    v_early: bool = False
    unmasked_full_blocks: bool = False
    pack_planes: bool = False
    step_blocks: int = 1
    merged_pv: bool = False

    n = _NL            # query columns (the outputs' N; one limb tile)
    dup = 0            # (no hi / lo column halves: ``_kernel_partials`` reads it)

    @property
    def kc(self) -> int:               # QK contraction chunk: one 128-byte swizzle of int8 (64 for D = 64)
        return min(self.d, 128)

    @property
    def k_rows(self) -> int:
        return 1 if self.k_zero == "symmetric" else 2

    @property
    def vgroups(self) -> int:
        return self.d // self.vg

    @property
    def vplanes(self) -> int:          # 64-token planes per pipeline step (``step_blocks`` blocks of ``planes``)
        return self.planes * self.step_blocks

    @property
    def steps(self) -> int:            # pipeline steps per split
        return self.nbs // self.step_blocks

    @property
    def tiles(self) -> int:            # [64, 8] float tiles per step: one per plane, or per plane pair (packed)
        return self.vplanes // 2 if self.pack_planes else self.vplanes

    @property
    def pv_rows(self) -> int:          # PV B rows per tile (:func:`pv_rows_per_plane`)
        return pv_rows_per_plane(self.pv_limbs, self.tiles)

    @property
    def lim_pv(self) -> int:
        return lim_of(self.pv_limbs)

    @property
    def pv_n(self) -> int:             # the PV wgmma's N: 3 limbs 32 rows (24 + 8 zero rows, as timed), 2 limbs 16
        return _NL * 4 if self.pv_limbs == 3 else _NL * self.pv_limbs

    @property
    def pv_group(self) -> int:         # planes per PV accumulator (:func:`pv_plane_group`)
        return pv_plane_group(self.pv_limbs, self.bits)


def _s8_call(start, end, qb, qaux, k, v, ks, vs, vm, sp: _S8Spec):
    """Launch.  ``qb`` int8 [BH, D/KC, 24, KC] (query limbs; packed: [BH, 2 D/KC, 24, KC], the low column half's
    chunks, then the high half's); ``qaux`` f32 [BH, 2, 16] (qs, qsum, 8 columns of
    padding); ``k`` int8 [BH, T/P, D]; ``v`` int8 [BH, D, T/P]; ``ks`` [BH, R, T]; ``vs`` (and ``vm`` unless symmetric) [BH, C, T].
    Returns ``o [BH, S, D, 8], z [BH, S, C, 8], m [BH, S, 8] (log2), l [BH, S, 8]`` float32."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bh = qb.shape[0]
    d, bt, ns, nbs, pln, kc = sp.d, sp.bt, sp.ns, sp.nbs, sp.planes, sp.kc
    n, nvg, dq, dch = _NL, sp.vgroups, d // kc, d // _M
    i8, i32 = jnp.int8, jnp.int32
    wg, w8 = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA_8BIT
    names = ["k", "v", "ks", "vs"] + ([] if sp.v_zero == "symmetric" else ["vm"])
    arrays = dict(k=k, v=v, ks=ks, vs=vs, vm=vm)
    sb, vpl = sp.step_blocks, sp.vplanes
    # the pipeline's inputs: every array once per block of a step (step_blocks > 1: one TMA per block, as for one)
    pipe = [(nm, h) for h in range(sb) for nm in names]
    half = 2.0 ** (sp.bits - 1)
    nlv, lim_pv, pvn, pgs = sp.pv_limbs, sp.lim_pv, sp.pv_n, sp.pv_group
    npg = pln // pgs                                    # PV accumulators per d-tile (plane groups)
    r0 = lambda r: (r // pgs) * pgs                     # noqa: E731  (the first plane of r's group)
    pk, nt = sp.pack_planes, sp.tiles
    # virtual plane R of a step (R < vpl) is bit plane R % pln of the step's block R // pln: its 64 tokens are the
    # step's rows [64 R, 64 R + 64), its scale 2^(-bits (R % pln))
    # packed: tile k holds planes 2k (query columns [0, 4)) and 2k + 1 (columns [4, 8)), each column half its own
    # online softmax ("even" / "odd" virtual heads, merged outside like two splits); PV accumulators per parity
    tile_planes = (lambda k: (2 * k, 2 * k + 1)) if pk else (lambda k: (k,))   # noqa: E731
    mg = sp.merged_pv                                   # (packed only: one accumulator for both parities)
    nacc = 1 if mg else 2 if pk else npg                # PV accumulators per d-tile
    acc_of = (lambda r: 0) if mg else (lambda r: r % 2) if pk else (lambda r: r // pgs)   # noqa: E731
    npl = sp.pv_rows                                    # limb rows per tile
    prows = nt * npl                                    # rows of one channel group's limbs (all tiles)
    pcopies = 2 if mg else 1                            # int8 B-operand copies (merged: even columns, odd columns)
    lp = sp.limb_path

    def body(start_ref, end_ref, qb_ref, qaux_ref, *refs):
        in_refs = dict(zip(names, refs[:len(names)]))
        o_ref, z_ref, m_ref, l_ref = refs[len(names):]
        pid, sid, lo, hi, base = _program_rows(start_ref, end_ref, sp.hkv, nbs)

        def scoped(qb_smem, qaux_smem, x_smem, p_smem, o_smem, z_smem, m_smem, l_smem, q_bar, a_bar):
            plgpu.copy_gmem_to_smem(qb_ref.at[pid], qb_smem, q_bar)
            plgpu.copy_gmem_to_smem(qaux_ref.at[pid], qaux_smem, a_bar)
            plgpu.barrier_wait(q_bar)
            plgpu.barrier_wait(a_bar)
            qs = plgpu.load(qaux_smem.at[0, pl.ds(0, n)], (), layout=wg.reduce(0), optimized=False)
            qsum = plgpu.load(qaux_smem.at[1, pl.ds(0, n)], (), layout=wg.reduce(0), optimized=False)
            x_smem[...] = _limb_zeros(nvg * prows, lp)               # the padding rows stay 0
            plgpu.commit_smem()
            rows_t = plgpu.broadcasted_iota(jnp.int32, (_M, n), 0, layout=wg)
            bcol = lambda x: lax.broadcast_in_dim(x, (_M, n), [1])  # noqa: E731
            brow = lambda x: lax.broadcast_in_dim(x, (_M, n), [0])  # noqa: E731
            if pk:
                col_lo = plgpu.broadcasted_iota(jnp.int32, (_M, n), 1, layout=wg) < n // 2
                rows_t = jnp.where(col_lo, rows_t, rows_t + _M)     # the odd plane's tokens sit 64 rows later

            def sel(rows_of_planes):
                """A tile's per-token row vectors (one per plane of the tile) -> ``[64, 8]`` (packed: the even
                plane's in the low column half, the odd plane's in the high one)."""
                if pk:
                    return jnp.where(col_lo, brow(rows_of_planes[0]), brow(rows_of_planes[1]))
                return brow(rows_of_planes[0])

            def step(indices, *args):
                (i,) = indices
                sm = dict(zip(pipe, args[:len(pipe)]))
                accs, m_i, l_i, zs = args[len(pipe)]
                row0 = (base + sb * i) * bt

                def load_k_qparams(rv):      # virtual plane rv's K qparam rows (scale [, zero]) [64] each, float32
                    h, r = divmod(rv, pln)
                    return [plgpu.load(sm["ks", h].at[row, pl.ds(r * _M, _M)], (), layout=wg.reduce(1),
                                       optimized=False).astype(_F32) for row in range(sp.k_rows)]

                def load_v_qparams(rv, ci):  # virtual plane rv's V scale and zero (None: symmetric) of group ci
                    h, r = divmod(rv, pln)
                    sv = plgpu.load(sm["vs", h].at[ci, pl.ds(r * _M, _M)], (), layout=wg.reduce(1),
                                    optimized=False).astype(_F32)
                    zv = None if sp.v_zero == "symmetric" else plgpu.load(
                        sm["vm", h].at[ci, pl.ds(r * _M, _M)], (), layout=wg.reduce(1), optimized=False).astype(_F32)
                    return sv, zv

                def load_qparams():
                    return ([load_k_qparams(rv) for rv in range(vpl)],
                            [[load_v_qparams(rv, ci) for ci in range(nvg)] for rv in range(vpl)])

                def load_v_tile(j, h):       # V codes [64 channels, 64 tokens] int8 of d-tile j, the step's block h
                    return plgpu.load(sm["v", h].at[pl.ds(j * _M, _M)], (), layout=w8)

                def load_v():
                    return [[load_v_tile(j, h) for h in range(sb)] for j in range(dch)]

                with jax.named_scope("s8_qk"):
                    # 1. S^T per plane: ONE s8 wgmma per D chunk (N = 3 limbs x 8 columns), int32, exact
                    def qk(*acc_refs):
                        with jax.named_scope("qk_issue"):
                            kbytes = [plgpu.load(sm["k", h], (), layout=w8)   # [64, D] int8 per block, P planes
                                      for h in range(sb)]
                            for k_, acc_ref in enumerate(acc_refs):
                                for hc, rv in enumerate(tile_planes(k_)):  # (packed: B = the query in one half)
                                    h, r = divmod(rv, pln)
                                    kr = kbytes[h] & jnp.full(kbytes[h].shape, _plane_mask(r, sp.bits), i8)
                                    for j in range(dq):
                                        qbj = qb_smem.at[hc * dq + j]       # (packed: half hc's chunks after hc-1's)
                                        plgpu.wgmma(acc_ref, kr[:, j * kc:(j + 1) * kc], qbj.T)
                            # (while the wgmmas run: what the config loads early)
                            early = (load_qparams() if sp.qparams_early else None,
                                     load_v() if sp.v_early else None)
                        with jax.named_scope("qk_wait"):
                            return [a_[...] for a_ in acc_refs], early

                    raw, (qparams, vbytes_all) = pl.run_scoped(qk, *[plgpu.ACC((_M, _NQ), i32) for _ in range(nt)])
                kq, vq = qparams if qparams is not None else (None, None)

                def softmax(masked: bool, l_i, zs):
                    """Logits, the online max, p, the V min sums and ``x = p sv 2^(-bits (r - r0))`` of the block;
                    ``masked``: rows outside ``[lo, hi)`` count as absent (a dead row's qparams may be anything,
                    NaN included: ``where``, not ``p = 0`` alone)."""
                    mask = (lambda v, x, other: jnp.where(v, x, other)) if masked else (lambda v, x, other: x)
                    with jax.named_scope("s8_softmax"), jax.named_scope("sm_logits"):
                        ss, valids = [], []
                        for k_ in range(nt):
                            dot = _from_limbs(*(raw[k_][:, li * n:(li + 1) * n] for li in range(_LIMBS)))
                            a_rows, m_rows = [], []
                            for rv in tile_planes(k_):
                                r = rv % pln
                                st, *zt = kq[rv] if kq is not None else load_k_qparams(rv)
                                mt = zero_min(st, zt[0] if zt else None, sp.k_zero, sp.bits)
                                if r == pln - 1:           # re-centred top-plane codes read u - 2^(bits-1)
                                    mt = mt + half * st
                                a_rows.append(st * (2.0 ** (-sp.bits * r)))
                                m_rows.append(mt)
                            s = dot * sel(a_rows) * bcol(qs) + sel(m_rows) * bcol(qsum)
                            valid = None
                            if masked:
                                rows = rows_t + (row0 + tile_planes(k_)[0] * _M)
                                valid = (rows >= lo) & (rows < hi)
                            ss.append(mask(valid, s, _NEG))
                            valids.append(valid)

                    with jax.named_scope("s8_softmax"), jax.named_scope("sm_max"):
                        # 2. online softmax: ONE cross-warp max for the block
                        m_new, alpha = _online_max(ss, m_i)
                        alpha_t = bcol(alpha)
                        l_i = l_i * alpha_t
                        zs = [z * alpha_t for z in zs]
                    with jax.named_scope("s8_softmax"), jax.named_scope("sm_p"):
                        xs = [[None] * nt for _ in range(nvg)]
                        for k_ in range(nt):
                            p = mask(valids[k_], jnp.exp2(ss[k_] - bcol(m_new)), 0.0)
                            l_i = l_i + p
                            for ci in range(nvg):
                                mv_rows, sv_rows = [], []
                                for rv in tile_planes(k_):
                                    r = rv % pln
                                    sv, zv = vq[rv][ci] if vq is not None else load_v_qparams(rv, ci)
                                    mv = zero_min(sv, zv, sp.v_zero, sp.bits)
                                    if r == pln - 1:
                                        mv = mv + half * sv
                                    mv_rows.append(mv)
                                    sv_rows.append(sv * (2.0 ** (-sp.bits * (r - r0(r)))))
                                zs[ci] = zs[ci] + mask(valids[k_], p * sel(mv_rows), 0.0)
                                xs[ci][k_] = mask(valids[k_], p * sel(sv_rows), 0.0)
                    return m_new, alpha_t, l_i, zs, xs

                if sp.unmasked_full_blocks:
                    # a block wholly inside [lo, hi) (all but the first and last of a ragged sequence) skips the
                    # row masks: one branch per step, on a scalar
                    full = (row0 >= lo) & (row0 + sb * bt <= hi)
                    m_new, alpha_t, l_i, zs, xs = lax.cond(full, lambda li, z: softmax(False, li, z),
                                                           lambda li, z: softmax(True, li, z), l_i, zs)
                else:
                    m_new, alpha_t, l_i, zs, xs = softmax(True, l_i, zs)

                with jax.named_scope("s8_limbs"):
                    # 3. x -> 21-bit limbs per column (scale S_c: the block's max |x|), via SMEM into the B operands
                    scales, invs = [], []
                    for ci in range(nvg):
                        with jax.named_scope("lb_amax"):
                            amax = jnp.abs(xs[ci][0])
                            for x in xs[ci][1:]:
                                amax = jnp.maximum(amax, jnp.abs(x))
                            cmax = amax.max(axis=0)
                            safe = jnp.where(cmax > 0, cmax, 1.0)
                            invs.append(bcol(lim_pv / safe))
                            scales.append(safe * (1.0 / lim_pv))
                    for ci in range(nvg):
                        inv = invs[ci]
                        for k_ in range(nt):
                            for li, limb in enumerate(limbs(_round_to_lim(xs[ci][k_] * inv, lim_pv), nlv)):
                                x_smem.at[pl.ds(ci * prows + k_ * npl + li * n, n)].T[...] = plgpu.layout_cast(
                                    _limb_value(limb, lp), plgpu.Layout.WGMMA_TRANSPOSED)
                with jax.named_scope("s8_copy"):
                    with jax.named_scope("cp_commit1"):
                        plgpu.commit_smem()
                    with jax.named_scope("cp_convert"):
                        if mg:  # the even copy keeps the even planes' columns (limb rows 8 li + c, c < 4), the odd
                            #     copy the others; a thread's rows all share r % 8 (one select per register)
                            even = (plgpu.broadcasted_iota(i32, (prows, _M), 0, layout=wg) & (n - 1)) < n // 2
                        for ci in range(nvg):
                            xr = pl.ds(ci * prows, prows)
                            if not mg:
                                p_smem.at[xr][...] = _limb_scratch_to_i8(x_smem.at[xr], lp)
                                continue
                            xw = _limb_scratch_wide(x_smem.at[xr], lp)
                            zero = jnp.zeros((prows, _M), xw.dtype)
                            p_smem.at[pl.ds(2 * ci * prows, prows)][...] = jnp.where(even, xw, zero).astype(i8)
                            p_smem.at[pl.ds((2 * ci + 1) * prows, prows)][...] = jnp.where(even, zero, xw).astype(i8)
                    with jax.named_scope("cp_commit2"):
                        plgpu.commit_smem()

                with jax.named_scope("s8_pv"):
                    # 4. O^T[d-tile j] += V^T plane r [64, 64] @ limbs (r): ONE s8 wgmma per (plane, d-tile),
                    #    into the accumulator of r's plane group (one group with 3 limbs)
                    def pv(*acc_refs):
                        with jax.named_scope("pv_issue"):
                            for j, h in itertools.product(range(dch), range(sb)):
                                ci = j * _M // sp.vg
                                vbytes = vbytes_all[j][h] if vbytes_all is not None else load_v_tile(j, h)
                                for r in range(pln):
                                    vr = vbytes & jnp.full(vbytes.shape, _plane_mask(r, sp.bits), i8)
                                    tile = (h * pln + r) // 2 if pk else h * pln + r
                                    row = (ci * pcopies + (r % 2 if mg else 0)) * prows + tile * npl
                                    plgpu.wgmma(acc_refs[j * nacc + acc_of(r)], vr, p_smem.at[pl.ds(row, pvn)].T)
                        with jax.named_scope("pv_wait"):
                            return [a_[...] for a_ in acc_refs]

                    pvr = pl.run_scoped(pv, *[plgpu.ACC((_M, pvn), i32) for _ in range(dch * nacc)])
                    if not sp.v_early:              # (v_early: cp_commit2 came after the stage's last read)
                        with jax.named_scope("pv_release"):
                            release_stage(sp.barriers)
                with jax.named_scope("s8_acc"):
                    new_accs = []
                    for j in range(dch):
                        ci = j * _M // sp.vg
                        part = None
                        if mg:                      # one accumulator: even planes' columns low, odd ones' high
                            part = _from_limbs(*(pvr[j][:, li * n:(li + 1) * n] for li in range(nlv)))
                        elif pk:                    # the even planes' dot in the low half, the odd ones' in the high
                            pe, po = (_from_limbs(*(pvr[j * 2 + h][:, li * n:(li + 1) * n] for li in range(nlv)))
                                      for h in range(2))
                            part = jnp.where(col_lo, pe, po)
                        for gi in range(npg if not pk else 0):
                            a_ = pvr[j * npg + gi]
                            pg = _from_limbs(*(a_[:, li * n:(li + 1) * n] for li in range(nlv)))
                            pg = pg if gi == 0 else pg * (2.0 ** (-sp.bits * gi * pgs))
                            part = pg if part is None else part + pg
                        new_accs.append(accs[j] * alpha_t + part * bcol(scales[ci]))
                return new_accs, m_new, l_i, zs

            def spec_of(nm, h):              # block h of each step: block base + sb i + h of the split
                blk = lambda i: (base + sb * i + h, 0)       # noqa: E731  (token rows first)
                blk_t = lambda i: (0, base + sb * i + h)     # noqa: E731  (tokens last)
                if nm == "k":
                    return plgpu.BlockSpec((_M, d), blk, transforms=_tile_transforms(i8, d))
                if nm == "v":
                    return plgpu.BlockSpec((d, _M), blk_t, transforms=_tile_transforms(i8, _M))
                return plgpu.BlockSpec((sp.k_rows if nm == "ks" else nvg, bt), blk_t)      # ks, vs, vm
            zero_t = lambda: plgpu.layout_cast(jnp.full((_M, n), 0.0, _F32), wg)  # noqa: E731
            m0 = plgpu.layout_cast(jnp.full((n,), _NEG, _F32), wg.reduce(0))
            carry0 = ([zero_t() for _ in range(dch)], m0, zero_t(), [zero_t() for _ in range(nvg)])
            accs, m_i, l_i, zs = plgpu.emit_pipeline(
                step, grid=(sp.steps,), in_specs=[spec_of(nm, h) for nm, h in pipe],
                max_concurrent_steps=min(sp.stages, sp.steps), init_carry=carry0)(
                    *[in_refs[nm].at[pid] for nm, _ in pipe])
            for j in range(dch):
                o_smem.at[pl.ds(j * _M, _M)][...] = accs[j]
            _write_split_outputs((o_smem, z_smem, m_smem, l_smem), (o_ref, z_ref, m_ref, l_ref), zs, m_i, l_i,
                                 pid, sid)

        pl.run_scoped(
            scoped,
            plgpu.SMEM(((2 if pk else 1) * dq, _NQ, kc), i8, transforms=_tile_transforms(i8, kc)),
            plgpu.SMEM((2, 2 * n), _F32),
            _limb_scratch(nvg * prows, lp),
            plgpu.SMEM((nvg * pcopies * prows, _M), i8, transforms=_tile_transforms(i8, _M)),
            plgpu.SMEM((d, n), _F32),
            plgpu.SMEM((nvg, n), _F32),
            plgpu.SMEM((n,), _F32),
            plgpu.SMEM((n,), _F32),
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=1),
        )

    # (room for every phase twice per step: a scope may be recorded again inside a nested region)
    nscopes = len(PROFILE_PHASES) + sum(map(len, PROFILE_SUBPHASES.values())) + 2 * nvg
    prof = dict(profile_space=2 * nbs * nscopes + 64, profile_dir=sp.profile_dir) if sp.profile_dir else {}
    fn = plgpu.kernel(body, out_type=_split_out_types(bh, ns, d, n, nvg), grid=(bh, ns), grid_names=("bh", "split"),
                      compiler_params=plgpu.CompilerParams(approx_math=True, **barrier_compiler_params(sp.barriers),
                                                           **prof))
    return fn(start, end, qb, qaux, *[arrays[nm] for nm in names])


#: Hopper's shared memory per block (what Mosaic GPU checks against), less a margin for what
#: :func:`smem_bytes_estimate` does not count (barriers, alignment: Mosaic's count was 5.9-6.4 KB above the
#: estimate in seven configurations, tested)
SMEM_BUDGET = 232448 - 8192
#: Hopper's shared memory per SM, and what a CTA takes beyond :func:`smem_bytes_estimate` (Mosaic's ~4-6 KB, ncu
#: 2026-12-08: INT2 58 -> 62 KB, INT4 90 -> 96 KB, plus the 1 KB the SM reserves per CTA): for the CTAs per SM
#: that the shared memory allows (:func:`ctas_per_sm_by_smem`)
SM_SMEM = 233472
CTA_SMEM_EXTRA = 7 * 1024


def ctas_per_sm_by_smem(smem_estimate: int, cap: int = 2) -> int:
    """CTAs of the s8 kernel per SM that its shared memory allows, at most ``cap``: 2, what the registers allow at
    D 128 (ncu, H100, 2026-12-08: 195 registers per thread for INT2, 209 for INT4, 128 threads) and what the split
    count is sized for (:func:`_auto_splits`)."""
    return min(cap, SM_SMEM // (smem_estimate + CTA_SMEM_EXTRA))


def smem_bytes_estimate(sp: _S8Spec, qparam_bytes: int) -> int:
    """Shared memory the s8 kernel allocates for ``sp``, in bytes, without barriers and alignment (Mosaic GPU counts
    ~6 KB more): the pipeline stages of K / V codes and their qparams, the query limbs, the limb scratch in
    ``sp.limb_path``'s dtype, the int8 B operands (two copies with ``merged_pv``), the outputs."""
    d, bt, nvg = sp.d, sp.bt, sp.vgroups
    rows = nvg * sp.tiles * sp.pv_rows
    per_stage = sp.step_blocks * (_M * d * 2 + (sp.k_rows + nvg * (1 if sp.v_zero == "symmetric" else 2)) * bt
                                  * qparam_bytes)
    scratch = rows * _M * jnp.dtype(_LIMB_DTYPES[sp.limb_path]).itemsize
    qb = (2 if sp.pack_planes else 1) * (d // sp.kc) * _NQ * sp.kc
    return (min(sp.stages, sp.steps) * per_stage + qb + 2 * 2 * _NL * 4 + scratch
            + rows * _M * (2 if sp.merged_pv else 1) + (d + nvg + 2) * _NL * 4)


#: the :class:`PlanarS8Config` fields the kernel spec carries as they are (the others become ``ns`` / ``stages``,
#: or are resolved in :func:`_spec`: ``pack_planes``, ``step_blocks``, ``qparams_early``, ``v_early``)
_SPEC_FROM_CONFIG = tuple(f.name for f in dataclasses.fields(PlanarS8Config)
                          if f.name not in ("num_splits", "max_concurrent_steps", "pack_planes", "step_blocks",
                                            "qparams_early", "v_early"))

#: ``PlanarS8Config.step_blocks=None``: blocks per pipeline step by code width (H100, T = 32K, LLaMA-3-8B shape,
#: 2026-12-07: INT4 121.7 -> 107.9 us and QServe 124.8 -> 110.6 with 2; 4 blocks 1.8-2.6x slower for every format,
#: past the registers.  2026-12-08, three calls: INT2 76.7-76.9 -> 72.7-73.0 us with 2 blocks and late loads
#: (:func:`auto_early_loads`; with the early loads 93.2, once), INT4 107.7-108.0, QServe 110.5-110.9)
AUTO_STEP_BLOCKS = {2: 2, 4: 2}


def auto_early_loads(bits: int, step_blocks: int) -> bool:
    """``PlanarS8Config.qparams_early`` / ``v_early`` when ``None``: the loads go under the QK wgmmas everywhere but
    INT2 with more than one block per step, where the early V codes and qparams (twice a 4-plane block's) cost
    more in registers than they hide (H100, T = 32K, LLaMA-3-8B shape: INT2 with 2 blocks 93.2 us early against
    72.7-73.0 late; INT4 / QServe with 2 blocks 107.7-108.0 / 110.5-110.9 early against 108.0-108.3 /
    111.1-111.3 late, three calls, 2026-12-08; with 1 block early wins for every format, 2026-12-07)."""
    return not (bits == 2 and step_blocks > 1)


def packs_planes(cfg: PlanarS8Config, g: int) -> bool:
    """Whether the kernel packs plane pairs for ``g`` query heads per KV head under ``cfg``: ``cfg.pack_planes``
    when set, else (``None``) wherever the shape allows it (``g <= 4`` and 3 PV limbs)."""
    if cfg.pack_planes is not None:
        return bool(cfg.pack_planes)
    return g <= _NL // 2 and cfg.pv_limbs == 3


def _spec(ops: TokenPlanarOperands, g: int, cfg: PlanarS8Config, allow_wrong: bool = False) -> _S8Spec:
    """The kernel's static spec for ``ops`` with ``g`` query heads per KV head, or a named refusal.  ``allow_wrong``
    lets a :data:`WRONG_LIMB_PATHS` entry through (``experiments/debug_mgpu_s8.py`` only)."""
    why = s8_unsupported(ops, g)
    if why:
        raise NotImplementedError(f"decode_attention_mgpu_planar_s8: {why}")
    if cfg.limb_path in WRONG_LIMB_PATHS and not allow_wrong:
        raise ValueError(f"PlanarS8Config.limb_path={cfg.limb_path!r} is refused: {WRONG_LIMB_PATHS[cfg.limb_path]}; "
                         f"use one of {LIMB_PATHS}")
    if cfg.limb_path not in LIMB_PATHS + tuple(WRONG_LIMB_PATHS):
        raise ValueError(f"PlanarS8Config.limb_path={cfg.limb_path!r}: one of {LIMB_PATHS}")
    if cfg.pv_limbs not in PV_LIMBS:
        raise ValueError(f"PlanarS8Config.pv_limbs={cfg.pv_limbs!r}: one of {PV_LIMBS}")
    if cfg.barriers not in BARRIERS:
        raise ValueError(f"PlanarS8Config.barriers={cfg.barriers!r}: one of {tuple(BARRIERS)}")
    if cfg.pack_planes and g > _NL // 2:
        raise NotImplementedError(f"decode_attention_mgpu_planar_s8: pack_planes needs at most {_NL // 2} query heads "
                                  f"per KV head (a plane pair shares the 8 columns), got {g}")
    if cfg.merged_pv and not packs_planes(cfg, g):   # (a shape without the free column half: NotImplementedError)
        err = NotImplementedError if g > _NL // 2 else ValueError
        raise err(f"PlanarS8Config.merged_pv needs packed plane pairs (pack_planes: at most {_NL // 2} query heads "
                  f"per KV head and 3 PV limbs), got g={g}, pv_limbs={cfg.pv_limbs}, pack_planes={cfg.pack_planes}")
    if cfg.pack_planes and cfg.pv_limbs != 3:
        raise ValueError(f"PlanarS8Config.pack_planes takes 3 PV limbs (one accumulator group), got pv_limbs="
                         f"{cfg.pv_limbs}")
    nb = ops.rows // ops.block_t
    ns = cfg.num_splits or _auto_splits(ops.k.shape[0], nb)
    if nb % ns:
        raise ValueError(f"num_splits={ns} does not divide the {nb} blocks")
    sb = cfg.step_blocks
    if sb is not None and not (isinstance(sb, int) and sb >= 1):
        raise ValueError(f"PlanarS8Config.step_blocks={sb!r}: a positive int or None")
    if sb is not None and (nb // ns) % sb:
        raise ValueError(f"PlanarS8Config.step_blocks={sb} does not divide the {nb // ns} blocks per "
                         f"split ({nb} blocks, {ns} splits)")
    make = lambda n: _S8Spec(  # noqa: E731
        d=ops.head_dim, g=g, bits=ops.bits, ns=ns, nbs=nb // ns, stages=cfg.max_concurrent_steps,
        hkv=ops.num_kv_heads, k_zero=ops.k_zero, v_zero=ops.v_zero_kind, vg=ops.v_group,
        **{f: getattr(cfg, f) for f in _SPEC_FROM_CONFIG}, pack_planes=packs_planes(cfg, g), step_blocks=n,
        **{f: auto_early_loads(ops.bits, n) if getattr(cfg, f) is None else bool(getattr(cfg, f))
           for f in ("qparams_early", "v_early")})
    qpb = ops.k_qparams.dtype.itemsize
    if sb is None:      # auto: AUTO_STEP_BLOCKS[bits] where it divides the split's blocks, fits, and keeps the CTAs
        sb = AUTO_STEP_BLOCKS.get(ops.bits, 1)      # per SM that one block's shared memory allows; else 1
        if sb > 1:
            need = smem_bytes_estimate(make(sb), qpb)
            if ((nb // ns) % sb or need > SMEM_BUDGET
                    or ctas_per_sm_by_smem(need) < ctas_per_sm_by_smem(smem_bytes_estimate(make(1), qpb))):
                sb = 1
    sp = make(sb)
    need = smem_bytes_estimate(sp, qpb)
    if need > SMEM_BUDGET:
        raise NotImplementedError(
            f"decode_attention_mgpu_planar_s8: ~{need // 1024} KB of shared memory (INT{ops.bits}, D {ops.head_dim}, "
            f"{sp.vgroups} V groups, {sp.stages} stages, limb_path {cfg.limb_path!r}, {cfg.pv_limbs} PV limbs, "
            f"{sp.step_blocks} blocks per step) is over the {SMEM_BUDGET // 1024} KB budget; fewer pipeline stages "
            f"(max_concurrent_steps) or blocks per step fit")
    return sp


def decode_attention_mgpu_planar_s8_partials(q, ops: TokenPlanarOperands, *, sm_scale: float | None = None,
                                             config: PlanarS8Config | None = None, interpret: Any = False):
    """Split-K partials of one prepared per-token region on s8 tensor cores.  ``q``: ``[B, Hq, D]``.  Returns
    ``acc [B, Hkv, S, G, D], m, l [B, Hkv, S, G]`` float32 (natural-log ``m``)."""
    cfg = config or PlanarS8Config()
    _check_operands(ops)
    b, hq, d = q.shape
    hkv = ops.num_kv_heads
    g = hq // hkv
    sp = _spec(ops, g, cfg)
    if interpret:
        return _partials_jnp(q, ops, sm_scale, sp)
    out = _raw_outputs(q, ops, sm_scale, sp)
    if not sp.pack_planes:
        return _kernel_partials(out, sp, b, hkv)
    return _kernel_partials(unpack_columns(out), _UnpackedColumns(d=sp.d, g=g, vg=sp.vg), b, hkv)


@dataclasses.dataclass(frozen=True)
class _UnpackedColumns:
    """What :func:`_kernel_partials` reads of a spec, for a packed kernel's outputs once unpacked: 4 columns."""
    d: int
    g: int
    vg: int
    n: int = _NL // 2
    dup: int = 0


def unpack_columns(out):
    """A packed kernel's outputs ``o [BH, S, D, 8], z [BH, S, C, 8], m, l [BH, S, 8]`` (columns ``[0, 4)`` the even
    planes' partial of heads 0-3, ``[4, 8)`` the odd planes') -> the same with 4 columns and ``2 S`` splits (split
    ``2 s + h``: split ``s``'s half ``h``), for the split merge."""
    o, z, m, l = out
    half = _NL // 2

    def cols(x, axis):                 # [..., 8 (axis), ...] -> halves as splits: [BH, 2S, ..., 4, ...]
        x = jnp.moveaxis(x, axis, -1)
        x = x.reshape(x.shape[:-1] + (2, half))
        x = jnp.moveaxis(x, -2, 2)                                                     # [BH, S, 2, ..., 4]
        x = x.reshape((x.shape[0], x.shape[1] * 2) + x.shape[3:])
        return jnp.moveaxis(x, -1, axis)

    return cols(o, 3), cols(z, 3), cols(m, 2), cols(l, 2)


def _raw_outputs(q, ops: TokenPlanarOperands, sm_scale, sp: _S8Spec):
    """The kernel's own outputs ``o [BH, S, D, 8], z [BH, S, C, 8], m, l [BH, S, 8]`` (log2 ``m``; all 8 query
    columns): the query limbs built, laid out for the kernel, and the kernel launched."""
    d = q.shape[2]
    qb, qs, qsum = query_limbs(q, ops.num_kv_heads, sm_scale, packed=sp.pack_planes)
    kc = sp.kc
    qb = jnp.swapaxes(qb.reshape(qb.shape[:-2] + (_NQ, d // kc, kc)), -3, -2)        # [BH, (2,) D/KC, 24, KC]
    qb = qb.reshape(qb.shape[0], -1, _NQ, kc)                                       # [BH, (2 x) D/KC, 24, KC]
    qaux = jnp.pad(jnp.stack([qs, qsum], 1), ((0, 0), (0, 0), (0, _NL)))          # 128 bytes: one TMA per thread
    return _s8_call(ops.start.astype(jnp.int32), ops.end.astype(jnp.int32), qb, qaux,
                    ops.k, ops.v, ops.k_qparams, ops.v_scale, ops.v_zero, sp)


def _partials_jnp(q, ops: TokenPlanarOperands, sm_scale, sp: _S8Spec):
    """Plain-JAX partials (one split) in the s8 kernel's arithmetic: query limbs, int32 plane dots, per-block
    per-column 21-bit ``p sv``, the V min term float32.  The softmax is global (one split) where the kernel's is
    online: the quantization scales are relative to each block's column max either way."""
    b, hq, d = q.shape
    hkv, bits, t, bt = ops.num_kv_heads, ops.bits, ops.rows, ops.block_t
    g = hq // hkv
    half = 2.0 ** (bits - 1)
    stt = bt * sp.step_blocks                                                          # tokens per step
    qb, qs, qsum = query_limbs(q, hkv, sm_scale)
    ql = [qb[:, li * _NL:(li + 1) * _NL].astype(jnp.int32) for li in range(_LIMBS)]  # [BH, 8, D] each
    uk = _masked_planes(ops.k, bits)                                                  # [BH, T, D]
    dot = _from_limbs(*(jnp.einsum("xtd,xcd->xtc", uk, l_, preferred_element_type=jnp.int32) for l_ in ql))
    plane = (jnp.arange(t) % bt) // _M                                                 # [T]
    pscale = jnp.asarray(2.0, _F32) ** (-bits * plane.astype(_F32))
    top = jnp.asarray(_top_plane_rows(t, bits))
    kz = None if ops.k_zero == "symmetric" else ops.k_qparams[:, 1].astype(_F32)
    st = ops.k_qparams[:, 0].astype(_F32)                                              # [BH, T]
    mt = zero_min(st, kz, ops.k_zero, bits) + jnp.where(top, half, 0.0) * st
    s = dot * (st * pscale)[..., None] * qs[:, None, :] + mt[..., None] * qsum[:, None, :]   # [BH, T, 8]
    rows = jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.repeat((rows >= ops.start[:, None]) & (rows < ops.end[:, None]), hkv, 0)[..., None]
    s = jnp.where(valid, s, _NEG)
    m = jnp.max(s, axis=1)                                                             # [BH, 8]
    p = jnp.where(valid, jnp.exp2(s - m[:, None, :]), 0.0)                             # [BH, T, 8]
    sv = ops.v_scale.astype(_F32)                                                      # [BH, C, T]
    zv = None if ops.v_zero is None else ops.v_zero.astype(_F32)
    mv = zero_min(sv, zv, ops.v_zero_kind, bits) + jnp.where(top, half, 0.0) * sv
    uv = _masked_planes(jnp.swapaxes(ops.v, 1, 2), bits)                               # [BH, T, D]
    nvg = sv.shape[1]
    gplane = (plane // sp.pv_group) * sp.pv_group                                      # first plane of the group
    xscale = jnp.asarray(2.0, _F32) ** (-bits * (plane - gplane).astype(_F32))       # [T]: 2^(-bits (r - r0))
    acc = []
    for ci in range(nvg):
        x = jnp.where(valid, p * (sv[:, ci] * xscale)[..., None], 0.0)                # [BH, T, 8]
        xb = x.reshape(x.shape[0], t // stt, stt, _NL)
        ub = uv[:, :, ci * ops.v_group:(ci + 1) * ops.v_group].reshape(x.shape[0], t // stt, stt, ops.v_group)
        # the p sv scale per step (step_blocks blocks) and column over the step's tokens, or (packed) over its even
        # planes' tokens and its odd planes' tokens apart (each column half of the kernel's tile has its own)
        plane_b = plane[:stt]
        subsets = [plane_b % 2 == h for h in (0, 1)] if sp.pack_planes else [plane_b >= 0]
        o = 0.0
        for sub in subsets:
            xs_ = jnp.where(sub[None, None, :, None], xb, 0.0)
            xi, deq = _quantize_pv(xs_, jnp.max(jnp.abs(xs_), axis=2, keepdims=True), sp.lim_pv)
            xl = [l_.reshape(x.shape) for l_ in limbs(xi, sp.pv_limbs)]
            # the int32 dots per plane group (exact), each group weighted by 2^(-bits r0) in float32
            part = 0.0
            for g0 in range(0, 8 // bits, sp.pv_group):
                grp = (plane >= g0) & (plane < g0 + sp.pv_group)                       # [T]
                gmask = grp.reshape(t // stt, stt)[None, :, :, None].astype(jnp.int32)
                part = part + _from_limbs(*(jnp.einsum("xktc,xktd->xkcd", l_.reshape(xb.shape) * gmask, ub,
                                                       preferred_element_type=jnp.int32) for l_ in xl)) * (
                    2.0 ** (-bits * g0))
            o = o + jnp.sum(part * deq[:, :, 0, :, None], axis=1)                     # [BH, 8, Gv]
        o = o + jnp.einsum("xtc,xt->xc", p, jnp.where(valid[..., 0], mv[:, ci], 0.0),
                           precision=lax.Precision.HIGHEST)[..., None]
        acc.append(o)
    acc = jnp.concatenate(acc, axis=-1)                                                # [BH, 8, D]
    sh = (b, hkv, 1, _NL)
    return (acc.reshape(sh + (d,))[:, :, :, :g], (m * _LN2).reshape(sh)[..., :g],
            jnp.sum(p, axis=1).reshape(sh)[..., :g])


def decode_attention_mgpu_planar_s8_prepared(q, ops: TokenPlanarOperands, *, k_new=None, v_new=None,
                                             sm_scale: float | None = None, config: PlanarS8Config | None = None,
                                             interpret: Any = False, out_dtype=None):
    """Attention of the new token over one prepared per-token region (+ the exact current token), ONE softmax.
    ``q [B, Hq, D]``; returns ``[B, Hq, D]`` (``out_dtype``, default ``q.dtype``)."""
    part = decode_attention_mgpu_planar_s8_partials(q, ops, sm_scale=sm_scale, config=config, interpret=interpret)
    return _merge_partials(q, part, ops.num_kv_heads, sm_scale, k_new=k_new, v_new=v_new,
                           out_dtype=out_dtype or q.dtype)


def _layer_shape_unsupported(q, fmt: tp.TokenPlanarFormat, operand: tp.TokenPlanarOperand) -> Optional[str]:
    return (token_planar_layout_unsupported(q, fmt, operand)
            or _group_unsupported(q.shape[1] // operand.k_codes.shape[1]))


def token_planar_s8_layout_unsupported(q, fmt: tp.TokenPlanarFormat, operand: tp.TokenPlanarOperand,
                                       config: PlanarS8Config | None = None) -> Optional[str]:
    """Why the s8 kernel cannot read this token-planar cache layer's shapes (any device; None when it can): the bf16
    kernel's conditions (:func:`~pallas_kernels.decode_attention_mgpu_planar.token_planar_layout_unsupported`), at
    most 8 query heads per KV head (a cache layer's V has one group: ``Gv = D``), and what building the kernel's
    spec refuses with ``config`` (default: the default config), shared memory included -- so a dispatcher that asks
    this first never meets a refusal at trace time."""
    why = _layer_shape_unsupported(q, fmt, operand)
    if why:
        return why
    try:
        _spec(token_planar_operands(fmt, operand), q.shape[1] // operand.k_codes.shape[1], config or PlanarS8Config())
    except (NotImplementedError, ValueError) as err:
        return str(err).removeprefix("decode_attention_mgpu_planar_s8: ")
    return None


def token_planar_s8_layer_unsupported(q, fmt: tp.TokenPlanarFormat, operand: tp.TokenPlanarOperand) -> Optional[str]:
    """Why the s8 kernel cannot read a token-planar cache layer in place on this device (None when it can): not a
    Hopper GPU, or :func:`token_planar_s8_layout_unsupported`."""
    return hopper_unsupported() or token_planar_s8_layout_unsupported(q, fmt, operand)


def decode_attention_token_planar_s8(q, fmt: tp.TokenPlanarFormat, operand: tp.TokenPlanarOperand, lengths=None,
                                     k_new=None, v_new=None, *, sm_scale: float | None = None,
                                     config: PlanarS8Config | None = None, interpret: Any = None, out_dtype=None):
    """Decode attention over one token-planar per-token cache layer read in place, on s8 tensor cores (the
    dispatcher's entry, beside the bf16 kernel's ``decode_attention_token_planar``): rows ``[0, operand.end)`` and
    the exact current token (``k_new, v_new [B, Hkv, D]``) in ONE softmax.  ``q [B, Hq, D]``; returns ``[B, Hq, D]``
    in ``out_dtype``, default float32 (the dispatcher casts).  ``lengths`` is not read (``operand.end`` holds them).
    ``interpret`` (None: off on a GPU only) runs the plain-JAX partials (CPU tests)."""
    del lengths
    why = _layer_shape_unsupported(q, fmt, operand)           # (a config the spec refuses raises from there)
    if why:
        raise NotImplementedError(f"decode_attention_token_planar_s8: {why}")
    interpret = bool(interpret) if interpret is not None else default_interpret()
    return decode_attention_mgpu_planar_s8_prepared(q, token_planar_operands(fmt, operand), k_new=k_new, v_new=v_new,
                                                    sm_scale=sm_scale, config=config, interpret=interpret,
                                                    out_dtype=out_dtype or _F32)
