"""Offline KVQuant calibration (design notes 0x07A-0x07E) and its artifact.

What is fit, per layer (with the runtime rules of :mod:`kvquant_jax.cache.kvquant`):

* K per-channel thresholds ``lo_c, hi_c`` (per KV head and channel) = the ``f/2`` and ``1 - f/2`` quantiles of the
  calibration keys, ``f = outlier_fraction`` (min / max for ``f = 0``); ``zero_c = (lo_c + hi_c) / 2``,
  ``scale_c = (hi_c - lo_c) / 2``.  Keys are PRE-RoPE unless ``key_stage="post_rope"`` (the ablation).
* One K codebook on the normalized inlier keys ``(k - zero) / scale``, ``|x| <= 1``.
* One V codebook on the per-token normalized inlier values (:func:`kvquant_jax.cache.kvquant.normalize_values`,
  the runtime's V rule including its per-row outliers).
* Codebooks: ``2**bits`` signposts from Fisher-weighted (``weighting="fisher"``) or unweighted k-means
  (:mod:`kvquant_jax.calibration.kmeans`), or the uniform grid ``linspace(-1, 1)`` (``codebook="uniform"``).
* Fisher summary: per layer/head/channel mean squared gradient of K and V, and per-layer weighted SSE of the
  chosen codebook next to the uniform grid's.

With ``sink = n`` the first ``n`` positions of every sample are left out of EVERY statistic (thresholds, codebooks,
Fisher summary): the runtime keeps them unquantized, so they are not part of the population the codes serve (0x07E).

Artifact (:func:`save`/:func:`load`): ``DIR/arrays`` (Orbax checkpoint of the arrays) + ``DIR/manifest.json``
(format, calibration id, the calibration schema, the scheme config, model name/sha256/geometry, tokenizer hash,
corpus name/sha256/split, sample count/length/offsets, seed, RoPE convention and key stage, calibration config,
per-array sha256, date, JAX version).  :func:`load` verifies every array's sha256 (bit-exact round trip) and,
given ``expect_model`` / ``expect_scheme``, raises :class:`~kvquant_jax.cache.schema.IncompatibleSchemaError`
listing every differing field.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from kvquant_jax.cache import checks
from kvquant_jax.artifact import read_artifact, write_artifact
from kvquant_jax.cache.kvquant import BITS, DTYPES
from kvquant_jax.cache.kvquant import (KVQuantScheme, default_outlier_counts, load_calibration, normalize_keys,
                                       normalize_values)
from kvquant_jax.cache.schema import CacheSchema, require_compatible
from kvquant_jax.calibration.fisher import KVActivations, collect, to_post_rope
from kvquant_jax.calibration.kmeans import weighted_kmeans
from kvquant_jax.data import load_corpus
from kvquant_jax.models import load_model
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.validation import check_fields, read_mapping

FORMAT = "kvquant_jax.kvquant_calibration/v1"
CODEBOOKS = ("nuq", "uniform")
WEIGHTINGS = ("fisher", "uniform")
ARRAY_NAMES = ("k_scale", "k_zero", "k_lo", "k_hi", "k_codebook", "v_codebook", "fisher_k", "fisher_v",
               "sse_k", "sse_v", "sse_k_uniform", "sse_v_uniform", "k_outlier_rate")


def _check_scheme_fields(c) -> None:
    """The runtime scheme's fields, checked before any model is loaded (``KVQuantScheme`` checks them again)."""
    for name in ("k_bits", "v_bits"):
        v = getattr(c, name)
        if isinstance(v, bool) or v not in BITS:
            raise ValueError(f"calibration: {name} must be one of {BITS}, got {v!r}")
    for name in ("k_sparse_capacity", "v_outliers", "sink"):
        v = getattr(c, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"calibration: {name} must be a non-negative int, got {v!r}")
    for name in ("qparam_dtype", "sparse_dtype", "residual_dtype"):
        if getattr(c, name) not in DTYPES:
            raise ValueError(f"calibration: {name} must be one of {sorted(DTYPES)}, got {getattr(c, name)!r}")


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
    """Everything that decides a calibration (YAML keys of ``kvq calibrate CONFIG``).

    Attributes:
      model: known model name / path (None: the default SmolLM2-135M-Instruct).  dtype: weight dtype.
      rope_pairing: RoPE convention the model is loaded with.
      corpus: calibration text: None / "wikitext2" (the WikiText-2 VALIDATION split) or a text file.  The
        WikiText-2 test split is refused.
      num_samples, seq_len, batch_size, seed: disjoint seeded windows of the tokenized corpus (no BOS).
      k_bits, v_bits: code widths.  outlier_fraction: nominal dense-and-sparse fraction (K thresholds at the
        ``f/2``, ``1-f/2`` quantiles; V ``default_outlier_counts``).  k_sparse_capacity / v_outliers: explicit
        per-row counts (None: from ``outlier_fraction``).  sink: leading full-precision positions.
      key_stage: "pre_rope" or "post_rope".  codebook: "nuq" (k-means) or "uniform".  weighting: "fisher" or
        "uniform" (unweighted k-means).  kmeans_*: solver settings.
      qparam_dtype, sparse_dtype, residual_dtype: runtime storage dtypes recorded in the scheme.
    """

    model: str | None = None
    dtype: str = "fp32"
    rope_pairing: str = "half_split"
    corpus: str | None = None
    num_samples: int = 16
    seq_len: int = 512
    batch_size: int = 2
    seed: int = 0
    k_bits: int = 4
    v_bits: int = 4
    outlier_fraction: float = 0.01
    k_sparse_capacity: int | None = None
    v_outliers: int | None = None
    sink: int = 1
    key_stage: str = "pre_rope"
    codebook: str = "nuq"
    weighting: str = "fisher"
    kmeans_n_init: int = 4
    kmeans_max_iter: int = 100
    qparam_dtype: str = "fp16"
    sparse_dtype: str = "fp16"
    residual_dtype: str = "fp16"

    def __post_init__(self):
        checks.choice("calibration", self, "codebook", CODEBOOKS)
        checks.choice("calibration", self, "weighting", WEIGHTINGS)
        checks.choice("calibration", self, "key_stage", ("pre_rope", "post_rope"),
                      listing="'pre_rope' or 'post_rope'")
        if not 0.0 <= float(self.outlier_fraction) < 0.5:
            raise ValueError(f"calibration: outlier_fraction must lie in [0, 0.5), got {self.outlier_fraction!r}")
        checks.ints_at_least("calibration", self, ("num_samples", "seq_len", "batch_size", "kmeans_n_init",
                                                   "kmeans_max_iter"), 1)
        _check_scheme_fields(self)
        if self.seq_len <= self.sink + 1:
            raise ValueError(f"calibration: seq_len ({self.seq_len}) must exceed sink + 1 ({self.sink + 1})")
        if self.corpus is not None and "wiki.test" in str(self.corpus):
            raise ValueError(f"calibration: {self.corpus!r} is the WikiText-2 TEST split; calibrate on the "
                             "validation split (corpus: null or 'wikitext2') or another text")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CalibrationConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"calibration config: unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
        check_fields(cls, d, "calibration config")
        return cls(**d)

    @classmethod
    def from_file(cls, path) -> "CalibrationConfig":
        d = read_mapping(path, "calibration config")
        d = d.get("calibration", d)
        if not isinstance(d, dict):
            raise ValueError(f"calibration config {path}: calibration: expected a mapping, got {type(d).__name__}")
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def counts(self, head_dim: int) -> tuple[int, int]:
        ck, cv = default_outlier_counts(float(self.outlier_fraction), head_dim)
        return (ck if self.k_sparse_capacity is None else self.k_sparse_capacity,
                cv if self.v_outliers is None else self.v_outliers)

    def scheme(self, cfg: LlamaConfig, *, calibration_id: str = "uncalibrated", model_id: str = "",
               tokenizer_hash: str = "") -> KVQuantScheme:
        ck, cv = self.counts(cfg.head_dim)
        return KVQuantScheme(k_bits=self.k_bits, v_bits=self.v_bits, k_sparse_capacity=ck, v_outliers=cv,
                             sink=self.sink, qparam_dtype=self.qparam_dtype, sparse_dtype=self.sparse_dtype,
                             residual_dtype=self.residual_dtype, calibration_id=calibration_id,
                             key_stage=self.key_stage, rope_theta=float(cfg.rope_theta),
                             rope_pairing=cfg.rope_pairing, model_id=model_id, tokenizer_hash=tokenizer_hash)


