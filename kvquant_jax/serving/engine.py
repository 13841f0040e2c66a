"""Continuous-batching engine over the paged quantized KV cache (``cache/paged.py``).

One :class:`Engine` owns ``num_slots`` sequence slots, a page pool and (optionally) a prefix cache.  Every
:meth:`Engine.step`:

1. **admits** queued requests (FCFS) into free slots while the pool has the pages ``EngineConfig.admission`` asks
   for (prefix-cache hits map stored pages first and need only the rest): ``"optimistic"`` (the default) -- the
   prompt plus one page per running request of headroom, so under load requests outgrow the pool and are
   preempted (step 3); ``"reserve"`` -- the request's prompt + ``max_new_tokens`` plus every page each running
   request still needs to reach its ``max_new_tokens``, so a request is never preempted (fewer in flight; the
   benchmark's policy);
2. **plans** one step: every decoding slot feeds its last sampled token (one ``[num_slots, 1]`` forward; idle
   and prefilling slots feed nothing, ``num_new = 0``) and up to ``prefill_slots`` prefilling slots (admission
   order) feed ``min(chunk, pending)`` prompt tokens (one ``[prefill_slots, chunk]`` forward of those rows);
   static shapes from a bounded, bucketed set (``Engine.compile_shapes``);
3. **reserves** pages (``paged.plan_reserve``: map new pages, copy-on-write shared ones); when the pool runs out it
   evicts least-recently-used prefix-cache entries, then **preempts** the most recently admitted request (its pages
   are released and it re-queues at the front to be *recomputed*: prompt + generated tokens are prefilled again,
   its output continues where it stopped) -- never writing into a page another request holds;
4. runs the step (``begin_step``/``retire_step`` bracket it: pages released while it runs are reclaimed only once
   its outputs are ready): both forwards are dispatched before either is waited for, and their outputs come back
   in one ``jax.device_get``; the page table and lengths are kept on the host (the engine is their only writer:
   ``paged.plan_reserve`` plans on them, every jitted step takes them as its ``host_state`` argument, and
   :attr:`Engine.cache` refreshes the device copies only when read), so planning a step reads nothing from the
   device; it samples every slot's next token with its own sampling parameters (temperature / top-k /
   top-p; a per-request PRNG stream, so results do not depend on batch composition) and **streams** a
   :class:`StreamEvent` per new token; a request stops at its stop tokens (EOS by default; the stop token is not
   emitted, as in ``serving.generate``) or its ``max_new_tokens``.

The forward runs **paged-direct** (``EngineConfig.forward = "direct"``, the default): ``llama.forward`` on an
``attention.paged.PagedStep``, which appends each layer's new rows through a window of the pages the step writes
and attends through the page table (the paged Pallas kernel for decode where the scheme reads its fields in place,
else the view of the step's mapped pages), so no ``[slots, Hkv, max capacity, ...]`` view exists; the step's
static shape is ``(T, view pages, window pages)``, each bucketed to a power of two (a bounded set of compiled
steps).  ``forward = "view"`` keeps the old path (``paged.gather`` -> ``llama.forward`` -> ``paged.scatter`` of
the whole view).  Either way every registry scheme serves and the results equal ``serving.generate`` one request
at a time (same prefill chunking) token for token: ``tests/serving/test_engine.py``; which path served each
scheme and phase is in ``Engine.paths``.

**On a device mesh** (``Engine(..., mesh=)``, default the enclosing ``sharding.mesh_context``): tensor parallel
over KV heads, like vLLM's TP.  The mesh must be ``data=1, model=M`` (a page id is global to the pool, so the
pools are one address space, never split over sequences: run one engine per data replica) with ``M`` dividing the
query heads and dividing the KV heads or exceeding them (then the KV heads are replicated); it is checked before
anything is allocated (``sharding.check_paged_mesh``, a ``ValueError`` naming the sizes).  The weights are placed
Megatron-style (``sharding.place_params``), every page pool ``[L_g, num_pages + 1, Hkv, page rows, ...]`` and
per-sequence field with its KV heads over ``model`` and the page table / lengths replicated
(``sharding.paged_cache_specs``); each step runs under the mesh and each layer appends and attends per device on
its own heads (``PagedStep.layer_step`` -> ``attention.sharded.shard_layer``; the paged kernel, where decode uses
it, reads the device's own pool shard).  Tokens equal the unsharded engine's (``tests/sharding/test_paged_mesh.py``:
the reference attention; the interpreted paged kernel and ``forward="view"`` were checked by hand on CPU, INT8 at
model = 2, not in the tests).

Bad input raises ``ValueError`` at :meth:`Engine.submit`: an empty prompt, a token outside the vocabulary, a
request longer than the model's context or the cache's, a request that needs more pages than the whole pool; a bad
:class:`EngineConfig` (unknown ``forward`` or ``admission``, a size that is not a positive int) raises
``ValueError`` when it is built.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import json
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax import sharding as S
from kvquant_jax.attention import paged as paged_attention
from kvquant_jax.cache import page_pool as pp
from kvquant_jax.cache import paged
from kvquant_jax.cache import prefix_cache as pcache
from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.llama import forward
from kvquant_jax.sharding import constrain_cache
from kvquant_jax.serving.sampling import SamplingParams

__all__ = ["EngineConfig", "Request", "StreamEvent", "Result", "Engine", "sample_rows", "synthetic_trace",
           "read_trace", "write_trace", "summarize"]


FORWARDS = ("direct", "view")
ADMISSIONS = ("optimistic", "reserve")


def bucket(n: int, limit: int) -> int:
    """The static size a count ``n >= 1`` compiles at: the next power of two, at most ``limit``."""
    return min(1 << max(int(n) - 1, 0).bit_length(), limit)


def view_ladder(max_pages: int, buckets: int) -> tuple[int, ...]:
    """The view sizes (pages) a forward compiles at: ``ceil(max_pages / 2^k)`` for ``k < buckets`` -- a view at
    most twice the pages the step maps (down to the smallest rung), ``buckets`` compiled shapes per phase."""
    return tuple(sorted({-(-max_pages // 2 ** k) for k in range(buckets)}))


class CacheAppendError(RuntimeError):
    """A step produced non-finite K/V (nothing of it was published)."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine geometry.

    Attributes:
      num_slots: sequences per step (the static batch of the jitted step).
      page_size: rows per page (a multiple of every KIVI group size).
      num_pages: pages in the pool (the HBM budget).
      max_pages: pages per sequence (context = hidden prefix rows + max_pages * page_size).
      chunk: prefill tokens per step and slot (the static T of mixed steps).
      prefix_cache: store full prompt pages and map them into later requests with the same prefix.
      seed: base PRNG seed of the per-request sampling streams.
      attention_impl: ``llama.forward``'s attention implementation.
      forward: "direct" (the paged-direct forward, ``attention.paged.PagedStep``) or "view" (gather the whole
        contiguous view, forward, scatter: memory ~ slots x max capacity; kept as the reference path).
      prefill_slots: rows of a step's prefill forward (``[prefill_slots, chunk]``; at most that many requests
        prefill a chunk per step, in admission order).
      view_buckets: page counts a forward's view of the mapped pages compiles at (``view_ladder``).
      admission: "optimistic" (admit while the free pages cover the prompt plus one page per running request:
        more requests in flight, but under load they outgrow the pool and are preempted -- recomputed) or
        "reserve" (admit only while the free pages cover this request's prompt + ``max_new_tokens`` and what
        every running request still needs to reach its ``max_new_tokens``: a request is never preempted).
    """

    num_slots: int = 8
    page_size: int = 16
    num_pages: int = 256
    max_pages: int = 32
    chunk: int = 64
    prefix_cache: bool = True
    seed: int = 0
    attention_impl: str = "auto"
    forward: str = "direct"
    prefill_slots: int = 4
    view_buckets: int = 4
    admission: str = "optimistic"

    def __post_init__(self):
        if self.forward not in FORWARDS:
            raise ValueError(f"engine: forward must be one of {FORWARDS}, got {self.forward!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"engine: admission must be one of {ADMISSIONS}, got {self.admission!r}")
        for f in ("num_slots", "page_size", "num_pages", "max_pages", "chunk", "prefill_slots", "view_buckets"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"engine: {f} must be a positive int, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request: ``prompt`` token ids, ``max_new_tokens``, sampling and ``stop`` token ids (None:
    the model's EOS), ``arrival`` seconds after the trace start (trace replay)."""

    id: int
    prompt: tuple
    max_new_tokens: int = 32
    sampling: SamplingParams = SamplingParams()
    stop: tuple | None = None
    arrival: float = 0.0


