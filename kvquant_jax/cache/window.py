"""Sliding-window cache: a local (sliding-window) layer keeps only the rows its window can still see, under any
scheme.

A query at position ``p`` of a local layer with window ``W`` attends keys ``p - W < s <= p`` (transformers'
convention).  The next forward starts at the committed length ``L``, so the history it can read is positions
``[L - W + 1, L)``; older rows are dead.  :class:`WindowScheme` wraps any body scheme and keeps a ring of
``nb = W / block + 1`` body states ("blocks") of ``block`` rows each:

* position ``p`` belongs to chunk ``c = p // block``, stored in block ``c % nb`` at body row ``p - c * block``;
* at committed length ``L`` block ``j`` holds chunk ``c_j(L)``, the largest ``c <= (L - 1) // block`` with
  ``c % nb == j`` (none when ``(L - 1) // block < j``), with local length ``clip(L - c_j * block, 0, block)``: the
  body scheme sees its own committed length, so its frontiers (KIVI's closed groups and rings, FP8 warm-up...) are
  functions of ``lengths`` as everywhere else, and codes / qparams / residual rows of evicted positions are simply
  overwritten when their block starts a new chunk (body length 0);
* the last ``nb`` chunks are retained: at least the ``W`` newest rows, at most ``W + block`` (the ledger counts
  exactly the retained rows of each block, :meth:`WindowScheme.ledger_layer`).

Shared (layer-wide) state is stored once and observed once per append.  The body's ``unbatched_fields`` (no
batch axis, and checked here to have no row axis either: FP8 / static-INT scales, KVQuant's calibration) are one
value per LAYER, not per block: every append first asks the body to update them from the layer's committed
lengths and all the appended rows (:meth:`~kvquant_jax.cache.interface.CacheScheme.observe_shared`, where the body
decides whether the layer is warm: FP8 ``scales="warmup"`` observes its scales iff the layer holds no row), then
appends each block's rows with them as given (``append_observed_with_status``, at the block's local length).  So the
warm-up scales of the first append into the layer (the prefill) serve every block for the rest of the sequence's
life, exactly as without the window (the retained rows' codes equal the unwindowed cache's bit for bit), and a
truncation to length 0 (or a fresh cache) warms up again.

The layer state is flat: ``shared__{field}`` once for every shared field, ``blk{j}__{field}`` for every other field
of the body state, so fork / reorder / publish / validate / serialization work unchanged (the shared fields are the
window's ``unbatched_fields``; the schema records them in ``extra.window_shared``, so an artifact of the per-block
layout is refused). Every field is a ring field: a multi-row append may restart blocks whose rows the old length
still exposes, so a rejected prefill restores the whole state (``ops.publish``) and a multi-row append is never read
in place (``append_keeps_old_view``). A one-row append at ``L`` restarts at most the block of the oldest chunk,
whose rows are all ``<= L - W``: invisible to the query at ``L``.

Reads: ``materialize_layer`` returns the ``nb * block`` ring rows in block order with ``valid`` exactly the window
view ``[L - W + 1, L)`` (other rows zero); :meth:`WindowScheme.row_positions` gives each row's position (the model
masks the window per query with it).  ``decode_regions`` returns one region per block restricted to the window
(a body with a single row-indexed region keeps its in-place layout; others are materialized per block).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvquant_jax.abi.regions import dense_operand, region
from kvquant_jax.cache.interface import CacheScheme, rows_finite

_STATE_CLASSES: dict[tuple[type, int], type] = {}
_SEP = "__"


def windowed_state_class(body_cls: type, blocks: int, shared: tuple[str, ...] = ()) -> type:
    """The flat layer-state class: ``shared__{name}`` once for each name in ``shared`` (the body's layer-wide
    fields) and ``blk{j}__{name}`` for every other field of ``body_cls``, ``j < blocks``."""
    key = (body_cls, blocks, tuple(shared))
    if key in _STATE_CLASSES:
        return _STATE_CLASSES[key]
    fields = dataclasses.fields(body_cls)
    if any(not f.metadata.get("pytree_node", True) for f in fields):
        raise TypeError(f"{body_cls.__name__} has static fields; a window body state must be all arrays")
    names = tuple(f.name for f in fields)
    if not set(shared) <= set(names):
        raise TypeError(f"{body_cls.__name__} has no fields {sorted(set(shared) - set(names))}")
    per_block = tuple(n for n in names if n not in shared)
    flat = tuple(_shared_name(n) for n in shared) + tuple(_block_name(j, n) for j in range(blocks) for n in per_block)
    name = f"Windowed{blocks}{body_cls.__name__}"
    cls = struct.dataclass(type(name, (), {"__annotations__": {n: jax.Array for n in flat}, "__module__": __name__,
                                           "__qualname__": name,
                                           "__doc__": f"{blocks} ring blocks of {body_cls.__name__} "
                                                      f"(shared once: {', '.join(shared) or 'none'})."}))
    cls.body_class, cls.body_fields, cls.blocks = body_cls, names, blocks
    cls.shared_fields, cls.block_fields = tuple(shared), per_block
    _STATE_CLASSES[key] = cls
    return cls


def _shared_name(name: str) -> str:
    return f"shared{_SEP}{name}"


def _block_name(j: int, name: str) -> str:
    return f"blk{j}{_SEP}{name}"


def shared_of(state) -> dict:
    """``{body field: array}``: the layer-wide fields of a windowed ``state`` (stored once)."""
    return {n: getattr(state, _shared_name(n)) for n in type(state).shared_fields}


def split_blocks(state) -> list:
    """The body states of the ring blocks, in block order, each carrying the layer's shared fields."""
    cls = type(state)
    shared = shared_of(state)
    return [cls.body_class(**shared, **{n: getattr(state, _block_name(j, n)) for n in cls.block_fields})
            for j in range(cls.blocks)]