def model_id(cfg: LlamaConfig) -> str:
    """The ``model_id`` a calibrated scheme is bound to: name plus the weights' sha256 prefix."""
    return f"{cfg.name}@{cfg.sha256[:16]}" if cfg.sha256 else cfg.name


def model_record(cfg: LlamaConfig) -> dict[str, Any]:
    """Model identity fields an artifact must match (compared field by field on :func:`load`)."""
    return {"name": cfg.name, "sha256": cfg.sha256, "num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rope_theta": float(cfg.rope_theta), "rope_pairing": cfg.rope_pairing}


@dataclasses.dataclass
class KVQuantCalibration:
    """A calibration result: per-layer arrays (:data:`ARRAY_NAMES`, NumPy, layer-major), the calibration schema
    they serve (``KVQuantScheme.calibration_schema()``) and the provenance manifest."""

    arrays: dict
    schema: CacheSchema
    manifest: dict

    @property
    def calibration_id(self) -> str:
        return self.schema.calibration_id

    def scheme(self, **runtime) -> KVQuantScheme:
        """The runtime scheme this artifact serves; ``runtime`` may override ``k_sparse_capacity`` and
        ``kernel_family`` (the choices the calibration does not depend on)."""
        allowed = {"k_sparse_capacity", "kernel_family"}
        bad = set(runtime) - allowed
        if bad:
            raise ValueError(f"KVQuantCalibration.scheme: {sorted(bad)} are fixed by the calibration; "
                             f"only {sorted(allowed)} may be overridden")
        cfg = dict(self.manifest["scheme_config"])
        cfg.pop("family", None)
        cfg.update(runtime)
        return KVQuantScheme(**cfg)

    def install(self, cache):
        """:func:`kvquant_jax.cache.kvquant.load_calibration` of this artifact into a fresh ``cache``."""
        return load_calibration(cache, self)


