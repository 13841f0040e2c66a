"""Mosaic GPU (Hopper) decode attention over one KV region: swap-AB wgmma, split-K, packed codes in registers.

Issue J, first kernel.  One query token per sequence, ``q: [B, Hq, D]`` attends over ONE region of K/V
(``[B, Hkv, T, ...]``, live rows ``[start[b], end[b])``) plus, optionally, the exact current token
``k_new, v_new: [B, Hkv, D]`` in the same softmax.  Like :mod:`pallas_kernels.decode_attention` (the Pallas
Triton kernel), the kernel returns split-K partials ``(acc, m, l)`` and the wrapper merges them and the current
token in one softmax (:func:`_merge_partials`, no concatenation), so the result is the softmax over all keys.

Formats (``KVFormat`` pairs, K and V the same family): bf16 (``fp16`` too), per-token symmetric INT8 and INT4
with one scale per (token, head) (``scale="token", zero="symmetric", group in (0, D)``), FP8 E4M3/E5M2 with
per-head scales.  Not here (yet): INT2/INT1 (Mosaic GPU has no 2-bit register type), grouped scales along D,
QServe offsets, KIVI, KVQuant -- :func:`mgpu_unsupported` says why and the caller keeps the Triton kernel.

Algorithm, per program ``(b*Hkv + h, split)`` (one warpgroup, 128 threads)
-------------------------------------------------------------------------
*Swap-AB*: the KV tokens are the wgmma M dimension and the query-head group is N.  For a block of ``BT`` (128)
tokens::

    S^T [BT, N]  = K_blk [BT, D] @ Q^T [D, N]          A = K codes (registers, converted) or bf16 K (SMEM)
    P^T [BT, N]  = exp2(S^T * (s_k[t] * sm_scale * log2 e) - m)   per-token K scale AFTER the dot (a row scale)
    O^T [D, N]  += V^T_blk [D, BT] @ (P^T * s_v[t])     V per-token scale folded into p (a row scale of P^T)

``N`` = the GQA group padded to a multiple of 8 (wgmma's smallest N): G = 4 query heads -> N = 8, not 16 or 64.
With ``precision="bf16x2"`` (default) the query rows are duplicated (N = 2G rounded up to 8; free for G = 4):
columns ``[0, G)`` of the PV operand carry ``hi = bf16(p)``, columns ``[G, 2G)`` carry ``lo = bf16(p - hi)``,
and the wrapper adds the two column blocks: ~16 significant bits for p in ONE bf16 wgmma (the Triton kernel's
"dup" trick).  ``precision="bf16"`` rounds p once (flash-attention practice).  A bf16 query is exact; a float32
query is rounded to the MMA dtype (the "bf16-operand error", ~1e-3 relative on the H200; ``split_query=True``
feeds hi + lo parts through two QK wgmmas but did not lower that error on the device: unverified, off by
default); codes are exact in bf16 (f16 for
FP8/fp16 payloads: e4m3 -> bf16 has no single cvt on sm_90, e4m3 -> f16 has); accumulation is float32 throughout.
The softmax denominator is kept as per-row partial sums in registers (elementwise), reduced once per split.

The softmax statistics are per column of S^T (a cross-warp reduction along M, through the small SMEM reduction
scratch Mosaic GPU reserves); ``m`` is kept in the log2 domain (``exp2`` + one FMA per element) and converted
back to natural log for the combine.  P^T goes through SMEM once per block (``BT x N`` bf16 = 2 KB, stored
transposed as the wgmma B operand); the K/V *codes* never take an SMEM round trip after their TMA copy: they are
loaded straight from the swizzled TMA tile into the wgmma register-A layout and converted in registers.

Loads: :func:`plgpu.emit_pipeline` double/triple-buffers the TMA copies of the K, V and scale tiles of the
split (``max_concurrent_steps``).  No warp specialization yet (one compute warpgroup issues its own TMAs).

Pack-time layout ("mgpu layout", NOT layout_version 1 -- convert with :func:`prepare_region`)
--------------------------------------------------------------------------------------------
The Mosaic GPU path wants each operand in the form its wgmma fragment reads::

    k        [B*Hkv, T, D]  int8 / int4 (SIGNED two's complement q = u - 2^(b-1), i.e. u XOR 0x80 / 0x88;
                            int4 packed two per byte, element i in the low nibble first = layout v1's order),
                            or the float payload (bf16/fp16/e4m3/e5m2) unchanged
    v        [B*Hkv, D, T]  the same codes TRANSPOSED (tokens contiguous) for INT and FP8: the PV product's A
                            operand is V^T, whose register fragment needs the contraction axis (tokens)
                            contiguous; bf16/fp16 V stays [B*Hkv, T, D] (wgmma reads it transposed from SMEM)
    k_scale, v_scale  f32 [B*Hkv, T]  per-token scales (INT); None for float payloads
    logit_scale       f32 [B*Hkv]     sm_scale * K per-head scale (fp8, 1 otherwise) * log2(e)
    v_head_scale      f32 [B*Hkv] or None (fp8 V per-head scale, applied to the partial outputs)

:func:`prepare_region` converts a layout_version-1 :class:`~kvquant_jax.abi.regions.Region` (offset-binary
``uint8`` codes packed little-endian along D, ``[B, Hkv, T, D*bits/8]``, scales ``[B, Hkv, T, 1]``) into it;
:func:`unprepare_codes` is the inverse for the codes (used by the CPU round-trip tests).  A cache that stores the
mgpu layout natively pays the transposed V append (one strided column write per token) instead of the conversion.

Ragged lengths: rows outside ``[start, end)`` are masked (their contents may be NaN: logits and scales are
selected, never multiplied; FP8 V columns are zeroed in registers; bf16/fp16 V rows are read by the wgmma
straight from SMEM, so dead bf16/fp16 V rows must be finite); blocks outside the live window are still read
(static pipeline grid; v1 limitation).

Measured (H200, JAX 0.11.2, 2026-12-01, ``experiments/check_mgpu_decode.py``, two runs, B=8 Hq=32 Hkv=8 D=128)
-----------------------------------------------------------------------------------------------------------
float64-oracle parity (ragged, poisoned, + k_new/v_new, bf16 query): 1.0e-6 .. 2.2e-6 for bf16/int8/int4 at
D = 64/128/256 and GQA 3/4/8, 1.7e-7 for e4m3; ``precision="bf16"`` 1.0e-3 .. 1.6e-3 (bf16 p); a float32 query
(rounded to bf16 / f16): 5e-4 .. 1.7e-3 (the bf16-operand error).  T = 32K, median of 8 programs, copy probe
3.20 / 3.51 TB/s, cuDNN bf16 487.5 / 497.6 us: bf16 385-441 us (1.11-1.29x, 76-84% of copy), INT8 345-346 us
(1.41-1.44x, 46-50%), INT4 229-243 us (2.0-2.2x, 33-37% of copy on the 285 MB it reads), e4m3 295-390 us
(1.27-1.65x).  T = 4K: bf16 105 us (1.13x), INT8 79-80 us (1.45-1.49x), INT4 53 us (2.26x).  The packed formats
are bound by the per-block dependency chain of the single warpgroup (TMA wait -> convert -> QK wgmma -> cross-warp
max -> exp -> transposed P store + fence -> PV wgmma), not by bytes: INT4 moves 0.52x INT8's bytes in 0.66x its
time, and neither more CTAs per SM (2x/4x splits), a deeper pipeline, 64-token blocks nor the UPCAST register
layouts made INT4 faster.  Next: two compute warpgroups ping-ponging + a TMA warpgroup, two blocks per softmax
update (built, not yet measured: :mod:`pallas_kernels.decode_attention_mgpu_ws`, which shares this file's layout,
wrapper and per-block update :func:`_block_update`), a dynamic pipeline grid for ragged windows.

Interpret mode: JAX exposes ``plgpu.InterpretGPUParams`` (0.10.2 has it), but its interpreter does not model
wgmma register fragments / layout casts, so ``interpret=True`` here runs :func:`decode_attention_mgpu_reference`
on the prepared operands (the same arithmetic, plain JAX) -- CI tests the layout conversion and that path; only
the H200 runs the kernel.
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

from kvquant_jax.abi.reference import decode_attention_reference as _oracle_f64
from kvquant_jax.abi.reference import unpack_codes
from kvquant_jax.abi.regions import KVFormat, Region, check_query
from kvquant_jax.abi.transposed_v import fp8_codes

__all__ = ["MgpuConfig", "MgpuOperands", "prepare_region", "unprepare_codes", "mgpu_unsupported",
           "decode_attention_mgpu", "decode_attention_mgpu_prepared", "decode_attention_mgpu_partials",
           "decode_attention_mgpu_reference", "decode_attention_mgpu_reference_f64", "transposed_v_operands",
           "transposed_v_device_unsupported", "transposed_v_unsupported", "transposed_v_config_unsupported",
           "transposed_v_shape", "decode_attention_transposed_v"]

_F32 = jnp.float32
_NEG = -1e30
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_INT_DTYPES = {8: jnp.int8, 4: jnp.int4}
_FLOAT_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Static knobs.

    block_t: KV tokens per pipeline step (the wgmma M of the QK product; a multiple of 64; 128 default).
    num_splits: split-K programs per (sequence, KV head); None -> enough for ~2 waves of the 132 SMs.
    max_concurrent_steps: TMA pipeline depth (stages in SMEM).
    precision: "bf16x2" (hi/lo p in one wgmma, ~1e-5) or "bf16" (p rounded once, ~1e-4..1e-3).
    barriers: "auto" (default): Pallas's warpgroup barriers around every SMEM store (the P tiles: BT/64 per step,
        two barriers each) and before every TMA load; "explicit" (``unsafe_no_auto_barriers``): the kernel's own
        ``commit_smem`` calls only (after the P stores, before the PV wgmma; the previous step's wgmmas waited
        for before the next stores; one at the end of each step before the pipeline refills the stage; the
        epilogue's) -- the same arithmetic, as ``KiviMgpuConfig.barriers`` (v1 only; the warp-specialized
        kernel keeps Pallas's barriers).
    """

    block_t: Optional[int] = None              # None -> default_mgpu_config
    num_splits: Optional[int] = None
    max_concurrent_steps: Optional[int] = None  # None -> default_mgpu_config
    precision: str = "bf16x2"
    upcast: bool = False                         # INT codes loaded in WGMMA_UPCAST_2X/4X layouts (wider vectors)
    barriers: str = "auto"
    split_query: bool = False                    # EXPERIMENTAL: float32 q as hi + lo MMA-dtype parts (2 QK wgmmas);
                                                 # on the H200 (2026-12-01) it did NOT lower the f32-q error
                                                 # (1.5e-3 bf16 K/V either way): unverified, off by default