def join_blocks(blocks: list, shared: dict):
    """The flat state of body states ``blocks`` (their per-block fields) and the layer's ``shared`` fields
    (``{body field: array}``; the blocks' own copies of them are ignored)."""
    cls = windowed_state_class(type(blocks[0]), len(blocks), tuple(shared))
    return cls(**{_shared_name(n): a for n, a in shared.items()},
               **{_block_name(j, n): getattr(b, n) for j, b in enumerate(blocks) for n in cls.block_fields})


def chunk_of_block(j: int, lengths, block: int, nb: int, xp=jnp):
    """``(chunk, exists)`` of block ``j`` at committed ``lengths`` (int ``[B]``; jnp or NumPy via ``xp``)."""
    last = xp.floor_divide(lengths - 1, block)
    chunk = j + nb * xp.floor_divide(last - j, nb)
    return chunk, last >= j


def block_length(j: int, lengths, block: int, nb: int, xp=jnp):
    """Committed rows of block ``j`` at ``lengths`` (its body scheme's length)."""
    chunk, exists = chunk_of_block(j, lengths, block, nb, xp)
    return xp.where(exists, xp.clip(lengths - chunk * block, 0, block), 0)


@dataclasses.dataclass(frozen=True)
class WindowScheme(CacheScheme):
    """Keep the last ``window`` rows of a sliding-window layer in a ring of ``body`` blocks (module doc).

    Attributes:
      body: any non-window scheme (full, fp8, per_token, kivi, qserve, static_int ...).
      window: W >= 1, the layer's attention window (must equal the model's: the model checks).
      block: rows per ring block (divides ``window``; default ``window // 4``, or ``window`` when that does not
        divide); ``window / block + 1`` blocks are kept.
    """

    family: ClassVar[str] = "window"
    presets: ClassVar[dict] = {"window": {"body": "fp32", "window": 512}}
    aliases: ClassVar[dict] = {}
    nested_fields: ClassVar[tuple] = ("body",)

    body: CacheScheme
    window: int
    block: int = 0

    def __post_init__(self):
        if not isinstance(self.body, CacheScheme) or isinstance(self.body, WindowScheme) or \
                self.body.family == "prefix":
            raise TypeError("WindowScheme: body must be a CacheScheme that is neither a window nor a prefix scheme")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"WindowScheme: window must be a positive int, got {self.window!r}")
        if self.block == 0:
            object.__setattr__(self, "block", self.window // 4 if self.window % 4 == 0 else self.window)
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1 or \
                self.window % self.block:
            raise ValueError(f"WindowScheme: block must be a positive int dividing window {self.window}, "
                             f"got {self.block!r}")

    @property
    def num_blocks(self) -> int:
        return self.window // self.block + 1

    @property
    def ring_rows(self) -> int:
        return self.num_blocks * self.block

    # identity fields of the body are the cache's
    def __getattr__(self, name):
        if name in ("rope_theta", "rope_pairing", "key_stage", "kernel_family", "model_id", "tokenizer_hash"):
            return getattr(self.body, name)
        raise AttributeError(name)

    @property
    def shared_fields(self) -> tuple[str, ...]:
        """The body's layer-wide fields (its ``unbatched_fields``), stored once as ``shared__{name}``."""
        return _body_layout(self.body, self.block)[1]

    def _flat(self, names) -> tuple:
        """Flat state names of body fields ``names``: once if shared, else one per block."""
        shared = self.shared_fields
        return tuple(_shared_name(n) for n in names if n in shared) + \
            tuple(_block_name(j, n) for j in range(self.num_blocks) for n in names if n not in shared)

    @property
    def unbatched_fields(self):  # type: ignore[override]
        return self._flat(self.shared_fields)

    @property
    def ring_fields(self):  # type: ignore[override]
        return self._flat(_body_layout(self.body, self.block)[0])

    @property
    def rotates_stored_keys(self):  # type: ignore[override]
        return self.body.rotates_stored_keys

    def append_keeps_old_view(self, num_rows: int) -> bool:
        return num_rows == 1 and self.body.append_keeps_old_view(1)

    @property
    def schema(self):
        bs = self.body.schema
        extra = dict(bs.extra)
        extra.update(window=self.window, window_block=self.block, window_blocks=self.num_blocks)
        if self.shared_fields:           # stored once per layer; absent when no field is shared (same layout)
            extra.update(window_shared=",".join(self.shared_fields))
        return dataclasses.replace(bs, extra=tuple(sorted((k, str(v)) for k, v in extra.items())))

    def config(self) -> dict[str, Any]:
        return {"family": self.family, "body": self.body.config(), "window": self.window, "block": self.block}

    # ----- state -----
    def init_layer(self, batch, capacity, num_kv_heads, head_dim):
        del capacity                      # the ring's size is the window's, whatever the cache's capacity
        one = self.body.init_layer(batch, self.block, num_kv_heads, head_dim)
        return join_blocks([one] * self.num_blocks, {n: getattr(one, n) for n in self.shared_fields})

    def block_lengths(self, lengths) -> list:
        return [block_length(j, lengths, self.block, self.num_blocks) for j in range(self.num_blocks)]

    def row_positions(self, lengths) -> jax.Array:
        """int32 ``[B, nb * block]``: the position held by each ring row (-1 for a block holding nothing)."""
        cols = []
        for j in range(self.num_blocks):
            chunk, exists = chunk_of_block(j, lengths, self.block, self.num_blocks)
            pos = chunk[:, None] * self.block + jnp.arange(self.block, dtype=jnp.int32)[None, :]
            cols.append(jnp.where(exists[:, None], pos, -1))
        return jnp.concatenate(cols, axis=1).astype(jnp.int32)

    def window_valid(self, lengths) -> jax.Array:
        """bool ``[B, nb * block]``: ring rows inside the window view ``[L - W + 1, L)`` at committed ``lengths``."""
        pos = self.row_positions(lengths)
        return (pos >= 0) & (pos < lengths[:, None]) & (pos > lengths[:, None] - self.window)

    def observe_shared(self, state, lengths, k, v, num_new):
        """The body observes the layer's shared fields from the layer's ``lengths`` and every appended row."""
        shared = self._observed(state, lengths, k, v, num_new)
        return state.replace(**{_shared_name(n): a for n, a in shared.items()})

    def _observed(self, state, lengths, k, v, num_new) -> dict:
        """``{body field: array}``: the shared fields after the body's :meth:`observe_shared` at LAYER level."""
        if not self.shared_fields:
            return {}
        seen = self.body.observe_shared(split_blocks(state)[0], lengths, k, v, num_new)
        return {n: getattr(seen, n) for n in self.shared_fields}

    def append_layer_with_status(self, state, lengths, k, v, num_new):
        """Observe the shared fields once for the layer, then append each block's rows (local lengths) with them."""
        return self.append_observed_with_status(self.observe_shared(state, lengths, k, v, num_new), lengths, k, v,
                                                num_new)

    def append_observed_with_status(self, state, lengths, k, v, num_new):
        """Each block's rows (``k, v [B, T, Hkv, D]`` at the layer's ``lengths``) appended at its local length,
        with the state's shared fields as given (the blocks' outputs of them are dropped)."""
        t = k.shape[1]
        tj = min(t, self.block)
        new_len = lengths + num_new
        out, ok = [], rows_finite(k, v, num_new)
        shared = shared_of(state)
        for j, bst in enumerate(split_blocks(state)):
            c0, e0 = chunk_of_block(j, lengths, self.block, self.num_blocks)
            c1, e1 = chunk_of_block(j, new_len, self.block, self.num_blocks)
            same = e0 & e1 & (c0 == c1)
            base = jnp.where(same, jnp.clip(lengths - c0 * self.block, 0, self.block), 0).astype(jnp.int32)
            first = c1 * self.block + base                                   # first new position of the block
            m = jnp.where(e1, jnp.clip(jnp.minimum(new_len, (c1 + 1) * self.block) - first, 0, tj), 0)
            idx = jnp.clip((first - lengths)[:, None] + jnp.arange(tj, dtype=jnp.int32)[None, :], 0, t - 1)
            kj = jnp.take_along_axis(k, idx[:, :, None, None], axis=1)
            vj = jnp.take_along_axis(v, idx[:, :, None, None], axis=1)
            nb_state, ok_j = self.body.append_observed_with_status(bst, base, kj, vj, m.astype(jnp.int32))
            out.append(nb_state)
            ok = ok & ok_j
        return join_blocks(out, shared), ok

    def append_layer(self, state, lengths, k, v, num_new):
        return self.append_layer_with_status(state, lengths, k, v, num_new)[0]

    def materialize_layer(self, state, lengths):
        ks, vs = [], []
        for bst, bl in zip(split_blocks(state), self.block_lengths(lengths)):
            k, v, _ = self.body.materialize_layer(bst, bl)
            ks.append(k)
            vs.append(v)
        valid = self.window_valid(lengths)
        m = valid[:, None, :, None]
        k = jnp.where(m, jnp.concatenate(ks, axis=2), jnp.float32(0))
        v = jnp.where(m, jnp.concatenate(vs, axis=2), jnp.float32(0))
        return k, v, valid

    def decode_regions(self, state, lengths):
        """One region per block, live rows restricted to the window ``[L - W + 1, L)``.  ``regions[0]`` (what a
        kernel streams) is block 0 in the body's own layout when the body reads as a single row-indexed region;
        the other blocks (and block 0 otherwise) are their materialized float32 rows: the small dense regions of
        the contract (``tail_rows`` counts them)."""
        regions, tail = [], 0
        for j, (bst, bl) in enumerate(zip(split_blocks(state), self.block_lengths(lengths))):
            chunk, _ = chunk_of_block(j, lengths, self.block, self.num_blocks)
            lo = jnp.clip(lengths - self.window + 1 - chunk * self.block, 0, self.block)   # local window start
            body_regions, tail_rows = self.body.decode_regions(bst, bl) if j == 0 else ((), 1)
            if len(body_regions) == 1 and tail_rows == 0:
                r = body_regions[0]
                regions.append(dataclasses.replace(r, start=jnp.maximum(r.start, lo).astype(jnp.int32)))
            else:
                k, v, _ = self.body.materialize_layer(bst, bl)
                regions.append(region(dense_operand(k), dense_operand(v), bl, start=jnp.minimum(lo, bl)))
                tail += self.block if j else 0
        return regions, tail

    def validate_layer(self, state, lengths):
        lh = np.asarray(jax.device_get(lengths))
        for j, bst in enumerate(split_blocks(state)):
            bl = block_length(j, lh, self.block, self.num_blocks, np)
            try:
                self.body.validate_layer(bst, jnp.asarray(bl, jnp.int32))
            except ValueError as e:
                raise ValueError(f"window block {j}: {e}") from None

    def layer_nbytes(self, state):
        """The body's count over every block, the shared fields once (block 0 holds them, the others count them
        as empty arrays of their dtype).  Unstacked or stacked states alike."""
        shared = shared_of(state)
        empty = {n: jnp.zeros((0,), a.dtype) for n, a in shared.items()}
        out: dict[str, int] = {}
        for j, bst in enumerate(split_blocks(state)):
            for cat, n in self.body.layer_nbytes(bst if j == 0 else bst.replace(**empty)).items():
                out[cat] = out.get(cat, 0) + int(n)
        return out

    def field_axes(self, state):
        """The body's axes of each block's fields, the shared fields' once (``state`` may be abstract)."""
        out: dict[str, tuple] = {}
        for j, bst in enumerate(split_blocks(state)):
            for n, ax in self.body.field_axes(bst).items():
                out[_shared_name(n) if n in self.shared_fields else _block_name(j, n)] = ax
        return out

    def retained_rows(self, length: int) -> list[int]:
        """Rows each block holds when every sequence has ``length`` rows (host-side ints)."""
        return [int(block_length(j, np.asarray([length]), self.block, self.num_blocks, np)[0])
                for j in range(self.num_blocks)]

    def ledger_layer(self, batch, heads, head_dim, rows, *, logical, capacity):
        """Physical: every block's allocation (``block`` rows each).  Logical at T rows: each block's body bytes
        at the rows it really retains at T (between min(T, W) and W + block in all).  The shared fields are counted
        once: the body's formula at ``batch=0, rows=0`` (their bytes alone, ``CacheScheme.ledger_layer``) is taken
        off every block and added back once."""
        def body(b, r):
            return self.body.ledger_layer(b, heads, head_dim, r, logical=logical, capacity=self.block)

        shared = body(0, 0)
        out: dict[tuple[str, str], int] = dict(shared)
        per_block = self.retained_rows(rows) if logical else [self.block] * self.num_blocks
        for r in per_block:
            if logical and r == 0:
                continue
            for key, n in body(batch, r).items():
                out[key] = out.get(key, 0) + n - shared.get(key, 0)
        return out

    # ----- truncation -----
    def rebuild_start(self, old_lengths, new_lengths):
        """A block whose chunk at the new length is not the one it holds (evicted since), or whose body needs
        rows for its own truncation, is rebuilt from its chunk's first position."""
        old, new = np.asarray(old_lengths, np.int64), np.asarray(new_lengths, np.int64)
        start = new.copy()
        for j in range(self.num_blocks):
            c_new, e_new = chunk_of_block(j, new, self.block, self.num_blocks, np)
            c_old, e_old = chunk_of_block(j, old, self.block, self.num_blocks, np)
            lo_old = block_length(j, old, self.block, self.num_blocks, np)
            lo_new = block_length(j, new, self.block, self.num_blocks, np)
            body_start = np.asarray(self.body.rebuild_start(lo_old, lo_new), np.int64)
            need = e_new & ((~e_old) | (c_new != c_old) | (body_start < lo_new))
            start = np.where(need, np.minimum(start, c_new * self.block), start)
        return start

    def restore_rows_layer(self, state, new_lengths, k, v, start):
        """Rebuild every block whose chunk starts at or after ``start`` from the given rows (row ``t`` =
        position ``start + t``): a fresh body append of the chunk's rows ``[c * block, new_length)``."""
        t = k.shape[1]
        out, shared = [], shared_of(state)
        for j, bst in enumerate(split_blocks(state)):
            chunk, exists = chunk_of_block(j, new_lengths, self.block, self.num_blocks)
            c0 = chunk * self.block
            rebuild = exists & (c0 >= start)
            n = jnp.where(rebuild, jnp.clip(new_lengths - c0, 0, self.block), 0).astype(jnp.int32)
            tj = min(t, self.block)
            idx = jnp.clip((c0 - start)[:, None] + jnp.arange(tj, dtype=jnp.int32)[None, :], 0, t - 1)
            kj = jnp.take_along_axis(k, idx[:, :, None, None], axis=1)
            vj = jnp.take_along_axis(v, idx[:, :, None, None], axis=1)
            fresh, _ = self.body.append_observed_with_status(bst, jnp.zeros_like(n), kj, vj, n)   # layer's shared
            out.append(bst.replace(**{f: jnp.where(_bcast(rebuild, getattr(fresh, f)), getattr(fresh, f),
                                                   getattr(bst, f)) for f in type(state).block_fields}))
        return join_blocks(out, shared)


@functools.lru_cache(maxsize=None)
def _body_layout(body: CacheScheme, block: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(fields, shared)``: the field names of ``body``'s layer state and its layer-wide ones (from abstract
    allocations at a head_dim it accepts, two batch sizes and two capacities).  ``shared`` is the body's declared
    ``unbatched_fields``; raises ``TypeError`` when one of them grows with the batch or the rows, or a field that
    grows with neither is not declared (the ring could not store it once, or would store it per block)."""
    err = None
    for d in (256, 128, 64, 512, 32, 16, 8):
        try:
            shapes = [jax.eval_shape(lambda b=b, c=c, d=d: body.init_layer(b, c, 1, d))
                      for b, c in ((1, block), (2, block), (1, 2 * block))]
        except ValueError as e:
            err = e
            continue
        names = tuple(f.name for f in dataclasses.fields(shapes[0]))
        fixed = {n for n in names if len({getattr(s, n).shape for s in shapes}) == 1}
        declared = set(body.unbatched_fields)
        if fixed != declared:
            raise TypeError(f"WindowScheme: {type(body).__name__} declares unbatched_fields {sorted(declared)} but "
                            f"its fields without a batch or row axis are {sorted(fixed)}")
        return names, tuple(n for n in names if n in declared)
    raise ValueError(f"WindowScheme: cannot allocate a {block}-row block of {body!r}: {err}")


def _bcast(mask, a):
    return mask.reshape(mask.shape + (1,) * (a.ndim - 1))
