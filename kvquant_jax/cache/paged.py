"""The paged KV cache (``layout_version`` 2): page pools per layer group, a page table, per-sequence residual state.

Layout (docs/architecture.md, "Paged layout")
---------------------------------------------
Every field of a scheme's layer state is classified once, from the shapes ``scheme.init_layer`` gives for two batch
sizes and two capacities (``jax.eval_shape``; no scheme switches on its family here):

* **paged** (has a batch axis AND a capacity-proportional row axis: codes, per-row qparams, KIVI's per-G-row K
  qparams, KVQuant's sparse outliers and positions, full-precision rows): stored in a *pool*
  ``[L_g, num_pages + 1, ..., rows_per_page, ...]`` -- the batch axis becomes the page axis and the row axis holds
  one page's rows (``rows_per_page = page_size * rows_per_position``: ``page_size / G`` for KIVI's K qparams, so
  ``G`` must divide ``page_size`` and a K group never mixes two requests).  Page ``num_pages`` is the *trash page*:
  never allocated, it absorbs masked writes and backs unmapped page-table entries.
* **per sequence** (batch axis, no row axis: KIVI's residual rings, KVQuant's sink rows, unshared prefix rows):
  ``[L_g, B, ...]`` as in the contiguous cache; residual rows stay with their sequence.
* **shared** (no batch axis: FP8 / static scales, KVQuant calibration, shared IntactKV prefix rows): ``[L_g, ...]``.

``page_table: int32 [B, max_pages]`` maps sequence ``b``'s logical page ``j`` (positions
``row_offset + j*page_size + [0, page_size)``) to a physical page (-1: none); ``lengths: int32 [B]`` is the
committed frontier as in :class:`~kvquant_jax.cache.interface.KVCache` (it counts hidden prefix rows:
``row_offset`` = the prefix wrapper's P, the positions that live outside pages).  The *view* of a paged cache is the
contiguous ``KVCache`` of capacity ``row_offset + max_pages * page_size`` whose row ``i`` is read through the page
table (:func:`gather`); every scheme operation (append, decode regions, materialize, truncate's rebuild) runs on it,
so every registry scheme works paged with the same guarantees, and :func:`scatter` writes back only the pages an
operation may change: those at or after the scheme's sealed frontier (``CacheScheme.sealed_rows``) up to the new
length.  The host-side allocator (``cache/page_pool.py``) owns free list, refcounts and quiescent reclamation.

Ownership rules: a page holding rows at or past an owner's sealed frontier is *mutable*; an append first copies
(copy-on-write) every mutable page it writes that another holder also references (a shared partial page, or a KIVI
page whose codes are not closed yet).  Fork / beam reorder edit the page table and gather per-sequence fields (no
payload copy); truncate frees whole pages past the new length and masks the partial one (frontiers re-derive);
release drops the sequence's references (pages return when no holder refers to them and no in-flight step reads
them).  Every operation is a pure function ``(cache, pool, ...) -> (cache', pool')``; on error nothing changes.
"""
from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.cache import ops
from kvquant_jax.cache import page_pool as pp
from kvquant_jax.cache.interface import CacheScheme, KVCache, LayerGroups, _runs
from kvquant_jax.cache.schema import CacheSchema

LAYOUT_VERSION = 2
PAGED, SLOT, SHARED = "paged", "per_sequence", "shared"


@dataclasses.dataclass(frozen=True)
class FieldLayout:
    """How one state field is stored paged.

    Attributes:
      name: the layer-state field.
      kind: "paged" | "per_sequence" | "shared".
      row_axis: per-layer axis index of the row axis (paged only; the batch axis is 0), else -1.
      rows_per_page: rows of that axis one page holds (paged only), else 0.
    """

    name: str
    kind: str
    row_axis: int = -1
    rows_per_page: int = 0