@dataclasses.dataclass(frozen=True)
class StreamEvent:
    """A new output token of request ``request_id`` (``token`` None when it finished without one)."""

    request_id: int
    token: int | None
    index: int
    finished: bool
    reason: str = ""           # "stop" | "length" when finished
    time: float = 0.0


@dataclasses.dataclass
class Result:
    request_id: int
    tokens: list
    reason: str = ""
    arrival: float = 0.0
    first_token: float | None = None
    token_times: list = dataclasses.field(default_factory=list)
    preemptions: int = 0
    prefix_hit_tokens: int = 0


@dataclasses.dataclass
class _Slot:
    req: Request
    cached: list               # token ids whose K/V are committed (positions row_offset ..)
    todo: list                 # tokens still to feed (prompt remainder, or the last sampled token)
    admitted: int              # admission counter (preemption picks the latest)
    prefilling: bool = True


def sample_rows(logits, keys, temperature, top_k, top_p):
    """Per-row sampling: ``logits`` float32 ``[S, V]``, ``keys`` ``[S, 2]`` uint32, ``temperature`` float32
    ``[S]`` (0 = greedy), ``top_k`` int32 ``[S]`` (0 = off), ``top_p`` float32 ``[S]`` (1 = off).  Returns int32
    ``[S]``.  Row ``s`` follows ``serving.sampling.sample`` with that row's parameters."""
    v = logits.shape[-1]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    srt = jnp.sort(x, axis=-1)[:, ::-1]
    kth = jnp.take_along_axis(srt, jnp.clip(top_k - 1, 0, v - 1)[:, None], axis=1)
    x = jnp.where((top_k[:, None] > 0) & (x < kth), -jnp.inf, x)
    srt = jnp.sort(x, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(srt, axis=-1)
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    thresh = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
    x = jnp.where((top_p[:, None] < 1.0) & (x < thresh), -jnp.inf, x)
    drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, x).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def _sample_last(last, temperature, top_k, top_p, base_key, req_ids, n_gen):
    """``last``: float32 ``[R, V]``, each row's logits at its last valid token (``forward(..., logits_at=)``)."""
    keys = jax.vmap(lambda i, n: jax.random.fold_in(jax.random.fold_in(base_key, i), n))(req_ids, n_gen)
    return sample_rows(last, keys, temperature, top_k, top_p)


