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
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax import sharding as S
from kvquant_jax.abi.regions import Region
from kvquant_jax.attention import dispatch
from kvquant_jax.attention.sharded import shard_layer
from kvquant_jax.cache import paged as paged_cache
from kvquant_jax.cache.interface import CacheScheme, LayerGroups
from kvquant_jax.cache.paged import PAGED, PagedKVCache
from pallas_kernels import paged_decode_attention as paged_kernel
from pallas_kernels.backend import resolve as resolve_backend

__all__ = ["layer_view", "paged_regions", "layer_pool_regions", "decode_attention", "PagedStep", "PATHS",
           "paged_step"]


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
    pst = jax.tree.map(lambda a: a[i], cache.groups[g])
    return layer_pool_regions(scheme, cache.layouts[g], pst, v_state, cache.lengths, cache.num_pages)


def layer_pool_regions(scheme, layout: tuple, pool_state, view_state, lengths: jax.Array, num_pages: int
                       ) -> tuple[Region | None, list[Region], list[Region], int]:
    """:func:`paged_regions` of one layer given its pool state (pools ``[P + 1, ...]``, no layer axis) and a
    contiguous view of it (any number of pages covering ``lengths``: only its small regions and region bounds are
    used, so under ``jit`` the view's gathers are dead code when the pool region serves)."""
    view_regs, tail = dispatch.layer_regions(scheme, view_state, lengths)
    n_pool = num_pages + 1
    fields, pooled = {}, []
    for f in layout:
        a = getattr(pool_state, f.name)
        if f.kind == PAGED:
            pooled.append(a)
            fields[f.name] = a
        elif f.kind == paged_cache.SLOT:                 # stand-ins with the pool's batch (dead code under jit)
            fields[f.name] = jnp.zeros((n_pool,) + a.shape[1:], a.dtype)
        else:
            fields[f.name] = a
    pool_regs, _ = scheme.decode_regions(pool_state.replace(**fields), jnp.zeros((n_pool,), jnp.int32))
    r0 = pool_regs[0]
    in_place = any(r0.k.data is a for a in pooled) and any(r0.v.data is a for a in pooled)
    if not in_place or scheme.fused_decode_operand(view_state, lengths) is not None:
        return None, view_regs[1:], view_regs, tail
    return (dataclasses.replace(r0, start=view_regs[0].start, end=view_regs[0].end), view_regs[1:], view_regs,
            tail)