@functools.lru_cache(maxsize=256)
def field_layouts(scheme: CacheScheme, page_size: int, num_kv_heads: int,
                  head_dim: int) -> tuple[int, tuple[FieldLayout, ...]]:
    """``(row_offset, fields)`` of one scheme: the positions outside pages (prefix rows) and every field's layout.

    Raises ``ValueError`` when a field's rows do not split into whole pages (e.g. KIVI with ``G`` not dividing
    ``page_size``) or a capacity-dependent field has no batch axis."""
    c1, c2 = 4096 * page_size, 8192 * page_size

    def shapes(b, c):
        st = jax.eval_shape(lambda: scheme.init_layer(b, c, num_kv_heads, head_dim))
        return {f.name: tuple(getattr(st, f.name).shape) for f in dataclasses.fields(st)}

    base, more_b, more_c = shapes(2, c1), shapes(3, c1), shapes(2, c2)
    offsets, out = set(), []
    for name, s in base.items():
        b_axes = [i for i, (x, y) in enumerate(zip(s, more_b[name])) if x != y]
        r_axes = [i for i, (x, y) in enumerate(zip(s, more_c[name])) if x != y]
        if len(b_axes) > 1 or len(r_axes) > 1 or (b_axes and b_axes[0] != 0):
            raise ValueError(f"paged layout: field {name!r} of {type(scheme).__name__} has shape {s}: expected at "
                             "most one batch axis (axis 0) and one capacity axis")
        if r_axes and not b_axes:
            raise ValueError(f"paged layout: field {name!r} of {type(scheme).__name__} grows with capacity but has "
                             "no batch axis; it cannot be paged")
        if not b_axes:
            out.append(FieldLayout(name, SHARED))
            continue
        if not r_axes:
            out.append(FieldLayout(name, SLOT))
            continue
        a = r_axes[0]
        alpha = Fraction(more_c[name][a] - s[a], c2 - c1)
        if alpha == 1:                   # per-position rows fix the hidden rows; per-group rows may floor them
            offsets.add(c1 - s[a])
        rpp = alpha * page_size
        if rpp.denominator != 1 or rpp < 1:
            raise ValueError(f"paged layout: field {name!r} of {type(scheme).__name__} holds {alpha} rows per "
                             f"position; page_size {page_size} must make that a whole number of rows per page "
                             "(KIVI: group_size must divide page_size)")
        out.append(FieldLayout(name, PAGED, a, int(rpp)))
    if len(offsets) > 1 or any(o.denominator != 1 or o < 0 for o in offsets):
        raise ValueError(f"paged layout: {type(scheme).__name__} fields disagree on the positions outside pages "
                         f"({sorted(offsets)})")
    if not offsets:
        raise ValueError(f"paged layout: {type(scheme).__name__} has no field that grows with capacity")
    return int(offsets.pop()), tuple(out)


@struct.dataclass
class PagedKVCache(LayerGroups):
    """The whole model's paged cache (one value, published whole like :class:`KVCache`).

    Attributes:
      groups: per layer group the scheme's layer-state class whose paged fields are pools
        ``[L_g, num_pages + 1, ...page...]``, per-sequence fields ``[L_g, B, ...]``, shared fields ``[L_g, ...]``.
      page_table: int32 ``[B, max_pages]``, -1 = unmapped.
      lengths: int32 ``[B]`` committed rows per sequence (hidden prefix rows included).
      schemes: static ``(scheme, first_layer, num_layers)`` per group (as ``KVCache.schemes``).
      layouts: static per-group tuple of :class:`FieldLayout`.
      page_size, num_pages, max_pages, row_offset, num_kv_heads, head_dim: static geometry.
    """

    groups: tuple
    page_table: jax.Array
    lengths: jax.Array
    schemes: tuple = struct.field(pytree_node=False)
    layouts: tuple = struct.field(pytree_node=False)
    page_size: int = struct.field(pytree_node=False)
    num_pages: int = struct.field(pytree_node=False)
    max_pages: int = struct.field(pytree_node=False)
    row_offset: int = struct.field(pytree_node=False)
    num_kv_heads: int = struct.field(pytree_node=False)
    head_dim: int = struct.field(pytree_node=False)

    @property
    def capacity(self) -> int:
        """Positions one sequence can hold: hidden prefix rows + ``max_pages`` pages."""
        return self.row_offset + self.max_pages * self.page_size

    def pages_needed(self, lengths) -> np.ndarray:
        """int64 ``[B]``: pages that hold positions ``[row_offset, lengths)``."""
        body = np.maximum(np.asarray(lengths, np.int64) - self.row_offset, 0)
        return -(-body // self.page_size)

    def sealed(self, lengths) -> np.ndarray:
        """int64 ``[B]``: the sealed frontier of every sequence (minimum over the groups' schemes)."""
        lengths = np.asarray(lengths, np.int64)
        return np.min([np.asarray(s.sealed_rows(lengths), np.int64) for s, _, _ in self.schemes], axis=0)


# --------------------------------------------------------------------------------------------------------------
# construction
# --------------------------------------------------------------------------------------------------------------
def init_paged(schemes, *, num_layers: int, batch: int, num_pages: int, page_size: int, max_pages: int,
               num_kv_heads: int, head_dim: int, layer_groups: str = "runs") -> tuple[PagedKVCache, pp.PoolState]:
    """Empty paged cache and its allocator: ``batch`` sequence slots, ``num_pages`` pages of ``page_size`` rows,
    at most ``max_pages`` per sequence.  Lengths start at ``row_offset`` (the hidden prefix rows, 0 without a
    prefix wrapper).  Arguments as :func:`~kvquant_jax.cache.interface.init_cache`."""
    if page_size < 1 or max_pages < 1 or num_pages < 1:
        raise ValueError(f"paged cache: page_size ({page_size}), max_pages ({max_pages}) and num_pages "
                         f"({num_pages}) must be >= 1")
    per_layer = (schemes,) * num_layers if isinstance(schemes, CacheScheme) else tuple(schemes)
    offs, layouts = set(), []
    runs = _runs(per_layer) if layer_groups == "runs" else [(s, i, 1) for i, s in enumerate(per_layer)]
    for s, _, _ in runs:
        off, lay = field_layouts(s, page_size, num_kv_heads, head_dim)
        offs.add(off)
        layouts.append(lay)
    if len(offs) != 1:
        raise ValueError(f"paged cache: layer groups disagree on the hidden prefix rows ({sorted(offs)})")
    off = offs.pop()
    for (s, _, _), lay in zip(runs, layouts):          # the view must be exactly the pages laid end to end
        view = jax.eval_shape(lambda s=s: s.init_layer(batch, off + max_pages * page_size, num_kv_heads, head_dim))
        for f in lay:
            got = getattr(view, f.name).shape[f.row_axis] if f.kind == PAGED else None
            if f.kind == PAGED and got != max_pages * f.rows_per_page:
                raise ValueError(f"paged layout: field {f.name!r} of {type(s).__name__} has {got} rows at capacity "
                                 f"{off + max_pages * page_size}, not {max_pages} pages x {f.rows_per_page}")
    groups = tuple(_init_group(s, n, batch, num_pages + 1, off + page_size, num_kv_heads, head_dim,
                               tuple(f.name for f in lay if f.kind == PAGED))
                   for (s, _, n), lay in zip(runs, layouts))
    cache = PagedKVCache(groups=groups, page_table=jnp.full((batch, max_pages), -1, jnp.int32),
                         lengths=jnp.full((batch,), off, jnp.int32), schemes=tuple(runs), layouts=tuple(layouts),
                         page_size=page_size, num_pages=num_pages, max_pages=max_pages, row_offset=off,
                         num_kv_heads=num_kv_heads, head_dim=head_dim)
    return cache, pp.new_pool(num_pages)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5, 6, 7))
