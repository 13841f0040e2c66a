"""Perplexity through a (quantized) KV cache: the fast chunked path and the serving path.

Both run the real model forward (``kvquant_jax.models.llama.forward``) on a real cache, so the stored
representation is exactly what serving would store.  Attention contract of that forward: the tokens of one
forward attend to each other with their EXACT K/V (causal), and to the earlier tokens through the cache's stored
(quantized) representation, under one softmax.

Fast path (:func:`make_nll_fn`, ``kvq ppl --cache``): a segment is fed in chunks of ``chunk`` tokens.  The query
at offset ``j`` inside its chunk sees ``j`` exact keys of its own chunk and the quantized history of all earlier
chunks.  One forward per chunk, so a 512-token segment costs ``512 / chunk`` forwards.

Serving path (:func:`serving_nll`): prefill ``P`` tokens in one forward (exact among themselves, as a serving
prefill is), then decode the next ``N`` tokens one forward each (T = 1, teacher-forced), so every decode query sees
ONLY its own exact K/V plus the quantized history -- what a deployed decode step sees.  Only the ``N`` decode
predictions are scored.

How they differ: the fast path's queries see up to ``chunk - 1`` recent tokens in full precision that the serving
path would read quantized, so for a lossy cache it is optimistic, and more so for large chunks (``chunk >=
seq_len`` never reads the cache at all).  ``chunk = 1`` is the serving path.  For a full-precision fp32 cache all
three of plain (``forward_nocache``), fast and serving perplexity agree to float rounding (tested).  For KIVI the
recent residual window is full precision in both paths; only rows beyond it differ in how recent a full-precision
row can be.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.eval.policy import as_policy
from kvquant_jax.models import fixed_order as FO
from kvquant_jax.models.llama import forward


class CacheEvalError(RuntimeError):
    """A forward through the cache produced non-finite K/V (nothing was appended)."""


def _log_softmax(logits: jax.Array, cfg) -> jax.Array:
    """float32 log-softmax over the vocabulary (by a fixed pairwise tree under the fixed-order numerics)."""
    lf = logits.astype(jnp.float32)
    return FO.log_softmax(lf, axis=-1) if FO.is_fixed_order(cfg.activation) else jax.nn.log_softmax(lf, axis=-1)


def _gather_nll(logits: jax.Array, targets: jax.Array, cfg) -> jax.Array:
    lp = _log_softmax(logits, cfg)
    return -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _chunk_step(params, cfg, tokens, targets, cache, num_new):
    logits, cache, ok = forward(params, cfg, tokens, cache, num_new)
    return _gather_nll(logits, targets, cfg), cache, ok


def chunked_nll(params, cfg, tokens, policy, chunk: int) -> jax.Array:
    """float32 ``[B, T-1]``: NLL of ``tokens[:, 1:]`` with the segment fed in ``chunk``-token forwards."""
    policy = as_policy(policy)
    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape
    if t < 2:
        raise ValueError(f"need at least 2 tokens per segment, got {t}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    chunk = min(chunk, t)
    n = -(-t // chunk)
    padded = n * chunk
    toks = np.zeros((b, padded), np.int32)
    toks[:, :t] = tokens
    targets = np.zeros((b, padded), np.int32)
    targets[:, : t - 1] = tokens[:, 1:]
    cache = policy.init(cfg, b, padded)
    out = []
    for i in range(n):
        s = i * chunk
        valid = min(chunk, t - s)
        nll, cache, ok = _chunk_step(params, cfg, jnp.asarray(toks[:, s:s + chunk]),
                                     jnp.asarray(targets[:, s:s + chunk]), cache,
                                     jnp.full((b,), valid, jnp.int32))
        if not bool(ok):
            raise CacheEvalError(f"chunk {i} (tokens {s}..{s + valid - 1}) produced non-finite K/V")
        out.append(nll)
    return jnp.concatenate(out, axis=1)[:, : t - 1]


def make_nll_fn(scheme, chunk: int = 128):
    """``nll_fn(params, cfg, tokens[B, T]) -> nll float32 [B, T-1]`` through the cache ``scheme`` (a scheme, a
    per-layer scheme tuple or a :class:`~kvquant_jax.eval.policy.Policy`), fed in ``chunk``-token forwards.

    This is the fast path (see the module doc for how it differs from the serving path)."""
    policy = as_policy(scheme)

    def nll_fn(params, cfg, tokens):
        return chunked_nll(params, cfg, tokens, policy, chunk)

    return nll_fn


# --------------------------------------------------------------------------------------------- decode path

@functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("cache",))
def _prefill(params, cfg, tokens, cache):
    b, t = tokens.shape
    logits, cache, ok = forward(params, cfg, tokens, cache, logits_at=jnp.full((b,), t - 1, jnp.int32))
    return logits[:, 0], cache, ok


@functools.partial(jax.jit, static_argnames=("cfg", "attention_impl", "mode"), donate_argnames=("cache",))
def _decode_scan(params, cfg, cache, first, forced, targets, free_running, ref=None, *, attention_impl: str,
                 mode: str = "nll"):
    """Decode ``N`` steps (T = 1 forwards) in one compiled scan.

    first: int32 [B] input of step 0; forced: int32 [B, N] teacher inputs of steps 1.. (column i feeds step i + 1;
    ignored when ``free_running`` (a traced bool, so both modes share one compilation): then step i + 1 feeds step
    i's argmax); targets: int32 [B, N] scored tokens.  ``mode``: "nll"; "logprobs" (also the float32 log-softmax
    ``[B, N, V]`` of every step); "compare" (``ref``: a reference's log-softmax ``[B, N, V]``; also
    ``KL(ref || this)`` ``[B, N]`` and top-1 agreement ``[B, N]`` with the reference).
    Returns (nll [B, N], argmax [B, N], extra (tuple per mode), cache, ok).
    """
    b = first.shape[0]
    ones = jnp.ones((b,), jnp.int32)

    def body(carry, xs):
        cache, tok, ok = carry
        nxt_forced, target = xs[:2]
        logits, cache, ok2 = forward(params, cfg, tok[:, None], cache, ones, attention_impl=attention_impl)
        lg = logits[:, 0]
        nll = _gather_nll(lg, target, cfg)
        am = jnp.argmax(lg, axis=-1).astype(jnp.int32)
        nxt = jnp.where(free_running, am, nxt_forced)
        extra = ()
        if mode != "nll":
            lp = _log_softmax(lg, cfg)
            if mode == "logprobs":
                extra = (lp,)
            else:
                lr = xs[2]
                kl = jnp.sum(jnp.exp(lr) * (lr - lp), axis=-1)
                extra = (kl, (jnp.argmax(lr, axis=-1) == am).astype(jnp.float32))
        return (cache, nxt, ok & ok2), (nll, am) + extra

    xs = (forced.T, targets.T) + ((jnp.swapaxes(ref, 0, 1),) if mode == "compare" else ())
    (cache, _, ok), outs = jax.lax.scan(body, (cache, first, jnp.bool_(True)), xs)
    nll, am = outs[0].T, outs[1].T
    extra = tuple(jnp.swapaxes(o, 0, 1) for o in outs[2:])
    return nll, am, extra, cache, ok


def _check_reference(reference_logprobs, b: int, n: int) -> None:
    """``reference_logprobs`` (None, or ``[B, n, V]``) must cover the ``[B, n]`` scored steps."""
    if reference_logprobs is not None and tuple(reference_logprobs.shape[:2]) != (b, n):
        raise ValueError(f"reference_logprobs must be [B, n, V] with [B, n] = {(b, n)}, got "
                         f"{tuple(reference_logprobs.shape)}")


def decode(params, cfg, policy, prompt, n: int, *, targets=None, free_running: bool = False,
           attention_impl: str = "auto", reference_logprobs=None, return_logprobs: bool = False):
    """Prefill ``prompt`` (int32 [B, P]) then decode ``n`` tokens through a fresh cache of ``policy``.

    Teacher-forced (``free_running=False``): ``targets`` int32 [B, n + 1] are the tokens after the prompt; step i
    feeds ``targets[:, i]`` and scores ``targets[:, i + 1]``.  Free-running: step 0 feeds the prefill's argmax,
    step i feeds step i - 1's argmax (greedy), and ``targets`` (optional, [B, n + 1]) are scored as above.
    ``return_logprobs``: also ``logprobs`` float32 [B, n, V] (a device array).  ``reference_logprobs`` ([B, n, V],
    e.g. the full-precision cache's ``logprobs`` on the same tokens): also ``kl`` = KL(reference || this) and
    ``agree`` (argmax equal to the reference's), both float32 [B, n].
    Returns dict(first=[B] prefill argmax, nll=[B, n], argmax=[B, n], ...) as NumPy arrays.
    """
    policy = as_policy(policy)
    prompt = np.asarray(prompt, np.int32)
    b, p = prompt.shape
    if targets is None:
        if not free_running:
            raise ValueError("teacher-forced decode needs targets")
        targets = np.zeros((b, n + 1), np.int32)
    targets = np.asarray(targets, np.int32)
    if targets.shape != (b, n + 1):
        raise ValueError(f"targets must be [B, n + 1] = {(b, n + 1)}, got {targets.shape}")
    _check_reference(reference_logprobs, b, n)
    mode = "compare" if reference_logprobs is not None else "logprobs" if return_logprobs else "nll"
    cache = policy.init(cfg, b, p + n)
    last, cache, ok = _prefill(params, cfg, jnp.asarray(prompt), cache)
    if not bool(ok):
        raise CacheEvalError("prefill produced non-finite K/V")
    first_am = jnp.argmax(last, axis=-1).astype(jnp.int32)
    first = first_am if free_running else jnp.asarray(targets[:, 0])
    forced = jnp.asarray(np.concatenate([targets[:, 1:n], np.zeros((b, 1), np.int32)], axis=1))
    ref = None if reference_logprobs is None else jnp.asarray(reference_logprobs, jnp.float32)
    nll, am, extra, cache, ok = _decode_scan(params, cfg, cache, first, forced, jnp.asarray(targets[:, 1:]),
                                             jnp.bool_(free_running), ref, attention_impl=attention_impl,
                                             mode=mode)
    if not bool(ok):
        raise CacheEvalError("a decode step produced non-finite K/V")
    out = {"first": np.asarray(first_am), "nll": np.asarray(nll), "argmax": np.asarray(am)}
    if mode == "logprobs":
        out["logprobs"] = extra[0]
    elif mode == "compare":
        out["kl"], out["agree"] = np.asarray(extra[0]), np.asarray(extra[1])
    return out


def serving_nll(params, cfg, tokens, policy, prefill: int, *, attention_impl: str = "auto") -> np.ndarray:
    """float32 ``[B, N]``: NLL of ``tokens[:, P + 1:]`` (``N = T - P - 1``) on the serving path: prefill
    ``tokens[:, :P]`` at once, then teacher-forced decode one token per forward.

    ``nll[:, i]`` is the prediction of ``tokens[:, P + 1 + i]``, i.e. ``chunked_nll(...)[:, P + i]``.
    """
    return serving_decode(params, cfg, tokens, policy, prefill, attention_impl=attention_impl)["nll"]


# The log-softmax rows one decode call may hold on the device ([rows, N, V] float32, and once more as the scan's
# stacked output): 2 GiB.  SmolLM2's GPU preset (64 segments x 1024 steps x 49,152 vocab) is 12 GiB per copy and
# ran out of memory on the H200 beside other jobs (2026-12-02); it now runs as 7 row blocks of <= 10 segments.
LOGPROB_BLOCK_BYTES = 2 << 30


def rows_per_block(n: int, vocab: int, rows: int, budget_bytes: int = LOGPROB_BLOCK_BYTES) -> int:
    """Rows of one decode call so that its ``[rows, n, vocab]`` float32 log-softmax fits ``budget_bytes``
    (at least 1, at most ``rows``)."""
    return int(max(1, min(rows, budget_bytes // max(1, 4 * n * vocab))))


def serving_decode(params, cfg, tokens, policy, prefill: int, *, attention_impl: str = "auto",
                   reference_logprobs=None, return_logprobs: bool = False,
                   block_bytes: int = LOGPROB_BLOCK_BYTES) -> dict:
    """The serving path of :func:`serving_nll` with :func:`decode`'s extras (``logprobs`` of every scored
    prediction, or ``kl`` / ``agree`` against ``reference_logprobs`` of the same tokens).

    Rows (segments) run in blocks of :func:`rows_per_block` (``block_bytes`` of log-softmax per call) when
    ``logprobs`` are returned or compared, each block through its own fresh cache: every row's computation is
    the same as in one call (rows never interact).  Then ``logprobs`` comes back as host float32
    ``[B, N, V]`` (NumPy), and ``reference_logprobs`` may be host or device; each block's slice goes to the
    device only for its call."""
    tokens = np.asarray(tokens, np.int32)
    b, t = tokens.shape
    n = t - prefill - 1
    if prefill < 1 or n < 1:
        raise ValueError(f"serving path needs 1 <= prefill and at least one decode prediction: prefill {prefill}, "
                         f"{t} tokens")
    _check_reference(reference_logprobs, b, n)
    rb = b
    if return_logprobs or reference_logprobs is not None:
        rb = rows_per_block(n, cfg.vocab_size, b, block_bytes)
    if rb >= b:
        return decode(params, cfg, policy, tokens[:, :prefill], n, targets=tokens[:, prefill:],
                      attention_impl=attention_impl, reference_logprobs=reference_logprobs,
                      return_logprobs=return_logprobs)
    parts = []
    for lo in range(0, b, rb):
        part = decode(params, cfg, policy, tokens[lo:lo + rb, :prefill], n, targets=tokens[lo:lo + rb, prefill:],
                      attention_impl=attention_impl,
                      reference_logprobs=None if reference_logprobs is None else reference_logprobs[lo:lo + rb],
                      return_logprobs=return_logprobs)
        if "logprobs" in part:
            part["logprobs"] = np.asarray(part["logprobs"], np.float32)
        parts.append(part)
    return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}