def default_mgpu_config(kf: KVFormat) -> MgpuConfig:
    """Per-format defaults from two H200 sweeps at T = 32K, B=8 Hq=32 Hkv=8 D=128 (2026-12-01, the better worst
    case of the two runs): bf16/fp16 128-token blocks x 3 stages (441 / 385 us), FP8 64 x 3 (295 / 390 us),
    INT8 128 x 3 (345 / 346 us), INT4 128 x 4 (243 / 229 us); num_splits auto (~2 CTAs per SM)."""
    if kf.payload in ("e4m3", "e5m2"):
        return MgpuConfig(block_t=64, max_concurrent_steps=3)
    if kf.payload == "int4":
        return MgpuConfig(block_t=128, max_concurrent_steps=4)
    return MgpuConfig(block_t=128, max_concurrent_steps=3)


def _resolve_config(cfg: MgpuConfig | None, kf: KVFormat) -> MgpuConfig:
    cfg = cfg or MgpuConfig()
    dflt = default_mgpu_config(kf)
    return dataclasses.replace(cfg, block_t=cfg.block_t or dflt.block_t,
                               max_concurrent_steps=cfg.max_concurrent_steps or dflt.max_concurrent_steps)


@struct.dataclass
class MgpuOperands:
    """One region in the mgpu pack-time layout (see the module docstring); shapes in the field comments."""

    k: jax.Array                      # [BH, T, D] int8/int4 signed codes or float payload
    v: jax.Array                      # [BH, D, T] (INT/FP8, transposed) or [BH, T, D] (bf16/fp16)
    k_scale: Optional[jax.Array]      # f32 [BH, T] per-token K scale (INT) or None
    v_scale: Optional[jax.Array]      # f32 [BH, T] per-token V scale (INT) or None
    k_head_scale: Optional[jax.Array]  # f32 [Hkv] fp8 per-head K scale or None
    v_head_scale: Optional[jax.Array]  # f32 [Hkv] fp8 per-head V scale or None
    start: jax.Array                  # int32 [B] first live row
    end: jax.Array                    # int32 [B] one past the last live row
    kf: KVFormat = struct.field(pytree_node=False, default=KVFormat("bf16"))
    vf: KVFormat = struct.field(pytree_node=False, default=KVFormat("bf16"))
    num_kv_heads: int = struct.field(pytree_node=False, default=1)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def head_dim(self) -> int:
        return self.k.shape[2]


# --------------------------------------------------------------------------------------------------------------
# Support matrix and pack-time layout conversion (CPU-checkable)
# --------------------------------------------------------------------------------------------------------------
def _fmt_supported(f: KVFormat, d: int) -> Optional[str]:
    if f.payload in ("bf16", "fp16"):
        return None
    if f.payload in ("e4m3", "e5m2"):
        return None
    if f.payload in ("int8", "int4"):
        if f.scale != "token" or f.zero != "symmetric":
            return f"{f}: only per-token symmetric INT (scale='token', zero='symmetric') is implemented"
        if f.token_groups(d) != 1:
            return f"{f}: scale groups along D are not implemented"
        return None
    return f"{f.payload}: no Mosaic GPU register type (INT2/INT1) or not implemented"


