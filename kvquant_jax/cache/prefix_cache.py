"""Prefix cache over a paged KV cache: full pages of a prompt, shared by reference (design notes 0x05E).

An entry holds the pages of positions ``[row_offset, length)`` of one sequence (``length - row_offset`` a multiple
of ``page_size``), one reference per page, and a snapshot of the sequence's per-sequence fields (KIVI's residual
rings, KVQuant's sink rows) at exactly that length.  It is keyed by

* the *content*: token ids and their positions, model hash and tokenizer hash (what the rows were computed
  from), and
* the *schema*: every layer's full :class:`~kvquant_jax.cache.schema.CacheSchema` (precision and code convention,
  K/V axes and group sizes, qparam dtype and order, pre/post-RoPE, RoPE θ/pairing, layout and kernel ABI, model /
  tokenizer ids), the paged layout (version, page size, hidden prefix rows) and the calibration artifact id.

A lookup finds the longest stored prefix with the same content; if its schema differs from the request's, the
lookup is *refused* with :class:`~kvquant_jax.cache.schema.IncompatibleSchemaError` naming every differing field
(two caches of the same prompt are not interchangeable when one stores pre-RoPE per-channel keys and the other
post-RoPE FP8 keys).  A hit is mapped into a slot with :func:`attach` (refcount +1 per page; the slot's first
append copies the partial / unsealed pages it writes).  Hidden prefix rows (IntactKV / PrefixQuant) are positions
``[0, row_offset)``: an entry's ``length`` counts them, so they count in capacity.

All functions are pure: ``(prefix_cache, pool[, cache]) -> new values``.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache import page_pool as pp
from kvquant_jax.cache import paged
from kvquant_jax.cache.paged import SLOT, PagedKVCache
from kvquant_jax.cache.schema import Compatibility, IncompatibleSchemaError, check_compatible


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cache_schema(cache: PagedKVCache, calibration_id: str = "") -> dict[str, Any]:
    """The full schema a prefix entry is keyed by: per-layer ``CacheSchema`` dicts, the paged layout and the
    calibration artifact id (plain JSON)."""
    return {"layers": [s.schema.to_dict() for s in cache.per_layer_schemes],
            "page_layout": {"layout_version": paged.LAYOUT_VERSION, "page_size": cache.page_size,
                            "row_offset": cache.row_offset, "num_kv_heads": cache.num_kv_heads,
                            "head_dim": cache.head_dim},
            "calibration_id": calibration_id}


def _content_hasher(start: int, model_hash: str, tokenizer_hash: str):
    """sha256 state over the content header: what the rows were computed from besides the token ids.  The header
    is JSON (which never contains a NUL byte) then NUL, then the ids follow as little-endian int32: so the input
    parses back uniquely and the key of a longer prefix extends the shorter one's state (:func:`content_keys`)."""
    header = json.dumps({"start": int(start), "model": model_hash, "tokenizer": tokenizer_hash}, sort_keys=True,
                        separators=(",", ":"))
    return hashlib.sha256(header.encode() + b"\0")


def _token_bytes(tokens) -> bytes:
    return np.ascontiguousarray(np.asarray(tokens).reshape(-1), dtype="<i4").tobytes()


def content_key(tokens, start: int, model_hash: str, tokenizer_hash: str) -> str:
    """sha256 of the content: token ids at positions ``start, start + 1, ...`` and the model / tokenizer hashes."""
    h = _content_hasher(start, model_hash, tokenizer_hash)
    h.update(_token_bytes(tokens))
    return h.hexdigest()


def content_keys(tokens, start: int, page_size: int, pages: int, model_hash: str, tokenizer_hash: str) -> list[str]:
    """``[content_key(tokens[:n * page_size], ...) for n in 1 .. pages]`` in one pass over the ids (one running
    sha256, copied at each page boundary): O(length), where keying every page-aligned prefix separately hashes
    O(length^2 / page_size) ids (an 8K prompt in 64-row pages: 128 prefixes; as JSON that was 133 ms per insert
    on the CI CPU, every prefill chunk)."""
    raw = _token_bytes(tokens)
    h, out, step = _content_hasher(start, model_hash, tokenizer_hash), [], 4 * page_size
    for n in range(pages):
        h.update(raw[n * step:(n + 1) * step])
        out.append(h.copy().hexdigest())
    return out