def _init_group(scheme: CacheScheme, n: int, batch: int, pool_batch: int, capacity: int, num_kv_heads: int,
                head_dim: int, paged_names: tuple) -> Any:
    """One layer group's empty state ``[n, ...]``: the paged fields (``paged_names``) as pools of ``pool_batch``
    pages, every other field at ``batch`` sequences (per-sequence) or as the scheme gives it (shared).

    Jitted so that only these fields are ever allocated: the scheme's state at the pool's batch also holds its
    per-sequence fields at ``pool_batch`` -- KIVI-2's residual rings at the LLaMA-3-8B engine geometry (10923
    pages, 8 KV heads, 128 + 129 ring rows) are 2.67 + 2.69 GiB per layer, 171 GiB over 32 layers, against a 16 GiB
    pool -- and eagerly (``init_cache``) those were built, held for every layer, and thrown away.  Under ``jit``
    they are dead code."""
    pools = scheme.init_layer(pool_batch, capacity, num_kv_heads, head_dim)
    one = scheme.init_layer(batch, capacity, num_kv_heads, head_dim)
    one = one.replace(**{name: getattr(pools, name) for name in paged_names})
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n,) + a.shape), one)


# --------------------------------------------------------------------------------------------------------------
# the contiguous view: gather through the page table, scatter pages back (jit-able)
# --------------------------------------------------------------------------------------------------------------
def _safe_table(cache: PagedKVCache, table: jax.Array) -> jax.Array:
    return jnp.where(table < 0, cache.num_pages, table)


def _gather_field(pool: jax.Array, table: jax.Array, f: FieldLayout, lead: int = 1) -> jax.Array:
    """Rows of the pages ``table [B, M]`` (safe ids) laid end to end: pool ``[*L, P + 1, ...page dims]`` ->
    ``[*L, B, ..., M * rows_per_page, ...]`` (``lead``: 1 for a stacked group, 0 for one layer)."""
    g = pool[(slice(None),) * lead + (table,)]            # [*L, B, M, ...page dims]
    r = f.row_axis + lead
    g = jnp.moveaxis(g, lead + 1, r)                     # [*L, B, ..., M, rows_per_page, ...]
    return g.reshape(g.shape[:r] + (g.shape[r] * g.shape[r + 1],) + g.shape[r + 2:])


def gather(cache: PagedKVCache, pages: int | None = None) -> KVCache:
    """The contiguous view (jit-able): ``KVCache`` of capacity ``row_offset + pages * page_size`` (``pages``
    static, default ``max_pages``: ``cache.capacity``); row ``i`` of sequence ``b`` is read from page
    ``page_table[b, (i - row_offset) // page_size]`` (the trash page where unmapped; such rows are invisible at
    ``lengths``).  With ``pages`` < ``max_pages`` it is the view of the first ``pages`` logical pages (every
    sequence must hold its ``lengths`` within them)."""
    pages = cache.max_pages if pages is None else pages
    table = _safe_table(cache, cache.page_table[:, :pages])
    groups = []
    for lay, st in zip(cache.layouts, cache.groups):
        groups.append(st.replace(**{f.name: _gather_field(getattr(st, f.name), table, f)
                                    for f in lay if f.kind == PAGED}))
    return KVCache(groups=tuple(groups), lengths=cache.lengths, schemes=cache.schemes,
                   capacity=cache.row_offset + pages * cache.page_size, num_kv_heads=cache.num_kv_heads,
                   head_dim=cache.head_dim)


