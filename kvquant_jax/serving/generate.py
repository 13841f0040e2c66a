"""Jit-compiled serving loop: batched prefill of ragged prompts, then a ``lax.while_loop`` decode.

The cache is donated into both jitted steps, so XLA updates its buffers in place instead of copying the whole
cache every token.  Each step returns an ``ok`` flag (all K/V rows finite); a failed step publishes nothing
(``lengths`` unchanged) and :func:`generate` raises :class:`CacheAppendError`.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache.full import FullPrecisionScheme
from kvquant_jax.cache.interface import CacheScheme, KVCache, init_cache
from kvquant_jax.models.cache_layout import layer_schemes
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.llama import forward
from kvquant_jax.quant.ledger import Ledger, LedgerShape, ledger
from kvquant_jax.serving.sampling import SamplingParams, sample
from kvquant_jax.sharding import on_current_mesh, to_host


class CacheAppendError(ValueError):
    """A forward produced non-finite K/V; nothing was published (the cache keeps its previous lengths)."""


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]          # generated ids per prompt (EOS excluded)
    finished: list[bool]             # stopped at EOS
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    cache: KVCache


def bucket(n: int, multiple: int = 16) -> int:
    return max(multiple, -(-n // multiple) * multiple)


DEFAULT_PREFILL_CHUNK = 4096


@functools.partial(jax.jit, static_argnames=("cfg", "attention_impl"), donate_argnames=("cache",))
def prefill_step(params, cfg: LlamaConfig, tokens, cache, num_new, attention_impl="auto"):
    """tokens int32 [B, T] right-padded; returns (logits of each sequence's last valid token [B, V], cache, ok).
    A sequence with ``num_new == 0`` appends nothing (its logits row is meaningless)."""
    logits, cache, ok = forward(params, cfg, tokens, cache, num_new, attention_impl=attention_impl,
                                logits_at=jnp.maximum(num_new - 1, 0))
    return logits[:, 0], cache, ok


def prefill_chunked(params, cfg: LlamaConfig, tokens, cache: KVCache, num_new, *, chunk: int = DEFAULT_PREFILL_CHUNK,
                    attention_impl: str = "auto"):
    """Prefill right-padded prompts ``tokens`` (int32 ``[B, T]``, ``num_new[b]`` valid) in chunks of ``chunk``
    tokens: each chunk is one :func:`prefill_step` (cache donated) that attends to the history the cache stores and
    to its own exact K/V, so peak activation memory is that of one chunk. Full-precision caches give the one-shot
    result (up to float rounding); a quantized cache stores exactly what the same chunk sequence through
    ``forward`` stores (later chunks read earlier chunks from the stored representation, as decode does).

    Returns (logits of each sequence's last prompt token ``[B, V]``, cache, ok); ``ok`` is False as soon as one
    chunk was rejected (that chunk published nothing, and no later chunk runs).
    """
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    tokens = jnp.asarray(tokens, jnp.int32)
    num_new = np.asarray(num_new, np.int32)
    b, t = tokens.shape
    last = None
    ok = jnp.bool_(True)
    for start in range(0, t, chunk):
        n_c = np.clip(num_new - start, 0, chunk).astype(np.int32)
        if not n_c.any():
            break
        width = min(chunk, t - start)
        logits, cache, ok = prefill_step(params, cfg, tokens[:, start:start + width], cache, jnp.asarray(n_c),
                                         attention_impl=attention_impl)
        if not bool(ok):
            break
        ends_here = jnp.asarray((num_new > start) & (num_new <= start + width))[:, None]
        last = logits if last is None else jnp.where(ends_here, logits, last)
    return last, cache, ok


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "sampling", "attention_impl", "eos_id"),
                   donate_argnames=("cache",))
def decode_loop(params, cfg: LlamaConfig, first_tok, cache, key, *, max_new: int, sampling: SamplingParams,
                eos_id: int, attention_impl: str = "auto"):
    """Decode up to ``max_new`` tokens (the first already sampled) in one compiled ``while_loop``.

    Returns (out int32 [B, max_new] (eos-padded), n_generated int32 [B], cache, ok, steps).
    """
    b = first_tok.shape[0]
    out = jnp.full((b, max_new), eos_id, jnp.int32).at[:, 0].set(first_tok)
    done = first_tok == eos_id
    n_gen = jnp.where(done, 0, 1).astype(jnp.int32)

    def cond(s):
        step, _, _, done, _, _, ok, _ = s
        return (step < max_new) & ~jnp.all(done) & ok

    def body(s):
        step, tok, cache, done, out, n_gen, ok, key = s
        key, sk = jax.random.split(key)
        logits, cache, ok2 = forward(params, cfg, tok[:, None], cache, jnp.ones((b,), jnp.int32),
                                     attention_impl=attention_impl)
        nxt = sample(logits[:, 0], sk, sampling)
        nxt = jnp.where(done, eos_id, nxt)
        out = out.at[:, step].set(nxt)
        newly = nxt == eos_id
        n_gen = n_gen + jnp.where(done | newly, 0, 1)
        return step + 1, nxt, cache, done | newly, out, n_gen, ok & ok2, key

    init = (jnp.int32(1), first_tok, cache, done, out, n_gen, jnp.bool_(True), key)
    steps, _, cache, _, out, n_gen, ok, _ = jax.lax.while_loop(cond, body, init)
    return out, n_gen, cache, ok, steps


def generate(params, cfg: LlamaConfig, prompts: list[list[int]], *, max_new_tokens: int = 32,
             scheme: CacheScheme | tuple | None = None, capacity: int | None = None,
             sampling: SamplingParams = SamplingParams(), seed: int = 0, eos_id: int | None = None,
             attention_impl: str = "auto", prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
             layer_groups: str | None = None) -> GenerationResult:
    """Generate for a batch of token-id prompts of different lengths.

    ``attention_impl`` (see ``llama.forward``; "auto" = kernels on GPU/TPU, the float32 reference on CPU),
    ``prefill_chunk`` (prompt tokens per prefill forward, :func:`prefill_chunked`) and ``layer_groups`` (cache
    layout, ``init_cache``; None = "per_layer" on GPU/TPU, where the unrolled step reads every layer's buffers in
    place, "runs" on CPU, where the layer scan compiles faster) only change speed and memory, not results, for
    prompts up to one chunk.

    Raises ValueError for an empty prompt, a prompt (plus ``max_new_tokens``) over the cache capacity, and
    :class:`CacheAppendError` when a step produced non-finite K/V.
    """
    if not prompts:
        raise ValueError("no prompts given")
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ValueError(f"prompt {lens.index(0)} is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    need = max(lens) + max_new_tokens
    if capacity is None:
        capacity = bucket(need, 256)   # a multiple of every kernel block (Mosaic GPU: 128 rows; token-planar KIVI-2: 256)
    check_fits(cfg, need, capacity, f"prompt of {max(lens)} tokens + {max_new_tokens} new tokens")
    scheme = scheme or FullPrecisionScheme(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    per_layer = layer_schemes(cfg, scheme, capacity=capacity)      # local layers of a windowed model: rings
    check_memory(cfg, per_layer, len(prompts), capacity)
    if layer_groups is None:
        layer_groups = "runs" if jax.default_backend() == "cpu" else "per_layer"
    cache = init_cache(per_layer, num_layers=cfg.num_layers, batch=len(prompts),
                       capacity=capacity,
                       num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, layer_groups=layer_groups)
    cache = on_current_mesh(cache)    # under sharding.mesh_context: batch over data, KV heads over model
    return run_batch(params, cfg, prompts, cache, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                     eos_id=eos_id, attention_impl=attention_impl, prefill_chunk=prefill_chunk)


def device_free_bytes(device=None) -> int | None:
    """Bytes the device's allocator can still hand out (``bytes_limit - bytes_in_use``), or None where the
    platform reports no memory statistics (the CPU)."""
    stats = (device or jax.local_devices()[0]).memory_stats()   # this process's first device
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def check_memory(cfg: LlamaConfig, scheme, batch: int, capacity: int, *, free_bytes: int | None = None,
                 headroom: float = 0.9) -> None:
    """Refuse, before anything is allocated or compiled, a cache of ``batch`` x ``capacity`` rows whose bytes (the
    ledger's physical view, every layer; ``scheme`` one scheme or the per-layer tuple, window rings included, of
    ``models.cache_layout.layer_schemes``) exceed ``headroom`` of the device memory still free (``free_bytes``,
    default :func:`device_free_bytes`; no check where the platform reports none). The error names the sizes and
    the largest batch that would fit."""
    free = device_free_bytes() if free_bytes is None else free_bytes
    if free is None:
        return
    shape = LedgerShape(cfg.num_layers, batch, cfg.num_kv_heads, cfg.head_dim, capacity, capacity)
    need = Ledger.total(ledger(scheme, shape).physical)
    budget = int(free * headroom)
    if need > budget:
        per_seq = Ledger.total(ledger(scheme, dataclasses.replace(shape, batch=1)).physical)
        raise ValueError(f"a cache of batch {batch} x {capacity} rows ({need / 1e9:.2f} GB, "
                         f"{per_seq / 1e9:.3f} GB per sequence) does not fit the {budget / 1e9:.2f} GB the device has "
                         f"free ({headroom:.0%} of {free / 1e9:.2f} GB); at most {budget // per_seq} sequences of "
                         f"{capacity} rows fit")


def check_fits(cfg: LlamaConfig, rows_needed: int, capacity: int, what: str) -> None:
    """Refuse a request before anything runs: ``rows_needed`` cache rows (``what`` says of what) must fit both the
    cache capacity and the model's context length."""
    if rows_needed > capacity:
        raise ValueError(f"{what} needs {rows_needed} cache rows; capacity is {capacity}")
    if rows_needed > cfg.max_position:
        raise ValueError(f"{what} = {rows_needed} positions exceed the model's context length {cfg.max_position}")


def run_batch(params, cfg: LlamaConfig, runs: list[list[int]], cache: KVCache, *, max_new_tokens: int,
              sampling: SamplingParams, seed: int, eos_id: int | None,
              attention_impl: str = "auto", prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> GenerationResult:
    """Prefill the non-empty token lists ``runs`` (one per sequence of ``cache``, appended after the rows the cache
    already holds) and decode up to ``max_new_tokens`` per sequence.  The caller has checked capacity."""
    eos_id = cfg.eos_id if eos_id is None else eos_id
    b = len(runs)
    lens = [len(r) for r in runs]
    toks = np.full((b, bucket(max(lens))), eos_id, np.int32)
    for i, r in enumerate(runs):
        toks[i, : len(r)] = r
    key, k0 = jax.random.split(jax.random.PRNGKey(seed))
    t0 = time.perf_counter()
    last, cache, ok = prefill_chunked(params, cfg, toks, cache, np.asarray(lens, np.int32), chunk=prefill_chunk,
                                      attention_impl=attention_impl)
    if not bool(ok):
        raise CacheAppendError("prefill produced non-finite K/V; nothing was appended")
    first = sample(last, k0, sampling)
    first.block_until_ready()
    t1 = time.perf_counter()
    out, n_gen, cache, ok, steps = decode_loop(params, cfg, first, cache, key, max_new=max_new_tokens,
                                               sampling=sampling, eos_id=eos_id, attention_impl=attention_impl)
    out = to_host(out)                # several processes: every process gets all sequences
    t2 = time.perf_counter()
    if not bool(ok):
        raise CacheAppendError(f"decode step {int(steps)} produced non-finite K/V; the cache holds the state "
                               f"before that step")
    n_gen = to_host(n_gen)
    return GenerationResult(tokens=[out[i, : n_gen[i]].tolist() for i in range(b)],
                            finished=[bool((out[i] == eos_id).any()) for i in range(b)], prefill_seconds=t1 - t0,
                            decode_seconds=t2 - t1, decode_steps=int(steps), cache=cache)