@dataclasses.dataclass(frozen=True)
class PrefixEntry:
    """One stored prefix.

    Attributes:
      key: the full key (sha256 of the content key and the schema's sha256).
      content: the content key (:func:`content_key`).
      length: positions covered (hidden prefix rows included).
      pages: physical page ids of logical pages ``0 .. n-1``.
      slots: per group ``{field: array [L_g, ...]}`` per-sequence state at ``length``.
      schema: :func:`cache_schema` of the cache it came from.
      last_use: a logical clock for LRU eviction.
    """

    key: str
    content: str
    length: int
    pages: tuple
    slots: tuple
    schema: dict
    last_use: int = 0


@dataclasses.dataclass(frozen=True)
class PrefixCache:
    """Entries by content key (immutable mapping as a tuple of pairs) and the clock."""

    entries: tuple = ()
    clock: int = 0

    def as_dict(self) -> dict[str, PrefixEntry]:
        return dict(self.entries)

    def references(self) -> list[int]:
        """Every page reference the entries hold (for ``paged.validate(..., extra_refs=)``)."""
        return [p for _, e in self.entries for p in e.pages]


def _has_slots(cache: PagedKVCache) -> bool:
    return any(f.kind == SLOT for lay in cache.layouts for f in lay)


def insert(pc: PrefixCache, cache: PagedKVCache, pool: pp.PoolState, seq: int, tokens, *, model_hash: str,
           tokenizer_hash: str, calibration_id: str = "") -> tuple[PrefixCache, pp.PoolState]:
    """Store the full pages of sequence ``seq`` (``tokens``: its ids at positions ``row_offset ..
    lengths[seq] - 1``): one entry per page-aligned prefix not stored yet (so a later prompt that shares only the
    first pages hits too), each holding one reference per page.  With per-sequence fields (KIVI rings) only a
    page-aligned CURRENT length can be stored (the snapshot is exact only there).  No-op when nothing fits."""
    length = int(np.asarray(cache.lengths)[seq])
    body = length - cache.row_offset
    toks = np.asarray(tokens).reshape(-1)
    if toks.shape[0] != body:
        raise ValueError(f"prefix insert: {toks.shape[0]} token ids for {body} positions of sequence {seq}")
    full = body // cache.page_size
    if full == 0 or (_has_slots(cache) and body % cache.page_size):
        return pc, pool
    table = np.asarray(cache.page_table)[seq]
    schema = cache_schema(cache, calibration_id)
    schema_digest = _sha(schema)
    keys = content_keys(toks, cache.row_offset, cache.page_size, full, model_hash, tokenizer_hash)
    entries, clock = pc.as_dict(), pc.clock
    for n in ([full] if _has_slots(cache) else range(1, full + 1)):
        content = keys[n - 1]
        if content in entries:
            continue
        pages = tuple(int(p) for p in table[:n])
        pool = pp.incref(pool, pages)
        slots = tuple({f.name: getattr(st, f.name)[:, seq] for f in lay if f.kind == SLOT}
                      for lay, st in zip(cache.layouts, cache.groups))
        entries[content] = PrefixEntry(key=_sha({"content": content, "schema": schema_digest}), content=content,
                                       length=cache.row_offset + n * cache.page_size, pages=pages, slots=slots,
                                       schema=schema, last_use=clock)
        clock += 1
    return PrefixCache(tuple(entries.items()), clock), pool