def _scatter_field(pool: jax.Array, view: jax.Array, idx: jax.Array, f: FieldLayout, pages: int,
                   lead: int = 1) -> jax.Array:
    """Inverse of :func:`_gather_field`: write the view's ``pages`` pages per sequence to pool pages ``idx``
    (``[B * pages]``, the trash page for pages not written)."""
    r = f.row_axis + lead
    v = view.reshape(view.shape[:r] + (pages, f.rows_per_page) + view.shape[r + 1:])
    v = jnp.moveaxis(v, r, lead + 1)                     # [*L, B, M, ...page dims]
    v = v.reshape(v.shape[:lead] + (v.shape[lead] * v.shape[lead + 1],) + v.shape[lead + 2:])
    return pool.at[(slice(None),) * lead + (idx,)].set(v.astype(pool.dtype))


def scatter(cache: PagedKVCache, view: KVCache, write: jax.Array) -> PagedKVCache:
    """Write the view's pages back (jit-able): page ``j`` of sequence ``b`` where ``write[b, j]`` (bool
    ``[B, max_pages]``; the caller makes every written page exclusively owned), every per-sequence field, and the
    view's lengths.  Shared fields are taken from the view (a warm-up FP8 scale is written by an append).  The view
    may hold fewer pages than ``max_pages`` (:func:`gather` with ``pages``); pages past it must not be written."""
    pages = (view.capacity - cache.row_offset) // cache.page_size
    idx = write_index(cache.page_table[:, :pages], write[:, :pages], cache.num_pages)
    groups = []
    for lay, st, vst in zip(cache.layouts, cache.groups, view.groups):
        groups.append(st.replace(**{f.name: (_scatter_field(getattr(st, f.name), getattr(vst, f.name), idx, f, pages)
                                             if f.kind == PAGED else getattr(vst, f.name)) for f in lay}))
    return cache.replace(groups=tuple(groups), lengths=view.lengths)


def write_index(table: jax.Array, write: jax.Array, num_pages: int) -> jax.Array:
    """int32 ``[B * M]``: the pool page each (sequence, page) of ``table [B, M]`` is written to -- its page where
    ``write`` and mapped, the trash page ``num_pages`` otherwise."""
    return jnp.where(write & (table >= 0), table, num_pages).reshape(-1)


# --------------------------------------------------------------------------------------------------------------
# one layer read and written through the page table (the paged-direct forward, attention/paged.PagedStep)
# --------------------------------------------------------------------------------------------------------------
def window_table(page_table: jax.Array, first: jax.Array, pages: int) -> tuple[jax.Array, jax.Array]:
    """``(table, in_range)`` of a window of ``pages`` logical pages starting at page ``first[b]`` (int32 ``[B]``):
    ``table[b, j] = page_table[b, first[b] + j]`` (-1 past ``max_pages``), ``in_range`` bool ``[B, pages]``."""
    j = first[:, None] + jnp.arange(pages, dtype=jnp.int32)[None, :]
    inside = j < page_table.shape[1]
    t = jnp.take_along_axis(page_table, jnp.minimum(j, page_table.shape[1] - 1), axis=1)
    return jnp.where(inside, t, -1), inside


def layer_window(layout: tuple, state, table: jax.Array, num_pages: int):
    """One layer's state (pools ``[P + 1, ...]``, per-sequence and shared fields; no layer axis) with every paged
    field replaced by the rows of pages ``table [B, M]`` laid end to end (-1: the trash page): the contiguous
    layer state of capacity ``M * page_size`` (plus hidden prefix rows) of those pages."""
    safe = jnp.where(table < 0, num_pages, table)
    return state.replace(**{f.name: _gather_field(getattr(state, f.name), safe, f, lead=0)
                            for f in layout if f.kind == PAGED})


def layer_unwindow(layout: tuple, state, window, table: jax.Array, write: jax.Array, num_pages: int):
    """Write a window (``layer_window``'s shape, after an append) back: its page ``j`` of sequence ``b`` to pool
    page ``table[b, j]`` where ``write[b, j]`` (bool ``[B, M]``; else the trash page); per-sequence and shared
    fields are taken from the window.  Returns the layer state (pools)."""
    m = table.shape[1]
    idx = write_index(table, write, num_pages)
    return state.replace(**{f.name: (_scatter_field(getattr(state, f.name), getattr(window, f.name), idx, f, m,
                                                    lead=0) if f.kind == PAGED else getattr(window, f.name))
                            for f in layout})


def copy_pages(cache: PagedKVCache, src: jax.Array, dst: jax.Array) -> PagedKVCache:
    """Copy whole pages ``src[i] -> dst[i]`` (int32 ``[n]``; pad with ``num_pages``, the trash page) in every
    pool of every group: the copy-on-write step (jit-able)."""
    groups = []
    for lay, st in zip(cache.layouts, cache.groups):
        groups.append(st.replace(**{f.name: getattr(st, f.name).at[:, dst].set(getattr(st, f.name)[:, src])
                                    for f in lay if f.kind == PAGED}))
    return cache.replace(groups=tuple(groups))