# ----------------------------------------------------------------------------------------------------------------
# fitting
# ----------------------------------------------------------------------------------------------------------------
def _codebook(points, weights, bits, config: CalibrationConfig, seed: int):
    if config.codebook == "uniform":
        return np.linspace(-1.0, 1.0, 2 ** bits, dtype=np.float32)
    w = weights if config.weighting == "fisher" else None
    if w is not None and not (w > 0).any():       # a layer whose loss ignores it: fall back to unweighted
        w = None
    return weighted_kmeans(points, w, bits=bits, seed=seed, n_init=config.kmeans_n_init,
                           max_iter=config.kmeans_max_iter).centers


def _sse(points, weights, codebook) -> float:
    """Weighted SSE of the nearest-signpost reconstruction (float64 NumPy, the nuq tie rule)."""
    c = np.asarray(codebook, np.float32)
    mids = c[:-1] * np.float32(0.5) + c[1:] * np.float32(0.5)
    a = np.searchsorted(mids, np.asarray(points, np.float32), side="left")
    return float(np.sum(np.asarray(weights, np.float64) * np.square(points - c[a].astype(np.float64))))


def fit(acts: KVActivations, cfg: LlamaConfig, config: CalibrationConfig) -> dict[str, np.ndarray]:
    """Per-layer calibrated arrays (:data:`ARRAY_NAMES`) from collected activations (no I/O, deterministic)."""
    L, n, t, h, d = acts.k.shape
    if (L, h, d) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
        raise ValueError(f"calibration: activations [L={L}, Hkv={h}, D={d}] do not match the model "
                         f"[L={cfg.num_layers}, Hkv={cfg.num_kv_heads}, D={cfg.head_dim}]")
    if config.sink >= t:
        raise ValueError(f"calibration: sink {config.sink} leaves no token of the {t}-token samples")
    _, cv = config.counts(d)
    f = float(config.outlier_fraction)
    keep = slice(config.sink, None)                 # the sink rows are not part of the quantized population
    out = {name: [] for name in ARRAY_NAMES}
    for layer in range(L):
        k, gk = acts.k[layer], acts.grad_k[layer]
        if config.key_stage == "post_rope":
            k, gk = to_post_rope(k, cfg), to_post_rope(gk, cfg)
        k = k[:, keep].reshape(-1, h, d).astype(np.float64)
        fk = np.square(gk[:, keep].reshape(-1, h, d).astype(np.float64))
        v = acts.v[layer][:, keep].reshape(-1, h, d)
        fv = np.square(acts.grad_v[layer][:, keep].reshape(-1, h, d).astype(np.float64))
        lo = np.quantile(k, f / 2, axis=0) if f else k.min(axis=0)
        hi = np.quantile(k, 1 - f / 2, axis=0) if f else k.max(axis=0)
        lo32, hi32 = lo.astype(np.float32), hi.astype(np.float32)
        zero = (lo32 * np.float32(0.5) + hi32 * np.float32(0.5)).astype(np.float32)
        scale = np.maximum(hi32 * np.float32(0.5) - lo32 * np.float32(0.5), np.float32(1e-6)).astype(np.float32)
        xk = np.asarray(normalize_keys(k.astype(np.float32), zero, scale))
        ink = np.abs(xk) <= 1.0
        xv, inv = (np.asarray(a) for a in normalize_values(v, cv, config.qparam_dtype))
        seed_k, seed_v = config.seed * 1000003 + 2 * layer, config.seed * 1000003 + 2 * layer + 1
        pk, wk, pv, wv = xk[ink], fk[ink].astype(np.float32), xv[inv], fv[inv].astype(np.float32)
        cbk = _codebook(pk, wk, config.k_bits, config, seed_k)
        cbv = _codebook(pv, wv, config.v_bits, config, seed_v)
        out["k_lo"].append(lo32)
        out["k_hi"].append(hi32)
        out["k_zero"].append(zero)
        out["k_scale"].append(scale)
        out["k_codebook"].append(cbk)
        out["v_codebook"].append(cbv)
        out["fisher_k"].append(fk.mean(axis=0).astype(np.float32))
        out["fisher_v"].append(fv.mean(axis=0).astype(np.float32))
        unit_k = wk if config.weighting == "fisher" else np.ones_like(pk)
        unit_v = wv if config.weighting == "fisher" else np.ones_like(pv)
        out["sse_k"].append(np.float32(_sse(pk, unit_k, cbk)))
        out["sse_v"].append(np.float32(_sse(pv, unit_v, cbv)))
        out["sse_k_uniform"].append(np.float32(_sse(pk, unit_k, np.linspace(-1, 1, 2 ** config.k_bits,
                                                                            dtype=np.float32))))
        out["sse_v_uniform"].append(np.float32(_sse(pv, unit_v, np.linspace(-1, 1, 2 ** config.v_bits,
                                                                            dtype=np.float32))))
        out["k_outlier_rate"].append(np.float32(1.0 - ink.mean()))
    return {name: np.stack(vals).astype(np.float32) for name, vals in out.items()}


