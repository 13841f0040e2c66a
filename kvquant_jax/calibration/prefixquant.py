"""PrefixQuant (design notes 0x08): discover outlier-inducing tokens and serve them as a declared prefix.

Discovery (training-free; the block-wise compensation of the full PrefixQuant method is NOT part of this; 0x08B)
    On calibration sequences (``[BOS] + text``, validation split) record, at every layer, the per-token maximum
    ``m[l, t] = max_j |d[l, t, j]|`` of the ``down_proj`` input ``d = silu(x W_gate) * (x W_up)``.  Token ``t`` is an
    outlier at layer ``l`` when ``m[l, t] > eta * median_t m[l, t]`` (``eta`` default 64), and an outlier token when it
    is one at any layer.  BOS is always appended to the prefix, so BOS positions are not counted;
    ``o = round(mean over sequences of the number of outlier tokens)`` (capped by ``max_tokens``), the ``o`` token
    ids with the most outlier occurrences are chosen (ties: lower id), and the prefix is ``those ids + [BOS]``,
    stored as token ids with the tokenizer hash (strings are not identity).

Serving
    The prefix rows are extracted in full precision (:func:`prefixquant_artifact`: kind ``"prefixquant"``, visibility
    ``"hidden"``) and committed by ``cache.prefix.start_request``; the user's tokens follow at positions ``P + t``
    (``kvquant_jax.serving.prefixed`` does the hidden-prefix accounting: max length, capacity, reported counts).

Static KV scales
    :func:`static_kv_scales` fits per-layer K and V scales on BODY rows only: the prefix rows are full precision at
    run time, so they are excluded from the statistics of the rows that are quantized (0x07E, 0x08C).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache.prefix import PrefixArtifact
from kvquant_jax.calibration.intactkv import extract_prefix
from kvquant_jax.calibration.prefix_model import artifact_rows, prefix_forward
from kvquant_jax.models.config import LlamaConfig


def _batches(tokens: np.ndarray, batch: int):
    for i in range(0, len(tokens), batch):
        yield tokens[i:i + batch]


def down_proj_token_max(params, cfg: LlamaConfig, tokens, artifact: PrefixArtifact | None = None, *,
                        batch: int = 4) -> np.ndarray:
    """float32 ``[L, N, T]``: per-token ``max |down_proj input|`` of every layer for body ``tokens [N, T]`` (after
    the artifact's prefix rows when given; prefix tokens themselves are not recomputed)."""
    tokens = np.asarray(tokens, np.int32)
    pk, pv = artifact_rows(artifact)
    outs = [np.asarray(prefix_forward(params, cfg, jnp.asarray(x), pk, pv, want=("down_max",))["down_max"])
            for x in _batches(tokens, batch)]
    return np.concatenate(outs, axis=1)


def outlier_mask(token_max: np.ndarray, eta: float) -> np.ndarray:
    """bool ``[L, N, T]``: ``token_max > eta * (median over tokens of that layer and sequence)``."""
    med = np.median(token_max, axis=-1, keepdims=True)
    return token_max > eta * med


@dataclasses.dataclass(frozen=True)
class PrefixQuantDiscovery:
    """Result of :func:`discover_prefix` (JSON-able via :meth:`to_dict`)."""

    prefix_token_ids: tuple
    outlier_token_ids: tuple
    o: int
    eta: float
    mean_outlier_tokens: float
    outlier_counts: dict          # token id -> outlier occurrences (BOS excluded)
    bos_outlier_fraction: float   # fraction of BOS positions that were outlier tokens
    sequences: int
    seq_len: int
    tokenizer_hash: str
    bos_id: int

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["prefix_token_ids"] = list(self.prefix_token_ids)
        d["outlier_token_ids"] = list(self.outlier_token_ids)
        d["outlier_counts"] = {str(k): int(v) for k, v in self.outlier_counts.items()}
        return d


def select_prefix(tokens: np.ndarray, outlier_tokens: np.ndarray, *, bos_id: int, eta: float, tokenizer_hash: str,
                  max_tokens: int = 8) -> PrefixQuantDiscovery:
    """The selection rule on given outlier flags (``outlier_tokens``: bool ``[N, T]``, any layer) -- see module doc."""
    tokens = np.asarray(tokens)
    flags = np.asarray(outlier_tokens, bool)
    is_bos = tokens == bos_id
    counted = flags & ~is_bos
    per_seq = counted.sum(axis=1)
    mean = float(per_seq.mean()) if len(per_seq) else 0.0
    o = min(int(np.floor(mean + 0.5)), max_tokens)
    counts = collections.Counter(int(t) for t in tokens[counted])
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    chosen = tuple(t for t, _ in ranked[:o])
    bos_frac = float(flags[is_bos].mean()) if is_bos.any() else 0.0
    return PrefixQuantDiscovery(prefix_token_ids=chosen + (int(bos_id),), outlier_token_ids=chosen, o=len(chosen),
                                eta=float(eta), mean_outlier_tokens=mean, outlier_counts=dict(ranked),
                                bos_outlier_fraction=bos_frac, sequences=int(tokens.shape[0]),
                                seq_len=int(tokens.shape[1]), tokenizer_hash=tokenizer_hash, bos_id=int(bos_id))


def discover_prefix(params, cfg: LlamaConfig, tokens, *, tokenizer_hash: str, bos_id: int | None = None,
                    eta: float = 64.0, max_tokens: int = 8, batch: int = 4) -> PrefixQuantDiscovery:
    """Discover the PrefixQuant prefix on calibration sequences ``tokens [N, T]`` (each should start with BOS)."""
    if eta <= 1:
        raise ValueError(f"discover_prefix: eta must exceed 1, got {eta}")
    tokens = np.asarray(tokens, np.int32)
    stats = down_proj_token_max(params, cfg, tokens, batch=batch)
    flags = outlier_mask(stats, eta).any(axis=0)
    return select_prefix(tokens, flags, bos_id=cfg.bos_id if bos_id is None else bos_id, eta=eta,
                         tokenizer_hash=tokenizer_hash, max_tokens=max_tokens)


def prefixquant_artifact(params, cfg: LlamaConfig, discovery: PrefixQuantDiscovery, *, tokenizer_hash: str,
                         compute_dtype: str = "fp32", dtype: str = "fp32", provenance: dict | None = None
                         ) -> PrefixArtifact:
    """Full-precision rows of the discovered prefix (a hidden prefix).  The tokenizer must be the one that
    produced the discovery."""
    if discovery.tokenizer_hash != tokenizer_hash:
        raise ValueError(f"prefixquant_artifact: discovery was made with tokenizer {discovery.tokenizer_hash}, "
                         f"serving tokenizer is {tokenizer_hash}")
    prov = {"discovery": discovery.to_dict()}
    prov.update(provenance or {})
    return extract_prefix(params, cfg, discovery.prefix_token_ids, tokenizer_hash=tokenizer_hash,
                          compute_dtype=compute_dtype, dtype=dtype, kind="prefixquant", visibility="hidden",
                          provenance=prov)


# ----------------------------------------------------------------------------------------------------------------
# static KV scales (body rows only)
# ----------------------------------------------------------------------------------------------------------------
def body_kv_rows(params, cfg: LlamaConfig, tokens, artifact: PrefixArtifact | None = None, *, batch: int = 4):
    """Exact body K (post-RoPE) and V rows ``[L, N, T, Hkv, D]`` (float32 NumPy) of ``tokens`` after the prefix;
    prefix rows are not among them."""
    tokens = np.asarray(tokens, np.int32)
    pk, pv = artifact_rows(artifact)
    ks, vs = [], []
    for x in _batches(tokens, batch):
        k, v = prefix_forward(params, cfg, jnp.asarray(x), pk, pv, want=("kv",))["kv"]
        ks.append(np.asarray(k))
        vs.append(np.asarray(v))
    return np.concatenate(ks, axis=1), np.concatenate(vs, axis=1)


def fit_static_scale(x: np.ndarray, bits: int, method: str = "mse", grid: int = 20) -> float:
    """One symmetric scale for all of ``x``: "amax" (``max|x| / qmax``) or "mse" (the clip ratio in
    ``{0.25, ..., 1}`` (``grid`` steps) of ``max|x|`` minimizing the quantize-dequantize mean squared error)."""
    qmax = 2 ** (bits - 1) - 1
    amax = float(np.max(np.abs(x)))
    if not np.isfinite(amax):
        raise ValueError("fit_static_scale: non-finite calibration rows")
    if amax == 0:
        return 1.0
    if method == "amax":
        return amax / qmax
    if method != "mse":
        raise ValueError(f"fit_static_scale: method must be 'amax' or 'mse', got {method!r}")
    xs = x.reshape(-1).astype(np.float32)
    best, best_err = amax / qmax, np.inf
    for r in np.linspace(0.25, 1.0, grid):
        s = np.float32(r * amax / qmax)
        err = float(np.mean(np.square(np.clip(np.rint(xs / s), -qmax, qmax) * s - xs)))
        if err < best_err:
            best, best_err = float(s), err
    return best


def static_kv_scales(params, cfg: LlamaConfig, tokens, artifact: PrefixArtifact | None = None, *, bits: int = 4,
                     method: str = "mse", batch: int = 4) -> tuple[np.ndarray, np.ndarray, dict]:
    """Per-layer static per-tensor K and V scales ``[L]`` fitted on body rows of ``tokens`` (prefix rows of
    ``artifact`` excluded).  Returns ``(k_scales, v_scales, info)`` with ``info`` the per-layer amax and the
    calibration population."""
    k, v = body_kv_rows(params, cfg, tokens, artifact, batch=batch)
    ks = np.array([fit_static_scale(k[l], bits, method) for l in range(k.shape[0])], np.float32)
    vs = np.array([fit_static_scale(v[l], bits, method) for l in range(v.shape[0])], np.float32)
    info = {"bits": bits, "method": method, "rows": int(k.shape[1] * k.shape[2]),
            "population": "body rows only (prefix rows excluded)" if artifact is not None else "all rows",
            "prefix_artifact": artifact.artifact_id if artifact is not None else None,
            "k_amax": np.abs(k).max(axis=(1, 2, 3, 4)).tolist(), "v_amax": np.abs(v).max(axis=(1, 2, 3, 4)).tolist()}
    return ks, vs, info


# ----------------------------------------------------------------------------------------------------------------
# outlier report (before vs after the prefix)
# ----------------------------------------------------------------------------------------------------------------
def outlier_summary(token_max: np.ndarray, eta: float, skip_first: int = 0) -> dict[str, Any]:
    """Token-wise outlier magnitude of ``token_max [L, N, T]`` (tokens ``< skip_first`` ignored): per layer the
    mean over sequences of ``max_t m / median_t m``, the overall maximum ratio, and outlier tokens per sequence."""
    m = token_max[:, :, skip_first:]
    med = np.median(m, axis=-1)
    ratio = m.max(axis=-1) / med                                      # [L, N]
    flags = (m > eta * med[..., None]).any(axis=0)                   # [N, T]
    return {"ratio_top_to_median_per_layer": ratio.mean(axis=1).tolist(),
            "max_ratio": float(ratio.max()), "mean_ratio": float(ratio.mean()),
            "max_token_value": float(m.max()),
            "outlier_tokens_per_sequence": float(flags.sum(axis=1).mean()), "eta": float(eta)}