def gather_slots(cache: PagedKVCache, index: jax.Array) -> PagedKVCache:
    """Per-sequence fields, page-table rows and lengths of sequence ``index[b]`` for every slot ``b`` (int32
    ``[B]``; jit-able): the device half of fork / reorder (refcounts are the host half)."""
    groups = []
    for lay, st in zip(cache.layouts, cache.groups):
        groups.append(st.replace(**{f.name: jnp.take(getattr(st, f.name), index, axis=1)
                                    for f in lay if f.kind == SLOT}))
    return cache.replace(groups=tuple(groups), page_table=jnp.take(cache.page_table, index, axis=0),
                         lengths=jnp.take(cache.lengths, index))


def select_slots(cache: PagedKVCache, index: jax.Array) -> PagedKVCache:
    """The paged cache of the sequences ``index`` (int32 ``[R]``; an entry ``>= B`` is an empty row: no page,
    length ``row_offset``, zero per-sequence fields) sharing the pools and shared fields (jit-able): the rows of
    one forward of an engine step.  :func:`merge_slots` writes the rows back."""
    b = cache.batch
    inside = index < b
    safe = jnp.minimum(index, b - 1)
    groups = []
    for lay, st in zip(cache.layouts, cache.groups):
        def rows(a):
            got = jnp.take(a, safe, axis=1)
            return jnp.where(inside.reshape((1, -1) + (1,) * (a.ndim - 2)), got, jnp.zeros((), a.dtype))
        groups.append(st.replace(**{f.name: rows(getattr(st, f.name)) for f in lay if f.kind == SLOT}))
    return cache.replace(groups=tuple(groups),
                         page_table=jnp.where(inside[:, None], cache.page_table[safe], -1),
                         lengths=jnp.where(inside, cache.lengths[safe], cache.row_offset))


def merge_slots(cache: PagedKVCache, sub: PagedKVCache, index: jax.Array) -> PagedKVCache:
    """Inverse of :func:`select_slots` after a forward on ``sub``: its pools and shared fields, and its
    per-sequence fields and lengths at rows ``index`` (distinct; entries ``>= B`` dropped).  The page table is
    the cache's (a forward maps no page)."""
    groups = []
    for lay, st, sst in zip(cache.layouts, cache.groups, sub.groups):
        groups.append(st.replace(**{f.name: (getattr(st, f.name).at[:, index].set(getattr(sst, f.name), mode="drop")
                                             if f.kind == SLOT else getattr(sst, f.name)) for f in lay}))
    return cache.replace(groups=tuple(groups), lengths=cache.lengths.at[index].set(sub.lengths, mode="drop"))


_gather_jit = jax.jit(gather, static_argnames="pages")
_scatter_jit = jax.jit(scatter)
_copy_jit = jax.jit(copy_pages)
_slots_jit = jax.jit(gather_slots)


# --------------------------------------------------------------------------------------------------------------
# ownership (host planning + the jitted device halves); every function returns (cache', pool')
# --------------------------------------------------------------------------------------------------------------
def _host(a) -> np.ndarray:
    return np.array(jax.device_get(a))


def table_refs(cache: PagedKVCache) -> np.ndarray:
    """Every page id the page table references (with repeats: one reference per entry)."""
    t = _host(cache.page_table)
    return t[t >= 0]


def plan_reserve(cache: PagedKVCache, pool: pp.PoolState, lengths, table, new_lengths, owners=None
                 ) -> tuple[np.ndarray, pp.PoolState, np.ndarray, np.ndarray, np.ndarray]:
    """The host half of :func:`reserve` on host copies of the cache's ``lengths`` (int ``[B]``) and
    ``page_table`` (int ``[B, max_pages]``; not modified): no device array is read or written, so an engine that
    keeps both on the host plans a step without a device round trip.  Returns ``(table', pool', write, src,
    dst)``: the new page table (int32 ``[B, max_pages]``), the pool, ``write`` bool ``[B, max_pages]`` (the
    pages the append may write, all exclusively owned then) and the copy-on-write copies ``src -> dst`` (int32
    ``[n]``) to apply to the pools first (:func:`copy_pages`).  Raises as :func:`reserve` (nothing changed)."""
    old = np.asarray(lengths, np.int64).reshape(-1)
    new = np.asarray(new_lengths, np.int64).reshape(old.shape)
    if (new > cache.capacity).any():
        b = int(np.argmax(new))
        raise ValueError(f"paged cache: sequence {b} needs {int(new[b])} positions but capacity is "
                         f"{cache.capacity} ({cache.row_offset} prefix rows + {cache.max_pages} pages of "
                         f"{cache.page_size})")
    owners = np.arange(cache.batch) if owners is None else np.asarray(owners)
    table = np.array(table, np.int32)
    need = cache.pages_needed(new)
    first = window_first(cache, old)
    grow = new > old
    write = np.zeros(table.shape, bool)
    src, dst = [], []
    for b in np.nonzero(grow)[0]:
        for j in range(int(first[b]), int(need[b])):
            write[b, j] = True
            p = int(table[b, j])
            start = cache.row_offset + j * cache.page_size
            if p < 0:
                pool, (q,) = pp.allocate(pool, 1, int(owners[b]), [start], what=f"sequence {b}")
                table[b, j] = q
            elif pool.refcount[p] > 1:                 # shared mutable page: copy on write
                pool, (q,) = pp.allocate(pool, 1, int(owners[b]), [start], what=f"copy-on-write for sequence {b}")
                pool = pp.decref(pool, [p])
                src.append(p)
                dst.append(q)
                table[b, j] = q
    return table, pool, write, np.asarray(src, np.int32), np.asarray(dst, np.int32)