def _digest_arrays(arrays: dict) -> dict[str, str]:
    return {n: hashlib.sha256(np.ascontiguousarray(arrays[n]).tobytes()).hexdigest() for n in sorted(arrays)}


def build(arrays: dict, cfg: LlamaConfig, config: CalibrationConfig, *, tokenizer_hash: str = "",
          corpus: dict | None = None, acts: KVActivations | None = None, seconds: float | None = None
          ) -> KVQuantCalibration:
    """Assemble a :class:`KVQuantCalibration` (calibration id = sha256 over the arrays, the config and the
    model / tokenizer / corpus identity)."""
    sha = _digest_arrays(arrays)
    ident = {"arrays": sha, "config": dataclasses.asdict(config), "model": model_record(cfg),
             "tokenizer_hash": tokenizer_hash, "corpus": corpus or {}}
    cal_id = "kvquant-" + hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    scheme = config.scheme(cfg, calibration_id=cal_id, model_id=model_id(cfg), tokenizer_hash=tokenizer_hash)
    manifest = {
        "format": FORMAT, "calibration_id": cal_id, "schema": scheme.calibration_schema().to_dict(),
        "scheme_config": scheme.config(), "model": model_record(cfg), "model_id": model_id(cfg),
        "tokenizer_hash": tokenizer_hash, "corpus": corpus or {},
        "num_samples": None if acts is None else acts.num_samples,
        "seq_len": None if acts is None else acts.seq_len,
        "sample_starts": None if acts is None else [int(s) for s in acts.starts],
        "calibration_nll": None if acts is None else acts.nll,
        "seed": config.seed,
        "rope": {"theta": float(cfg.rope_theta), "pairing": cfg.rope_pairing, "key_stage": config.key_stage},
        "config": dataclasses.asdict(config),
        "arrays": {n: {"shape": list(arrays[n].shape), "dtype": str(arrays[n].dtype), "sha256": sha[n]}
                   for n in sorted(arrays)},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__, "seconds": seconds,
    }
    return KVQuantCalibration(arrays=dict(arrays), schema=scheme.calibration_schema(), manifest=manifest)


