"""Pallas decode attention that reads K/V pages through a page table (paged cache, layout_version 2).

The paged form of :func:`pallas_kernels.decode_attention.decode_attention`: the large region's operands are page
*pools* -- ``data [P, Hkv, page_rows, X]`` and its scale / zero pools (``[P, Hkv, page_rows, G]`` per token,
``[P, Hkv, page_rows / G_k, D]`` per channel, KIVI) in the physical formats of ``abi/regions.py`` -- and
``page_table: int32 [B, M]`` maps sequence ``b``'s logical page ``j`` (rows ``j * page_rows + [0, page_rows)`` of
the region's coordinate) to a pool page (entries < 0 are unmapped and read pool page ``P - 1``, the trash page; such
rows must lie outside ``[start, end)``).  One block = one page.  The block body, the scale folding and the unpacking
are the contiguous kernel's (``_block``), so every format it takes is read paged: fp32/bf16/fp16, FP8 with
per-head scales, INT8/4/2 per-token symmetric (grouped), QServe's floating offset, static per-head INT, KIVI
per-channel keys.  Small regions (KIVI's residual ring, IntactKV prefix rows) and the current token join the same
softmax through the contiguous kernel's split-K combine.

Backends:

* ``"tpu"`` (Mosaic TPU): ``PrefetchScalarGridSpec`` with THREE scalar-prefetched operands ``(start, end,
  page_table)``; grid ``(B, Hkv, 1, M)``, the block index map of every page pool is ``(page_table[b, blk], h, 0,
  0)``, so the DMA engine fetches each page where it lies.  Validated in the TPU interpreter
  (``pltpu.InterpretParams()``) on CPU.
* ``"gpu"`` (Pallas Triton): one program per ``(b, kv head)`` loops over its live pages and reads the page index
  from the table in the loop (``interpret=True`` on CPU).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvquant_jax.abi.regions import Region, check_query
from pallas_kernels import decode_attention as dk
from pallas_kernels.decode_attention import (_F32, PRECISIONS, _combine, _dense_partial, _grid_kernel, _loop_kernel,
                                             _out_shapes, _small_region_partial, _Spec, _split_range, _Tile)

__all__ = ["paged_decode_attention", "paged_unsupported"]


def paged_unsupported(reg: Region, head_dim: int, *, compiled_gpu: bool = False) -> str | None:
    """Why the paged kernel cannot take this pool region (None when it can).  ``compiled_gpu``: the kernel would be
    compiled by Triton for a GPU (not interpreted), where every dot dimension must be >= ``MMA_MIN``
    (:func:`pallas_kernels.decode_attention.mma_too_small`: the H200 gave wrong results below it)."""
    kf, vf = reg.k.fmt, reg.v.fmt
    rows = reg.k.data.shape[2]
    if compiled_gpu:
        why = dk.mma_too_small(reg, head_dim, block_rows=rows)
        if why:
            return f"page: {why}"
    if not dk._pow2(head_dim):
        return f"head_dim {head_dim} is not a power of two"
    if vf.scale == "channel":
        return "per-channel V scales"
    if kf.scale == "channel" and (not dk._pow2(kf.group) or rows % kf.group):
        return f"channel group {kf.group} must be a power of two dividing the page ({rows} rows)"
    for f in (kf, vf):
        if f.is_int and not dk._pow2(head_dim // f.codes_per_byte // f.token_groups(head_dim)):
            return f"{f}: plane width is not a power of two"
    return None


def _paged_grid_kernel(start_sref, end_sref, table_sref, *refs, sp: _Spec, names):
    del table_sref                                  # used by the index maps only
    _grid_kernel(start_sref, end_sref, *refs, sp=sp, names=names)


def _tpu_call(start, end, table, qk, qs, arrays, sp: _Spec, names, interpret):
    from jax.experimental.pallas import tpu as pltpu

    b, hkv = qk.shape[:2]

    def page_index(bi, si, ji, st, en, tab):
        lo, hi = _split_range(st[bi], en[bi], si, sp)
        return tab[bi, jnp.clip(jnp.minimum(lo + ji, hi - 1), 0, sp.nb - 1)]

    def pool_spec(arr, rows):
        return pl.BlockSpec((None, None, rows, arr.shape[-1]),
                            lambda bi, h, si, ji, st, en, tab: (page_index(bi, si, ji, st, en, tab), h, 0, 0))

    in_specs = [pl.BlockSpec((None, None) + qk.shape[2:], lambda bi, h, si, ji, st, en, tab: (bi, h, 0, 0, 0, 0)),
                pl.BlockSpec((None, None, sp.mp, 1), lambda bi, h, si, ji, st, en, tab: (bi, h, 0, 0))]
    for name, arr in zip(names, arrays):
        in_specs.append(pool_spec(arr, arr.shape[2]))
    out_shape = _out_shapes(b, hkv, sp)
    out_specs = [
        pl.BlockSpec((None, None, None) + out_shape[0].shape[3:],
                     lambda bi, h, si, ji, st, en, tab: (bi, h, si, 0, 0, 0, 0)),
        pl.BlockSpec((None, None, None, sp.mp, 1), lambda bi, h, si, ji, st, en, tab: (bi, h, si, 0, 0)),
        pl.BlockSpec((None, None, None, sp.mp, 1), lambda bi, h, si, ji, st, en, tab: (bi, h, si, 0, 0)),
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, hkv, sp.ns, sp.nbps), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((sp.mp, 1), _F32), pltpu.VMEM((sp.mp, 1), _F32),
                        pltpu.VMEM((sp.ngv * sp.npv, sp.mp, sp.gbv), _F32), pltpu.VMEM((sp.ngv, sp.mp, 1), _F32)])
    if interpret is True:
        interpret = pltpu.InterpretParams()
    return pl.pallas_call(
        functools.partial(_paged_grid_kernel, sp=sp, names=names), grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret if interpret else False,
        name=f"paged_decode_attention_{sp.kf.payload}_{sp.vf.payload}",
    )(start, end, table, qk, qs, *arrays)


def _paged_loop_kernel(start_ref, end_ref, table_ref, q_ref, qs_ref, *refs, sp: _Spec, names):
    """The contiguous loop kernel with block ``blk`` of sequence ``b`` read from its page ``table[b, blk]``."""
    _loop_kernel(start_ref, end_ref, q_ref, qs_ref, *refs, sp=sp, names=names,
                 tile_of=lambda ins, b, h, blk: _Tile(ins, (table_ref[b, blk], h), 0, 0))


def _gpu_call(start, end, table, qk, qs, arrays, sp: _Spec, names, interpret, num_warps, num_stages):
    b, hkv = qk.shape[:2]
    kw = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu
        kw["compiler_params"] = plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return pl.pallas_call(
        functools.partial(_paged_loop_kernel, sp=sp, names=names), out_shape=_out_shapes(b, hkv, sp),
        grid=(b, hkv, sp.ns), interpret=interpret,
        name=f"paged_decode_attention_{sp.kf.payload}_{sp.vf.payload}", **kw,
    )(start, end, table, qk, qs, *arrays)


def _paged_partial(q4, qs, q_dtype, reg: Region, table, backend, interpret, precision, num_splits,
                   kivi_update="group"):
    b, hkv, g, d = q4.shape
    kf, vf = reg.k.fmt, reg.v.fmt
    page_rows = reg.k.data.shape[2]
    n_pool = reg.k.data.shape[0]
    m_pages = table.shape[1]
    why = paged_unsupported(reg, d, compiled_gpu=backend == "gpu" and not interpret)
    if why:
        raise ValueError(f"paged decode-attention kernel: {why}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    dk._check_kivi_update(kivi_update)
    sub, kblock = dk._key_update(kf, page_rows, kivi_update)
    op_k, dup, mp = dk._query_rows(g, kf, vf, precision, backend)
    sp = _Spec(kf=kf, vf=vf, d=d, mp=mp, bt=page_rows, sub=sub,
               ns=max(1, min(num_splits, m_pages)), nb=m_pages, precision=precision, unpack="magic",
               q_exact=kf.scale != "channel" and jnp.dtype(q_dtype) == jnp.dtype(op_k), dup=dup, kblock=kblock)
    qk, qs, names, arrays = dk._launch_operands(q4, qs, reg, dup, mp)
    rows = m_pages * page_rows
    start = jnp.clip(reg.start.astype(jnp.int32), 0, rows)
    end = jnp.clip(reg.end.astype(jnp.int32), 0, rows)
    table = jnp.where(table < 0, n_pool - 1, table).astype(jnp.int32)
    if backend == "tpu":
        o, m, l = _tpu_call(start, end, table, qk, qs, arrays, sp, names, interpret)
    else:
        o, m, l = _gpu_call(start, end, table, qk, qs, arrays, sp, names, interpret, 4, 3)
    return dk._kernel_partials(o, m, l, reg, g, dup)


def paged_decode_attention(q, paged_region: Region, page_table, small_regions: Sequence[Region] = (), *,
                           k_new=None, v_new=None, sm_scale: float | None = None, backend: str | None = None,
                           interpret: Any = None, precision: str | None = None, num_splits: int = 1,
                           out_dtype=None, kivi_update: str = "group"):
    """One new token's attention over a paged region + small contiguous regions + the current token, ONE softmax.

    Args:
      q: ``[B, Hq, D]``.
      paged_region: operands are page pools ``[P, Hkv, page_rows, ...]``; ``start, end: int32 [B]`` live rows in
        the logical coordinate (``page_table[b, r // page_rows]`` holds row ``r``).
      page_table: int32 ``[B, M]``; entries < 0 read the trash page ``P - 1``.
      small_regions: contiguous regions (``[B, Hkv, n, ...]``: rings, prefix rows) attended in plain JAX.
      k_new, v_new: optional ``[B, Hkv, D]`` exact K/V of the current token.
      backend: "gpu" (Pallas Triton) / "tpu" (Mosaic) / None by platform; interpret: as the contiguous kernel.
      precision: "f32" (default when interpreted), "bf16x2" (default compiled) or "bf16".
      kivi_update: KIVI (per-channel K) pages: "group" (default, one softmax update per key group) or "block"
        (one update and one PV per page; :func:`pallas_kernels.decode_attention._logits_channel_block`).
    Returns ``[B, Hq, D]`` in ``out_dtype`` (default ``q.dtype``).
    """
    small_regions = list(small_regions)
    b, hq, hkv, d = check_query(q, small_regions, k_new, v_new) if small_regions else (
        q.shape[0], q.shape[1], paged_region.k.data.shape[1], q.shape[2])
    if page_table.shape[0] != b:
        raise ValueError(f"page_table has {page_table.shape[0]} rows for batch {b}")
    g = hq // hkv
    backend, interpret = dk._resolve(backend, interpret)
    precision = precision or ("f32" if interpret else "bf16x2")
    scale = (1.0 / math.sqrt(d)) if sm_scale is None else float(sm_scale)
    q4 = q.astype(_F32).reshape(b, hkv, g, d)
    qs = jnp.full((b, hkv, g), scale, _F32)
    parts = [_paged_partial(q4, qs, q.dtype, paged_region, page_table, backend, interpret, precision, num_splits,
                            kivi_update)]
    parts += [_small_region_partial(q4, qs, r) for r in small_regions]
    if k_new is not None:
        parts.append(_dense_partial(q4, qs, k_new.astype(_F32)[:, :, None], v_new.astype(_F32)[:, :, None],
                                    jnp.ones((b, 1), jnp.bool_)))
    return _combine(parts).reshape(b, hq, d).astype(out_dtype or q.dtype)