def _compiled_gpu(backend: str | None = None, interpret: Any = None) -> bool:
    """Whether a paged-kernel call with these arguments is compiled by Triton for a GPU (not interpreted)."""
    kb, ki = resolve_backend(backend, interpret)
    return kb == "gpu" and not ki


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
    if pool_region is None or paged_kernel.paged_unsupported(pool_region, q.shape[-1],
                                                             compiled_gpu=_compiled_gpu(backend, interpret)):
        return dispatch.decode_attention(q, scheme, state, cache.lengths, k_new, v_new, impl="kernel",
                                         backend=backend, interpret=interpret, sm_scale=sm_scale,
                                         out_dtype=out_dtype)
    return paged_kernel.paged_decode_attention(q, pool_region, cache.page_table, small, k_new=k_new, v_new=v_new,
                                               sm_scale=sm_scale, backend=backend, interpret=interpret,
                                               precision=precision, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------------------------
# the paged-direct forward: a cache value that owns its per-layer append and attention (llama.forward's contract)
# --------------------------------------------------------------------------------------------------------------
_log = logging.getLogger("kvquant_jax.attention")

#: ``(family, "append" | "attention", phase) -> path`` for every paged-direct layer traced so far: "window"
#: (append through the written pages) or "view" (append on the view of the mapped pages); "paged_kernel" (decode
#: read through the page table) or "view" (the model's attention over the view of the mapped pages).
PATHS: dict[tuple[str, str, str], str] = {}


def _record(scheme, what: str, t: int, path: str, reason: str = "") -> None:
    key = (scheme.family or type(scheme).__name__, what, "decode" if t == 1 else "prefill")
    if PATHS.get(key) != path:
        PATHS[key] = path
        _log.info("paged step: %s %s (%s) served by %s%s", key[0], what, key[2], path,
                  f" ({reason})" if reason else "")


@struct.dataclass
class PagedStep(LayerGroups):
    """One forward's view of a paged cache (``cache/paged.py``) that ``llama.forward`` runs on directly: no
    contiguous view of the whole cache exists.  Per layer (:meth:`layer_step`):

    * **append**: a scheme with :meth:`~kvquant_jax.cache.interface.CacheScheme.supports_window_append` appends
      to a *window* -- the ``window_pages`` logical pages from ``first[b]`` (the page of its sealed frontier) --
      gathered from the pools, and the window's pages marked in ``write`` are scattered back; other schemes
      append on the view of the first ``view_pages`` pages (``view`` path);
    * **attention**: a decode step (T == 1, ``decode_impl`` not "reference") whose scheme reads its stored
      fields in place goes to the paged Pallas kernel (pages read through the page table); everything else
      (prefill chunks, fused formats, the CPU reference) attends through the model's attention over the view of
      the first ``view_pages`` pages -- memory and time proportional to the mapped pages (bucketed), not to
      ``max_pages``.

    Attributes (pytree): ``groups`` (pools, per-sequence and shared fields, as :class:`PagedKVCache`),
    ``lengths`` int32 ``[B]``, ``page_table`` int32 ``[B, max_pages]``, ``write`` bool ``[B, max_pages]`` (pages
    this step may write, from ``paged.reserve``), ``first`` int32 ``[B]`` (first window page).  Static: the paged
    geometry, ``view_pages`` (>= the pages every sequence maps after the step) and ``window_pages`` (>= the pages
    any sequence writes from ``first``).  ``capacity`` is the view's.  :func:`paged_step` builds it,
    :meth:`paged` returns the successor :class:`PagedKVCache`."""

    groups: tuple
    lengths: jax.Array
    page_table: jax.Array
    write: jax.Array
    first: jax.Array
    schemes: tuple = struct.field(pytree_node=False)
    layouts: tuple = struct.field(pytree_node=False)
    page_size: int = struct.field(pytree_node=False)
    num_pages: int = struct.field(pytree_node=False)
    max_pages: int = struct.field(pytree_node=False)
    row_offset: int = struct.field(pytree_node=False)
    num_kv_heads: int = struct.field(pytree_node=False)
    head_dim: int = struct.field(pytree_node=False)
    view_pages: int = struct.field(pytree_node=False)
    window_pages: int = struct.field(pytree_node=False)

    @property
    def capacity(self) -> int:
        return self.row_offset + self.view_pages * self.page_size

    def paged(self) -> PagedKVCache:
        """The :class:`PagedKVCache` this step's arrays form (after ``forward``: the successor cache)."""
        return PagedKVCache(groups=self.groups, page_table=self.page_table, lengths=self.lengths,
                            schemes=self.schemes, layouts=self.layouts, page_size=self.page_size,
                            num_pages=self.num_pages, max_pages=self.max_pages, row_offset=self.row_offset,
                            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    def _view(self, layout, state, page_table):
        return paged_cache.layer_window(layout, state, page_table[:, :self.view_pages], self.num_pages)

    def layer_step(self, group: int, gst, i, attn: Callable, q, k, v, num_new, *, decode_impl: str):
        """Append this forward's ``k, v`` to layer ``i`` of group ``group`` and attend (class docstring).

        ``gst``: the group's state (``[L_g, ...]``); ``i``: the layer's index in it (int or traced int32);
        ``attn(q, k, v, view, lengths, num_new) -> [B, T, Hq, D]``: the model's attention over a contiguous
        layer state; ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]``, ``num_new`` int32 ``[B]``.
        Returns ``(gst', ok [B], out [B, T, Hq, D])``.

        Under :func:`kvquant_jax.sharding.mesh_context` (a ``(data, model)`` mesh with ``data = 1``) the append and
        the attention run per device on its KV heads (``attention.sharded.shard_layer``, as the contiguous cache's
        ``local_layer``): each device gathers its heads of the window / view pages from its shard of the pools,
        appends, scatters them back and attends its query heads; the page table, lengths, write mask and window
        starts are replicated.  Raises ``ValueError`` naming the sizes when the mesh does not fit
        (``sharding.check_paged_mesh``: data > 1, KV or query heads the model axis does not divide)."""
        scheme, lay = self.schemes[group][0], self.layouts[group]
        st = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), gst)
        args = (q, k, v, st, self.lengths, num_new, self.page_table, self.write, self.first)
        body = functools.partial(self._layer_body, scheme, lay, attn, decode_impl)
        mesh = S.active_mesh()
        if mesh is None:
            st2, ok, out = body(*args)
        else:
            S.check_paged_mesh(mesh, num_heads=q.shape[2], num_kv_heads=k.shape[2])
            specs = S.layer_specs(scheme, st, model=int(mesh.shape[S.MODEL]), batch=q.shape[0],
                                  num_kv_heads=k.shape[2], layout=lay)
            st2, ok, out = shard_layer(body, scheme, *args[:4], specs, *args[4:], batch_axis=None)
        gst = jax.tree.map(lambda a, u: jax.lax.dynamic_update_index_in_dim(a, u.astype(a.dtype), i, 0), gst, st2)
        return gst, ok, out

    def _layer_body(self, scheme, lay, attn, decode_impl, q, k, v, st, lengths, num_new, page_table, write, first):
        """One layer's append + attention on (this device's heads of) the layer state ``st`` (pools, no layer
        axis): ``(st', ok [B], out [B, T, Hq, D])``."""
        t = q.shape[1]
        view_old = None
        if scheme.supports_window_append():
            table, inside = paged_cache.window_table(page_table, first, self.window_pages)
            wr, _ = paged_cache.window_table(write.astype(jnp.int32), first, self.window_pages)
            win = paged_cache.layer_window(lay, st, table, self.num_pages)
            row0 = (self.row_offset + first * self.page_size).astype(jnp.int32)
            win2, ok = scheme.append_window_with_status(win, lengths, k, v, num_new, row0)
            st2 = paged_cache.layer_unwindow(lay, st, win2, table, (wr > 0) & inside, self.num_pages)
            _record(scheme, "append", t, "window")
            view_new = None
        else:
            view_old = self._view(lay, st, page_table)
            view_new, ok = scheme.append_layer_with_status(view_old, lengths, k, v, num_new)
            st2 = paged_cache.layer_unwindow(lay, st, view_new, page_table[:, :self.view_pages],
                                             write[:, :self.view_pages], self.num_pages)
            _record(scheme, "append", t, "view", "no window append")
        keep = scheme.append_keeps_old_view(t)          # read the appended state at the old lengths, or the old one
        read = st2 if keep else _old_view_state(scheme, st, st2)

        def view():
            cached = view_new if keep else view_old
            return cached if cached is not None else self._view(lay, read, page_table)

        out = None
        if t == 1 and decode_impl != "reference":
            pool_region, small, _, _ = layer_pool_regions(scheme, lay, read, view(), lengths, self.num_pages)
            why = ("scheme not read in place" if pool_region is None
                   else paged_kernel.paged_unsupported(pool_region, q.shape[-1], compiled_gpu=_compiled_gpu()))
            if why is None:
                out = paged_kernel.paged_decode_attention(q[:, 0], pool_region, page_table, small,
                                                          k_new=k[:, 0], v_new=v[:, 0])[:, None].astype(q.dtype)
                _record(scheme, "attention", t, "paged_kernel")
        if out is None:
            out = attn(q, k, v, view(), lengths, num_new)
            _record(scheme, "attention", t, "view")
        return st2, ok, out


