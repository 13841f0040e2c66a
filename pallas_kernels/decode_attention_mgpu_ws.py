"""Warp-specialized Mosaic GPU (Hopper) decode attention over one KV region: a TMA warpgroup + C compute warpgroups.

Issue J, second kernel.  Same problem, operands and numerics as :mod:`pallas_kernels.decode_attention_mgpu` ("v1":
read its docstring first): one query token per sequence attends over one region of K/V in the mgpu pack-time
layout (:func:`~pallas_kernels.decode_attention_mgpu.prepare_region`), split-K partials merged by the same wrapper
(:func:`~pallas_kernels.decode_attention_mgpu._kernel_partials` / ``_merge_partials``).  The per-block math is
v1's :func:`~pallas_kernels.decode_attention_mgpu._block_update` (imported, not copied): swap-AB wgmma (KV tokens
= M, the query-head group = N), codes loaded from the swizzled TMA tile straight into the wgmma register-A layout,
per-token K scale after the QK dot, V scale folded into p, log2-domain online softmax, bf16x2 hi/lo p, ragged
masks.  Formats: v1's (bf16 / fp16, per-token symmetric INT8 / INT4, FP8 e4m3 / e5m2).

Why: v1 runs ONE warpgroup per CTA, whose per-block chain (TMA wait -> convert -> QK wgmma -> cross-warp max ->
exp -> P store + fence -> PV wgmma) is serial; the packed formats reached only 33-50 % of copy bandwidth on the
H200 (and v1's registers allow 2 such CTAs per SM).  Here ``C`` (``compute_wgs``: 2, or 4 with half the registers
each) compute warpgroups work on different KV blocks of the same split at the same time, so one's tensor-core /
conversion work overlaps another's softmax and barrier latency, and one more warpgroup does nothing but keep the
TMA ring full.

Per CTA (program ``(b*Hkv + h, split)``, (C + 1) x 128 threads, ``plgpu.kernel(num_threads=C + 1, thread_name="wg")``)
------------------------------------------------------------------------------------------------------------------
* Block ownership: the split's ``nbs`` blocks of ``BT`` tokens form groups of ``U`` consecutive blocks
  (``U = blocks_per_update``, 1 or 2); compute warpgroup ``w`` (0 .. C-1) owns the groups ``g`` with
  ``g % C == w`` and does ONE online-softmax update per group (U = 2: one cross-warp max and one rescale per
  2 BT tokens).
* SMEM ring: ``S`` slots (``max_concurrent_steps``, a multiple of ``C U``), one block per slot: K tile, V tile and,
  for INT, the two per-token scale tiles.  Block ``i`` lives in slot ``i % S``; because ``S`` is a multiple of
  ``C U`` a slot always belongs to the same compute warpgroup, so every mbarrier is waited on by one warpgroup
  only and Mosaic's per-thread phase bits stay exact.
* Barriers: ``full[S]`` (TMA completion, one arrival per copy into the slot), ``consumed[S]`` (the owning compute
  warpgroup arrives when it has finished with the slot: after the PV wgmma has completed, so bf16 K/V read by the
  wgmma straight from SMEM are safe), ``q_bar`` (the query block), ``turn[C]`` (see below).
* Memory warpgroup (``wg == C``, ``memory_registers`` registers, ``setmaxnreg`` down): copies the query block,
  fills the first ``S`` slots, then for block ``i = S .. nbs-1``: wait ``consumed[i % S]``, issue the 2-4 TMA
  copies of block ``i`` (K, V, and for INT the K / V scale tiles).
* Compute warpgroup ``w`` (``compute_registers`` each, ``setmaxnreg`` up): wait ``q_bar``; per owned group: wait
  ``full`` of its U slots, ``_block_update`` (QK wgmma(s) with the K codes converted in registers, K scale, masks,
  [V tiles converted in registers: ``v_first``], column max in its turn, exp2, l, P^T store to its OWN P buffer +
  fence, PV wgmma(s)), arrive ``consumed``.  Each warpgroup keeps its own ``(acc, m, l)`` and writes them as its
  own split-K partial: the launch returns ``C * num_splits`` partials and the wrapper's combine merges them like
  any others.
* ``turn`` barriers: Mosaic GPU's cross-warp reductions (the column max of S^T, reduced along M = across the 4
  warps, and the final sum of l) go through ONE reduction scratch at a fixed SMEM offset, the same for every
  compute warpgroup (the offset is static; a warpgroup-local ``run_scoped`` is not allowed in a multi-warpgroup
  kernel).  So the warpgroups take turns: ``w`` waits ``turn[w]`` before each reduction and arrives on
  ``turn[(w + 1) % C]`` after it (warpgroup C-1 pre-arrives ``turn[0]`` once): a strict ring order in block order,
  which is the order the blocks arrive in anyway.  Only the reduction itself is serialized; every warpgroup takes
  the same number of turns (``nbs / (C U)`` + the final one), so the ring never stalls on a finished warpgroup.

Device status: first H200 run (JAX 0.11.2): C = 2 (one and two blocks per update) matched the float64 oracle
(bf16, rel err 1.7e-6); C = 4 hung, because its ``setmaxnreg`` numbers (40 + 4 x 112) exceeded the CTA's register
pool (5 x 96, :func:`register_pool`): fixed to 32 + 4 x 112 = 480, and :func:`_resolve` now refuses any pair
that does not fit.  The CPU test lowers it for "cuda" (shapes, layouts, the SMEM budget; passes with JAX 0.10.2
and 0.11.2; ptxas is not run), a CPU model of the mbarrier plan AND the register pool runs random interleavings;
``experiments/check_mgpu_decode.py --ws`` checks parity against the float64 oracle (one child process per
variant group) and times it next to v1 on the H200.  ``interpret=True`` runs v1's plain-JAX partials (same
arithmetic), as v1 does.

A cache stored in v1's layout (``kvquant_jax.abi.transposed_v``: ``int8_vt`` / ``int4_vt``) is read in place by
:func:`decode_attention_transposed_v_ws` (v1's ``transposed_v_operands``, this kernel);
``kvquant_jax.attention.dispatch`` picks it or v1 per layer from the measured table
(:mod:`pallas_kernels.decode_tuning`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvquant_jax.abi.regions import KVFormat, Region, check_query
from pallas_kernels.decode_attention_mgpu import (MgpuConfig, MgpuOperands, _auto_splits, _block_update, _F32,
                                                  _formats_unsupported, _kernel_partials, _partials_jnp, _spec_for, _Spec,
                                                  _merge_partials, _tile_transforms, dense_payload_unsupported,
                                                  prepare_region, transposed_v_device_unsupported,
                                                  transposed_v_kv_format, transposed_v_operands, transposed_v_shape)

__all__ = ["MgpuWsConfig", "default_ws_config", "register_pool", "mgpu_ws_unsupported", "decode_attention_mgpu_ws",
           "decode_attention_mgpu_ws_prepared", "decode_attention_mgpu_ws_partials",
           "transposed_v_ws_config_unsupported", "transposed_v_ws_unsupported", "decode_attention_transposed_v_ws"]


@dataclasses.dataclass(frozen=True)
class MgpuWsConfig:
    """Static knobs of the warp-specialized kernel.

    block_t: KV tokens per block (a multiple of 64).  max_concurrent_steps: SMEM ring slots (blocks in flight,
    all compute warpgroups together; rounded down to a multiple of compute_wgs * blocks_per_update).
    blocks_per_update: 1 or 2 blocks per online-softmax update of a compute warpgroup.  num_splits: None -> v1's
    rule (>= 2 x 132 CTAs; this kernel's registers allow one CTA per SM, so ~2 waves).  precision: as v1.
    v_first: convert the V tile(s) to registers right after the QK wgmma, before waiting for the reduction turn
    (None -> only with one block per update: two converted V tiles would hold 128 registers across the softmax).
    compute_wgs: compute warpgroups (2, or 4 for twice the warps in flight per SM with half the registers each:
    pair it with 64-row blocks).  memory_registers / compute_registers: ``setmaxnreg`` of the TMA / compute
    warpgroups; None -> 40 / 232 for C = 2, 32 / 112 for C = 4.  They must fit the CTA's register POOL, which
    is what the launch gave it, not the whole register file: :func:`register_pool` (504 per 128-thread slot for
    C = 2, only 480 for C = 4); ``setmaxnreg.inc`` past the pool blocks forever (the first H200 run's hang).
    """

    block_t: Optional[int] = None
    num_splits: Optional[int] = None
    max_concurrent_steps: Optional[int] = None
    precision: str = "bf16x2"
    upcast: bool = False
    blocks_per_update: int = 1
    v_first: Optional[bool] = None       # V tiles converted before the turn wait (None: when blocks_per_update == 1)
    compute_wgs: int = 2                 # compute warpgroups per CTA (2 or 4); the TMA warpgroup comes on top
    memory_registers: Optional[int] = None   # None -> 40 (C = 2) / 32 (C = 4)
    compute_registers: Optional[int] = None  # None -> (register_pool(C) - memory_registers) / C, rounded down to 8


def default_ws_config(kf: KVFormat) -> MgpuWsConfig:
    """Starting points (NOT tuned on the device yet): SMEM per slot is 2 x BT x D x bytes (+ 2 x BT x 4 scales)."""
    if kf.payload in ("bf16", "fp16"):
        return MgpuWsConfig(block_t=64, max_concurrent_steps=6)       # 6 x 32 KB
    if kf.payload in ("e4m3", "e5m2"):
        return MgpuWsConfig(block_t=64, max_concurrent_steps=8)       # 8 x 16 KB
    if kf.payload == "int4":
        return MgpuWsConfig(block_t=128, max_concurrent_steps=6)      # 6 x 17 KB
    return MgpuWsConfig(block_t=128, max_concurrent_steps=4)          # int8: 4 x 33 KB


def register_pool(compute_wgs: int) -> int:
    """Registers per thread slot (x 128 threads = per warpgroup) that a CTA of ``compute_wgs + 1`` warpgroups owns.

    Mosaic GPU launches with a known block size (``gpu.launch`` -> ``.maxntid``), so ptxas gives every thread
    of the ``128 (C + 1)`` the largest count that fits one CTA in the 64K register file, rounded DOWN to the
    allocation granularity of 8 per thread (256 per warp), and ``setmaxnreg`` only moves registers between the
    warpgroups of that CTA: PTX, "setmaxnreg.inc blocks the execution until enough registers are available in
    the CTA's register pool".  C = 2: 3 x 168 = 504 = 40 + 2 x 232 (the FA3 / JAX attention numbers).  C = 4:
    5 x 96 = 480 < 40 + 4 x 112 = 488 (``(512 - 40) / 4``, also JAX's ``pipeline._compute_registers``), so the
    last compute warpgroup's ``setmaxnreg.inc`` never returned and the CTA deadlocked on its turn barrier."""
    return (compute_wgs + 1) * (512 // (compute_wgs + 1) // 8 * 8)


def _resolve(cfg: MgpuWsConfig | None, kf: KVFormat) -> MgpuWsConfig:
    cfg = cfg or MgpuWsConfig()
    d = default_ws_config(kf)
    c = cfg.compute_wgs
    if c not in (2, 4):
        raise ValueError(f"compute_wgs must be 2 or 4, got {c}")
    pool = register_pool(c)
    mem = cfg.memory_registers or (40 if c == 2 else 32)
    regs = cfg.compute_registers or min(256, (pool - mem) // c // 8 * 8)
    for what, r in (("memory_registers", mem), ("compute_registers", regs)):
        if r % 8 or not 24 <= r <= 256:
            raise ValueError(f"{what}={r}: setmaxnreg takes a multiple of 8 in [24, 256]")
    if mem + c * regs > pool:
        raise ValueError(f"memory_registers={mem} + {c} x compute_registers={regs} = {mem + c * regs} > the "
                         f"{pool} registers per thread slot a CTA of {c + 1} warpgroups owns: setmaxnreg.inc "
                         "would block forever")
    return dataclasses.replace(cfg, block_t=cfg.block_t or d.block_t, compute_registers=regs, memory_registers=mem,
                               max_concurrent_steps=cfg.max_concurrent_steps or d.max_concurrent_steps)


def _ws_spec(ops: MgpuOperands, g: int, cfg: MgpuWsConfig | None, q_dtype) -> tuple[_Spec, MgpuWsConfig]:
    """v1's :class:`_Spec` for this kernel (+ the resolved ws config); raises ValueError when a knob does not fit."""
    cfg = _resolve(cfg, ops.kf)
    u, c = cfg.blocks_per_update, cfg.compute_wgs
    if u not in (1, 2):
        raise ValueError(f"blocks_per_update must be 1 or 2, got {u}")
    bt, t, bh = cfg.block_t, ops.rows, ops.k.shape[0]
    if bt % 64 or t % bt:
        raise ValueError(f"{t} rows is not a multiple of block_t={bt} (a multiple of 64)")
    nb = t // bt
    if nb % (c * u):
        raise ValueError(f"{nb} blocks of {bt} rows do not split into {c} compute warpgroups x {u} blocks per "
                         "update")
    ns = cfg.num_splits or _auto_splits(bh, nb // (c * u))
    if nb % ns or (nb // ns) % (c * u):
        raise ValueError(f"num_splits={ns}: each split needs a multiple of {c * u} of the {nb} blocks")
    nbs = nb // ns
    stages = min(cfg.max_concurrent_steps, nbs)
    stages -= stages % (c * u)
    if stages < c * u:
        raise ValueError(f"max_concurrent_steps={cfg.max_concurrent_steps}: need at least {c * u} slots")
    mcfg = MgpuConfig(block_t=bt, num_splits=ns, max_concurrent_steps=stages, precision=cfg.precision,
                      upcast=cfg.upcast)
    return _spec_for(ops, g, mcfg, q_dtype), cfg       # too many slots for SMEM: Mosaic GPU says so when lowering


def mgpu_ws_unsupported(reg: Region, head_dim: int, config: MgpuWsConfig | None = None) -> Optional[str]:
    """Why this kernel cannot take the region (None when it can)."""
    kf, vf = reg.k.fmt, reg.v.fmt
    why = _formats_unsupported(kf, vf, head_dim)
    if why:
        return why
    try:
        cfg = _resolve(config, kf)
    except ValueError as e:
        return str(e)
    rows, u, c = reg.k.data.shape[2], cfg.blocks_per_update, cfg.compute_wgs
    if cfg.block_t % 64 or rows % (c * u * cfg.block_t):
        return f"{rows} rows is not a multiple of {c} x {u} x block_t={cfg.block_t}"
    return None


def _ws_call(start, end, lscale, q, k, v, ks, vs, sp: _Spec, cfg: MgpuWsConfig):
    """Launch.  Arguments as v1's ``_mgpu_call``; returns ``o [BH, C S, D, N], m [BH, C S, N] (log2), l [BH, C S,
    N]`` (C = compute warpgroups; partial ``C s + w`` = compute warpgroup ``w`` of split ``s``)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bh = q.shape[0]
    d, n, bt, ns, nbs, stages = sp.d, sp.n, sp.bt, sp.ns, sp.nbs, sp.stages
    u, nc = cfg.blocks_per_update, cfg.compute_wgs
    nch = bt // 64
    bf16 = sp.mma_dtype
    groups_per_wg = nbs // (nc * u)
    v_first = cfg.v_first if cfg.v_first is not None else u == 1
    q_tf = _tile_transforms(bf16, d)
    k_tf = _tile_transforms(sp.k_dtype, d)
    v_tf = _tile_transforms(sp.v_dtype, bt if sp.v_regs else d)
    p_tf = _tile_transforms(bf16, 64)
    has_ks, has_vs = ks is not None, vs is not None
    n_copies = 2 + has_ks + has_vs
    v_block = (d, bt) if sp.v_regs else (bt, d)
    # setmaxnreg: plgpu.set_max_registers in JAX 0.10.2 / 0.11.x; without it the warpgroups share the launch
    # register budget evenly (slower, still correct)
    setmaxnreg = getattr(plgpu, "set_max_registers", None) or (lambda *a, **k: None)

    def body(start_ref, end_ref, ls_ref, q_ref, k_ref, v_ref, *rest):
        rest = list(rest)
        ks_ref = rest.pop(0) if has_ks else None
        vs_ref = rest.pop(0) if has_vs else None
        o_ref, m_ref, l_ref = rest
        pid = lax.axis_index("bh")
        sid = lax.axis_index("split")
        wg_idx = lax.axis_index("wg")
        base = sid * nbs

        def scoped(q_smem, p_smem, o_smem, m_smem, l_smem, k_smem, v_smem, ks_smem, vs_smem,
                   q_bar, full, consumed, turn):

            @pl.when(wg_idx == nc)
            def _memory_wg():
                setmaxnreg(cfg.memory_registers, action="decrease")
                plgpu.copy_gmem_to_smem(q_ref.at[pid], q_smem, q_bar)

                def issue(i, slot):
                    row0 = (base + i) * bt
                    plgpu.copy_gmem_to_smem(k_ref.at[pid, pl.ds(row0, bt)], k_smem.at[slot], full.at[slot])
                    vsrc = v_ref.at[pid, :, pl.ds(row0, bt)] if sp.v_regs else v_ref.at[pid, pl.ds(row0, bt)]
                    plgpu.copy_gmem_to_smem(vsrc, v_smem.at[slot], full.at[slot])
                    if has_ks:
                        plgpu.copy_gmem_to_smem(ks_ref.at[pid, pl.ds(row0, bt)], ks_smem.at[slot], full.at[slot])
                    if has_vs:
                        plgpu.copy_gmem_to_smem(vs_ref.at[pid, pl.ds(row0, bt)], vs_smem.at[slot], full.at[slot])

                for i in range(stages):                       # prologue: fill the ring
                    issue(i, i)

                def refill(i, c):
                    slot = lax.rem(i, stages)
                    plgpu.barrier_wait(consumed.at[slot])      # its owner is done with block i - stages
                    issue(i, slot)
                    return c

                if nbs > stages:
                    lax.fori_loop(stages, nbs, refill, 0)

            @pl.when(wg_idx < nc)
            def _compute_wg():
                setmaxnreg(cfg.compute_registers, action="increase")
                w = wg_idx
                lo = start_ref[pid // sp.hkv]
                hi = end_ref[pid // sp.hkv]
                lsc = ls_ref[pid % sp.hkv]
                p_w = p_smem.at[w]

                @pl.when(w == nc - 1)
                def _():
                    plgpu.barrier_arrive(turn.at[0])          # warpgroup 0 takes the first turn

                def in_turn(f):                               # turns in the ring order 0, 1, .., nc-1, 0, ..
                    plgpu.barrier_wait(turn.at[w])
                    r = f()
                    plgpu.barrier_arrive(turn.at[lax.rem(w + 1, nc)])
                    return r

                col_max = lambda s: in_turn(lambda: s.max(axis=0))  # noqa: E731
                plgpu.barrier_wait(q_bar)

                def group(j, carry):
                    first = (nc * j + w) * u                  # first block of this warpgroup's j-th group
                    blocks, slots = [], []
                    for bi in range(u):
                        i = first + bi
                        slot = lax.rem(i, stages)
                        plgpu.barrier_wait(full.at[slot])
                        blocks.append((k_smem.at[slot], v_smem.at[slot], ks_smem.at[slot] if has_ks else None,
                                       vs_smem.at[slot] if has_vs else None, (base + i) * bt))
                        slots.append(slot)
                    carry = _block_update(sp, q_smem, p_w, blocks, carry, lo, hi, lsc, col_max, v_first=v_first)
                    for slot in slots:
                        plgpu.barrier_arrive(consumed.at[slot])
                    return carry

                wgl = plgpu.Layout.WGMMA
                m0 = plgpu.layout_cast(jnp.full((n,), -1e30, _F32), wgl.reduce(0))
                l0 = plgpu.layout_cast(jnp.full((bt, n), 0.0, _F32), wgl)
                a0 = plgpu.layout_cast(jnp.full((d, n), 0.0, _F32), wgl)
                acc, m_i, l_i = lax.fori_loop(0, groups_per_wg, group, (a0, m0, l0))
                l_sum = in_turn(lambda: l_i.sum(axis=0))
                o_smem.at[w][...] = acc
                m_smem.at[w][...] = m_i
                l_smem.at[w][...] = l_sum
                plgpu.commit_smem()
                part = sid * nc + w
                plgpu.copy_smem_to_gmem(o_smem.at[w], o_ref.at[pid, part])
                plgpu.copy_smem_to_gmem(m_smem.at[w], m_ref.at[pid, part])
                plgpu.copy_smem_to_gmem(l_smem.at[w], l_ref.at[pid, part])
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((sp.q_split, n, d), bf16, transforms=q_tf),
            plgpu.SMEM((nc, u * nch, n, 64), bf16, transforms=p_tf),
            plgpu.SMEM((nc, d, n), _F32),
            plgpu.SMEM((nc, n), _F32),
            plgpu.SMEM((nc, n), _F32),
            plgpu.SMEM((stages, bt, d), sp.k_dtype, transforms=k_tf),
            plgpu.SMEM((stages,) + v_block, sp.v_dtype, transforms=v_tf),
            plgpu.SMEM((stages, bt), _F32) if has_ks else None,
            plgpu.SMEM((stages, bt), _F32) if has_vs else None,
            plgpu.Barrier(num_arrivals=1),
            plgpu.Barrier(num_arrivals=n_copies, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=stages),
            plgpu.Barrier(num_arrivals=1, num_barriers=nc),
            collective_axes="wg",
        )

    out_type = (jax.ShapeDtypeStruct((bh, nc * ns, d, n), _F32), jax.ShapeDtypeStruct((bh, nc * ns, n), _F32),
                jax.ShapeDtypeStruct((bh, nc * ns, n), _F32))
    fn = plgpu.kernel(body, out_type=out_type, grid=(bh, ns), grid_names=("bh", "split"), num_threads=nc + 1,
                      thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True))
    args = [start, end, lscale, q, k, v] + ([ks] if has_ks else []) + ([vs] if has_vs else [])
    return fn(*args)


def decode_attention_mgpu_ws_partials(q, ops: MgpuOperands, *, sm_scale: float | None = None,
                                      config: MgpuWsConfig | None = None, interpret: Any = False):
    """Split-K partials of one prepared region (``compute_wgs * num_splits`` of them), v1's output format."""
    if interpret:
        return _partials_jnp(q, ops, sm_scale)
    sp, cfg = _ws_spec(ops, q.shape[1] // ops.num_kv_heads, config, q.dtype)
    return _kernel_partials(lambda *a: _ws_call(*a, cfg=cfg), q, ops, sp, sm_scale)


def decode_attention_mgpu_ws_prepared(q, ops: MgpuOperands, *, k_new=None, v_new=None,
                                      sm_scale: float | None = None, config: MgpuWsConfig | None = None,
                                      interpret: Any = False, out_dtype=None):
    """:func:`~pallas_kernels.decode_attention_mgpu.decode_attention_mgpu_prepared` with this kernel."""
    part = decode_attention_mgpu_ws_partials(q, ops, sm_scale=sm_scale, config=config, interpret=interpret)
    return _merge_partials(q, part, ops.num_kv_heads, sm_scale, k_new=k_new, v_new=v_new,
                           out_dtype=out_dtype or q.dtype)


def decode_attention_mgpu_ws(q, region: Region, *, k_new=None, v_new=None, sm_scale: float | None = None,
                             config: MgpuWsConfig | None = None, interpret: Any = False, out_dtype=None):
    """Layout-v1 entry point (:func:`prepare_region` then the kernel), the signature of v1's
    :func:`~pallas_kernels.decode_attention_mgpu.decode_attention_mgpu`."""
    check_query(q, [region], k_new, v_new)
    why = mgpu_ws_unsupported(region, q.shape[-1], config)
    if why:
        raise NotImplementedError(f"decode_attention_mgpu_ws: {why}")
    ops = prepare_region(region)
    return decode_attention_mgpu_ws_prepared(q, ops, k_new=k_new, v_new=v_new, sm_scale=sm_scale, config=config,
                                             interpret=interpret, out_dtype=out_dtype)


def dense_region_ws_config_unsupported(reg: Region, group: int, config: MgpuWsConfig | None = None) -> Optional[str]:
    """Why this kernel with ``config`` cannot read a full-precision (bf16 / fp16) region in place (None when it
    can): v1's payload rule, then :func:`mgpu_ws_unsupported` and the launch plan of :func:`_ws_spec` on the
    region's shapes (no array is read).  Device independent (CPU-checkable)."""
    why = dense_payload_unsupported(reg) or mgpu_ws_unsupported(reg, reg.k.data.shape[3], config)
    if why:
        return why
    try:
        _ws_spec(jax.eval_shape(prepare_region, reg), group, config, jnp.bfloat16)
    except ValueError as e:
        return str(e)
    return None


# --------------------------------------------------------------------------------------------------------------
# A cache stored in the kernel's layout (kvquant_jax.abi.transposed_v): v1's operands, this kernel
# --------------------------------------------------------------------------------------------------------------
def transposed_v_ws_config_unsupported(fmt, state, head_dim: int, group: int,
                                       config: MgpuWsConfig | None = None) -> Optional[str]:
    """Why this kernel with ``config`` cannot read a transposed-V layer of this shape (None when it can): the
    format / head_dim rules, the register plan, capacity vs ``compute_wgs x blocks_per_update x block_t``,
    num_splits and ring slots (the launch plan of :func:`_ws_spec` on the layer's shapes; no array is read).
    Device independent (CPU-checkable); :func:`transposed_v_ws_unsupported` adds the device and query checks.
    ``state``: the layer's arrays (``k_codes [B, Hkv, C, D*b/8]``, ...), ``group``: query heads per KV head."""
    kf = transposed_v_kv_format(fmt)
    why = _formats_unsupported(kf, kf, head_dim)
    if why:
        return why
    try:
        _ws_spec(transposed_v_shape(fmt, state), group, config, jnp.bfloat16)
    except ValueError as e:
        return str(e)
    return None


def transposed_v_ws_unsupported(q, fmt, state, config: MgpuWsConfig | None = None) -> Optional[str]:
    """Why this kernel cannot serve this transposed-V layer on this device with ``config`` (None when it can): v1's
    device / query checks (a Hopper GPU, a bf16 / fp16 query), then :func:`transposed_v_ws_config_unsupported`."""
    return (transposed_v_device_unsupported(q)
            or transposed_v_ws_config_unsupported(fmt, state, q.shape[-1], q.shape[1] // state.k_codes.shape[1],
                                                  config))


def decode_attention_transposed_v_ws(q, fmt, state, lengths, k_new=None, v_new=None, *,
                                     sm_scale: float | None = None, interpret: Any = None,
                                     config: MgpuWsConfig | None = None):
    """:func:`~pallas_kernels.decode_attention_mgpu.decode_attention_transposed_v` with this kernel: the same
    operands (:func:`~pallas_kernels.decode_attention_mgpu.transposed_v_operands`, codes reinterpreted in place),
    ONE softmax with the exact current token.

    ``q [B, Hq, D]``; ``fmt, state``: the layer's static format and arrays; ``lengths`` int ``[B]``; ``k_new,
    v_new`` optional ``[B, Hkv, D]``.  ``interpret``: anything but False/None on a non-GPU platform runs v1's
    plain-JAX partials on the same operands (CPU tests), as v1 does.  Returns ``[B, Hq, D]`` float32.
    """
    ops = transposed_v_operands(fmt, state, lengths)
    interp = bool(interpret) if interpret is not None else jax.devices()[0].platform != "gpu"
    return decode_attention_mgpu_ws_prepared(q, ops, k_new=k_new, v_new=v_new, sm_scale=sm_scale, config=config,
                                             interpret=interp, out_dtype=_F32)