def reserve(cache: PagedKVCache, pool: pp.PoolState, new_lengths, owners=None
            ) -> tuple[PagedKVCache, pp.PoolState, np.ndarray]:
    """Make room for sequences to grow to ``new_lengths`` (int ``[B]``): map missing pages and copy-on-write every
    shared page an append to that length would write.  Returns ``(cache', pool', write)`` with ``write`` bool
    ``[B, max_pages]``: the pages the append may write (all exclusively owned now).  Raises ``ValueError`` past
    the capacity and :class:`~kvquant_jax.cache.page_pool.PoolExhaustedError` (nothing changed)."""
    table, pool, write, src, dst = plan_reserve(cache, pool, _host(cache.lengths), _host(cache.page_table),
                                                new_lengths, owners)
    cache = cache.replace(page_table=jnp.asarray(table, jnp.int32))
    if src.size:
        cache = apply_copies(cache, src, dst)
    return cache, pool, write


def apply_copies(cache: PagedKVCache, src, dst) -> PagedKVCache:
    """:func:`copy_pages` (jitted) of host page lists ``src -> dst`` (int ``[n]``, ``n >= 1``): the device half of
    a copy-on-write that :func:`plan_reserve` planned."""
    return _copy_jit(cache, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))


def window_first(cache: PagedKVCache, lengths) -> np.ndarray:
    """int64 ``[B]``: the first logical page an append at committed ``lengths`` may write -- the page holding the
    sealed frontier (``CacheScheme.sealed_rows``, minimum over the groups); host-side."""
    return np.maximum(cache.sealed(lengths) - cache.row_offset, 0) // cache.page_size


def step_pages(cache: PagedKVCache, old_lengths, new_lengths) -> tuple[np.ndarray, int, int]:
    """Host-side page counts of one append from ``old_lengths`` to ``new_lengths`` (int ``[B]``):
    ``(first [B], window, view)`` -- the first page each sequence writes (:func:`window_first`), the most pages
    any growing sequence writes (``pages_needed(new) - first``, >= 1) and the most pages any sequence maps at the
    new lengths (>= 1).  An engine buckets the two counts into static step shapes."""
    old = np.asarray(old_lengths, np.int64)
    new = np.asarray(new_lengths, np.int64)
    first = window_first(cache, old)
    need = cache.pages_needed(new)
    grow = new > old
    window = int(np.max(np.where(grow, need - first, 0), initial=0))
    return first, max(window, 1), max(int(np.max(need, initial=0)), 1)


def append(cache: PagedKVCache, pool: pp.PoolState, layer_kv: Sequence, num_new, owners=None
           ) -> tuple[PagedKVCache, pp.PoolState]:
    """Eager append (the paged form of :func:`kvquant_jax.cache.ops.append`: same arguments and errors, plus
    :class:`~kvquant_jax.cache.page_pool.PoolExhaustedError`).  ``layer_kv``: per layer ``(k, v)`` float
    ``[B, T, Hkv, D]``; ``num_new`` int ``[B]``."""
    num = np.asarray(num_new, np.int64).reshape(-1)
    new = _host(cache.lengths).astype(np.int64) + num
    cache2, pool2, write = reserve(cache, pool, new, owners)
    view = ops.append(_gather_jit(cache2), layer_kv, num)
    return _scatter_jit(cache2, view, jnp.asarray(write)), pool2


def fork(cache: PagedKVCache, pool: pp.PoolState, parent_index_per_child) -> tuple[PagedKVCache, pp.PoolState]:
    """Slot ``c`` becomes a copy of sequence ``parent_index_per_child[c]`` (``[B]``, repeats allowed: fork and beam
    reorder).  Page-table edit + per-sequence gather; pages gain/lose references, no payload is copied."""
    idx = np.asarray(parent_index_per_child)
    if idx.shape != (cache.batch,) or not np.issubdtype(idx.dtype, np.integer):
        raise ValueError(f"paged fork: need {cache.batch} integer parent indices, got {idx.tolist()}")
    if (idx < 0).any() or (idx >= cache.batch).any():
        raise ValueError(f"paged fork: parent indices {idx.tolist()} out of range [0, {cache.batch})")
    table = _host(cache.page_table)
    pool = pp.decref(pp.incref(pool, table[idx].reshape(-1)), table.reshape(-1))
    return _slots_jit(cache, jnp.asarray(idx, jnp.int32)), pool


