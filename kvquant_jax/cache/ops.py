"""State operations on a whole :class:`KVCache`: append, publish, fork, reorder, truncate, resize, decode, validate.

All operations are pure: they return a new ``KVCache`` and never modify their argument (JAX arrays are immutable),
so "atomic publication" is simply "the caller keeps the old value until the new one is complete" (0x05D, 0x0CA).

append
    :func:`append` (eager) checks capacity and that every valid new K/V row of every layer is finite, raising
    ``ValueError`` naming the layer and tensor BEFORE anything is computed; then it runs the jitted core and
    raises if a quantizer rejected a row (e.g. a stored qparam would overflow fp16).  :func:`try_append` is the
    jit-able form: it returns ``(cache, ok)`` and publishes the new lengths only if ``ok`` (all layers, all
    sequences).  A rejected step leaves a cache *logically equal* to the old one even when its buffers were
    donated: a one-row append writes only slots invisible at the old lengths (interface.py), and for multi-row
    appends :func:`publish` restores the schemes' ``ring_fields`` (the only slots such an append may reuse).
fork / reorder
    gather along the batch axis: codes, qparams, residual rings and lengths move together; fields declared
    ``unbatched_fields`` (FP8 layer scales) are shared.  :func:`fork` (eager) raises for an index outside
    ``[0, batch)`` or a non-integer index array; :func:`try_fork` is the jit-able form: it clamps the indices into
    range and returns ``(cache, ok)`` like :func:`try_append`.  A child's later append produces its own arrays, so forks
    are independent (copy-on-write for free).
truncate
    lowers ``lengths``; every frontier is re-derived from them, so stale rows beyond the new length (or beyond a
    re-derived quantized frontier) are invisible.  The result must equal a fresh cache built by appending the same
    first ``new_length`` rows.  For schemes that store every row on its own (full, fp8, per_token, qserve) and for
    KIVI truncations inside the current residual window that is just the length update.  When the shorter length
    needs full-precision rows the cache no longer holds (KIVI: a closed K chunk, or V rows that left the rolling
    tail), exactness is impossible from codes: :func:`truncate` raises :class:`TruncationNeedsRowsError` unless the
    caller passes the original rows for positions ``[rebuild_start, new_length)`` (``rows=``); they are written
    back into the residual rings.  Use :func:`rebuild_start` to ask which rows are needed.  (With JAX's immutable
    values the cheapest exact "undo" is often to keep the pre-append cache value and re-append accepted rows.)
release
    drop the last reference to the ``KVCache`` value.  XLA frees a buffer when no live ``jax.Array`` refers to it;
    arrays shared by forks stay alive while any child holds them.  ``jax.Array.delete()`` frees eagerly, but only
    when no other cache shares the buffer (forks made by gathers own their buffers; ``resize``/``fork`` never
    alias the parent).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache._rows import host
from kvquant_jax.cache.interface import KVCache, check_room, init_cache
from kvquant_jax.quant.tracing import is_tracer


class TruncationNeedsRowsError(ValueError):
    """A truncation whose exact result needs full-precision rows that only exist as codes now.

    Attributes:
      start: int ``[B]`` first position whose original row must be given (``== new_lengths`` where none).
      new_lengths: int ``[B]``.
      layers: tuple of layer indices that need rows.
    """

    def __init__(self, start, new_lengths, layers):
        self.start, self.new_lengths, self.layers = start, new_lengths, tuple(layers)
        seqs = [f"sequence {b}: rows [{int(start[b])}, {int(new_lengths[b])})"
                for b in range(len(start)) if start[b] < new_lengths[b]]
        super().__init__(
            "truncate: the shorter cache would hold these positions in full precision, but the cache only has "
            f"their quantized codes ({'; '.join(seqs)}; layers {list(self.layers)}). A closed KIVI K chunk or a V "
            "row that left the rolling tail cannot be reopened exactly. Pass rows=[(k, v) per layer] with the "
            "original rows from rebuild_start(cache, new_lengths), or keep the pre-append cache value instead.")


# --------------------------------------------------------------------------------------------------------------
# argument plumbing
# --------------------------------------------------------------------------------------------------------------
def _as_num_new(cache: KVCache, num_new) -> jax.Array:
    n = jnp.asarray(num_new, jnp.int32)
    return jnp.broadcast_to(n, (cache.batch,)) if n.ndim == 0 else n


def _layer_pairs(cache: KVCache, layer_kv, what: str) -> list:
    pairs = list(layer_kv)
    if len(pairs) != cache.num_layers:
        raise ValueError(f"{what}: got K/V for {len(pairs)} layers, the cache has {cache.num_layers}")
    shape = None
    for i, pair in enumerate(pairs):
        if len(pair) != 2:
            raise ValueError(f"{what}: layer {i} must be a (k, v) pair")
        for name, x in zip("KV", pair):
            s = tuple(jnp.shape(x))
            if len(s) != 4 or s[0] != cache.batch or (cache.num_kv_heads and s[2] != cache.num_kv_heads) or (
                    cache.head_dim and s[3] != cache.head_dim):
                raise ValueError(f"{what}: layer {i} {name} has shape {s}, expected [B={cache.batch}, T, "
                                 f"Hkv={cache.num_kv_heads or '?'}, D={cache.head_dim or '?'}]")
            if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                raise ValueError(f"{what}: layer {i} {name} must be floating, got {jnp.result_type(x)}")
            if shape is None:
                shape = s
            elif s != shape:
                raise ValueError(f"{what}: layer {i} {name} has shape {s}, layer 0 K has {shape}")
    return pairs


def _stack_group(pairs, first: int, n: int):
    ks = jnp.stack([jnp.asarray(pairs[i][0]) for i in range(first, first + n)])
    vs = jnp.stack([jnp.asarray(pairs[i][1]) for i in range(first, first + n)])
    return ks, vs


# --------------------------------------------------------------------------------------------------------------
# append / publish
# --------------------------------------------------------------------------------------------------------------
def _append_core(cache: KVCache, pairs, num_new):
    """New group states (unpublished) and ``ok [L, B]`` per layer and sequence."""
    groups, oks = [], []
    for (scheme, first, n), st in zip(cache.schemes, cache.groups):
        ks, vs = _stack_group(pairs, first, n)
        new, ok = jax.vmap(scheme.append_layer_with_status, in_axes=(0, None, 0, 0, None))(
            st, cache.lengths, ks, vs, num_new)
        groups.append(new)
        oks.append(ok)
    room = cache.lengths + num_new <= cache.capacity
    return tuple(groups), jnp.concatenate(oks, axis=0) & room[None, :]


def publish(cache: KVCache, new_groups: tuple, num_new: jax.Array, ok: jax.Array, *, multi_row: bool) -> KVCache:
    """The successor of ``cache`` after an append that produced ``new_groups``: lengths advance iff ``ok``.

    ``multi_row`` (static: the append carried more than one row per sequence): a rejected multi-row append may have
    overwritten live residual-ring slots, so those fields (``scheme.ring_fields``) fall back to the old arrays;
    one-row appends need no fallback (they only touch invisible slots), so decode stays copy-free under donation.
    """
    ok = jnp.asarray(ok, jnp.bool_)
    groups = []
    for (scheme, _, _), old, new in zip(cache.schemes, cache.groups, new_groups):
        if multi_row and scheme.ring_fields:
            new = new.replace(**{f: jnp.where(ok, getattr(new, f), getattr(old, f)) for f in scheme.ring_fields})
        groups.append(new)
    lengths = jnp.where(ok, cache.lengths + num_new, cache.lengths)
    return cache.replace(groups=tuple(groups), lengths=lengths)


def try_append(cache: KVCache, layer_kv: Sequence, num_new) -> tuple[KVCache, jax.Array]:
    """Jit-able append of rows for every layer: returns ``(cache', ok)``.

    Args:
      layer_kv: sequence over layers of ``(k, v)``, each float ``[B, T, Hkv, D]`` (keys in the schema's stage).
      num_new: int or int32 ``[B]`` in ``[0, T]``: rows ``t < num_new[b]`` are real, the rest padding.
    ``ok`` (bool scalar) is False when any valid row of any layer is non-finite or unencodable, or a sequence would
    exceed the capacity; then ``cache'`` has the old lengths and is logically the old cache.
    """
    pairs = _layer_pairs(cache, layer_kv, "try_append")
    t = int(jnp.shape(pairs[0][0])[1])
    num_new = _as_num_new(cache, num_new)
    groups, ok_lb = _append_core(cache, pairs, num_new)
    ok = jnp.all(ok_lb)
    return publish(cache, groups, num_new, ok, multi_row=t > 1), ok


#: ``jax.jit(try_append)``: one compiled function per cache structure and row count, shared by :func:`append`.
try_append_jit = jax.jit(try_append)


def append(cache: KVCache, layer_kv: Sequence, num_new) -> KVCache:
    """Eager append for all layers (prefill many rows or decode one): returns the new cache whole, or raises.

    Raises ``ValueError`` -- before anything is computed -- for a capacity overflow, a bad shape, or a non-finite
    valid row (naming the layer and tensor); and after the jitted core (whose result is then dropped) when a
    quantizer rejected a finite row.  The argument cache is never modified.  Under ``jit`` use :func:`try_append`.
    """
    if is_tracer((cache, layer_kv, num_new)):
        raise TypeError("ops.append raises on bad input and cannot run under jit; use ops.try_append there")
    pairs = _layer_pairs(cache, layer_kv, "append")
    t = int(np.shape(pairs[0][0])[1])
    n = np.broadcast_to(np.asarray(num_new, np.int64), (cache.batch,))
    if (n < 0).any() or (n > t).any():
        raise ValueError(f"append: num_new must lie in [0, {t}], got {n.tolist()}")
    check_room(cache, n)
    valid = np.arange(t)[None, :] < n[:, None]
    for i, (k, v) in enumerate(pairs):
        for name, x in (("K", k), ("V", v)):
            fin = np.isfinite(np.asarray(x, np.float32)).all(axis=(2, 3))
            bad = valid & ~fin
            if bad.any():
                b, row = (int(z) for z in np.argwhere(bad)[0])
                raise ValueError(f"append: layer {i} {name} has non-finite values (sequence {b}, new row {row}); "
                                 "nothing was appended")
    pairs = tuple((jnp.asarray(k), jnp.asarray(v)) for k, v in pairs)
    num = jnp.asarray(n, jnp.int32)
    new, ok = try_append_jit(cache, pairs, num)
    if not bool(ok):
        ok_lb = host(_append_core(cache, pairs, num)[1])          # diagnostics only (rare path, eager)
        layer, b = (int(z) for z in np.argwhere(~ok_lb)[0])
        raise ValueError(f"append: layer {layer} sequence {b}: a finite row could not be encoded by "
                         f"{type(cache.scheme_for_layer(layer)).__name__} (a stored qparam or residual value "
                         "overflows its dtype); nothing was appended")
    return new


# --------------------------------------------------------------------------------------------------------------
# fork / reorder / resize
# --------------------------------------------------------------------------------------------------------------
def _gather_batch(scheme, state, index):
    fields = {}
    for f in dataclasses.fields(state):
        a = getattr(state, f.name)
        fields[f.name] = a if f.name in scheme.unbatched_fields else jnp.take(a, index, axis=1)
    return state.replace(**fields)


def _parent_index(cache: KVCache, parent_index_per_child, what: str) -> jax.Array:
    """int32 ``[N]`` of an integer index array; a float / bool dtype (static, even under jit) raises."""
    dt = jnp.result_type(parent_index_per_child) if is_tracer(parent_index_per_child) else \
        np.asarray(parent_index_per_child).dtype
    shape = tuple(np.shape(parent_index_per_child))
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{what}: parent_index_per_child must be a non-empty 1-D index array, got shape {shape}")
    if not jnp.issubdtype(dt, jnp.integer):
        raise TypeError(f"{what}: parent indices must be integers, got dtype {dt} (a float index would be "
                        "truncated silently)")
    return jnp.asarray(parent_index_per_child, jnp.int32)


def fork(cache: KVCache, parent_index_per_child) -> KVCache:
    """A cache whose sequence ``c`` is a copy of sequence ``parent_index_per_child[c]`` (eager).

    The batch size becomes ``len(parent_index_per_child)``.  Codes, qparams, residual rings and lengths move
    together; the parent is untouched and later appends to either side are independent.  Raises ``ValueError``
    for an index outside ``[0, batch)`` and ``TypeError`` for a non-integer index array.  Under ``jit`` use
    :func:`try_fork` (as :func:`append` / :func:`try_append`).
    """
    if is_tracer((cache, parent_index_per_child)):
        raise TypeError("ops.fork raises on bad indices and cannot run under jit; use ops.try_fork there")
    idx = _parent_index(cache, parent_index_per_child, "fork")
    h = host(idx)
    if (h < 0).any() or (h >= cache.batch).any():
        raise ValueError(f"fork: parent indices {np.asarray(parent_index_per_child).tolist()} out of range "
                         f"[0, {cache.batch})")
    return _fork_jit(cache, idx)


def try_fork(cache: KVCache, parent_index_per_child) -> tuple[KVCache, jax.Array]:
    """Jit-able :func:`fork`: ``(cache', ok)``.  Indices are clamped into ``[0, batch)`` (so every length of
    ``cache'`` is a real parent's and ``validate`` holds) and ``ok`` (bool scalar) is False when any index was
    out of range, as ``try_append``'s ``ok``: the caller must check it.  A float / bool index dtype raises
    ``TypeError`` at trace time."""
    idx = _parent_index(cache, parent_index_per_child, "try_fork")
    ok = jnp.all((idx >= 0) & (idx < cache.batch))
    return _fork_jit(cache, jnp.clip(idx, 0, cache.batch - 1)), ok


@jax.jit
def _fork_jit(cache: KVCache, idx: jax.Array) -> KVCache:
    groups = tuple(_gather_batch(s, st, idx) for (s, _, _), st in zip(cache.schemes, cache.groups))
    return cache.replace(groups=groups, lengths=jnp.take(cache.lengths, idx))


def reorder(cache: KVCache, beam_order) -> KVCache:
    """Beam reorder: sequence ``b`` of the result is sequence ``beam_order[b]`` (repeats allowed, as in beam
    search); the batch size is unchanged.  Same data movement and checks as :func:`fork` (eager; under ``jit``
    use :func:`try_reorder`)."""
    if int(np.shape(beam_order)[0]) != cache.batch:
        raise ValueError(f"reorder: beam_order has {np.shape(beam_order)[0]} entries for batch {cache.batch}")
    return fork(cache, beam_order)


def try_reorder(cache: KVCache, beam_order) -> tuple[KVCache, jax.Array]:
    """Jit-able :func:`reorder`: ``(cache', ok)`` with :func:`try_fork`'s clamp-and-flag."""
    if int(np.shape(beam_order)[0]) != cache.batch:
        raise ValueError(f"try_reorder: beam_order has {np.shape(beam_order)[0]} entries for batch {cache.batch}")
    return try_fork(cache, beam_order)


def resize(cache: KVCache, capacity: int) -> KVCache:
    """The same cache with another static capacity (e.g. a short prefix cache grown for a request).

    Every capacity-dependent axis (code rows, per-row qparams, K group rows) is copied into a fresh allocation;
    rings and unbatched fields keep their shapes.  Shrinking below a committed length raises.
    """
    lengths = host(cache.lengths)
    if capacity < 1 or (lengths > capacity).any():
        raise ValueError(f"resize: capacity {capacity} is below a committed length {int(lengths.max())}")
    fresh = init_cache(cache.per_layer_schemes, num_layers=cache.num_layers, batch=cache.batch, capacity=capacity,
                       num_kv_heads=cache.num_kv_heads, head_dim=cache.head_dim)

    def copy(old, new):
        if old.shape == new.shape:
            return old
        region = tuple(slice(0, min(a, b)) for a, b in zip(old.shape, new.shape))
        return new.at[region].set(old[region])

    groups = jax.tree.map(copy, cache.groups, fresh.groups)
    return fresh.replace(groups=groups, lengths=cache.lengths)


# --------------------------------------------------------------------------------------------------------------
# truncate
# --------------------------------------------------------------------------------------------------------------
def rebuild_start(cache: KVCache, new_lengths) -> np.ndarray:
    """int64 ``[B]``: the first position whose ORIGINAL K/V row :func:`truncate` needs (``== new_lengths`` where
    the held state suffices).  Host-side."""
    old = host(cache.lengths).astype(np.int64)
    new = np.broadcast_to(np.asarray(new_lengths, np.int64), old.shape).copy()
    start = new.copy()
    for scheme, _, _ in cache.schemes:
        start = np.minimum(start, np.asarray(scheme.rebuild_start(old, new), np.int64))
    return start


@jax.jit
def _restore_jit(cache, new_lengths, pairs, start):
    groups = []
    for (scheme, first, n), st in zip(cache.schemes, cache.groups):
        ks, vs = _stack_group(pairs, first, n)
        groups.append(jax.vmap(scheme.restore_rows_layer, in_axes=(0, None, 0, 0, None))(
            st, new_lengths, ks, vs, start))
    return cache.replace(groups=tuple(groups), lengths=new_lengths)


def truncate(cache: KVCache, new_lengths, *, rows: Sequence | None = None) -> KVCache:
    """Cut sequence ``b`` back to ``new_lengths[b]`` rows (host-side checks; equal to a fresh build of those rows).

    Args:
      new_lengths: int or int ``[B]``, each in ``[0, lengths[b]]``.
      rows: only needed when :func:`rebuild_start` is below ``new_lengths`` for some sequence: a sequence over
        layers of ``(k, v)`` float ``[B, T_r, Hkv, D]`` where row ``t`` of sequence ``b`` is the ORIGINAL row of
        position ``rebuild_start[b] + t`` (``T_r >= max(new_lengths - rebuild_start)``; rows past a sequence's
        need are ignored).
    Raises:
      ValueError: a length outside ``[0, lengths]``, or bad / non-finite rows.
      TruncationNeedsRowsError: rows are needed and ``rows`` is None.
    """
    old = host(cache.lengths).astype(np.int64)
    new = np.broadcast_to(np.asarray(new_lengths, np.int64), old.shape).copy()
    if (new < 0).any() or (new > old).any():
        raise ValueError(f"truncate: new lengths {new.tolist()} must lie in [0, lengths={old.tolist()}]")
    start = rebuild_start(cache, new)
    new_j = jnp.asarray(new, jnp.int32)
    if not (start < new).any():
        return cache.replace(lengths=new_j)
    if rows is None:
        layers = [layer for scheme, first, n in cache.schemes
                  if (np.asarray(scheme.rebuild_start(old, new)) < new).any() for layer in range(first, first + n)]
        raise TruncationNeedsRowsError(start, new, layers)
    pairs = _layer_pairs(cache, rows, "truncate rows")
    t_r = int(np.shape(pairs[0][0])[1])
    if t_r < int((new - start).max()):
        raise ValueError(f"truncate: rows hold {t_r} positions per sequence, need {int((new - start).max())}")
    valid = np.arange(t_r)[None, :] < (new - start)[:, None]
    for i, (k, v) in enumerate(pairs):
        for name, x in (("K", k), ("V", v)):
            if (valid & ~np.isfinite(np.asarray(x, np.float32)).all(axis=(2, 3))).any():
                raise ValueError(f"truncate: rebuild rows of layer {i} {name} are not finite")
    pairs = tuple((jnp.asarray(k), jnp.asarray(v)) for k, v in pairs)
    return _restore_jit(cache, new_j, pairs, jnp.asarray(start, jnp.int32))


# --------------------------------------------------------------------------------------------------------------
# reference decode and validation
# --------------------------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _materialize(scheme, group_state, index, lengths):
    st = jax.tree.map(lambda a: a[index], group_state)
    return scheme.materialize_layer(st, lengths)


def decode_reference(cache: KVCache, layer: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dequantized ``(k, v, valid)`` of one layer: float32 ``[B, Hkv, C, D]`` twice and bool ``[B, C]``
    (rows at or past ``lengths`` are zero and invalid; keys in the schema's stored stage).  The oracle's view."""
    for g, (scheme, first, n) in enumerate(cache.schemes):
        if first <= layer < first + n:
            return _materialize(scheme, cache.groups[g], np.int32(layer - first), cache.lengths)
    raise IndexError(f"layer {layer} out of range [0, {cache.num_layers})")


@jax.jit
def decode_all(cache: KVCache) -> tuple:
    """:func:`decode_reference` of every layer in one call: a tuple over layers of ``(k, v, valid)``."""
    out = []
    for (scheme, _, n), st in zip(cache.schemes, cache.groups):
        k, v, valid = jax.vmap(scheme.materialize_layer, in_axes=(0, None))(st, cache.lengths)
        out += [(k[i], v[i], valid[i]) for i in range(n)]
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _layout(per_layer: tuple, batch: int, capacity: int, num_kv_heads: int, head_dim: int):
    want = jax.eval_shape(lambda: init_cache(per_layer, num_layers=len(per_layer), batch=batch, capacity=capacity,
                                             num_kv_heads=num_kv_heads, head_dim=head_dim))
    leaves, treedef = jax.tree.flatten(want.groups)
    return treedef, tuple((tuple(a.shape), np.dtype(a.dtype)) for a in leaves)


def validate(cache: KVCache) -> None:
    """Check every invariant of ``cache`` on the host; raise ``ValueError`` naming the first broken one.

    Structure (runs cover the layers, one stacked state per run, every array's shape and dtype equal to a fresh
    allocation's), lengths (int32 ``[B]`` in ``[0, capacity]``) and each layer's scheme invariants (visible codes
    in range, visible scales finite positive normal, visible residual rows finite, ring spans fit their rings).
    """
    lengths = cache.lengths
    if lengths.dtype != jnp.int32 or lengths.ndim != 1:
        raise ValueError(f"validate: lengths must be int32 [B], got {lengths.dtype} {lengths.shape}")
    lh = host(lengths)
    if (lh < 0).any() or (lh > cache.capacity).any():
        raise ValueError(f"validate: lengths {lh.tolist()} outside [0, capacity={cache.capacity}]")
    expect_first = 0
    for scheme, first, n in cache.schemes:
        if first != expect_first or n < 1:
            raise ValueError(f"validate: layer runs are not contiguous at layer {first}")
        expect_first = first + n
    if len(cache.groups) != len(cache.schemes):
        raise ValueError(f"validate: {len(cache.groups)} stacked states for {len(cache.schemes)} layer runs")
    if cache.num_kv_heads and cache.head_dim:
        treedef, want = _layout(cache.per_layer_schemes, cache.batch, cache.capacity, cache.num_kv_heads,
                                cache.head_dim)
        got_leaves, got_def = jax.tree.flatten(cache.groups)
        if got_def != treedef:
            raise ValueError("validate: state structure differs from the schemes' layout")
        for g, (shape, dtype) in zip(got_leaves, want):
            if tuple(g.shape) != shape or np.dtype(g.dtype) != dtype:
                raise ValueError(f"validate: array {g.shape} {g.dtype} where the layout has {shape} {dtype}")
    groups = jax.device_get(cache.groups)
    for (scheme, first, n), gstate in zip(cache.schemes, groups):
        for i in range(n):
            st = jax.tree.map(lambda a, i=i: np.asarray(a)[i], gstate)
            try:
                scheme.validate_layer(st, lh)
            except ValueError as e:
                raise ValueError(f"validate: layer {first + i}: {e}") from None