def _with_host_state(cache: paged.PagedKVCache, host_state) -> paged.PagedKVCache:
    """The cache with the engine's host page table and lengths (``host_state`` int32 ``[S, max_pages + 1]``:
    columns ``:max_pages`` the table, the last column the committed lengths; None: the cache as is)."""
    if host_state is None:
        return cache
    m = cache.max_pages
    return cache.replace(page_table=host_state[:, :m], lengths=host_state[:, m])


@functools.partial(jax.jit, static_argnames=("cfg", "attention_impl"), donate_argnames=("cache",))
def _step_view(params, cfg: LlamaConfig, cache: paged.PagedKVCache, tokens, num_new, write, temperature, top_k,
               top_p, base_key, req_ids, n_gen, attention_impl="auto", host_state=None):
    """One forward on the whole contiguous view of every slot (``paged.gather`` -> ``forward`` ->
    ``paged.scatter``): ``tokens`` int32 ``[S, T]`` (``num_new[s]`` valid), pages ``write`` bool ``[S, M]``;
    ``host_state``: the engine's page table and lengths (``_with_host_state``).  Returns (next token int32
    ``[S]``, cache', ok)."""
    cache = _with_host_state(cache, host_state)
    view = paged.gather(cache)
    logits, view2, ok = forward(params, cfg, tokens, view, num_new, attention_impl=attention_impl,
                                logits_at=jnp.maximum(num_new - 1, 0))
    cache2 = constrain_cache(paged.scatter(cache, view2, write))
    return _sample_last(logits[:, 0], temperature, top_k, top_p, base_key, req_ids, n_gen), cache2, ok


@functools.partial(jax.jit, static_argnames=("cfg", "attention_impl", "view_pages", "window_pages"),
                   donate_argnames=("cache",))
def _step_direct(params, cfg: LlamaConfig, cache: paged.PagedKVCache, index, tokens, num_new, write, first,
                 temperature, top_k, top_p, base_key, req_ids, n_gen, attention_impl="auto", view_pages=1,
                 window_pages=1, host_state=None):
    """One paged-direct forward (``attention.paged.PagedStep``) of the rows ``index`` (int32 ``[R]``, slot ids;
    ``>= S`` = an empty row): ``tokens`` int32 ``[R, T]``, ``num_new``, ``write`` bool ``[R, M]``, ``first``
    int32 ``[R]`` (first page each row writes), per-row sampling; static page buckets; ``host_state`` int32
    ``[S, M + 1]``: the engine's page table and lengths (``_with_host_state``; the rows read theirs from it).
    Returns (next token int32 ``[R]``, cache', ok).  With ``host_state`` only the rows' lengths and per-sequence
    fields in cache' are meaningful (the engine's host copies are the truth for the others)."""
    cache = _with_host_state(cache, host_state)
    sub = paged.select_slots(cache, index)
    step = paged_attention.paged_step(sub, write, first, view_pages=view_pages, window_pages=window_pages)
    logits, step2, ok = forward(params, cfg, tokens, step, num_new, attention_impl=attention_impl,
                                logits_at=jnp.maximum(num_new - 1, 0))
    cache2 = constrain_cache(paged.merge_slots(cache, step2.paged(), index))   # under a mesh: its placed layout
    return _sample_last(logits[:, 0], temperature, top_k, top_p, base_key, req_ids, n_gen), cache2, ok


