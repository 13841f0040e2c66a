"""Config ``cache`` block -> a per-layer cache policy the evaluation metrics run with.

Scheme names are the registry's (``kvquant_jax.cache.registry.make_scheme``) plus the evaluation-only ones in
:data:`EVAL_SCHEMES` (the simulated KIVI axis ablation).  A policy is the per-layer scheme tuple plus the
calibrated FP8 scales (if any layer needs them), loaded into every fresh cache before its first append.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from kvquant_jax.cache.interface import CacheScheme, KVCache, init_cache
from kvquant_jax.eval.ablation import AxisAblationScheme

# name -> (class, fixed constructor arguments, aliases)
EVAL_SCHEMES: dict[str, tuple[type, dict, dict]] = {
    "kivi_axes": (AxisAblationScheme, {}, {"bits": ("k_bits", "v_bits"), "residual_length": ("residual",)}),
}
# schemes built from a calibration artifact: name -> (the config key naming the artifact, runtime options allowed)
ARTIFACT_SCHEMES: dict[str, tuple[str, frozenset]] = {
    "kvquant": ("calibration.kvquant", frozenset({"k_sparse_capacity", "kernel_family"})),
}


def make_scheme(spec: dict[str, Any], *, rope_theta: float = 10000.0, rope_pairing: str = "half_split") -> CacheScheme:
    """A registry scheme or an evaluation-only scheme from a spec mapping ``{"name": ..., **options}``."""
    d = dict(spec)
    name = d.get("name")
    if name not in EVAL_SCHEMES:
        from kvquant_jax.cache.registry import make_scheme as registry_make

        return registry_make(d, rope_theta=rope_theta, rope_pairing=rope_pairing)
    cls, fixed, aliases = EVAL_SCHEMES[name]
    d.pop("name")
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = dict(fixed, rope_theta=rope_theta, rope_pairing=rope_pairing)
    for k, v in d.items():
        if k in aliases:
            for f in aliases[k]:
                kw[f] = v
        elif k in fields and k not in ("rope_theta", "rope_pairing"):
            kw[k] = v
        else:
            allowed = sorted((fields | set(aliases)) - {"rope_theta", "rope_pairing"})
            raise ValueError(f"cache scheme {name!r}: unknown key {k!r}; allowed: {allowed}")
    try:
        return cls(**kw)
    except TypeError as e:
        raise ValueError(f"cache scheme {name!r}: {e}") from None


def _is_fp8_calibrated(spec: dict) -> bool:
    return str(spec.get("name", "")).startswith("fp8") and spec.get("scales", spec.get("scale")) == "calibrated"


def _needs_artifact(spec: dict) -> bool:
    return _is_fp8_calibrated(spec) and not spec.get("k_scales")


def _specs(cfg) -> list[tuple[str, dict]]:
    out = [("cache.scheme", cfg.cache.scheme.to_spec())]
    out += [(f"cache.layers[{i}].scheme", r.scheme.to_spec()) for i, r in enumerate(cfg.cache.layers)]
    if cfg.sweep is not None:
        out.append(("sweep.baseline", cfg.sweep.baseline.to_spec()))
    return out


def needs_kvquant_artifact(cfg) -> bool:
    return any(spec["name"] == "kvquant" for key, spec in _specs(cfg) if key != "sweep.baseline")


def needs_fp8_artifact(cfg) -> bool:
    """Some cache spec of ``cfg`` is FP8 with calibrated scales that come from ``calibration.fp8_scales``."""
    return any(_needs_artifact(spec) for key, spec in _specs(cfg) if key != "sweep.baseline")


def check_specs(cfg, error: Callable[[str, str], Exception]) -> None:
    """Construct every scheme spec of an ``ExperimentConfig``; raise ``error(key, message)`` on the first bad one."""
    for key, spec in _specs(cfg):
        if spec["name"] in ARTIFACT_SCHEMES:
            art_key, allowed = ARTIFACT_SCHEMES[spec["name"]]
            if getattr(cfg.calibration, art_key.split(".")[1]) is None:
                raise error(key, f"{spec['name']} is built from a calibration artifact: set {art_key}")
            bad = sorted(set(spec) - {"name"} - allowed)
            if bad:
                raise error(key, f"{spec['name']}: {bad} are fixed by the calibration artifact; only "
                                 f"{sorted(allowed)} may be set here")
            continue
        if _needs_artifact(spec):
            if cfg.calibration.fp8_scales is None:
                raise error(key, "fp8 scales='calibrated' needs calibration.fp8_scales (a scale artifact .npz, or "
                                 "'observe') or explicit k_scales / v_scales")
            spec = dict(spec, calibration_id=spec.get("calibration_id") or "pending")
        try:
            make_scheme(spec)
        except (ValueError, TypeError) as e:
            raise error(key, str(e)) from None
    for i, r in enumerate(cfg.cache.layers):
        if any(x < 0 for x in r.layers):
            raise error(f"cache.layers[{i}].layers", f"negative layer index in {list(r.layers)}")


@dataclasses.dataclass(frozen=True, eq=False)
class Fp8Scales:
    """Per-layer calibrated FP8 scales ``k, v: float32 [L, Hkv]`` (per-tensor: equal over heads) and their id."""

    k: np.ndarray
    v: np.ndarray
    calibration_id: str
    source: str


@dataclasses.dataclass(frozen=True, eq=False)
class Policy:
    """Per-layer schemes plus what a fresh cache needs before its first append."""

    schemes: tuple
    fp8: Fp8Scales | None = None
    kvquant: object = None          # a KVQuantCalibration installed into every fresh cache

    def init(self, cfg, batch: int, capacity: int) -> KVCache:
        schemes = self.schemes[0] if len(self.schemes) == 1 else self.schemes
        cache = init_cache(schemes, num_layers=cfg.num_layers, batch=batch, capacity=capacity,
                           num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        if self.fp8 is not None:
            from kvquant_jax.cache.fp8 import load_scales

            k, v = self.fp8.k, self.fp8.v
            if all(s.scale_axis == "tensor" for s in self.schemes if needs_fp8_scales(s)):
                k, v = k[:, :1], v[:, :1]          # per-tensor layers take one value per layer
            cache = load_scales(cache, k, v)
        if self.kvquant is not None:
            cache = self.kvquant.install(cache)
        return cache

    def describe(self) -> str:
        from kvquant_jax.cache.mixed import describe

        return describe(self.schemes)


def as_policy(x) -> Policy:
    """A :class:`Policy` from a policy, a scheme (every layer) or a per-layer scheme sequence."""
    if isinstance(x, Policy):
        return x
    if isinstance(x, CacheScheme):
        return Policy(schemes=(x,))
    return Policy(schemes=tuple(x))


def build_policy(cache_cfg, llama_cfg, *, fp8=None, kvquant=None) -> Policy:
    """The per-layer policy of a config ``cache`` block for a model (raises ``ValueError`` naming the key).

    ``fp8``: an :class:`~kvquant_jax.eval.calib.Fp8Calibration` for FP8 layers with ``scales: calibrated`` and no
    explicit ``k_scales`` (its ``calibration_id`` becomes theirs unless the spec names one).
    ``kvquant``: the :class:`~kvquant_jax.calibration.kvquant.KVQuantCalibration` that ``{name: kvquant}`` layers are
    built from (``calibration.scheme(**runtime options)``) and that every fresh cache gets installed."""
    from kvquant_jax.cache.mixed import full_precision_like

    n = llama_cfg.num_layers
    rope = dict(rope_theta=llama_cfg.rope_theta, rope_pairing=llama_cfg.rope_pairing)
    built: dict[str, CacheScheme] = {}
    uses_artifact = False

    def make(spec: dict, key: str) -> CacheScheme:
        nonlocal uses_artifact
        if spec["name"] == "kvquant":
            if kvquant is None:
                raise ValueError(f"{key}: kvquant needs calibration.kvquant (a calibration artifact)")
            return kvquant.scheme(**{k: v for k, v in spec.items() if k != "name"})
        if _needs_artifact(spec):
            if fp8 is None:
                raise ValueError(f"{key}: fp8 scales='calibrated' needs calibration.fp8_scales")
            spec = dict(spec, calibration_id=spec.get("calibration_id") or fp8.calibration_id)
            uses_artifact = True
        k = repr(sorted(spec.items(), key=lambda kv: kv[0]))
        if k not in built:
            try:
                built[k] = make_scheme(spec, **rope)
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
        return built[k]

    base = make(cache_cfg.scheme.to_spec(), "cache.scheme")
    per = [base] * n
    for i, rule in enumerate(cache_cfg.layers):
        bad = [x for x in rule.layers if not 0 <= x < n]
        if bad:
            raise ValueError(f"cache.layers[{i}].layers: {bad} out of range for {n} layers")
        s = make(rule.scheme.to_spec(), f"cache.layers[{i}].scheme")
        for x in rule.layers:
            per[x] = s
    first, last = cache_cfg.full_precision_first, cache_cfg.full_precision_last
    if first + last > n:
        raise ValueError(f"cache.full_precision_first + full_precision_last = {first + last} exceeds the model's "
                         f"{n} layers")
    bad = [x for x in cache_cfg.full_precision_layers if not 0 <= x < n]
    if bad:
        raise ValueError(f"cache.full_precision_layers: {bad} out of range for {n} layers")
    keep = set(range(first)) | set(range(n - last, n)) | set(cache_cfg.full_precision_layers)
    if keep:
        full = full_precision_like(base, cache_cfg.full_precision_dtype)
        per = [full if i in keep else s for i, s in enumerate(per)]
    for s in dict.fromkeys(per):
        try:   # geometry: head_dim / packing / group divisibility for this model
            s.init_layer(1, 1, llama_cfg.num_kv_heads, llama_cfg.head_dim)
        except ValueError as e:
            raise ValueError(f"cache: {e} (model {llama_cfg.name}: head_dim {llama_cfg.head_dim}, "
                             f"{llama_cfg.num_kv_heads} KV heads)") from None
    scales = fp8.scales_for(per, llama_cfg.num_kv_heads) if uses_artifact and any(
        needs_fp8_scales(s) for s in per) else None
    uses_kvquant = any(s.family == "kvquant" for s in per)
    return Policy(schemes=tuple(per), fp8=scales, kvquant=kvquant if uses_kvquant else None)


def needs_fp8_scales(s: CacheScheme) -> bool:
    """An FP8 layer whose calibrated scales come from the artifact (:class:`Fp8Scales`)."""
    from kvquant_jax.cache.fp8 import FP8Scheme

    return isinstance(s, FP8Scheme) and s.scales == "calibrated" and not s.k_scales
