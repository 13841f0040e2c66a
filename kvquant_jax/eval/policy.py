"""Config ``cache`` block -> a per-layer cache policy the evaluation metrics run with.

Scheme names are the registry's (``kvquant_jax.cache.registry.make_scheme``: the one registry, the simulated KIVI
axis ablation included); which specs need a calibration artifact is decided with the config
(``kvquant_jax.config.check_specs``).  A policy is the per-layer scheme tuple plus the calibrated FP8 scales (if
any layer needs them), loaded into every fresh cache before its first append.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from kvquant_jax.cache.fp8 import FP8Scheme, load_scales
from kvquant_jax.cache.interface import CacheScheme, KVCache, init_cache
from kvquant_jax.cache.mixed import describe, full_precision_like
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.models.cache_layout import layer_schemes
from kvquant_jax.config import needs_artifact_scales, needs_fp8_artifact, needs_kvquant_artifact
from kvquant_jax.sharding import on_current_mesh

__all__ = ["Fp8Scales", "Policy", "as_policy", "build_policy", "needs_fp8_scales", "needs_fp8_artifact",
           "needs_kvquant_artifact"]


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
        cache = init_cache(layer_schemes(cfg, schemes, capacity=capacity), num_layers=cfg.num_layers, batch=batch,
                           capacity=capacity,
                           num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
        if self.fp8 is not None:
            k, v = self.fp8.k, self.fp8.v
            if all(s.scale_axis == "tensor" for s in self.schemes if needs_fp8_scales(s)):
                k, v = k[:, :1], v[:, :1]          # per-tensor layers take one value per layer
            cache = load_scales(cache, k, v)
        if self.kvquant is not None:
            cache = self.kvquant.install(cache)
        return on_current_mesh(cache)   # under sharding.mesh_context: laid out on the mesh

    def describe(self) -> str:
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
        if needs_artifact_scales(spec):
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
        layers = resolve_layers(rule.layers, llama_cfg, f"cache.layers[{i}].layers")
        s = make(rule.scheme.to_spec(), f"cache.layers[{i}].scheme")
        for x in layers:
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


def resolve_layers(items, llama_cfg, key: str) -> list[int]:
    """Layer indices of a rule's ``layers`` (ints and the layer types "local" / "global" of the model); raises
    ``ValueError`` naming ``key`` for an index out of range or a type the model does not have."""
    n = llama_cfg.num_layers
    types = [llama_cfg.layer_type(i) for i in range(n)]
    out: list[int] = []
    for x in items:
        if isinstance(x, str):
            hit = [i for i, t in enumerate(types) if t == x]
            if not hit:
                raise ValueError(f"{key}: model {llama_cfg.name} has no {x} layers (its layers are "
                                 f"{sorted(set(types))}; 'local' = sliding-window layers)")
            out += hit
        elif not 0 <= x < n:
            raise ValueError(f"{key}: {[x]} out of range for {n} layers")
        else:
            out.append(x)
    return out


def needs_fp8_scales(s: CacheScheme) -> bool:
    """An FP8 layer whose calibrated scales come from the artifact (:class:`Fp8Scales`)."""
    return isinstance(s, FP8Scheme) and s.scales == "calibrated" and not s.k_scales