class Engine:
    """Continuous batching over a paged cache (module docstring).  ``scheme``: one scheme or a per-layer tuple;
    ``mesh``: a ``(data=1, model)`` device mesh (default: the enclosing ``sharding.mesh_context``'s; None: one
    device), ``ValueError`` naming the sizes when it does not fit the model."""

    def __init__(self, params, cfg: LlamaConfig, scheme=None, config: EngineConfig = EngineConfig(), *,
                 model_hash: str = "", tokenizer_hash: str = "", calibration_id: str = "", mesh=None):
        mesh = S.current_mesh() if mesh is None else mesh
        if mesh is not None:           # before anything is allocated: data = 1, the heads must fit the model axis
            S.check_paged_mesh(mesh, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
            params = S.place_params(params, cfg, mesh)
        self.params, self.cfg, self.config, self.mesh = params, cfg, config, mesh
        scheme = scheme or FullPrecisionScheme(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
        cache, self.pool = paged.init_paged(
            scheme, num_layers=cfg.num_layers, batch=config.num_slots, num_pages=config.num_pages,
            page_size=config.page_size, max_pages=config.max_pages, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, layer_groups="runs" if jax.default_backend() == "cpu" else "per_layer")
        if mesh is not None:
            cache = S.place_cache(cache, mesh)
        self.cache = cache              # the setter also takes the host copies of page table and lengths
        self.hashes = dict(model_hash=model_hash or cfg.name, tokenizer_hash=tokenizer_hash,
                           calibration_id=calibration_id)
        self.prefixes = pcache.PrefixCache()
        self.queue: collections.deque = collections.deque()
        self.slots: list[_Slot | None] = [None] * config.num_slots
        self.results: dict[int, Result] = {}
        self.base_key = jax.random.PRNGKey(config.seed)
        self._admitted = 0
        self.peak_running = 0
        self.steps = 0
        self.step_shapes: dict[tuple, int] = {}     # (T, rows, view pages, window pages) -> forwards run
        self.ladder = view_ladder(config.max_pages, config.view_buckets)
        self._windows: dict[int, int] = {}
        self.t0 = time.perf_counter()

    @property
    def cache(self) -> paged.PagedKVCache:
        """The paged cache, page table and lengths included.  The engine is their only writer and keeps them on
        the host (``_table`` int32 ``[S, max_pages]``, ``_len`` int64 ``[S]``; every step passes them into the
        jitted forward), so the device copies are refreshed only here, when someone reads the cache."""
        if not self._synced:
            self._cache = self._cache.replace(page_table=jnp.asarray(self._table, jnp.int32),
                                              lengths=jnp.asarray(self._len, jnp.int32))
            self._synced = True
        return self._cache

    @cache.setter
    def cache(self, cache: paged.PagedKVCache) -> None:
        self._cache = cache
        self._table = np.array(jax.device_get(cache.page_table), np.int32)
        self._len = np.array(jax.device_get(cache.lengths), np.int64)
        self._synced = True

    def _host_cache(self) -> paged.PagedKVCache:
        """The cache with the host page table and lengths (NumPy) in place of the device ones: what host-side
        readers (``prefix_cache.insert``) take, without a device round trip."""
        return self._cache.replace(page_table=self._table, lengths=self._len)

    def _host_state(self) -> np.ndarray:
        """int32 ``[S, max_pages + 1]``: the host page table and lengths, one argument of every jitted step."""
        return np.concatenate([self._table, self._len[:, None].astype(np.int32)], axis=1)

    def _release(self, i: int) -> None:
        """``paged.release`` of slot ``i`` on the host copies: its page references are dropped, the slot restarts
        empty at ``row_offset`` (the next step's forwards take the table and lengths from the host)."""
        self.pool = pp.decref(self.pool, self._table[i])
        self._table[i] = -1
        self._len[i] = self._cache.row_offset
        self._synced = False

    def _jit_step(self, fn, *args, **kw):
        """``fn(params, cfg, cache, *args, **kw)`` (a jitted step) on the engine's mesh: under
        ``sharding.mesh_context`` with the cache re-placed on its ``sharding.cache_specs`` layout first (a no-op
        unless a host-side edit -- ``reserve``'s copy-on-write, ``release``, a prefix ``attach`` -- left an array
        elsewhere), so every step shape compiles once; no mesh: called as is."""
        if self.mesh is None:
            return fn(self.params, self.cfg, self._cache, *args, **kw)
        with S.mesh_context(self.mesh):
            return fn(self.params, self.cfg, S.place_cache(self._cache, self.mesh), *args, **kw)

    @property
    def paths(self) -> dict[str, str]:
        """Which path served each (family, append | attention, phase) of the paged-direct forward so far
        (``attention.paged.PATHS``; process-wide), or ``{"forward": "view"}``."""
        if self.config.forward == "view":
            return {"forward": "view"}
        return {"/".join(k): v for k, v in sorted(paged_attention.PATHS.items())}

    # ----- requests -----
    @property
    def context(self) -> int:
        """Longest request (prompt + new tokens) the engine serves: the model's and the cache's limit."""
        return min(self.cfg.max_position, self._cache.capacity) - self._cache.row_offset

    def submit(self, req: Request) -> None:
        """Queue a request (after :meth:`check`)."""
        self.check(req)
        if req.id in self.results:
            raise ValueError(f"request id {req.id} submitted twice")
        self.results[req.id] = Result(req.id, [], arrival=req.arrival)
        self.queue.append(req)

    def check(self, req: Request) -> None:
        """Raise ``ValueError`` for an empty prompt, out-of-vocabulary ids, a bad ``max_new_tokens``, a request
        over the context or one that needs more pages than the whole pool (it could never run)."""
        if not req.prompt:
            raise ValueError(f"request {req.id}: empty prompt")
        bad = [t for t in req.prompt if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"request {req.id}: token ids {bad[:5]} outside the vocabulary [0, {self.cfg.vocab_size})")
        if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
            raise ValueError(f"request {req.id}: max_new_tokens must be a positive int, got {req.max_new_tokens!r}")
        need = len(req.prompt) + req.max_new_tokens
        if need > self.context:
            raise ValueError(f"request {req.id}: prompt of {len(req.prompt)} tokens + {req.max_new_tokens} new "
                             f"tokens = {need} exceeds the context of {self.context} tokens (model max_position "
                             f"{self.cfg.max_position}, cache {self._cache.max_pages} pages x "
                             f"{self._cache.page_size})")
        pages = -(-need // self._cache.page_size)
        if pages > self._cache.num_pages:
            raise ValueError(f"request {req.id} needs {pages} pages of {self._cache.page_size} rows but the pool has "
                             f"{self._cache.num_pages}: it cannot fit even alone")

    @property
    def running(self) -> int:
        return sum(s is not None for s in self.slots)

    def done(self) -> bool:
        return not self.queue and not self.running

    # ----- admission and preemption -----
    def _stops(self, req: Request) -> set:
        return set(req.stop) if req.stop is not None else {self.cfg.eos_id}

    def _final_pages(self, req: Request) -> int:
        """Pages ``req`` holds at most: its prompt plus every one of its ``max_new_tokens``."""
        return -(-(len(req.prompt) + req.max_new_tokens) // self._cache.page_size)

    def _headroom(self) -> int:
        """Free pages the running requests are promised beyond what they hold (``EngineConfig.admission``):
        "reserve": every page each still needs to reach its ``max_new_tokens``; "optimistic": one page each."""
        if self.config.admission == "optimistic":
            return self.running
        mapped = (self._table >= 0).sum(axis=1)
        return int(sum(max(self._final_pages(s.req) - int(mapped[i]), 0)
                       for i, s in enumerate(self.slots) if s is not None))

    def _admit(self) -> None:
        """FCFS admission into free slots while the pool covers the request and the running requests' headroom
        (:meth:`_headroom`), evicting least-recently-used prefix entries first."""
        while self.queue and None in self.slots:
            req = self.queue[0]
            res = self.results[req.id]
            tokens = list(req.prompt) + res.tokens                  # a preempted request recomputes its output
            hit = None
            if self.config.prefix_cache:
                hit = pcache.lookup(self.prefixes, self._cache, tokens, max_tokens=len(tokens) - 1,
                                    **self.hashes)
            hit_tokens = 0 if hit is None else hit.length - self._cache.row_offset
            hit_pages = hit_tokens // self._cache.page_size
            if self.config.admission == "optimistic":     # the prompt (+ the first sampled token) only
                need = -(-(len(tokens) + 1) // self._cache.page_size) - hit_pages
            else:                                          # every page it can ever need
                need = max(self._final_pages(req) - hit_pages, 0)
            headroom = self._headroom()
            others = [e for _, e in self.prefixes.entries if hit is None or e.content != hit.content]
            for victim in sorted(others, key=lambda e: e.last_use):
                if need + headroom <= self.pool.num_free:
                    break
                self.prefixes, self.pool = pcache.evict(self.prefixes, self.pool, victim.content)
            if need + headroom > self.pool.num_free and self.running:
                return
            slot = self.slots.index(None)
            self.queue.popleft()
            if hit is not None:
                # attach edits row `slot` of the table and its length on the device: the setter takes them back
                self.prefixes, self.cache, self.pool = pcache.attach(self.prefixes, self.cache, self.pool, hit,
                                                                     slot)
                res.prefix_hit_tokens += hit_tokens
            self._admitted += 1
            self.slots[slot] = _Slot(req, tokens[:hit_tokens], tokens[hit_tokens:], self._admitted)

    def _preempt(self, keep: int | None = None) -> bool:
        """Free pages: evict a prefix entry, else preempt the latest admitted request (not ``keep``)."""
        if self.prefixes.entries:
            self.prefixes, self.pool = pcache.evict(self.prefixes, self.pool)
            return True
        cands = [(s.admitted, i) for i, s in enumerate(self.slots) if s is not None and i != keep]
        if not cands:
            return False
        _, i = max(cands)
        s = self.slots[i]
        self._release(i)
        self.slots[i] = None
        self.results[s.req.id].preemptions += 1
        self.queue.appendleft(s.req)
        return True

    # ----- one step -----
    def _plan(self):
        """Tokens each slot feeds this step: a decoding slot its last token; with the paged-direct forward at most
        ``prefill_slots`` prefilling slots (admission order) a chunk each, every prefilling slot otherwise."""
        n = np.zeros(self.config.num_slots, np.int64)
        pre = sorted((s.admitted, i) for i, s in enumerate(self.slots) if s is not None and s.prefilling)
        if self.config.forward == "direct":
            pre = pre[:self.config.prefill_slots]
        for _, i in pre:
            n[i] = min(self.config.chunk, len(self.slots[i].todo))
        for i, s in enumerate(self.slots):
            if s is not None and not s.prefilling:
                n[i] = len(s.todo)                                 # 1: the last sampled token
        return n

    def _row_inputs(self, rows, t: int, n):
        """Host (NumPy) arrays of one forward's rows (slot ids; ``num_slots`` = an empty row): tokens int32
        ``[R, t]``, num_new int32 ``[R]``, and the sampling tuple (temperature float32, top-k int32, top-p
        float32 ``[R]``, the base key, request ids, output indices int32 ``[R]``).  Passed to the jitted step as
        they are: its call transfers them together (no eager ``jnp.asarray`` per array)."""
        r = len(rows)
        toks = np.zeros((r, t), np.int32)
        num = np.zeros(r, np.int32)
        temp, topk, topp = np.zeros(r, np.float32), np.zeros(r, np.int32), np.ones(r, np.float32)
        ids, ngen = np.zeros(r, np.int32), np.zeros(r, np.int32)
        for j, i in enumerate(rows):
            s = self.slots[i] if i < self.config.num_slots else None
            if s is None or n[i] == 0:
                continue
            num[j] = n[i]
            toks[j, : n[i]] = s.todo[: n[i]]
            sp = s.req.sampling
            temp[j], topk[j], topp[j], ids[j] = sp.temperature, sp.top_k, sp.top_p, s.req.id
            ngen[j] = len(self.results[s.req.id].tokens)
        return toks, num, (temp, topk, topp, self.base_key, ids, ngen)

    def _direct_forward(self, rows, t: int, n, write, first, need, host_state):
        """Dispatch one paged-direct forward of ``rows`` (slot ids, padded with ``num_slots``); returns (next
        tokens of the rows, ok) as device arrays, not waited for.  Its static shape is ``(T, rows, view pages,
        window pages)``; ``host_state``: :meth:`_host_state`."""
        rows = np.asarray(rows, np.int64)
        real = rows[rows < self.config.num_slots]
        toks, num, sampling = self._row_inputs(rows, t, n)
        pad = np.concatenate([write, np.zeros((1,) + write.shape[1:], bool)])[rows]
        firsts = np.concatenate([first, [0]])[rows].astype(np.int32)
        win = int(np.max(need[real] - first[real], initial=1))
        if win > self._window_pages(t):
            raise AssertionError(f"engine: a row writes {win} pages, more than the {self._window_pages(t)} of a "
                                 f"T={t} window")
        shape = (t, len(rows), self._view_pages(t, int(np.max(need[real], initial=1))), self._window_pages(t))
        nxt, self._cache, ok = self._jit_step(_step_direct, rows.astype(np.int32), toks, num, pad, firsts,
                                              *sampling, attention_impl=self.config.attention_impl,
                                              view_pages=shape[2], window_pages=shape[3], host_state=host_state)
        self.step_shapes[shape] = self.step_shapes.get(shape, 0) + 1
        return nxt, ok

    def _window_pages(self, t: int) -> int:
        """The window (pages) every T-token forward compiles at: the most pages one row can write from its
        sealed page (``pages_needed(L + T) - window_first(L)`` over every committed length L), bucketed; one shape
        per T (a few spare pages per row cost less than another compile)."""
        if t not in self._windows:
            c = self._cache
            lengths = np.arange(c.row_offset, c.capacity, dtype=np.int64)
            worst = np.max(c.pages_needed(np.minimum(lengths + t, c.capacity)) - paged.window_first(c, lengths))
            self._windows[t] = bucket(max(int(worst), 1), c.max_pages)
        return self._windows[t]

    def compile_shapes(self) -> list[tuple[int, int, int, int]]:
        """Every ``(T, rows, view pages, window pages)`` the paged-direct forward can run at (bounded:
        ``view_buckets`` decode shapes and ``view_buckets`` prefill shapes)."""
        s, r = self.config.num_slots, self._prefill_rows()
        return ([(1, s, v, self._window_pages(1)) for v in self.ladder]
                + [(self.config.chunk, r, v, self._window_pages(self.config.chunk)) for v in self.ladder])

    def warmup(self) -> float:
        """Compile every shape of :meth:`compile_shapes` (forwards whose rows feed nothing: the cache is logically
        unchanged) so a timed run pays no compilation; returns the seconds spent.  The view path compiles its two
        shapes on first use."""
        t0 = time.perf_counter()
        if self.config.forward != "direct":
            return 0.0
        host_state = self._host_state()
        for t, r, v, w in self.compile_shapes():
            rows = np.full(r, self.config.num_slots, np.int32)
            toks, num, sampling = self._row_inputs(rows, t, np.zeros(self.config.num_slots + 1, np.int64))
            _, self._cache, ok = self._jit_step(_step_direct, rows, toks, num,
                                                np.zeros((r, self._cache.max_pages), bool), np.zeros(r, np.int32),
                                                *sampling, attention_impl=self.config.attention_impl,
                                                view_pages=v, window_pages=w, host_state=host_state)
            ok.block_until_ready()
        return time.perf_counter() - t0

    def _view_pages(self, t: int, need: int) -> int:
        """The view size of a forward whose rows map at most ``need`` pages: the smallest ``view_ladder`` rung.
        (Also for decode steps the paged kernel serves: the view's gathers are dead code there, except where a
        scheme's small regions read paged rows -- KIVI's tail decodes ``[fv, fk)`` from K codes -- so the view must
        cover the lengths.)"""
        del t
        return next(v for v in self.ladder if v >= need)

    def _prefill_rows(self) -> int:
        """Rows of the prefill forward (``[prefill_slots, chunk]``; at most ``num_slots``)."""
        return min(self.config.prefill_slots, self.config.num_slots)

    def step(self) -> list[StreamEvent]:
        """Admit, run one step (decode + prefill chunks), return the new tokens as stream events.

        Both forwards are dispatched before either is waited for (the prefill forward takes the decode
        forward's cache, so the device runs them back to back), then their packed outputs come back in one
        ``jax.device_get``; the page table and lengths live on the host (:attr:`cache`), so planning a step
        reads nothing from the device."""
        self._admit()
        if not self.running:
            return []
        while True:
            n = self._plan()
            lengths = self._len
            try:
                owners = [s.req.id if s is not None else -1 for s in self.slots]
                table, pool, write, src, dst = paged.plan_reserve(self._cache, self.pool, lengths, self._table,
                                                                  lengths + n, owners)
                break
            except pp.PoolExhaustedError:
                oldest = min((s.admitted, i) for i, s in enumerate(self.slots) if s is not None)[1]
                if not self._preempt(keep=oldest):
                    raise
        self._table, self.pool, self._synced = table, pool, False
        if src.size:
            self._cache = paged.apply_copies(self._cache, src, dst)
        self.pool, step_id = pp.begin_step(self.pool)
        host_state = self._host_state()
        nxt = np.zeros(self.config.num_slots, np.int64)
        pending = []                          # (slot ids, their rows in the forward, (next tokens, ok) on device)
        if self.config.forward == "direct":
            # decode rows: every slot in one [S, 1] forward (others feed nothing); prefill rows: up to
            # prefill_slots slots in one [prefill_slots, chunk] forward
            first, _, _ = paged.step_pages(self._cache, lengths, lengths + n)
            need = self._cache.pages_needed(lengths + n)
            decoding = np.array([s is not None and not s.prefilling and n[i] > 0 for i, s in enumerate(self.slots)])
            prefill = [i for i, s in enumerate(self.slots) if s is not None and s.prefilling and n[i] > 0]
            if decoding.any():
                idx = np.nonzero(decoding)[0]
                pending.append((idx, idx, self._direct_forward(np.arange(self.config.num_slots), 1, n * decoding,
                                                               write & decoding[:, None], first,
                                                               np.where(decoding, need, 1), host_state)))
            if prefill:
                rows = prefill + [self.config.num_slots] * (self._prefill_rows() - len(prefill))
                pending.append((np.asarray(prefill), np.arange(len(prefill)),
                                self._direct_forward(rows, self.config.chunk, n, write, first, need, host_state)))
        else:
            t = 1 if n.max() <= 1 else self.config.chunk
            rows = np.arange(self.config.num_slots)
            toks, num, sampling = self._row_inputs(rows, t, n)
            out, self._cache, ok = self._jit_step(_step_view, toks, num, write, *sampling,
                                                  attention_impl=self.config.attention_impl,
                                                  host_state=host_state)
            shape = (t, self.config.num_slots, self._cache.max_pages, 0)
            self.step_shapes[shape] = self.step_shapes.get(shape, 0) + 1
            pending.append((rows, rows, (out, ok)))
        outs = jax.device_get(tuple(o for _, _, o in pending))   # one wait for every forward of the step
        self.pool = pp.retire_step(self.pool, step_id)        # outputs ready: the step's reads are done
        if not all(bool(ok) for _, ok in outs):
            raise CacheAppendError("engine step produced non-finite K/V; nothing was published")
        for (slots, pos, _), (out, _) in zip(pending, outs):
            nxt[slots] = out[pos]
        self._len = lengths + n                                # what the forwards committed
        self.steps += 1
        self.peak_running = max(self.peak_running, self.running)
        now = time.perf_counter() - self.t0
        events = []
        for i, s in enumerate(self.slots):
            if s is None or n[i] == 0:
                continue
            s.cached += s.todo[: n[i]]
            s.todo = s.todo[n[i]:]
            if s.prefilling and self.config.prefix_cache:
                self._store_prefix(i, s)
            if s.todo:
                continue                                           # prompt chunks remain
            s.prefilling = False
            events.append(self._emit(i, s, int(nxt[i]), now))
        return events

    def _store_prefix(self, i: int, s: _Slot) -> None:
        """After a prefill chunk: the full pages so far become a prefix-cache entry (``prefix_cache.insert``, on
        the host page table and lengths)."""
        self.prefixes, self.pool = pcache.insert(self.prefixes, self._host_cache(), self.pool, i, s.cached,
                                                 **self.hashes)

    def _emit(self, i: int, s: _Slot, tok: int, now: float) -> StreamEvent:
        res = self.results[s.req.id]
        if tok in self._stops(s.req):
            return self._finish(i, s, None, "stop", now)
        res.tokens.append(tok)
        res.token_times.append(now)
        if res.first_token is None:
            res.first_token = now
        if len(res.tokens) >= s.req.max_new_tokens:
            return self._finish(i, s, tok, "length", now)
        s.todo = [tok]
        return StreamEvent(s.req.id, tok, len(res.tokens) - 1, False, time=now)

    def _finish(self, i: int, s: _Slot, tok, reason: str, now: float) -> StreamEvent:
        res = self.results[s.req.id]
        res.reason = reason
        self._release(i)
        self.slots[i] = None
        return StreamEvent(s.req.id, tok, len(res.tokens) - (tok is not None), True, reason, now)

    # ----- drivers -----
    def stream(self, requests: Iterable[Request] = (), *, realtime: bool = False, max_seconds: float | None = None):
        """Submit ``requests`` (by ``arrival`` when ``realtime``: a request is queued once the engine clock
        reaches its arrival; otherwise all at once) and yield :class:`StreamEvent` s until every request is done,
        or -- ``max_seconds`` -- until the first step boundary after that many seconds (``self.stopped`` True;
        unfinished requests keep their tokens so far)."""
        pending = sorted(requests, key=lambda r: r.arrival)
        self.t0 = time.perf_counter()
        self.stopped = False
        k = 0
        while k < len(pending) or not self.done():
            now = time.perf_counter() - self.t0
            if max_seconds is not None and now > max_seconds:
                self.stopped = True
                return
            while k < len(pending) and (not realtime or pending[k].arrival <= now):
                self.submit(pending[k])
                k += 1
            if self.done() and k < len(pending):
                time.sleep(max(0.0, min(pending[k].arrival - now, 0.05)))
                continue
            yield from self.step()

    def run(self, requests: Iterable[Request] = (), *, realtime: bool = False) -> dict[int, Result]:
        """:meth:`stream` to the end; returns the results by request id."""
        for _ in self.stream(requests, realtime=realtime):
            pass
        return self.results


# --------------------------------------------------------------------------------------------------------------
# traces
# --------------------------------------------------------------------------------------------------------------
def synthetic_trace(n: int, *, rate: float, prompt_range: tuple[int, int], output_range: tuple[int, int],
                    vocab_size: int, seed: int = 0, shared_prefix: int = 0) -> list[Request]:
    """``n`` requests with Poisson arrivals (``rate`` per second), prompt and output lengths uniform in the
    inclusive ranges, random token ids (ids 0-2 avoided: BOS / EOS of the small models) and, with
    ``shared_prefix``, a common prefix of that many tokens (a system prompt).  Seeded: the same trace every run."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n)) if rate > 0 else np.zeros(n)
    common = rng.integers(3, vocab_size, shared_prefix).tolist()
    out = []
    for i in range(n):
        p = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        body = rng.integers(3, vocab_size, max(p - shared_prefix, 1)).tolist()
        out.append(Request(i, tuple(common + body), int(rng.integers(output_range[0], output_range[1] + 1)),
                           arrival=float(t[i])))
    return out


def write_trace(requests: Iterable[Request], path: str) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"id": r.id, "arrival": r.arrival, "prompt": list(r.prompt),
                                "max_new_tokens": r.max_new_tokens, "temperature": r.sampling.temperature,
                                "top_k": r.sampling.top_k, "top_p": r.sampling.top_p,
                                "stop": None if r.stop is None else list(r.stop)}) + "\n")


def read_trace(path: str) -> list[Request]:
    """JSONL, one request per line: ``id``, ``arrival`` (s), ``prompt`` (ids), ``max_new_tokens``, optional
    ``temperature`` / ``top_k`` / ``top_p`` / ``stop``.  Raises ``ValueError`` naming the line."""
    out = []
    with open(path) as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                out.append(Request(int(d["id"]), tuple(int(t) for t in d["prompt"]), int(d["max_new_tokens"]),
                                   SamplingParams(float(d.get("temperature", 0.0)), int(d.get("top_k", 0)),
                                                  float(d.get("top_p", 1.0))),
                                   None if d.get("stop") is None else tuple(int(t) for t in d["stop"]),
                                   float(d.get("arrival", 0.0))))
            except (KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{no}: bad trace line ({e})") from None
    return out


def summarize(results: dict[int, Result], seconds: float, peak_running: int) -> dict:
    """Output tokens/s, TTFT and inter-token latency p50/p99 (seconds), peak concurrent requests."""
    toks = sum(len(r.tokens) for r in results.values())
    ttft = [r.first_token - r.arrival for r in results.values() if r.first_token is not None]
    itl = [b - a for r in results.values() for a, b in zip(r.token_times, r.token_times[1:])]

    def pct(x, q):
        return float(np.percentile(x, q)) if x else float("nan")

    return {"requests": len(results), "output_tokens": toks, "seconds": round(seconds, 3),
            "output_tok_per_s": round(toks / max(seconds, 1e-9), 2), "ttft_p50_s": pct(ttft, 50),
            "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "peak_concurrent": peak_running,
            "preemptions": sum(r.preemptions for r in results.values()),
            "prefix_hit_tokens": sum(r.prefix_hit_tokens for r in results.values())}