def _old_view_state(scheme, old, new):
    """The state a multi-row append's attention reads at the OLD lengths when ``append_keeps_old_view`` is False.

    Where that is False only because of the scheme's residual rings (the base rule: ``ring_fields``, the only
    slots such an append may overwrite while they are visible at the old lengths -- the contract
    ``ops.publish`` relies on too), the appended state with just the ring fields taken from the old one: every
    other field is unchanged at the rows the old lengths see, so the values read are the same, and the paged
    pools are read after their in-place update instead of before it.  Reading the whole pre-append state would
    keep each layer's pre-append pools alive beside the updated ones, which makes XLA copy every layer's pools
    per prefill step (KIVI-2 at the LLaMA-3-8B engine geometry: ~0.5 GiB a layer, ~16 GiB a step).  Schemes with
    their own rule (window rings, the K/V split): the whole old state, as before."""
    rings = tuple(scheme.ring_fields)
    if rings and type(scheme).append_keeps_old_view is CacheScheme.append_keeps_old_view and \
            all(hasattr(old, f) for f in rings):
        return new.replace(**{f: getattr(old, f) for f in rings})
    return old


def paged_step(cache: PagedKVCache, write: jax.Array, first: jax.Array, *, view_pages: int,
               window_pages: int) -> PagedStep:
    """A :class:`PagedStep` of ``cache`` (jit-able; ``view_pages`` / ``window_pages`` static, see
    ``paged.step_pages``): ``write`` bool ``[B, max_pages]`` from ``paged.reserve``, ``first`` int32 ``[B]``."""
    if not 1 <= view_pages <= cache.max_pages or window_pages < 1:
        raise ValueError(f"paged step: view_pages {view_pages} must be in [1, {cache.max_pages}] and window_pages "
                         f"{window_pages} >= 1")
    return PagedStep(groups=cache.groups, lengths=cache.lengths, page_table=cache.page_table,
                     write=jnp.asarray(write, jnp.bool_), first=jnp.asarray(first, jnp.int32),
                     schemes=cache.schemes, layouts=cache.layouts, page_size=cache.page_size,
                     num_pages=cache.num_pages, max_pages=cache.max_pages, row_offset=cache.row_offset,
                     num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim, view_pages=view_pages,
                     window_pages=window_pages)