def _formats_unsupported(kf: KVFormat, vf: KVFormat, head_dim: int) -> Optional[str]:
    """The format / head_dim conditions every Mosaic GPU decode kernel here shares (v1 and the warp-specialized
    one): why the K/V pair cannot be read, or None."""
    for f in (kf, vf):
        why = _fmt_supported(f, head_dim)
        if why:
            return why
    if (kf.payload in ("bf16", "fp16")) != (vf.payload in ("bf16", "fp16")):
        return "mixed float/quantized K and V are not implemented"
    if head_dim % 64:
        return f"head_dim {head_dim} is not a multiple of 64"
    return None


def mgpu_unsupported(reg: Region, head_dim: int, config: MgpuConfig | None = None) -> Optional[str]:
    """Why this kernel cannot take the region (None when it can); the caller keeps the Triton kernel then."""
    kf, vf = reg.k.fmt, reg.v.fmt
    cfg = _resolve_config(config, kf)
    why = _formats_unsupported(kf, vf, head_dim)
    if why:
        return why
    rows = reg.k.data.shape[2]
    if cfg.block_t % 64 or rows % cfg.block_t:
        return f"{rows} rows is not a multiple of block_t={cfg.block_t} (a multiple of 64)"
    return None


def _codes_signed(data_u8, bits: int, xp=jnp):
    """Offset-binary uint8 codes ``[..., D*bits/8]`` -> signed integer codes ``[..., D]`` (int8 values)."""
    u = unpack_codes(data_u8, bits, xp).astype(xp.int32 if xp is not np else np.int32)
    return (u - 2 ** (bits - 1)).astype(xp.int8 if xp is not np else np.int8)