reorder = fork


def share(cache: PagedKVCache, pool: pp.PoolState, src: int, dst: int) -> tuple[PagedKVCache, pp.PoolState]:
    """Slot ``dst`` takes sequence ``src``'s whole history by reference (its old pages are released): the
    shared-prefix operation.  Full pages stay shared; the partial last page (and, for KIVI, pages whose codes are
    not closed) are copied on the first append of either side."""
    idx = np.arange(cache.batch)
    idx[dst] = src
    return fork(cache, pool, idx)


def truncate(cache: PagedKVCache, pool: pp.PoolState, new_lengths, *, rows: Sequence | None = None
             ) -> tuple[PagedKVCache, pp.PoolState]:
    """Lower lengths (the paged form of :func:`kvquant_jax.cache.ops.truncate`, same ``rows=`` rule and
    :class:`~kvquant_jax.cache.ops.TruncationNeedsRowsError`): whole pages past the new length are released, the
    partial one is masked by the length; original rows restored into per-sequence rings."""
    new = np.asarray(new_lengths, np.int64).reshape(-1)
    if (new < cache.row_offset).any():
        raise ValueError(f"paged truncate: lengths {new.tolist()} below the {cache.row_offset} hidden prefix rows")
    view = ops.truncate(_gather_jit(cache), new, rows=rows)
    table = _host(cache.page_table)
    keep = np.arange(cache.max_pages)[None, :] < cache.pages_needed(new)[:, None]
    pool = pp.decref(pool, table[~keep])
    table[~keep] = -1
    out = _scatter_jit(cache.replace(page_table=jnp.asarray(table, jnp.int32)), view,
                       jnp.zeros(table.shape, bool))
    return out, pool


def release(cache: PagedKVCache, pool: pp.PoolState, seqs) -> tuple[PagedKVCache, pp.PoolState]:
    """Close sequences logically (their slots restart empty at ``row_offset``) and drop their page references;
    a page returns to the free list only when no holder refers to it and no in-flight step reads it."""
    seqs = np.atleast_1d(np.asarray(seqs, np.int64))
    table = _host(cache.page_table)
    pool = pp.decref(pool, table[seqs].reshape(-1))
    table[seqs] = -1
    lengths = _host(cache.lengths)
    lengths[seqs] = cache.row_offset
    return cache.replace(page_table=jnp.asarray(table, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32)), pool


def materialize(cache: PagedKVCache) -> tuple:
    """:func:`kvquant_jax.cache.ops.decode_all` of the view: per layer ``(k, v, valid)`` float32
    ``[B, Hkv, capacity, D]`` twice and bool ``[B, capacity]``."""
    return ops.decode_all(_gather_jit(cache))


def validate(cache: PagedKVCache, pool: pp.PoolState, extra_refs=()) -> None:
    """Host-side invariants: the pool's (every page referenced / quarantined / free exactly once, refcount ==
    page-table entries + ``extra_refs``, e.g. prefix-cache entries), the table maps exactly the pages a length
    needs, and every scheme invariant of the view (``ops.validate``).  Raises ``AssertionError`` / ``ValueError``."""
    table = _host(cache.page_table)
    lengths = _host(cache.lengths)
    need = cache.pages_needed(lengths)
    mapped = table >= 0
    want = np.arange(cache.max_pages)[None, :] < need[:, None]
    assert (mapped == want).all(), f"page table maps {mapped.sum(1).tolist()} pages, lengths need {need.tolist()}"
    assert (table < cache.num_pages).all(), "page table points at the trash page or beyond"
    assert (lengths >= cache.row_offset).all() and (lengths <= cache.capacity).all(), f"lengths {lengths}"
    pp.check_pool(pool, np.concatenate([table[mapped], np.asarray(list(extra_refs), np.int64)]))
    ops.validate(_gather_jit(cache))


# --------------------------------------------------------------------------------------------------------------
# page records (0x05C) and the byte ledger
# --------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PageSchema:
    """The static half of a page record (0x05C), one per layer group: what the bytes of a page mean."""

    layers: tuple                  # (first_layer, num_layers)
    key_payload: str
    value_payload: str
    key_qparams: bool
    value_qparams: bool
    sparse_outliers: bool
    residual_in_page: bool         # full-precision rows stored in pages (False: per-sequence rings / none)
    key_signed: bool
    value_signed: bool
    key_zero: str
    value_zero: str
    key_axis: str
    key_group_size: int
    value_axis: str
    value_group_size: int
    qparam_dtype: str
    qparam_order: str
    key_stage: str
    rope: str                      # "theta=...,pairing=..."
    packing: str                   # "paged-v2, little-endian bit packing, offset-binary"
    layout_version: int
    kernel_family: str
    page_size: int
    fields: tuple                  # the paged field names