def calibrate_loaded(params, cfg: LlamaConfig, token_ids, config: CalibrationConfig, *, tokenizer_hash: str = "",
                     corpus: dict | None = None, acts: KVActivations | None = None,
                     progress: bool = False) -> KVQuantCalibration:
    """Collect (unless ``acts`` is given) and fit.  ``token_ids``: the tokenized calibration corpus."""
    t0 = time.perf_counter()
    if acts is None:
        acts = collect(params, cfg, token_ids, num_samples=config.num_samples, seq_len=config.seq_len,
                       seed=config.seed, batch_size=config.batch_size, progress=progress)
    arrays = fit(acts, cfg, config)
    return build(arrays, cfg, config, tokenizer_hash=tokenizer_hash, corpus=corpus, acts=acts,
                 seconds=time.perf_counter() - t0)


def load_calibration_corpus(spec: str | None):
    """The calibration text (WikiText-2 VALIDATION by default; the test split is refused)."""
    corpus = load_corpus(spec, split="validation", fallback=False)
    if "wiki.test" in corpus.source:
        raise ValueError(f"calibration corpus {corpus.source} is the WikiText-2 test split")
    return corpus


def calibrate(config: CalibrationConfig, *, progress: bool = False) -> KVQuantCalibration:
    """End to end: load the model and the calibration corpus, collect K/V + Fisher, fit, return the artifact."""
    corpus = load_calibration_corpus(config.corpus)      # first: a missing corpus fails before the model loads
    m = load_model(config.model, dtype=config.dtype, rope_pairing=config.rope_pairing)
    ids = m.tokenizer.encode(corpus.text)
    rec = {"name": corpus.name, "source": corpus.source, "sha256": corpus.sha256, "split": "validation",
           "tokens": len(ids)}
    return calibrate_loaded(m.params, m.cfg, ids, config, tokenizer_hash=m.tokenizer.hash, corpus=rec,
                            progress=progress)