def prepare_region(reg: Region, num_kv_heads: int | None = None) -> MgpuOperands:
    """layout_version-1 region -> :class:`MgpuOperands` (jit-able; one pass over the codes).

    ``reg.k.data``: ``[B, Hkv, T, D*bits/8]`` uint8 (INT) or ``[B, Hkv, T, D]`` float; scales ``[B, Hkv, T, 1]``
    (INT per-token) or ``[Hkv]`` (fp8 per-head).
    """
    kf, vf = reg.k.fmt, reg.v.fmt
    b, hkv, t = reg.k.data.shape[:3]
    d = reg.k.data.shape[3] * (8 // kf.bits) if kf.is_int else reg.k.data.shape[3]
    why = None
    for f in (kf, vf):
        why = why or _fmt_supported(f, d)
    if why:
        raise NotImplementedError(f"decode_attention_mgpu: {why}")

    def conv(op, transpose):
        f = op.fmt
        if f.is_int:
            x = _codes_signed(op.data, f.bits).astype(_INT_DTYPES[f.bits])     # [B, Hkv, T, D]
            sc = op.scale.astype(_F32).reshape(b * hkv, t)
        else:
            x, sc = op.data, None
        x = x.reshape(b * hkv, t, d)
        if transpose:
            x = jnp.swapaxes(x, 1, 2)                                          # [BH, D, T]
        hs = op.scale.astype(_F32) if f.scale == "head" and not f.is_int else None
        return x, sc, hs

    k, ks, khs = conv(reg.k, False)
    v, vs, vhs = conv(reg.v, vf.payload not in ("bf16", "fp16"))
    return MgpuOperands(k=k, v=v, k_scale=ks, v_scale=vs, k_head_scale=khs, v_head_scale=vhs,
                        start=reg.start.astype(jnp.int32), end=reg.end.astype(jnp.int32), kf=kf, vf=vf,
                        num_kv_heads=hkv)


def unprepare_codes(codes, bits: int, transposed: bool, b: int, hkv: int, xp=np):
    """Inverse of the code part of :func:`prepare_region`: signed codes ``[BH, T, D]`` (or ``[BH, D, T]`` when
    ``transposed``) -> layout-v1 offset-binary uint8 ``[B, Hkv, T, D*bits/8]`` packed little-endian along D."""
    c = xp.asarray(codes).astype(np.int32)
    if transposed:
        c = xp.swapaxes(c, 1, 2)
        bh, t, d = c.shape
    else:
        bh, t, d = c.shape
    u = (c + 2 ** (bits - 1)).astype(np.uint8)
    per = 8 // bits
    u = u.reshape(b, hkv, t, d // per, per).astype(np.uint32)
    shifts = xp.asarray(np.arange(per, dtype=np.uint32) * bits)
    packed = xp.sum(u << shifts, axis=-1).astype(np.uint8)
    return packed


# --------------------------------------------------------------------------------------------------------------
# The Mosaic GPU kernel
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Spec:
    d: int
    g: int            # query heads per KV head
    n: int            # padded wgmma N
    dup: int          # > 0: columns [dup, 2 dup) carry lo(p)
    bt: int
    ns: int
    nbs: int          # blocks per split
    stages: int
    k_dtype: Any
    v_dtype: Any
    k_regs: bool      # K converted in registers (INT / FP8) vs bf16 A from SMEM
    v_regs: bool      # V^T tile in registers (INT / FP8) vs transposed SMEM A
    k_tok_scale: bool
    v_tok_scale: bool
    q_split: int = 1                # 2: the query enters as bf16 hi + lo parts (two QK wgmmas, float32-grade q)
    upcast: int = 0                 # 2 / 4: load INT8 / INT4 code tiles in the WGMMA_UPCAST_2X / 4X layout
    v_mask: bool = False            # zero dead V columns in registers (FP8 V can hold NaN in dead rows)
    mma_dtype: Any = jnp.bfloat16   # operand type of both wgmmas (f16 for fp16/FP8 payloads: e4m3 -> f16 is one cvt)
    hkv: int = 1                    # KV heads: program pid reads start / end of sequence pid // hkv, lscale pid % hkv
    barriers: str = "auto"          # MgpuConfig.barriers (v1's launch reads it)


def _tile_transforms(dtype, minor: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bits = jnp.dtype(dtype).itemsize * 8 if dtype != jnp.int4 else 4
    sw = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, sw * 8 // bits)), plgpu.SwizzleTransform(sw))


def _codes_to_regs(sp: _Spec, ref):
    """SMEM code tile -> MMA-dtype registers in the wgmma register-A (WGMMA) layout."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bf16, wg = sp.mma_dtype, plgpu.Layout.WGMMA
    if sp.upcast:
        if sp.upcast == 4:   # int4: 8 codes per 32-bit register; relayout on the narrow type, then widen
            x = plgpu.load(ref, (), layout=plgpu.Layout.WGMMA_UPCAST_4X)
            x = plgpu.layout_cast(x, plgpu.Layout.WGMMA_UPCAST_2X).astype(bf16)
        else:
            x = plgpu.load(ref, (), layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(bf16)
        return plgpu.layout_cast(x, wg)
    return ref[...].astype(bf16)


def _block_update(sp: _Spec, q_smem, p_smem, blocks, carry, lo, hi, lsc, col_max=None, v_first: bool = False):
    """One online-softmax update of ONE compute warpgroup over ``len(blocks)`` (1 or 2) KV blocks.

    ``blocks``: ``(k_smem, v_smem, ks_smem, vs_smem, row0)`` per block (SMEM tiles of one pipeline slot; scale
    tiles None when absent; ``row0`` the block's first row); ``p_smem``: ``[len(blocks) * BT/64, N, 64]`` (P^T of
    each block, transposed); ``carry = (acc [D, N], m [N] log2 domain, l [BT, N] per-row partial sums)``.
    ``col_max(s)`` is the column max of ``s [BT, N]`` (a cross-warp reduction through Mosaic GPU's reduction
    scratch; the warp-specialized kernel passes a version that takes a turn with the other compute warpgroup,
    which shares that scratch).  With two blocks ONE max / rescale covers both.  ``v_first``: convert the V
    tiles to registers before the column max instead of after the P store (work to do while waiting for the
    other warpgroup's turn; more registers live).  Returns the new carry.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    d, n, bt = sp.d, sp.n, sp.bt
    nch = bt // 64
    bf16 = sp.mma_dtype               # "bf16" below = the 16-bit MMA operand type (bf16 or f16)
    wg = plgpu.Layout.WGMMA
    col_max = col_max or (lambda s: s.max(axis=0))
    acc, m_i, l_i = carry
    ss, valids = [], []
    for k_smem, _, ks_smem, _, row0 in blocks:
        def qk(acc_ref, k_smem=k_smem):
            if sp.k_regs:
                kr = _codes_to_regs(sp, k_smem)                         # [BT, D] WGMMA registers
                for qi in range(sp.q_split):
                    for j in range(d // 64):
                        cs = slice(j * 64, (j + 1) * 64)
                        plgpu.wgmma(acc_ref, kr[:, cs], q_smem.at[qi, :, cs].T)
            else:
                for qi in range(sp.q_split):
                    plgpu.wgmma(acc_ref, k_smem, q_smem.at[qi].T)
            return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((bt, n), _F32))          # S^T [BT, N]
        if ks_smem is not None:
            ksv = plgpu.load(ks_smem, (), layout=wg.reduce(1), optimized=False)
            s = s * lax.broadcast_in_dim(ksv * lsc, s.shape, [0])
        else:
            s = s * lsc
        rows = plgpu.broadcasted_iota(jnp.int32, (bt, n), 0, layout=wg) + row0
        valid = (rows >= lo) & (rows < hi)
        ss.append(jnp.where(valid, s, _NEG))
        valids.append(valid)
    def v_tiles():
        out = []
        for _, v_smem, _, _, row0 in blocks:
            vr = _codes_to_regs(sp, v_smem) if sp.v_regs else None     # V^T [D, BT] registers
            if sp.v_mask:
                vcols = plgpu.broadcasted_iota(jnp.int32, (d, bt), 1, layout=wg) + row0
                vr = jnp.where((vcols >= lo) & (vcols < hi), vr, jnp.zeros_like(vr))
            out.append(vr)
        return out

    vrs = v_tiles() if v_first else None
    smax = ss[0] if len(ss) == 1 else jnp.maximum(ss[0], ss[1])   # elementwise first: ONE cross-warp max
    m_new = jnp.maximum(m_i, col_max(smax))
    alpha = jnp.exp2(m_i - m_new)
    for bi, ((_, _, _, vs_smem, _), s, valid) in enumerate(zip(blocks, ss, valids)):
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
        p = jnp.where(valid, p, 0.0)
        # l kept as per-row partial sums [BT, N] (elementwise): no cross-warp reduction per block
        l_i = (l_i * lax.broadcast_in_dim(alpha, s.shape, [1]) if bi == 0 else l_i) + p
        if vs_smem is not None:
            vsv = plgpu.load(vs_smem, (), layout=wg.reduce(1), optimized=False)
            p = jnp.where(valid, p * lax.broadcast_in_dim(vsv, s.shape, [0]), 0.0)
        if sp.dup:
            cols = plgpu.broadcasted_iota(jnp.int32, (bt, n), 1, layout=wg)
            p_lo = p - p.astype(bf16).astype(_F32)
            p = jnp.where(cols < sp.dup, p, p_lo)
        p16 = p.astype(bf16)
        for j in range(nch):
            p_smem.at[bi * nch + j].T[...] = plgpu.layout_cast(p16[j * 64:(j + 1) * 64],
                                                               plgpu.Layout.WGMMA_TRANSPOSED)
    plgpu.commit_smem()
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [1])
    vrs = vrs if v_first else v_tiles()

    def pv(acc_ref):
        for bi, ((_, v_smem, _, _, _), vr) in enumerate(zip(blocks, vrs)):
            for j in range(nch):
                if sp.v_regs:
                    a = vr[:, j * 64:(j + 1) * 64]
                else:
                    a = v_smem.at[pl.ds(j * 64, 64), :].T
                plgpu.wgmma(acc_ref, a, p_smem.at[bi * nch + j].T)

    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
    return acc, m_new, l_i


def _mgpu_call(start, end, lscale, q, k, v, ks, vs, sp: _Spec):
    """Launch.  ``start, end``: int32 [B] (program ``pid`` reads entry ``pid // sp.hkv``); ``lscale``: f32 [Hkv]
    (entry ``pid % sp.hkv``); ``q``: [BH, QS, N, D] (MMA dtype); ``k``: [BH, T, D]; ``v``: [BH, D, T] or
    [BH, T, D]; ``ks, vs``: f32 [BH, T] or None.  Returns ``o [BH, S, D, N], m [BH, S, N], l [BH, S, N]`` f32
    (``m`` in log2 units)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bh = q.shape[0]
    d, n, bt, ns, nbs = sp.d, sp.n, sp.bt, sp.ns, sp.nbs
    nch = bt // 64
    bf16 = sp.mma_dtype               # "bf16" below = the 16-bit MMA operand type (bf16 or f16)
    wg = plgpu.Layout.WGMMA
    q_tf = _tile_transforms(bf16, d)
    k_tf = _tile_transforms(sp.k_dtype, d)
    v_tf = _tile_transforms(sp.v_dtype, bt if sp.v_regs else d)
    p_tf = _tile_transforms(bf16, 64)
    has_ks, has_vs = ks is not None, vs is not None

    def body(start_ref, end_ref, ls_ref, q_ref, k_ref, v_ref, *rest):
        rest = list(rest)
        ks_ref = rest.pop(0) if has_ks else None
        vs_ref = rest.pop(0) if has_vs else None
        o_ref, m_ref, l_ref = rest
        pid = lax.axis_index("bh")
        sid = lax.axis_index("split")
        lo = start_ref[pid // sp.hkv]
        hi = end_ref[pid // sp.hkv]
        lsc = ls_ref[pid % sp.hkv]
        base = sid * nbs

        def scoped(q_smem, p_smem, o_smem, m_smem, l_smem, q_bar):
            plgpu.copy_gmem_to_smem(q_ref.at[pid], q_smem, q_bar)       # [QS, N, D]: hi (, lo) parts
            plgpu.barrier_wait(q_bar)

            def step(indices, k_smem, v_smem, *more):
                more = list(more)
                carry = more.pop()
                ks_smem = more.pop(0) if has_ks else None
                vs_smem = more.pop(0) if has_vs else None
                (i,) = indices
                out = _block_update(sp, q_smem, p_smem, [(k_smem, v_smem, ks_smem, vs_smem, (base + i) * bt)],
                                    carry, lo, hi, lsc)
                release_stage(sp.barriers)
                return out

            kspec = plgpu.BlockSpec((bt, d), lambda i: (base + i, 0), transforms=k_tf)
            if sp.v_regs:
                vspec = plgpu.BlockSpec((d, bt), lambda i: (0, base + i), transforms=v_tf)
            else:
                vspec = plgpu.BlockSpec((bt, d), lambda i: (base + i, 0), transforms=v_tf)
            specs = [kspec, vspec]
            refs = [k_ref.at[pid], v_ref.at[pid]]
            if has_ks:
                specs.append(plgpu.BlockSpec((bt,), lambda i: (base + i,)))
                refs.append(ks_ref.at[pid])
            if has_vs:
                specs.append(plgpu.BlockSpec((bt,), lambda i: (base + i,)))
                refs.append(vs_ref.at[pid])
            m0 = plgpu.layout_cast(jnp.full((n,), _NEG, _F32), wg.reduce(0))
            l0 = plgpu.layout_cast(jnp.full((bt, n), 0.0, _F32), wg)
            a0 = plgpu.layout_cast(jnp.full((d, n), 0.0, _F32), wg)
            acc, m_i, l_i = plgpu.emit_pipeline(
                step, grid=(nbs,), in_specs=specs, max_concurrent_steps=min(sp.stages, nbs),
                init_carry=(a0, m0, l0))(*refs)
            o_smem[...] = acc
            m_smem[...] = m_i
            l_smem[...] = l_i.sum(axis=0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pid, sid])
            plgpu.copy_smem_to_gmem(m_smem, m_ref.at[pid, sid])
            plgpu.copy_smem_to_gmem(l_smem, l_ref.at[pid, sid])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((sp.q_split, n, d), bf16, transforms=q_tf),
            plgpu.SMEM((nch, n, 64), bf16, transforms=p_tf),
            plgpu.SMEM((d, n), _F32),
            plgpu.SMEM((n,), _F32),
            plgpu.SMEM((n,), _F32),
            plgpu.Barrier(num_arrivals=1),
        )

    out_type = (jax.ShapeDtypeStruct((bh, ns, d, n), _F32), jax.ShapeDtypeStruct((bh, ns, n), _F32),
                jax.ShapeDtypeStruct((bh, ns, n), _F32))
    fn = plgpu.kernel(body, out_type=out_type, grid=(bh, ns), grid_names=("bh", "split"),
                      compiler_params=plgpu.CompilerParams(approx_math=True, **barrier_compiler_params(sp.barriers)))
    args = [start, end, lscale, q, k, v] + ([ks] if has_ks else []) + ([vs] if has_vs else [])
    return fn(*args)


#: what orders a Mosaic decode kernel's shared memory (``MgpuConfig.barriers``, ``KiviMgpuConfig.barriers``,
#: ``PlanarS8Config.barriers``): Pallas's automatic warpgroup barriers around every SMEM store and before every TMA
#: load ("auto"), or the kernel's own ``commit_smem`` calls ("explicit")
BARRIER_MODES = ("auto", "explicit")


def barrier_compiler_params(barriers: str) -> dict:
    """The ``plgpu.CompilerParams`` fields of a barrier mode: ``"explicit"`` turns Pallas's automatic barriers off."""
    return dict(unsafe_no_auto_barriers=barriers == "explicit")


def release_stage(barriers: str) -> None:
    """The end of a pipeline step (inside a kernel) under ``"explicit"`` barriers: one warpgroup barrier
    (``commit_smem``), so that every thread's reads of the stage just used are done before ``emit_pipeline`` issues
    the TMA that refills it (what Pallas's barrier before that copy did).  Nothing under ``"auto"``."""
    if barriers == "explicit":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.commit_smem()


def _auto_splits(bh: int, nb: int) -> int:
    want = max(1, -(-2 * 132 // bh))
    s = 1
    while s * 2 <= min(want, nb) and nb % (s * 2) == 0:
        s *= 2
    return s


def _spec_for(ops: MgpuOperands, g: int, cfg: MgpuConfig | None, q_dtype=jnp.bfloat16) -> _Spec:
    kf, vf = ops.kf, ops.vf
    cfg = _resolve_config(cfg, kf)
    d, t, bh = ops.head_dim, ops.rows, ops.k.shape[0]
    if cfg.precision not in ("bf16x2", "bf16"):
        raise ValueError(f"precision must be 'bf16x2' or 'bf16', got {cfg.precision!r}")
    if cfg.barriers not in BARRIER_MODES:
        raise ValueError(f"barriers must be 'auto' or 'explicit', got {cfg.barriers!r}")
    dup = g if cfg.precision == "bf16x2" else 0
    n = max(8, -(-(2 * g if dup else g) // 8) * 8)
    if cfg.block_t % 64 or t % cfg.block_t:
        raise ValueError(f"{t} rows is not a multiple of block_t={cfg.block_t} (a multiple of 64)")
    nb = t // cfg.block_t
    ns = cfg.num_splits or _auto_splits(bh, nb)
    if nb % ns:
        raise ValueError(f"num_splits={ns} does not divide the {nb} blocks")
    mma = jnp.float16 if kf.payload in ("fp16", "e4m3", "e5m2") else jnp.bfloat16
    return _Spec(d=d, g=g, n=n, dup=dup, bt=cfg.block_t, ns=ns, nbs=nb // ns, stages=cfg.max_concurrent_steps,
                 k_dtype=ops.k.dtype, v_dtype=ops.v.dtype, k_regs=kf.payload not in ("bf16", "fp16"),
                 v_regs=vf.payload not in ("bf16", "fp16"), k_tok_scale=ops.k_scale is not None,
                 v_tok_scale=ops.v_scale is not None,
                 q_split=2 if cfg.split_query and jnp.dtype(q_dtype) != jnp.dtype(mma) else 1,
                 v_mask=vf.payload in ("e4m3", "e5m2"), mma_dtype=mma,
                 upcast=(4 if kf.bits == 4 else 2) if cfg.upcast and kf.is_int else 0, hkv=ops.num_kv_heads,
                 barriers=cfg.barriers)


def _query_block(q, hkv: int, sp: _Spec):
    """``[B, Hq, D]`` -> ``[B*Hkv, QS, N, D]`` in the MMA dtype: group rows, duplicated for bf16x2, zero-padded
    to N (QS = 1, or 2 for hi + lo of a float32 query with ``split_query``)."""
    b, hq, d = q.shape
    q4 = q.reshape(b, hkv, sp.g, d)
    if sp.dup:
        q4 = jnp.concatenate([q4, q4], axis=2)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, sp.n - q4.shape[2]), (0, 0)))
    hi = q4.astype(sp.mma_dtype)
    parts = [hi]
    if sp.q_split == 2:
        parts.append((q4.astype(_F32) - hi.astype(_F32)).astype(sp.mma_dtype))
    return jnp.stack(parts, axis=2).reshape(b * hkv, sp.q_split, sp.n, d)


def decode_attention_mgpu_partials(q, ops: MgpuOperands, *, sm_scale: float | None = None,
                                   config: MgpuConfig | None = None, interpret: Any = False):
    """Split-K partials of one prepared region.  ``q``: ``[B, Hq, D]``.

    Returns ``acc [B, Hkv, S, G, D], m [B, Hkv, S, G], l [B, Hkv, S, G]`` float32 (natural-log ``m``), the
    format of ``pallas_kernels.decode_attention._region_partial`` (feed a list of them to its ``_combine``).
    """
    if interpret:
        return _partials_jnp(q, ops, sm_scale)
    sp = _spec_for(ops, q.shape[1] // ops.num_kv_heads, config, q.dtype)
    return _kernel_partials(_mgpu_call, q, ops, sp, sm_scale)


def _kernel_partials(call, q, ops: MgpuOperands, sp: _Spec, sm_scale):
    """The wrapper around a kernel launch ``call(start, end, lscale, q_block, k, v, ks, vs, sp) -> (o [BH, S', D,
    N], m [BH, S', N] log2, l [BH, S', N])``: per-row scalars and the query block in, the partials out as ``acc [B,
    Hkv, S', G, D], m, l [B, Hkv, S', G]`` (S' = the number of partials the launch returns: ``sp.ns`` for the
    single-warpgroup kernel, two per split for the warp-specialized one)."""
    b, hq, d = q.shape
    hkv = ops.num_kv_heads
    g = hq // hkv
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    lsc = jnp.full((hkv,), scale * _LOG2E, _F32)
    if ops.k_head_scale is not None:
        lsc = lsc * ops.k_head_scale.astype(_F32)
    qb = _query_block(q, hkv, sp)
    # bounds per sequence, read by the kernel as entry pid // Hkv (no repeat / clip kernel in the wrapper: a row
    # outside [0, rows) does not exist, so unclipped bounds select the same rows)
    o, m, l = call(ops.start.astype(jnp.int32), ops.end.astype(jnp.int32), lsc, qb, ops.k, ops.v, ops.k_scale,
                   ops.v_scale, sp)
    ns = o.shape[1]
    o = jnp.swapaxes(o, 2, 3).reshape(b, hkv, ns, sp.n, d)                   # [B, Hkv, S', N, D]
    m = m.reshape(b, hkv, ns, sp.n) * _LN2
    l = l.reshape(b, hkv, ns, sp.n)
    acc = o[:, :, :, :g] + (o[:, :, :, g:2 * g] if sp.dup else 0.0)
    if ops.v_head_scale is not None:
        acc = acc * ops.v_head_scale.astype(_F32)[None, :, None, None, None]
    return acc, m[..., :g], l[..., :g]


def _partials_jnp(q, ops: MgpuOperands, sm_scale):
    """Plain-JAX partials (one split) from the prepared operands: the same arithmetic in float32."""
    b, hq, d = q.shape
    hkv = ops.num_kv_heads
    g = hq // hkv
    t = ops.rows
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    k = ops.k.astype(_F32).reshape(b, hkv, t, d)
    v = ops.v.astype(_F32)
    v = (jnp.swapaxes(v, 1, 2) if ops.vf.payload not in ("bf16", "fp16") else v).reshape(b, hkv, t, d)
    q4 = q.astype(_F32).reshape(b, hkv, g, d)
    s = jnp.einsum("bhgd,bhtd->bhgt", q4, k, precision=lax.Precision.HIGHEST) * scale
    if ops.k_scale is not None:
        s = s * ops.k_scale.reshape(b, hkv, 1, t)
    if ops.k_head_scale is not None:
        s = s * ops.k_head_scale.astype(_F32)[None, :, None, None]
    rows = jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = ((rows >= ops.start[:, None]) & (rows < ops.end[:, None]))[:, None, None, :]
    s = jnp.where(valid, s, _NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.where(valid, jnp.exp(s - m[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    pv = p
    if ops.v_scale is not None:
        pv = jnp.where(valid, p * ops.v_scale.reshape(b, hkv, 1, t), 0.0)
    vz = jnp.where(valid[:, :, 0, :, None], v, 0.0)
    acc = jnp.einsum("bhgt,bhtd->bhgd", pv, vz, precision=lax.Precision.HIGHEST)
    if ops.v_head_scale is not None:
        acc = acc * ops.v_head_scale.astype(_F32)[None, :, None, None]
    return acc[:, :, None], m[:, :, None], l[:, :, None]


def decode_attention_mgpu_prepared(q, ops: MgpuOperands, *, k_new=None, v_new=None, sm_scale: float | None = None,
                                   config: MgpuConfig | None = None, interpret: Any = False, out_dtype=None):
    """Attention of the new token over one prepared region (+ the exact current token), ONE softmax.

    ``q``: ``[B, Hq, D]``; ``k_new, v_new``: optional ``[B, Hkv, D]``.  Returns ``[B, Hq, D]`` in ``out_dtype``
    (default ``q.dtype``).
    """
    part = decode_attention_mgpu_partials(q, ops, sm_scale=sm_scale, config=config, interpret=interpret)
    return _merge_partials(q, part, ops.num_kv_heads, sm_scale, k_new=k_new, v_new=v_new,
                           out_dtype=out_dtype or q.dtype)


def _merge_partials(q, part, hkv: int, sm_scale, *, tail=None, k_new=None, v_new=None, out_dtype=_F32):
    """ONE softmax over the kernel's split partials, an optional dense tail and the optional exact current token,
    with no concatenation: the epilogue of every Mosaic GPU route (v1, warp-specialized, KIVI).  ``_combine`` of
    concatenated partials materialized each concatenate as its own XLA kernel, ~1.4-4.4 us apiece at 4K on an
    H100 (docs/benchmarks_decode.md, 2026-12-06).

    ``q [B, Hq, D]``; ``part = (acc [B, Hkv, S, G, D], m, l [B, Hkv, S, G])`` float32 (natural-log ``m``, an empty
    split has ``m = -1e30, l = 0``); ``tail = (k, v [B, Hkv, Nt, D], live bool [B, Nt])`` or None; ``k_new, v_new
    [B, Hkv, D]`` or None.  Returns ``[B, Hq, D]`` in ``out_dtype`` (zeros where nothing is live)."""
    b, hq, d = q.shape
    g = hq // hkv
    hp = lax.Precision.HIGHEST
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    acc, m, l = part
    q4 = q.astype(_F32).reshape(b, hkv, g, d) * scale                                 # [B, Hkv, G, D]
    m_all = jnp.max(m, axis=2)                                                         # [B, Hkv, G]
    if tail is not None:
        tk, tv, live = tail
        live4 = live[:, None, None, :]
        s_t = jnp.where(live4, jnp.einsum("bhgd,bhnd->bhgn", q4, tk.astype(_F32), precision=hp), _NEG)
        m_all = jnp.maximum(m_all, jnp.max(s_t, axis=-1))
    if k_new is not None:
        s_c = jnp.sum(q4 * k_new.astype(_F32)[:, :, None, :], axis=-1)                # [B, Hkv, G]
        m_all = jnp.maximum(m_all, s_c)
    w = jnp.exp(m - m_all[:, :, None])                                                 # [B, Hkv, S, G]
    den = jnp.sum(w * l, axis=2)
    num = jnp.sum(w[..., None] * acc, axis=2)                                          # [B, Hkv, G, D]
    if tail is not None:
        p_t = jnp.where(live4, jnp.exp(s_t - m_all[..., None]), 0.0)
        den = den + jnp.sum(p_t, axis=-1)
        num = num + jnp.einsum("bhgn,bhnd->bhgd", p_t, jnp.where(live[:, None, :, None], tv.astype(_F32), 0.0),
                               precision=hp)
    if k_new is not None:
        p_c = jnp.exp(s_c - m_all)
        den = den + p_c
        num = num + p_c[..., None] * v_new.astype(_F32)[:, :, None, :]
    out = jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)
    return out.reshape(b, hq, d).astype(out_dtype)


def decode_attention_mgpu(q, region: Region, *, k_new=None, v_new=None, sm_scale: float | None = None,
                          config: MgpuConfig | None = None, interpret: Any = False, out_dtype=None):
    """Layout-v1 entry point: :func:`prepare_region` (a pass over the codes) then the kernel.

    ``q``: ``[B, Hq, D]``; ``region``: one :class:`Region` (``[B, Hkv, T, ...]``); ``k_new, v_new``: optional
    ``[B, Hkv, D]``.  Serving code should keep the cache in the mgpu layout and call
    :func:`decode_attention_mgpu_prepared`.
    """
    check_query(q, [region], k_new, v_new)
    why = mgpu_unsupported(region, q.shape[-1], config)
    if why:
        raise NotImplementedError(f"decode_attention_mgpu: {why}")
    ops = prepare_region(region)
    return decode_attention_mgpu_prepared(q, ops, k_new=k_new, v_new=v_new, sm_scale=sm_scale, config=config,
                                          interpret=interpret, out_dtype=out_dtype)


def decode_attention_mgpu_reference(q, region: Region, *, k_new=None, v_new=None, sm_scale: float | None = None,
                                    config: MgpuConfig | None = None, interpret: Any = False, out_dtype=None):
    """Plain-JAX float32 twin of :func:`decode_attention_mgpu` (same signature; kernel-only args ignored):
    converts to the mgpu layout and runs the same partial arithmetic, so it also checks :func:`prepare_region`."""
    del config, interpret
    ops = prepare_region(region)
    return decode_attention_mgpu_prepared(q, ops, k_new=k_new, v_new=v_new, sm_scale=sm_scale, interpret=True,
                                          out_dtype=out_dtype)


def decode_attention_mgpu_reference_f64(q, region: Region, *, k_new=None, v_new=None,
                                        sm_scale: float | None = None) -> np.ndarray:
    """The float64 NumPy oracle (``kvquant_jax.abi.reference``) on the same layout-v1 inputs."""
    return _oracle_f64(q, [region], k_new=k_new, v_new=v_new, sm_scale=sm_scale)


# --------------------------------------------------------------------------------------------------------------
# A cache stored in the kernel's layout (kvquant_jax.abi.transposed_v): no per-step conversion
# --------------------------------------------------------------------------------------------------------------
def _reinterpret(codes_u8, bits: int, count: int):
    """uint8 two's-complement bytes ``[..., count*bits/8]`` -> int8 / int4 ``[..., count]`` (a bitcast: free on
    the H200 when it feeds the kernel, see ``experiments/probe_subbyte_append.py``)."""
    x = lax.bitcast_convert_type(codes_u8, _INT_DTYPES[bits])
    return x.reshape(codes_u8.shape[:-1] + (count,))


def transposed_v_kv_format(fmt) -> KVFormat:
    """The :class:`KVFormat` of a transposed-V layer's K and V (``fmt``: ``abi.transposed_v.TransposedVFormat``):
    per-token symmetric INT, or FP8 with one scale per KV head."""
    return KVFormat(fmt.payload, "head") if fmt.fp8 else KVFormat(fmt.payload, "token", "symmetric")


def transposed_v_operands(fmt, state, lengths) -> MgpuOperands:
    """:class:`MgpuOperands` over a transposed-V layer (``fmt``: ``abi.transposed_v.TransposedVFormat``; ``state``
    with ``k_codes [B, Hkv, C, D*b/8]``, ``v_codes [B, Hkv, D, C*b/8]``, ``k_scale, v_scale [B, Hkv, C, 1]``),
    live rows ``[0, lengths[b])``.  Codes are reinterpreted in place; the scales are cast to float32 (a pass over
    ``4 * C`` bytes per head, ~3 % of an INT4 layer).  FP8 (``fmt.fp8``): the uint8 codes are the FP8 bytes
    (bitcast in place) and ``k_scale, v_scale`` float32 ``[Hkv]`` the per-head scales."""
    b, hkv, c, pk = state.k_codes.shape
    d = pk * 8 // fmt.bits
    kf = transposed_v_kv_format(fmt)
    if fmt.fp8:
        k = fp8_codes(state.k_codes, fmt.fp8).reshape(b * hkv, c, d)
        v = fp8_codes(state.v_codes, fmt.fp8).reshape(b * hkv, d, c)
        return MgpuOperands(k=k, v=v, k_scale=None, v_scale=None, k_head_scale=state.k_scale.astype(_F32),
                            v_head_scale=state.v_scale.astype(_F32), start=jnp.zeros((b,), jnp.int32),
                            end=lengths.astype(jnp.int32), kf=kf, vf=kf, num_kv_heads=hkv)
    k = _reinterpret(state.k_codes, fmt.bits, d).reshape(b * hkv, c, d)
    v = _reinterpret(state.v_codes, fmt.bits, c).reshape(b * hkv, d, c)
    ks = state.k_scale.astype(_F32).reshape(b * hkv, c)
    vs = state.v_scale.astype(_F32).reshape(b * hkv, c)
    return MgpuOperands(k=k, v=v, k_scale=ks, v_scale=vs, k_head_scale=None, v_head_scale=None,
                        start=jnp.zeros((b,), jnp.int32), end=lengths.astype(jnp.int32), kf=kf, vf=kf,
                        num_kv_heads=hkv)


def hopper_unsupported() -> Optional[str]:
    """Why the default device cannot run a Mosaic GPU wgmma kernel (None on a Hopper, sm_90, GPU)."""
    dev = jax.devices()[0]
    cc = str(getattr(dev, "compute_capability", ""))
    if dev.platform != "gpu" or not (cc.startswith("9") or any(h in dev.device_kind for h in ("H100", "H200"))):
        return f"the Mosaic GPU swap-AB kernel needs a Hopper (sm_90) GPU, have {dev.device_kind}"
    return None


def transposed_v_device_unsupported(q) -> Optional[str]:
    """The device / query conditions every Mosaic GPU kernel over a transposed-V layer shares (v1 and the
    warp-specialized one): why not (not a Hopper GPU, a float32 query), or None."""
    why = hopper_unsupported()
    if why:
        return why
    if jnp.dtype(q.dtype) == jnp.float32:
        return ("float32 query: the kernel rounds q to bf16 (~1e-3 relative); a float32 model keeps float32 parity "
                "on the reference path")
    return None


def transposed_v_unsupported(q, fmt, state) -> Optional[str]:
    """Why the Mosaic GPU kernel cannot serve this transposed-V layer on this device (None when it can): not a
    Hopper GPU, a float32 query, head_dim not a multiple of 64, capacity not a multiple of the format's block."""
    why = transposed_v_device_unsupported(q)
    if why:
        return why
    c = state.k_codes.shape[-2]
    d = q.shape[-1]
    bt = default_mgpu_config(transposed_v_kv_format(fmt)).block_t
    if d % 64:
        return f"head_dim {d} is not a multiple of 64"
    if c % bt:
        return f"capacity {c} is not a multiple of block_t={bt} (round the capacity up)"
    return None


def transposed_v_shape(fmt, state) -> MgpuOperands:
    """The :class:`MgpuOperands` of a transposed-V layer as shapes and dtypes only (``jax.eval_shape``: no array
    is read or written; works on tracers), for the launch-plan checks of both Mosaic GPU kernels."""
    zeros = lambda st: jnp.zeros(st.k_codes.shape[:1], jnp.int32)  # noqa: E731
    return jax.eval_shape(lambda st: transposed_v_operands(fmt, st, zeros(st)), state)


def transposed_v_config_unsupported(fmt, state, head_dim: int, group: int,
                                    config: MgpuConfig | None = None) -> Optional[str]:
    """Why this kernel with ``config`` cannot read a transposed-V layer of this shape (None when it can): the
    format / head_dim rules, block_t vs the capacity, num_splits (the launch plan of :func:`_spec_for`).  Device
    independent (CPU-checkable); :func:`transposed_v_unsupported` adds the device and query checks."""
    kf = transposed_v_kv_format(fmt)
    why = _formats_unsupported(kf, kf, head_dim)
    if why:
        return why
    try:
        _spec_for(transposed_v_shape(fmt, state), group, config)
    except ValueError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------------------------
# A full-precision (bf16 / fp16) region read in place: prepare_region is a reshape, no pass over the rows
# --------------------------------------------------------------------------------------------------------------
DENSE_PAYLOADS = ("bf16", "fp16")


def dense_payload_unsupported(reg: Region) -> Optional[str]:
    """Why ``reg`` is not a full-precision region the Mosaic kernels read in place (None when it is): K and V must
    hold the same :data:`DENSE_PAYLOADS` payload."""
    kf, vf = reg.k.fmt, reg.v.fmt
    if kf.payload not in DENSE_PAYLOADS or vf.payload != kf.payload:
        return f"not a full-precision region read in place ({kf} / {vf})"
    return None


def dense_region_config_unsupported(reg: Region, group: int, config: MgpuConfig | None = None) -> Optional[str]:
    """Why this kernel with ``config`` cannot read a full-precision region in place (None when it can): K and V
    not the same bf16 / fp16 payload, the format / head_dim rules, block_t vs the rows, num_splits (the launch plan
    of :func:`_spec_for` on the region's shapes; no array is read).  Device independent (CPU-checkable)."""
    why = dense_payload_unsupported(reg) or mgpu_unsupported(reg, reg.k.data.shape[3], config)
    if why:
        return why
    try:
        _spec_for(jax.eval_shape(prepare_region, reg), group, config)
    except ValueError as e:
        return str(e)
    return None


def dense_region_device_unsupported(q) -> Optional[str]:
    """The device / query conditions of a Mosaic GPU kernel over a full-precision region: not a Hopper GPU, or a
    float32 query (the kernels round q to the 16-bit MMA type, ~1e-3 relative; the Triton kernel keeps float32
    parity for a float32 model).  None when it can."""
    return transposed_v_device_unsupported(q)


def decode_attention_transposed_v(q, fmt, state, lengths, k_new=None, v_new=None, *, sm_scale: float | None = None,
                                  interpret: Any = None, config: MgpuConfig | None = None):
    """Attention of one new token over a transposed-V layer (+ the exact current token), ONE softmax.

    ``q [B, Hq, D]``; ``fmt, state``: the layer's static format and arrays (see :func:`transposed_v_operands`);
    ``lengths`` int ``[B]``; ``k_new, v_new`` optional ``[B, Hkv, D]``.  ``interpret``: anything but False/None
    on a non-GPU platform runs the plain-JAX partials on the same reinterpreted operands (CPU tests).  Returns
    ``[B, Hq, D]`` float32 (the dispatcher casts).
    """
    ops = transposed_v_operands(fmt, state, lengths)
    interp = bool(interpret) if interpret is not None else jax.devices()[0].platform != "gpu"
    return decode_attention_mgpu_prepared(q, ops, k_new=k_new, v_new=v_new, sm_scale=sm_scale, config=config,
                                          interpret=interp, out_dtype=_F32)
