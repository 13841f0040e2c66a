"""Decode attention over a paged cache (``cache/paged.py``): reference through the gathered view, or the Pallas
kernel that reads the pages through the page table (``pallas_kernels/paged_decode_attention.py``).

The scheme still owns how it is read: its ``decode_regions`` is asked twice, on the contiguous *view* (region
bounds at the committed lengths, and the small per-sequence regions -- KIVI's residual ring, IntactKV prefix
rows) and on the *pool state* (the same fields as pools ``[num_pages + 1, Hkv, page_rows, ...]``), whose
``regions[0]`` operands are then the pools themselves when the scheme reads its stored fields in place.  Under
``jit`` the view's unused gathers are dead code, so the kernel path reads only pages.  A scheme whose regions are
not its stored fields (a fused format such as KVQuant, the simulated axis ablation's materialized view) is attended
through the view (``impl="kernel"`` then runs the contiguous kernels on the gathered view).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from kvquant_jax.abi.regions import Region
from kvquant_jax.attention import dispatch
from kvquant_jax.cache import paged as paged_cache
from kvquant_jax.cache.paged import PAGED, PagedKVCache
from pallas_kernels import paged_decode_attention as paged_kernel

__all__ = ["layer_view", "paged_regions", "decode_attention"]


def _group(cache: PagedKVCache, layer: int):
    for g, (scheme, first, n) in enumerate(cache.schemes):
        if first <= layer < first + n:
            return g, scheme, layer - first
    raise IndexError(f"layer {layer} out of range [0, {cache.num_layers})")


def layer_view(cache: PagedKVCache, layer: int):
    """``(scheme, layer_state)`` of the contiguous view of one layer (arrays ``[B, Hkv, capacity, ...]``)."""
    g, scheme, i = _group(cache, layer)
    view = paged_cache.gather(cache)
    return scheme, jax.tree.map(lambda a: a[i], view.groups[g])


def paged_regions(cache: PagedKVCache, layer: int) -> tuple[Region | None, list[Region], list[Region], int]:
    """``(pool_region, small_regions, view_regions, tail_rows)`` of one layer.

    ``pool_region``: ``regions[0]`` with pool operands and the view's bounds, or None when the scheme does not
    read its stored fields in place (then attend ``view_regions``).  ``small_regions``: ``view_regions[1:]``."""
    g, scheme, i = _group(cache, layer)
    v_scheme, v_state = layer_view(cache, layer)
    view_regs, tail = dispatch.layer_regions(v_scheme, v_state, cache.lengths)
    pst = jax.tree.map(lambda a: a[i], cache.groups[g])
    n_pool = cache.num_pages + 1
    fields, pooled = {}, []
    for f in cache.layouts[g]:
        a = getattr(pst, f.name)
        if f.kind == PAGED:
            pooled.append(a)
            fields[f.name] = a
        elif f.kind == paged_cache.SLOT:                 # stand-ins with the pool's batch (dead code under jit)
            fields[f.name] = jnp.zeros((n_pool,) + a.shape[1:], a.dtype)
        else:
            fields[f.name] = a
    pool_regs, _ = scheme.decode_regions(pst.replace(**fields), jnp.zeros((n_pool,), jnp.int32))
    r0 = pool_regs[0]
    in_place = any(r0.k.data is a for a in pooled) and any(r0.v.data is a for a in pooled)
    if not in_place or scheme.fused_decode_operand(v_state) is not None:
        return None, view_regs[1:], view_regs, tail
    return (dataclasses.replace(r0, start=view_regs[0].start, end=view_regs[0].end), view_regs[1:], view_regs,
            tail)


def decode_attention(q: jax.Array, cache: PagedKVCache, layer: int, k_new: jax.Array | None = None,
                     v_new: jax.Array | None = None, *, impl: str = "reference", backend: str | None = None,
                     interpret: Any = None, sm_scale: float | None = None, precision: str | None = None,
                     out_dtype=None) -> jax.Array:
    """One decode step's attention for ``layer`` of a paged cache: ``q [B, Hq, D]`` over the committed history
    and the exact current token (``k_new, v_new [B, Hkv, D]``), one softmax; returns ``[B, Hq, D]``.

    ``impl``: "reference" (float32 JAX over the gathered view's regions), "kernel" (the paged Pallas kernel:
    pages read through the page table; interpreted on CPU), "auto" (kernel on GPU/TPU, reference elsewhere)."""
    if impl not in dispatch.IMPLS:
        raise ValueError(f"impl must be one of {dispatch.IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "kernel" if dispatch.platform() in ("gpu", "tpu") else "reference"
    scheme, state = layer_view(cache, layer)
    if impl == "reference":
        return dispatch.decode_attention(q, scheme, state, cache.lengths, k_new, v_new, impl="reference",
                                         sm_scale=sm_scale, out_dtype=out_dtype)
    pool_region, small, _, _ = paged_regions(cache, layer)
    if pool_region is None or paged_kernel.paged_unsupported(pool_region, q.shape[-1]):
        return dispatch.decode_attention(q, scheme, state, cache.lengths, k_new, v_new, impl="kernel",
                                         backend=backend, interpret=interpret, sm_scale=sm_scale,
                                         out_dtype=out_dtype)
    return paged_kernel.paged_decode_attention(q, pool_region, cache.page_table, small, k_new=k_new, v_new=v_new,
                                               sm_scale=sm_scale, backend=backend, interpret=interpret,
                                               precision=precision, out_dtype=out_dtype)