def schema_differences(have: dict, want: dict) -> Compatibility:
    """Every differing field between two :func:`cache_schema` dicts (``layer{i}.field``, ``page_layout.field``,
    ``calibration_id``)."""
    diffs = []
    la, lb = have["layers"], want["layers"]
    if len(la) != len(lb):
        diffs.append(("num_layers", len(la), len(lb)))
    for i, (a, b) in enumerate(zip(la, lb)):
        diffs += [(f"layer{i}.{f}", x, y) for f, x, y in check_compatible(a, b).differences]
    diffs += [(f"page_layout.{f}", x, y) for f, x, y in check_compatible(have["page_layout"],
                                                                          want["page_layout"]).differences]
    if have["calibration_id"] != want["calibration_id"]:
        diffs.append(("calibration_id", have["calibration_id"], want["calibration_id"]))
    return Compatibility(tuple(diffs))


def lookup(pc: PrefixCache, cache: PagedKVCache, tokens, *, model_hash: str, tokenizer_hash: str,
           calibration_id: str = "", max_tokens: int | None = None) -> PrefixEntry | None:
    """The longest stored prefix of ``tokens`` (ids from position ``row_offset``; at most ``max_tokens`` of them,
    so a request always keeps at least one token to compute), or None.  Raises
    :class:`~kvquant_jax.cache.schema.IncompatibleSchemaError` naming every differing field when the content is
    stored under another schema / calibration / page layout (0x05E)."""
    toks = np.asarray(tokens).reshape(-1)
    limit = toks.shape[0] if max_tokens is None else min(max_tokens, toks.shape[0])
    entries = pc.as_dict()
    if not entries:
        return None
    want = cache_schema(cache, calibration_id)
    keys = content_keys(toks, cache.row_offset, cache.page_size, limit // cache.page_size, model_hash,
                        tokenizer_hash)
    for n in range(limit // cache.page_size, 0, -1):
        e = entries.get(keys[n - 1])
        if e is None:
            continue
        diff = schema_differences(e.schema, want)
        if not diff.ok:
            raise IncompatibleSchemaError("prefix cache hit", diff)
        return e
    return None


@jax.jit
def _put_slots(cache: PagedKVCache, seq, slots, length) -> PagedKVCache:
    groups = []
    for lay, st, snap in zip(cache.layouts, cache.groups, slots):
        groups.append(st.replace(**{f.name: getattr(st, f.name).at[:, seq].set(snap[f.name])
                                    for f in lay if f.kind == SLOT}))
    return cache.replace(groups=tuple(groups), lengths=cache.lengths.at[seq].set(length))


def attach(pc: PrefixCache, cache: PagedKVCache, pool: pp.PoolState, entry: PrefixEntry, seq: int
           ) -> tuple[PrefixCache, PagedKVCache, pp.PoolState]:
    """Map ``entry`` into the empty slot ``seq`` (released: no pages, length ``row_offset``): its pages gain a
    reference, its per-sequence snapshot and length become the slot's.  Raises if the slot holds pages."""
    table = np.array(jax.device_get(cache.page_table))
    if (table[seq] >= 0).any() or int(np.asarray(cache.lengths)[seq]) != cache.row_offset:
        raise ValueError(f"prefix attach: slot {seq} is not empty (release it first)")
    if entry.schema["page_layout"]["page_size"] != cache.page_size:
        raise ValueError("prefix attach: entry from a cache with another page size")
    pool = pp.incref(pool, entry.pages)
    table[seq, : len(entry.pages)] = entry.pages
    cache = cache.replace(page_table=jnp.asarray(table, jnp.int32))
    cache = _put_slots(cache, jnp.int32(seq), entry.slots, jnp.int32(entry.length))
    entries = pc.as_dict()
    entries[entry.content] = dataclasses.replace(entry, last_use=pc.clock)
    return PrefixCache(tuple(entries.items()), pc.clock + 1), cache, pool


def evict(pc: PrefixCache, pool: pp.PoolState, content: str | None = None) -> tuple[PrefixCache, pp.PoolState]:
    """Drop one entry (``content`` key, or the least recently used) and its page references."""
    entries = pc.as_dict()
    if not entries:
        return pc, pool
    if content is None:
        content = min(entries.values(), key=lambda e: e.last_use).content
    e = entries.pop(content)
    return PrefixCache(tuple(entries.items()), pc.clock), pp.decref(pool, e.pages)
