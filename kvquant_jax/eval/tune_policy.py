"""Sensitivity-driven per-layer, per-tensor cache policy search (``kvq tune-policy``; issue 20, item 3).

1. **Sensitivity** (calibration text only): for every layer ``l``, tensor ``t`` in {K, V} and candidate format
   ``f``, the mean Δ NLL (nats per scored token) and mean KL(full precision || probe) of next-token distributions
   when ONLY layer ``l``'s ``t`` is stored as ``f`` (the other tensor and every other layer full precision fp32).
   The probe is the fast chunked path of ``eval.quantized_ppl`` restricted to one layer: the float forward is run
   once and its layer inputs kept (shared by every probe), layer ``l`` is fed in ``chunk``-token pieces through a
   real one-layer cache of ``kv:k=f,v=fp32`` (or ``k=fp32,v=f``) -- the queries of a piece see its exact K/V and
   the STORED representation of earlier pieces, exactly what ``llama.forward`` does -- and the later layers run in
   float (an fp32 cache is exact).  One compilation per (format, tensor, layer type): the layer index is traced.
   Models with sliding-window layers (Gemma-3) probe each layer through the cache the evaluation builds for it
   (``models.cache_layout.layer_schemes``: its RoPE base, a window ring on local layers when the segment is longer
   than the window) and segments follow the model's protocol (``[BOS] + text`` when ``cfg.bos_required``).
2. **Search**: a multiple-choice knapsack (``eval.policy_search``) minimizing mean bits/element (the byte
   ledger's logical bits of each layer's tensor at ``bits_length`` tokens -- the target context: codes, qparams,
   residual rows, and on a local layer only the rows its window ring retains -- over the elements of a full-length
   cache) subject to the sum of the chosen items' Δ NLL <= log(1 + budget%) (budget metric ``ppl``) or their KL <=
   budget (``kl``).
3. **Validation**: the chosen policy through the real cache (``eval.quantized_ppl.chunked_nll``) on the same
   calibration tokens against the fp32 cache; when its Δppl exceeds the budget (losses are not exactly additive)
   the internal budget shrinks and the search re-runs (``max_backoff`` times), every attempt recorded.

The policy is written as a config ``cache`` block (``scheme: fp32`` + ``layers`` rules of ``kv`` specs, loaded
back by ``config.from_dict`` and ``eval.policy.build_policy`` before it is written) and a JSON manifest (model
sha256, tokenizer hash, calibration corpus sha256, candidates, budget, sensitivities, choice, bits, validation).
The evaluation split is never read: :func:`check_calibration_text` refuses it.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import struct

from kvquant_jax.cache.kv_split import KVSplitScheme, tensor_bits
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.config import from_dict
from kvquant_jax.data import SPLITS, data_dirs
from kvquant_jax.eval import policy_search
from kvquant_jax.eval.policy import build_policy
from kvquant_jax.eval.quantized_ppl import chunked_nll
from kvquant_jax.eval.ppl import segments
from kvquant_jax.eval.stats import ppl_delta_ci
from kvquant_jax.models.cache_layout import layer_schemes
from kvquant_jax.models.llama import (decoder_layer, embed_tokens, finish_layer, history_positions, is_unstacked,
                                      layer_window, logits_from_hidden, project_qkv, stack_layers)
from kvquant_jax.models.prefill_attention import attend

TENSORS = ("k", "v")
DEFAULT_CANDIDATES = ("fp16", "int8", "kivi4", "int4", "kivi2", "int2")
BUDGET_METRICS = ("ppl", "kl")
BASELINE = "fp32"


class EvaluationSplitError(ValueError):
    """tune-policy was pointed at the evaluation (test) text."""


# --------------------------------------------------------------------------------------------- inputs

def check_calibration_text(split: str | None, corpus: str | None) -> None:
    """Refuse the evaluation text before anything is read: ``split == "test"`` or a corpus path that is the
    WikiText-2 test file (by name, or the file the data directories resolve).  Raises
    :class:`EvaluationSplitError` naming what was given."""
    if split == "test":
        raise EvaluationSplitError("tune-policy reads calibration text only: data.calibration_split is 'test' (the "
                                   "evaluation split); use 'validation'")
    if corpus not in (None, "wikitext2", "builtin"):
        p = Path(corpus).expanduser()
        test_files = [d / SPLITS["test"] for d in data_dirs()]
        if p.name == Path(SPLITS["test"]).name or any(p.resolve() == f.resolve() for f in test_files):
            raise EvaluationSplitError(f"tune-policy reads calibration text only: {corpus} is the WikiText-2 test "
                                       "file (the evaluation split)")


def candidate_scheme(fmt: str, tensor: str, cfg) -> KVSplitScheme:
    """The probe scheme of one candidate: ``tensor`` ("k"/"v") stored as ``fmt``, the other one fp32."""
    if tensor not in TENSORS:
        raise ValueError(f"tensor must be 'k' or 'v', got {tensor!r}")
    rope = dict(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    q, full = make_scheme(fmt, **rope), make_scheme(BASELINE, **rope)
    return KVSplitScheme(k=q, v=full) if tensor == "k" else KVSplitScheme(k=full, v=q)


def per_layer_schemes(scheme, cfg, rows: int) -> tuple:
    """The scheme every layer of ``cfg`` really stores ``scheme`` as in a cache of ``rows`` rows
    (``layer_schemes``: the layer's RoPE base; a window ring on local layers when ``rows`` exceeds the window;
    LLaMA: ``scheme`` on every layer)."""
    return layer_schemes(cfg, (scheme,) * cfg.num_layers, capacity=rows)


def layer_bits(candidates, cfg, rows: int) -> np.ndarray:
    """float64 ``[L, 2, F]``: bits/element of layer ``l``'s tensor (K, V) stored as candidate ``f`` at ``rows``
    tokens -- the ledger's logical bytes of what that layer retains (a local layer's ring keeps about its window,
    however long the context) over the ``Hkv x rows x D`` elements of a full-length tensor, so the mean over every
    item is the cache's bits/element (``eval.footprint``, metadata aside)."""
    if rows < 1:
        raise ValueError(f"bits length (tasks.bytes.length / --context) must be >= 1, got {rows}")
    return np.array([[[tensor_bits(s, t, rows=rows, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
                       for s in per] for t in TENSORS]
                     for per in zip(*(per_layer_schemes(make_scheme(f), cfg, rows) for f in candidates))])


def calibration_segments(ids, seq_len: int, count: int, cfg) -> np.ndarray:
    """int32 ``[count, seq_len]`` consecutive calibration segments in the model's protocol: ``[BOS] + seq_len - 1``
    text tokens each when ``cfg.bos_required`` (Gemma, as ``kvq ppl``), plain text tokens otherwise; raises
    ``ValueError`` when ``ids`` (int ``[N]``) is too short."""
    bos = cfg.bos_id if cfg.bos_required else None
    segs = segments(list(np.asarray(ids).tolist()), seq_len, count, bos_id=bos)
    if len(segs) < count:
        raise ValueError(f"tune-policy calibration: needs {count} segment(s) of {seq_len} tokens"
                         f"{' ([BOS] + text)' if bos is not None else ''} but the corpus has {len(ids)} tokens")
    return segs


# --------------------------------------------------------------------------------------------- the probe

@functools.partial(jax.jit, static_argnames=("cfg",))
def float_trace(params, cfg, tokens):
    """The float forward of ``tokens`` (int32 ``[B, T]``): ``(hidden float32 [L, B, T, H]`` = every layer's
    input, ``logprobs float32 [B, T-1, V]`` = log-softmax of the predictions of ``tokens[:, 1:]``)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    num_new = jnp.full((b,), t, jnp.int32)

    def layer(x, inp):
        return _float_layer(cfg, x, *inp, positions, num_new), x

    n = jax.tree.leaves(params["layers"])[0].shape[0]
    x, hidden = jax.lax.scan(layer, embed_tokens(params, cfg, tokens),
                             (params["layers"], jnp.arange(n, dtype=jnp.int32)))
    return hidden, jax.nn.log_softmax(logits_from_hidden(params, cfg, x)[:, :-1], axis=-1)


def _float_layer(cfg, x, lp, i, positions, num_new):
    """Decoder layer ``i`` (traced int32) without a cache: its RoPE base and attention window (``forward_nocache``)."""
    window = layer_window(cfg, i)
    return decoder_layer(cfg, x, lp, positions, lambda q, k, v: attend(q, k, v, num_new, None, window=window),
                         layer=i)[0]


def layer_through_cache(cfg, lp, x, scheme, chunk: int, layer=None):
    """One decoder layer fed in ``chunk``-token pieces through a fresh one-layer cache of ``scheme`` (the fast
    chunked path of ``llama.forward`` for that layer): x float ``[B, T, H]`` (``T`` a multiple of ``chunk``), lp
    one layer's params -> the layer's output ``[B, T, H]``.  ``layer`` (an int or traced int32; needed when
    layers differ) picks the RoPE base and attention window; a window ring ``scheme`` is read at its rows'
    positions as ``llama.forward`` does."""
    b, t, h = x.shape
    n = t // chunk
    state = scheme.init_layer(b, t, cfg.num_kv_heads, cfg.head_dim)
    full = jnp.full((b,), chunk, jnp.int32)
    window = layer_window(cfg, layer) if cfg.local_layers else None

    def piece(state, inp):
        xc, i = inp
        lengths = jnp.full((b,), i * chunk, jnp.int32)
        positions = lengths[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]
        q, k, v = project_qkv(cfg, xc, lp, positions, layer=layer)
        hist = scheme.materialize_layer(state, lengths)
        if window is None:                                  # every layer unbounded (LLaMA): the plain call
            a = attend(q, k, v, full, hist)
        else:
            a = attend(q, k, v, full, hist, window=window, q_start=lengths,
                       hist_pos=history_positions(scheme, lengths, t))
        return scheme.append_layer(state, lengths, k, v, full), finish_layer(cfg, xc, lp, a)

    xs = jnp.swapaxes(x.reshape(b, n, chunk, h), 0, 1)
    _, out = jax.lax.scan(piece, state, (xs, jnp.arange(n, dtype=jnp.int32)))
    return jnp.swapaxes(out, 0, 1).reshape(b, t, h)


@functools.partial(jax.jit, static_argnames=("cfg", "scheme", "chunk"))
def probe(params, cfg, tokens, hidden, ref_logprobs, layer, scheme, chunk: int):
    """``(nll, kl)`` float32 ``[B, T-1]`` with only ``layer`` (a traced int) cached as ``scheme`` (the scheme
    that layer really stores: :func:`per_layer_schemes`): that layer
    through :func:`layer_through_cache` from its float input ``hidden[layer]``, the later layers in float.
    ``kl`` = KL(``ref_logprobs`` || probe) per prediction."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    num_new = jnp.full((b,), t, jnp.int32)
    lp_l = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), params["layers"])
    x = layer_through_cache(cfg, lp_l, hidden[layer].astype(hidden.dtype), scheme, chunk, layer)

    def later(x, inp):
        lp, i = inp
        run = lambda x: _float_layer(cfg, x, lp, i, positions, num_new)
        return jax.lax.cond(i > layer, run, lambda x: x, x), None

    n = hidden.shape[0]
    x, _ = jax.lax.scan(later, x, (params["layers"], jnp.arange(n, dtype=jnp.int32)))
    lp = jax.nn.log_softmax(logits_from_hidden(params, cfg, x)[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    kl = jnp.sum(jnp.exp(ref_logprobs) * (ref_logprobs - lp), axis=-1)
    return nll, kl


@struct.dataclass
class Sensitivity:
    """Measured sensitivities.  ``dnll``, ``kl``: float64 ``[L, 2, F]`` (layer, tensor K/V, candidate) mean Δ NLL
    (nats per scored token, vs the fp32 cache) and mean KL; NaN = not measured (pruned: a more precise format of
    the same item already exceeded ``prune_above``).  ``bits``: float64 ``[L, 2, F]`` (:func:`layer_bits`) or
    ``[2, F]`` (every layer alike) bits/element of each tensor in each candidate format at ``bits_length``
    tokens; :meth:`item_bits` broadcasts.  ``base_nll``: the fp32 cache's mean NLL; ``tokens``: scored
    predictions."""

    dnll: np.ndarray
    kl: np.ndarray
    bits: np.ndarray
    base_nll: float
    candidates: tuple = struct.field(pytree_node=False)
    tokens: int = struct.field(pytree_node=False)
    bits_length: int = struct.field(pytree_node=False)

    def item_bits(self) -> np.ndarray:
        """float64 ``[L, 2, F]``: the bits of every (layer, tensor, candidate)."""
        return np.broadcast_to(self.bits, self.dnll.shape)

    def to_dict(self) -> dict:
        """Plain JSON: ``bits`` per tensor of the first full-length (global) layer, plus ``layer_bits`` (per tensor
        and format, one value per layer) when layers differ."""
        out = []
        for layer in range(self.dnll.shape[0]):
            for ti, t in enumerate(TENSORS):
                for fi, f in enumerate(self.candidates):
                    d, k = self.dnll[layer, ti, fi], self.kl[layer, ti, fi]
                    out.append({"layer": layer, "tensor": t, "format": f,
                                "dnll": None if np.isnan(d) else float(d), "kl": None if np.isnan(k) else float(k)})
        per = self.item_bits()
        full = next((i for i in range(per.shape[0]) if np.all(per[i] >= per.max(axis=0))), 0)
        d = {"base_nll": float(self.base_nll), "scored_tokens": self.tokens, "bits_length": self.bits_length,
             "bits": {t: dict(zip(self.candidates, map(float, per[full, ti]))) for ti, t in enumerate(TENSORS)},
             "per_item": out}
        if not np.all(per == per[:1]):
            d["layer_bits"] = {t: {f: per[:, ti, fi].tolist() for fi, f in enumerate(self.candidates)}
                               for ti, t in enumerate(TENSORS)}
        return d


def sensitivity_from_dict(d: dict) -> Sensitivity:
    """Inverse of :meth:`Sensitivity.to_dict` (a ``sensitivity.json`` or a manifest's ``sensitivity``)."""
    cands = tuple(d["bits"]["k"])
    layers = 1 + max(it["layer"] for it in d["per_item"])
    dnll = np.full((layers, 2, len(cands)), np.nan)
    kl = np.full_like(dnll, np.nan)
    for it in d["per_item"]:
        at = (it["layer"], TENSORS.index(it["tensor"]), cands.index(it["format"]))
        dnll[at] = np.nan if it["dnll"] is None else it["dnll"]
        kl[at] = np.nan if it["kl"] is None else it["kl"]
    bits = np.array([[d["bits"][t][f] for f in cands] for t in TENSORS])
    if "layer_bits" in d:
        bits = np.array([[d["layer_bits"][t][f] for f in cands] for t in TENSORS]).transpose(2, 0, 1)
    return Sensitivity(dnll=dnll, kl=kl, bits=bits, base_nll=d["base_nll"], candidates=cands,
                       tokens=d["scored_tokens"], bits_length=d["bits_length"])


def _bits_order(bits_row, candidates) -> list[int]:
    return sorted(range(len(candidates)), key=lambda j: -bits_row[j])


def measure_sensitivity(params, cfg, tokens, candidates=DEFAULT_CANDIDATES, *, chunk: int = 64,
                        bits_length: int = 2048, prune_above: float = math.inf,
                        log: Callable[[str], None] = lambda m: None) -> Sensitivity:
    """Probe every (layer, tensor, candidate) on ``tokens`` (int32 ``[B, T]``, calibration text in the model's
    protocol (:func:`calibration_segments`); ``T`` a multiple of ``chunk``): each layer through the scheme it
    really stores (:func:`per_layer_schemes` at ``T`` rows).  Bits per item at ``bits_length`` tokens
    (:func:`layer_bits`).  Per item the candidates run from most to fewest bits; once both the Δ NLL and the KL
    of one exceed ``prune_above`` (nats) the cheaper ones are not measured (NaN)."""
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be int32 [B, T >= 2], got shape {tokens.shape}")
    if chunk < 1 or tokens.shape[1] % chunk:
        raise ValueError(f"chunk {chunk} must be >= 1 and divide the calibration segment length {tokens.shape[1]}")
    if not candidates or len(set(candidates)) != len(candidates):
        raise ValueError(f"candidates must be distinct format names, got {list(candidates)}")
    if is_unstacked(params):
        params = stack_layers(params)
    n = cfg.num_layers
    bits = layer_bits(candidates, cfg, bits_length)
    toks = jnp.asarray(tokens)
    hidden, ref = float_trace(params, cfg, toks)
    base_nll = float(-jnp.mean(jnp.take_along_axis(ref, toks[:, 1:, None], axis=-1)))
    dnll = np.full((n, 2, len(candidates)), np.nan)
    kl = np.full_like(dnll, np.nan)
    t0 = time.perf_counter()
    for ti, t in enumerate(TENSORS):
        order = _bits_order(bits.max(axis=0)[ti], candidates)   # by precision
        schemes = {j: per_layer_schemes(candidate_scheme(candidates[j], t, cfg), cfg, tokens.shape[1]) for j in order}
        for layer in range(n):
            for j in order:
                nll, k = probe(params, cfg, toks, hidden, ref, jnp.int32(layer), schemes[j][layer], chunk)
                dnll[layer, ti, j] = float(jnp.mean(nll)) - base_nll
                kl[layer, ti, j] = float(jnp.mean(k))
                if min(dnll[layer, ti, j], kl[layer, ti, j]) > prune_above:
                    break                 # no cost (Δ NLL, KL or their max) can fit this item in the budget
            log(f"sensitivity {t.upper()} layer {layer}: " + " ".join(
                f"{candidates[j]} {dnll[layer, ti, j]:+.4f}" for j in order if not np.isnan(dnll[layer, ti, j]))
                + f" ({time.perf_counter() - t0:.0f} s)")
    return Sensitivity(dnll=dnll, kl=kl, bits=bits, base_nll=base_nll, candidates=tuple(candidates),
                       tokens=int(tokens.shape[0] * (tokens.shape[1] - 1)), bits_length=bits_length)


# --------------------------------------------------------------------------------------------- the policy

@dataclasses.dataclass(frozen=True)
class Choice:
    """The chosen candidate format names per layer: ``k[l]`` for layer ``l``'s keys, ``v[l]`` for its values."""

    k: tuple[str, ...]
    v: tuple[str, ...]

    def items(self) -> list[tuple[str, str]]:
        return list(zip(self.k, self.v))


COSTS = ("max", "kl", "dnll")


def item_costs(sens: Sensitivity, cost: str) -> np.ndarray:
    """float64 ``[L, 2, F]`` per-item cost the search sums: ``"dnll"`` the measured Δ NLL (label-dependent, noisy
    around 0 on short calibration text: a negative value counts 0), ``"kl"`` the mean KL of the next-token
    distributions (>= 0, the expected Δ NLL to first order and far less noisy), ``"max"`` the larger of the two
    (the default: a measured Δ NLL above the KL still counts).  NaN (pruned) stays NaN."""
    if cost not in COSTS:
        raise ValueError(f"cost must be one of {COSTS}, got {cost!r}")
    if cost == "dnll":
        return sens.dnll
    if cost == "kl":
        return sens.kl
    return np.maximum(sens.dnll, sens.kl)


def solve(sens: Sensitivity, metric: str, budget: float, *, cost: str = "max", grid: int = 1000) -> Choice:
    """The minimum-bits choice whose summed per-item cost (:func:`item_costs`) fits the budget
    (``policy_search.solve_exact``): ``budget`` in % ppl for ``metric="ppl"`` (the sum of nats must stay under
    log(1 + budget / 100)), in nats of mean KL for ``"kl"``.  Unmeasured (pruned) options are not allowed."""
    if metric not in BUDGET_METRICS:
        raise ValueError(f"budget metric must be one of {BUDGET_METRICS}, got {metric!r}")
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 0):
        raise ValueError(f"budget must be a finite number >= 0, got {budget!r}")
    per_item = item_costs(sens, cost)
    limit = math.log1p(budget / 100.0) if metric == "ppl" else budget
    n, _, f = per_item.shape
    flat_cost = np.where(np.isnan(per_item), np.inf, per_item).reshape(n * 2, f)
    flat_bits = sens.item_bits().reshape(n * 2, f)
    pick = policy_search.solve_exact(flat_bits, flat_cost, limit, grid=grid).reshape(n, 2)
    return Choice(k=tuple(sens.candidates[j] for j in pick[:, 0]), v=tuple(sens.candidates[j] for j in pick[:, 1]))


def choice_bits(sens: Sensitivity, choice: Choice) -> float:
    """Mean bits/element of a choice over every layer's K and V (each at its layer's bits)."""
    idx = {f: j for j, f in enumerate(sens.candidates)}
    per = sens.item_bits()
    b = [per[i, 0, idx[k]] for i, k in enumerate(choice.k)] + [per[i, 1, idx[v]] for i, v in enumerate(choice.v)]
    return float(np.mean(b))


def _spec(k: str, v: str) -> Any:
    return k if k == v else {"name": "kv", "k": k, "v": v}


def cache_block(choice: Choice) -> dict:
    """The config ``cache`` block of a choice: ``scheme: fp32`` plus one ``layers`` rule per distinct (K, V)
    format pair (a plain name when K and V agree, else ``{name: kv, k: ..., v: ...}``), layers in ascending order."""
    groups: dict[tuple[str, str], list[int]] = {}
    for layer, kv in enumerate(choice.items()):
        groups.setdefault(kv, []).append(layer)
    rules = [{"layers": layers, "scheme": _spec(*kv)} for kv, layers in
             sorted(groups.items(), key=lambda g: g[1][0])]
    return {"scheme": BASELINE, "layers": rules}


def policy_from_block(block: dict, cfg, experiment: dict | None = None):
    """The per-layer :class:`~kvquant_jax.eval.policy.Policy` a ``cache`` block builds through the config loader
    (``config.from_dict``) and ``build_policy`` -- what ``kvq eval`` will run."""
    loaded = from_dict({**(experiment or {}), "cache": block}, source="tune-policy cache block")
    return build_policy(loaded.cache, cfg)


def choice_schemes(choice: Choice, cfg) -> tuple:
    """The per-layer scheme tuple of a choice (fp32 / fp16 / ... when K and V agree, else ``kv``)."""
    rope = dict(rope_theta=cfg.rope_theta, rope_pairing=cfg.rope_pairing)
    return tuple(make_scheme(_spec(k, v), **rope) for k, v in choice.items())


def validate(params, cfg, tokens, schemes, *, chunk: int, base_nll_per_token=None) -> dict:
    """Δppl of a per-layer policy on ``tokens`` through the real cache (fast chunked path) vs the fp32 cache:
    ``{"nll", "base_nll", "ppl_pct"}`` (``ppl_pct`` = 100 (exp(Δ mean NLL) - 1))."""
    nll = np.asarray(chunked_nll(params, cfg, tokens, tuple(schemes), chunk))
    base = base_nll_per_token if base_nll_per_token is not None else np.asarray(
        chunked_nll(params, cfg, tokens, (make_scheme(BASELINE),) * cfg.num_layers, chunk))
    d = float(nll.mean() - base.mean())
    return {"nll": float(nll.mean()), "base_nll": float(base.mean()), "ppl_pct": 100.0 * math.expm1(d),
            "segment_nll": nll.mean(axis=1).tolist(), "base_segment_nll": base.mean(axis=1).tolist()}


@dataclasses.dataclass(frozen=True)
class TuneResult:
    choice: Choice
    bits: float
    validation: dict
    attempts: tuple
    within_budget: bool


def validated_upper(val: dict, confidence: float) -> float:
    """The upper end of the paired bootstrap ``confidence`` interval of a validation's Δppl in % (needs >= 2
    segments; ``eval.stats.ppl_delta_ci``); the point estimate when the interval cannot be formed."""
    if len(val["segment_nll"]) < 2:
        return val["ppl_pct"]
    ci = ppl_delta_ci(val["segment_nll"], val["base_segment_nll"], confidence=confidence)
    return 100.0 * ci.hi / math.exp(val["base_nll"])


def tune(params, cfg, tokens, sens: Sensitivity, *, metric: str = "ppl", budget: float = 1.0, chunk: int = 64,
         cost: str = "max", max_backoff: int = 4, accept: str = "point", confidence: float = 0.95,
         log: Callable[[str], None] = lambda m: None) -> TuneResult:
    """Search then validate on ``tokens`` (int32 ``[S, T]`` calibration segments; best held out from the probe's:
    the probe's own tokens flatter the policy), backing off the internal budget while the validated Δppl (metric
    "ppl") exceeds ``budget``: each retry solves at ``internal * min(0.8, budget / measured)``.  For metric "kl"
    the validation is recorded, not enforced (the KL of the whole policy is not re-measured).  ``accept``:
    "point" (the validated Δppl must fit) or "upper" (the upper end of its paired bootstrap ``confidence``
    interval over the validation segments must fit: conservative, for small calibration sets)."""
    if accept not in ("point", "upper"):
        raise ValueError(f"accept must be 'point' or 'upper', got {accept!r}")
    base = np.asarray(chunked_nll(params, cfg, tokens, (make_scheme(BASELINE),) * cfg.num_layers, chunk))
    internal, attempts = budget, []
    for attempt in range(max_backoff + 1):
        choice = solve(sens, metric, internal, cost=cost)
        val = validate(params, cfg, tokens, choice_schemes(choice, cfg), chunk=chunk, base_nll_per_token=base)
        bits = choice_bits(sens, choice)
        judged = val["ppl_pct"] if accept == "point" else validated_upper(val, confidence)
        attempts.append({"internal_budget": internal, "bits": bits, "ppl_pct": val["ppl_pct"], "judged": judged})
        log(f"attempt {attempt}: internal budget {internal:.4g} -> {bits:.3f} bits/elem, validated Δppl "
            f"{val['ppl_pct']:+.3f}% (judged {accept}: {judged:+.3f}%)")
        ok = metric != "ppl" or judged <= budget
        if ok or attempt == max_backoff:
            return TuneResult(choice, bits, val, tuple(attempts), ok)
        internal *= min(0.8, budget / max(judged, 1e-12))
    raise AssertionError("unreachable")


def protected_summary(sens: Sensitivity, choice: Choice) -> dict:
    """Which items kept a more precise format (more bits on a full-length layer) than the policy's most common
    format per tensor (the "protected" ones)."""
    out = {}
    full = sens.item_bits().max(axis=0)                   # [2, F]: a full-length layer's bits rank precision
    for ti, (t, fmts) in enumerate(zip(TENSORS, (choice.k, choice.v))):
        common = max(set(fmts), key=fmts.count)
        idx = {f: j for j, f in enumerate(sens.candidates)}
        out[t] = {"typical": common, "protected": [{"layer": i, "format": f} for i, f in enumerate(fmts)
                                                   if full[ti, idx[f]] > full[ti, idx[common]]]}
    return out


def manifest(*, model_sha256: str, tokenizer_hash: str, corpus: dict, sens: Sensitivity, result: TuneResult,
             metric: str, budget: float, settings: dict, cost: str = "max") -> dict:
    """The JSON manifest of a tuned policy (every field plain JSON)."""
    return {"kind": "kvq.tune_policy", "version": 1,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "model_sha256": model_sha256, "tokenizer_hash": tokenizer_hash, "calibration_corpus": corpus,
            "candidates": list(sens.candidates), "budget": {"metric": metric, "value": budget, "cost": cost},
            "settings": settings, "sensitivity": sens.to_dict(),
            "choice": {"k": list(result.choice.k), "v": list(result.choice.v)},
            "bits_per_element": result.bits, "protected": protected_summary(sens, result.choice),
            "validation": {**result.validation, "within_budget": result.within_budget,
                           "attempts": list(result.attempts)},
            "cache": cache_block(result.choice)}


def write_outputs(out: Path, man: dict) -> None:
    """``out/policy.yaml`` (a config with the ``cache`` block: ``base:``-able or ``--set``-able) and
    ``out/manifest.json``."""
    out.mkdir(parents=True, exist_ok=True)
    head = (f"# kvq tune-policy: {man['budget']['metric']} budget {man['budget']['value']}, "
            f"{man['bits_per_element']:.3f} bits/elem, validated Δppl {man['validation']['ppl_pct']:+.3f}% on "
            f"calibration text ({man['calibration_corpus']['name']}); manifest.json has the measurements\n")
    (out / "policy.yaml").write_text(head + yaml.safe_dump({"cache": man["cache"]}, sort_keys=False,
                                                           default_flow_style=None))
    (out / "manifest.json").write_text(json.dumps(man, indent=1, sort_keys=True) + "\n")