# ----------------------------------------------------------------------------------------------------------------
# artifact I/O
# ----------------------------------------------------------------------------------------------------------------
def save(calibration: KVQuantCalibration, path) -> Path:
    """Write ``path/arrays`` (Orbax) and ``path/manifest.json``; ``path`` must not exist (artifacts are
    immutable)."""
    return write_artifact(path, calibration.arrays, calibration.manifest, "kvquant calibration")


def load(path, *, expect_model: LlamaConfig | None = None, expect_scheme: KVQuantScheme | None = None,
         expect_tokenizer_hash: str | None = None) -> KVQuantCalibration:
    """Read an artifact written by :func:`save`, verify every array's sha256 against the manifest, and check it.

    Raises ``ValueError`` for a missing / malformed artifact or a checksum mismatch, and
    :class:`~kvquant_jax.cache.schema.IncompatibleSchemaError` naming every differing field when the model
    (``expect_model``: name, sha256, layers, KV heads, head_dim, RoPE theta/pairing), the tokenizer or the scheme's
    calibration schema (bits, sink, key stage, outliers, dtypes, calibration id, model, ...) does not match.
    """
    path = Path(path).absolute()
    man, arrays = read_artifact(path, FORMAT, "kvquant calibration")
    specs = man["arrays"]
    sha = _digest_arrays(arrays)
    bad = [n for n in specs if sha[n] != specs[n]["sha256"]]
    if bad:
        raise ValueError(f"kvquant calibration: {path}: arrays {bad} do not match their recorded sha256 "
                         "(corrupted artifact)")
    cal = KVQuantCalibration(arrays=arrays, schema=CacheSchema.from_dict(man["schema"]), manifest=man)
    if cal.schema.calibration_id != man["calibration_id"]:
        raise ValueError(f"kvquant calibration: {path}: schema calibration_id {cal.schema.calibration_id!r} != "
                         f"manifest {man['calibration_id']!r}")
    if expect_model is not None:
        require_compatible(man["model"], model_record(expect_model), what=f"KVQuant calibration {path} (model)")
    if expect_tokenizer_hash is not None:
        require_compatible({"tokenizer_hash": man["tokenizer_hash"]}, {"tokenizer_hash": expect_tokenizer_hash},
                           what=f"KVQuant calibration {path} (tokenizer)")
    if expect_scheme is not None:
        require_compatible(cal.schema, expect_scheme.calibration_schema(), what=f"KVQuant calibration {path}")
    return cal


def summary(calibration: KVQuantCalibration) -> dict[str, Any]:
    """A small JSON-able digest (printed by ``kvq calibrate``)."""
    a = calibration.arrays
    return {"calibration_id": calibration.calibration_id, "layers": int(a["k_scale"].shape[0]),
            "k_codebook_layer0": [round(float(x), 4) for x in a["k_codebook"][0]],
            "v_codebook_layer0": [round(float(x), 4) for x in a["v_codebook"][0]],
            "mean_k_outlier_rate": float(a["k_outlier_rate"].mean()),
            "sse_k_vs_uniform": float(a["sse_k"].sum() / max(a["sse_k_uniform"].sum(), 1e-30)),
            "sse_v_vs_uniform": float(a["sse_v"].sum() / max(a["sse_v_uniform"].sum(), 1e-30)),
            "fisher_k_by_layer": [float(x) for x in a["fisher_k"].mean(axis=(1, 2))],
            "fisher_v_by_layer": [float(x) for x in a["fisher_v"].mean(axis=(1, 2))],
            "calibration_nll": calibration.manifest.get("calibration_nll"),
            "seconds": calibration.manifest.get("seconds")}
