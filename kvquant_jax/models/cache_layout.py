"""Per-layer cache schemes for a model's layer types: sliding-window layers keep only their window.

``layer_schemes(cfg, schemes)`` takes one scheme (every layer) or a per-layer sequence and returns the per-layer
tuple a model's cache is built from: every "local" (sliding-window) layer of ``cfg`` gets its scheme wrapped in a
:class:`~kvquant_jax.cache.window.WindowScheme` of the model's window (unless it already is one), and every scheme
with RoPE identity fields carries its layer's RoPE base (Gemma-3: 10000 on local layers, 1e6 on global ones), so
the schema of each layer names the rotation its keys really have.  A config without local layers (LLaMA) gets its
schemes back unchanged.  The model is exact with or without the ring (it masks the window itself); the ring only
bounds memory.
"""
from __future__ import annotations

import dataclasses

from kvquant_jax.cache.interface import CacheScheme, KVCache, init_cache
from kvquant_jax.cache.registry import make_scheme
from kvquant_jax.cache.window import WindowScheme
from kvquant_jax.models.config import LlamaConfig


def _with_theta(s: CacheScheme, theta: float) -> CacheScheme:
    names = {f.name for f in dataclasses.fields(s)} if dataclasses.is_dataclass(s) else set()
    if "rope_theta" in names and float(s.rope_theta) != float(theta):
        return dataclasses.replace(s, rope_theta=float(theta))
    if "body" in names:                                    # wrappers (prefix, window): their body's identity
        return dataclasses.replace(s, body=_with_theta(s.body, theta))
    return s


def layer_schemes(cfg: LlamaConfig, schemes, *, ring: bool = True, capacity: int | None = None
                  ) -> tuple[CacheScheme, ...]:
    """Per-layer schemes for ``cfg`` (module doc).  ``ring=False`` keeps full-length storage on local layers; so
    does a ``capacity`` (the cache's rows) within the window, where the ring would only cost memory and time."""
    per = (schemes,) * cfg.num_layers if isinstance(schemes, CacheScheme) else tuple(schemes)
    if len(per) != cfg.num_layers:
        raise ValueError(f"{len(per)} cache schemes for the {cfg.num_layers} layers of {cfg.name}")
    if not cfg.layer_types:
        return per
    out = []
    for i, s in enumerate(per):
        s = _with_theta(s, cfg.layer_rope_theta(i))
        w = cfg.layer_window(i)
        if isinstance(s, WindowScheme) and s.window != w:
            raise ValueError(f"layer {i} of {cfg.name} ({cfg.layer_type(i)}, window {w or 'none'}) cannot use a "
                             f"{s.window}-row window cache")
        if ring and w and (capacity is None or capacity > w) and not isinstance(s, WindowScheme):
            s = WindowScheme(s, window=w)
        out.append(s)
    return tuple(out)


def schemes_by_layer_type(cfg: LlamaConfig, local_spec, global_spec) -> tuple[CacheScheme, ...]:
    """Per-layer schemes from two registry specs: ``local_spec`` on sliding-window layers, ``global_spec`` on the
    others (each with its layer's RoPE base); pass the result through :func:`layer_schemes` for the rings."""
    return tuple(make_scheme(local_spec if cfg.layer_type(i) == "local" else global_spec,
                             rope_theta=cfg.layer_rope_theta(i), rope_pairing=cfg.rope_pairing)
                 for i in range(cfg.num_layers))


def init_model_cache(cfg: LlamaConfig, schemes, *, batch: int, capacity: int, layer_groups: str = "runs",
                     ring: bool = True) -> KVCache:
    """``init_cache`` with :func:`layer_schemes` for the model's geometry."""
    return init_cache(layer_schemes(cfg, schemes, ring=ring, capacity=capacity), num_layers=cfg.num_layers,
                      batch=batch, capacity=capacity, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                      layer_groups=layer_groups)