@dataclasses.dataclass(frozen=True)
class PageRecord:
    """One referenced page: the dynamic fields plus its group's :class:`PageSchema`."""

    page: int
    owner: int                     # request or prefix id that allocated it
    refcount: int
    logical_token_start: int
    valid_token_count: int
    schemas: tuple                 # one PageSchema per layer group (a page id spans every group's pool)


def page_schemas(cache: PagedKVCache) -> tuple[PageSchema, ...]:
    out = []
    for (scheme, first, n), lay in zip(cache.schemes, cache.layouts):
        s: CacheSchema = scheme.schema
        names = tuple(f.name for f in lay if f.kind == PAGED)
        q = [f for f in names if any(t in f for t in ("scale", "min", "offset", "zero"))]
        full_in_page = s.key.payload in ("fp32", "bf16", "fp16") or any(n_ in ("k", "v") for n_ in names)
        out.append(PageSchema(
            layers=(first, n), key_payload=s.key.payload, value_payload=s.value.payload,
            key_qparams=any(f.startswith("k") for f in q), value_qparams=any(f.startswith("v") for f in q),
            sparse_outliers=any("sp_" in f for f in names), residual_in_page=bool(full_in_page),
            key_signed=s.key.signed, value_signed=s.value.signed, key_zero=s.key.zero, value_zero=s.value.zero,
            key_axis=s.key.axis, key_group_size=s.key.group_size, value_axis=s.value.axis,
            value_group_size=s.value.group_size, qparam_dtype=s.key.qparam_dtype,
            qparam_order=s.key.qparam_order, key_stage=s.key_stage,
            rope=f"theta={s.rope_theta},pairing={s.rope_pairing}",
            packing=f"paged-v{LAYOUT_VERSION}/bits-v{s.layout_version}", layout_version=LAYOUT_VERSION,
            kernel_family=s.kernel_family, page_size=cache.page_size, fields=names))
    return tuple(out)


def page_records(cache: PagedKVCache, pool: pp.PoolState) -> list[PageRecord]:
    """A :class:`PageRecord` per referenced page (valid count = the most rows any referencing sequence sees)."""
    table, lengths = _host(cache.page_table), _host(cache.lengths).astype(np.int64)
    valid = np.zeros(cache.num_pages, np.int64)
    for b in range(cache.batch):
        for j in np.nonzero(table[b] >= 0)[0]:
            start = cache.row_offset + j * cache.page_size
            valid[table[b, j]] = max(valid[table[b, j]], int(np.clip(lengths[b] - start, 0, cache.page_size)))
    schemas = page_schemas(cache)
    return [PageRecord(int(p), int(pool.owner[p]), int(pool.refcount[p]), int(pool.logical_start[p]),
                       int(valid[p]), schemas) for p in np.nonzero(pool.refcount > 0)[0]]


def page_nbytes(cache: PagedKVCache) -> int:
    """Bytes one page occupies across every pool of every layer."""
    total = 0
    for lay, st in zip(cache.layouts, cache.groups):
        for f in lay:
            if f.kind == PAGED:
                a = getattr(st, f.name)
                total += a.nbytes // a.shape[1]
    return total


def ledger(cache: PagedKVCache, pool: pp.PoolState) -> dict[str, int]:
    """Measured bytes by category: ``pages`` (pages referenced), ``slack_partial`` (unfilled rows of referenced
    pages), ``slack_free`` (free + quarantined pages + the trash page: the allocator's slack), ``page_table``
    (table + lengths), ``per_sequence`` (residual rings, sinks), ``shared`` (layer-wide qparams, shared prefix
    rows).  ``pages + slack_partial`` is the bytes of referenced pages; the categories sum to every array's
    ``nbytes``."""
    per_page = page_nbytes(cache)
    used = pool.num_used
    filled = sum(r.valid_token_count for r in page_records(cache, pool))
    out = {"pages": per_page * filled // cache.page_size,
           "slack_partial": per_page * used - per_page * filled // cache.page_size,
           "slack_free": per_page * (cache.num_pages + 1 - used),
           "page_table": int(cache.page_table.nbytes + cache.lengths.nbytes), "per_sequence": 0, "shared": 0}
    for lay, st in zip(cache.layouts, cache.groups):
        for f in lay:
            if f.kind == SLOT:
                out["per_sequence"] += int(getattr(st, f.name).nbytes)
            elif f.kind == SHARED:
                out["shared"] += int(getattr(st, f.name).nbytes)
    return out


def measured_nbytes(cache: PagedKVCache) -> int:
    """Every array's ``nbytes`` (what :func:`ledger` must sum to)."""
    return int(sum(a.nbytes for a in jax.tree.leaves(cache)))


def describe(cache: PagedKVCache) -> dict[str, Any]:
    """Static geometry as plain JSON (serving reports)."""
    return {"layout_version": LAYOUT_VERSION, "page_size": cache.page_size, "num_pages": cache.num_pages,
            "max_pages": cache.max_pages, "row_offset": cache.row_offset, "batch": cache.batch,
            "capacity": cache.capacity}
