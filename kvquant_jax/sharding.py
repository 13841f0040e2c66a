"""Meshes and PartitionSpecs: the ONE place that states how every array lies on a ``(data, model)`` mesh.

Mesh: axes ``data`` (D: sequences of the batch) and ``model`` (M: tensor parallel over heads / FFN / vocab),
``make_mesh(MeshShape(D, M))``; ``parse_mesh("data=2,model=4")`` is the CLI / config form.

Weights (Megatron-style, :data:`WEIGHT_RULES`, keyed on the parameter's path name; a leading stacked layer axis
``L`` is never sharded):

=====================  =====================  =================================================================
param (float layout)   spec of [K, N] / [V,H]  meaning
=====================  =====================  =================================================================
wq                     (None, model)          column-parallel over query heads (``Hq % M == 0`` required)
wk, wv                 (None, model)          column-parallel over KV heads; replicated when ``Hkv < M``
w_gate, w_up           (None, model)          column-parallel over the FFN width
wo                     (model, None)          row-parallel over heads (the all-reduce after it is the math's)
w_down                 (model, None)          row-parallel over the FFN width (all-reduce after it)
embed [V, H]           (model, None)          over the vocabulary (tied head: the same array)
lm_head [H, V]         (None, model)          over the vocabulary (logits ``[B, T, V]`` vocab-sharded)
norms, 1-D             replicated
=====================  =====================  =================================================================

W8A8 ``QuantLinear`` leaves (``codes [N, K]``, ``scale [N]``, ``w_float [K, N]``, ``active``) follow the same
column / row role on their own axes.  A dimension that the model axis does not divide (FFN width, vocabulary) is
replicated; the head counts are checked (:func:`check_mesh`).

Activations (:data:`ACTIVATIONS`): tokens / lengths over ``data``; the hidden stream ``[B, T, H]`` replicated over
``model`` (after the o / down all-reduces); q / attention output ``[B, T, Hq, D]`` and k / v ``[B, T, Hkv, D]``
heads over ``model``; logits ``[B, T, V]`` vocab over ``model``.

Cache: every field of every scheme, from the scheme's own :meth:`~kvquant_jax.cache.interface.CacheScheme.
field_axes` (logical axes ``batch``, ``heads``, ``heads_replicated``, None): batch over ``data``, KV heads over
``model`` (qparams, residual rings, sparse outliers, sink and prefix rows, per-channel calibrated tables: every
field that has a head axis moves with its head), per-tensor scales replicated, codebooks / positions tables
unsharded on ``model``; ``lengths [B]`` over ``data``.

**Paged cache** (``cache/paged.PagedKVCache``, and the paged-direct step ``attention.paged.PagedStep``):
tensor parallel only.  Every page pool ``[L_g, num_pages + 1, ...]`` has its KV-head axis over ``model`` (with
the heads: codes, per-row qparams, sparse outliers; replicated when ``Hkv < M`` as above); per-sequence fields
(residual rings, sinks) likewise; the page axis, the batch axes, ``page_table [B, max_pages]`` and ``lengths [B]``
are replicated: a page id is global (any slot may map any page: prefix sharing, copy-on-write), so the pools are
one address space that cannot be split over sequences.  The mesh must have ``data = 1``
(:func:`check_paged_mesh`); data parallel serving is one engine (one pool) per data replica.

**Hkv < M** (e.g. 2 KV heads on 4 model shards): the KV heads (wk, wv, every cache field) are REPLICATED on the
model axis and each model shard attends all heads (the attention is computed redundantly; the MLP, the query and
output projections and the vocabulary are still split).  ``Hkv >= M`` must divide: 3 KV heads on 2 shards is
refused, naming the sizes.

Several hosts: :func:`initialize_distributed` (coordinator address, process count and id from arguments or the
environment variables ``KVQ_COORDINATOR``, ``KVQ_NUM_PROCESSES``, ``KVQ_PROCESS_ID``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import socket
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvquant_jax.cache.interface import BATCH, HEADS, HEADS_REPLICATED, KVCache
from kvquant_jax.cache.paged import PAGED
from kvquant_jax.quant.ledger import measured_nbytes

__all__ = ["AXES", "DATA", "MODEL", "MeshShape", "parse_mesh", "make_mesh", "mesh_context", "active_mesh",
           "check_mesh", "check_paged_mesh", "kv_heads_sharded", "current_mesh", "on_current_mesh", "params_on_current_mesh", "param_spec", "param_specs", "place_params", "layer_specs",
           "cache_specs", "paged_cache_specs", "place_cache", "constrain_cache", "activation_spec", "place", "device_ledger",
           "addressable_bytes", "to_host", "initialize_distributed", "WEIGHT_RULES", "ACTIVATIONS"]

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


# ----------------------------------------------------------------------------------------------------------------
# The mesh
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MeshShape:
    """``data`` x ``model`` device counts (both >= 1)."""

    data: int = 1
    model: int = 1

    def __post_init__(self):
        for name in AXES:
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"mesh: {name} must be a positive integer, got {n!r}")

    @property
    def size(self) -> int:
        return self.data * self.model

    def __str__(self) -> str:
        return f"data={self.data},model={self.model}"


def parse_mesh(spec) -> MeshShape:
    """``"data=2,model=4"`` (either key may be left out: 1), a mapping ``{"data": 2, "model": 4}``, a
    :class:`MeshShape` or None (None -> None).  Unknown keys, repeated keys and non-integers raise ``ValueError``
    naming them."""
    if spec is None or isinstance(spec, MeshShape):
        return spec
    if isinstance(spec, dict):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in filter(None, (s.strip() for s in spec.split(","))):
            key, eq, val = part.partition("=")
            if not eq:
                raise ValueError(f"mesh {spec!r}: {part!r} is not axis=size (want e.g. data=2,model=4)")
            items.append((key.strip(), val.strip()))
        if not items:
            raise ValueError(f"mesh {spec!r} is empty (want e.g. data=2,model=4)")
    else:
        raise ValueError(f"mesh must be a string like 'data=2,model=4' or a mapping, got {type(spec).__name__}")
    out: dict[str, int] = {}
    for key, val in items:
        if key not in AXES:
            raise ValueError(f"mesh {spec!r}: unknown axis {key!r} (axes: {', '.join(AXES)})")
        if key in out:
            raise ValueError(f"mesh {spec!r}: axis {key!r} given twice")
        if isinstance(val, bool) or (isinstance(val, float) and not val.is_integer()):
            raise ValueError(f"mesh {spec!r}: {key} must be a positive integer, got {val!r}")
        try:
            n = int(val)
        except (TypeError, ValueError):
            raise ValueError(f"mesh {spec!r}: {key} must be a positive integer, got {val!r}") from None
        if str(val).strip() not in (str(n), f"{n}.0") and not isinstance(val, (int, np.integer)):
            raise ValueError(f"mesh {spec!r}: {key} must be a positive integer, got {val!r}")
        out[key] = n
    return MeshShape(**out)


def make_mesh(shape: MeshShape | str | dict, devices=None) -> Mesh:
    """A ``Mesh`` with axes ``(data, model)`` over the first ``data * model`` of ``devices`` (default every
    device of every process, ``jax.devices()``).  Several processes: the mesh must span every device.  Raises
    ``ValueError`` naming the sizes when there are not enough devices."""
    shape = parse_mesh(shape)
    devs = list(jax.devices() if devices is None else devices)
    if shape.size > len(devs):
        raise ValueError(f"mesh {shape} needs {shape.size} devices, {len(devs)} available "
                         "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX starts)")
    if jax.process_count() > 1 and devices is None and shape.size != len(devs):
        raise ValueError(f"mesh {shape} ({shape.size} devices) must span all {len(devs)} devices of the "
                         f"{jax.process_count()} processes")
    grid = np.array(devs[: shape.size], dtype=object).reshape(shape.data, shape.model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_context(mesh: Mesh | None):
    """``with mesh_context(mesh):`` runs jitted model code on ``mesh`` (``jax.set_mesh``: the model's attention
    then runs per device on its local heads, :mod:`kvquant_jax.attention.sharded`); None: a no-op context."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def active_mesh():
    """The (abstract) mesh of the enclosing :func:`mesh_context` when its axes are ``(data, model)``, else None.
    Readable inside jit (the abstract mesh is part of the trace context)."""
    am = jax.sharding.get_abstract_mesh()
    if am.empty or tuple(am.axis_names) != AXES:
        return None
    return am


def current_mesh() -> Mesh | None:
    """The concrete mesh of the enclosing :func:`mesh_context` (outside jit) when its axes are ``(data, model)``."""
    mesh = jax.sharding.get_mesh()
    if mesh is None or getattr(mesh, "empty", False) or tuple(mesh.axis_names) != AXES:
        return None
    return mesh


def on_current_mesh(cache: KVCache) -> KVCache:
    """``cache`` placed by :func:`place_cache` on the :func:`current_mesh` (unchanged without one): what a
    caller that allocates a fresh cache (``serving.generate``, the evaluation policies) does so that the whole
    computation runs on the mesh the user chose."""
    mesh = current_mesh()
    return cache if mesh is None else place_cache(cache, mesh)


def params_on_current_mesh(params, cfg):
    """``params`` placed by :func:`place_params` on the :func:`current_mesh` (unchanged without one)."""
    mesh = current_mesh()
    return params if mesh is None else place_params(params, cfg, mesh)


def _sizes(mesh) -> tuple[int, int]:
    if isinstance(mesh, MeshShape):
        return mesh.data, mesh.model
    shape = dict(mesh.shape)
    return int(shape[DATA]), int(shape[MODEL])


def kv_heads_sharded(num_kv_heads: int, model: int) -> bool:
    """True when the KV heads are split over the model axis (``Hkv % model == 0``); False: replicated
    (``Hkv < model``; :func:`check_mesh` refuses the other non-dividing cases)."""
    return num_kv_heads % model == 0


def check_mesh(mesh, *, batch: int | None = None, num_heads: int | None = None,
               num_kv_heads: int | None = None) -> None:
    """Raise ``ValueError`` naming the sizes when ``mesh`` (a Mesh or :class:`MeshShape`) does not fit: the batch
    must divide by ``data``, the query heads by ``model``, the KV heads by ``model`` unless fewer KV heads than
    model shards (then they are replicated, see the module doc)."""
    d, m = _sizes(mesh)
    if batch is not None and batch % d:
        raise ValueError(f"mesh data={d} does not divide the batch of {batch} sequences "
                         f"(use a batch that is a multiple of {d}, or data dividing {batch})")
    if num_heads is not None and num_heads % m:
        raise ValueError(f"mesh model={m} does not divide the {num_heads} query heads")
    if num_kv_heads is not None and num_kv_heads >= m and num_kv_heads % m:
        raise ValueError(f"mesh model={m} does not divide the {num_kv_heads} KV heads "
                         f"(model must divide {num_kv_heads}, or exceed it: then KV heads are replicated)")


def check_paged_mesh(mesh, *, num_heads: int | None = None, num_kv_heads: int | None = None) -> None:
    """:func:`check_mesh` for a paged cache, which also needs ``data == 1``: its page pools are one address space
    shared by every sequence slot (a page id is global), so they are split over KV heads only (module doc).
    Raises ``ValueError`` naming the sizes."""
    d, m = _sizes(mesh)
    if d != 1:
        raise ValueError(f"paged cache on mesh data={d},model={m}: the page pools are one address space shared "
                         "by every sequence (a page id is global), so the paged path is tensor parallel only -- "
                         f"use data=1 (model={m}) and one engine per data replica")
    check_mesh(mesh, num_heads=num_heads, num_kv_heads=num_kv_heads)


# ----------------------------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------------------------
#: (regex on a parameter's name, role): "q_col" / "kv_col" / "ffn_col" (column-parallel: output axis N over
#: model), "heads_row" / "ffn_row" (row-parallel: input axis K over model), "vocab_rows" (``[V, H]``),
#: "vocab_cols" (``[H, V]``), "replicated".  The first match wins.
WEIGHT_RULES: tuple[tuple[str, str], ...] = (
    (r"wq", "q_col"), (r"wk|wv", "kv_col"), (r"w_gate|w_up", "ffn_col"),
    (r"wo", "heads_row"), (r"w_down", "ffn_row"),
    (r"embed", "vocab_rows"), (r"lm_head|lm_head_q", "vocab_cols"),
    (r".*norm.*", "replicated"),
)
_QUANT_LEAVES = ("codes", "scale", "w_float", "active")


def _path_names(path) -> list[str]:
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return out


def _role(names: list[str]) -> tuple[str | None, str | None]:
    """(role, QuantLinear leaf or None) of a parameter path."""
    leaf = names[-1] if names and names[-1] in _QUANT_LEAVES and len(names) > 1 else None
    name = names[-2] if leaf else (names[-1] if names else "")
    for pattern, role in WEIGHT_RULES:
        if re.fullmatch(pattern, name):
            return role, leaf
    return None, leaf


def param_spec(path, shape: tuple[int, ...], *, model: int, num_kv_heads: int) -> P:
    """The PartitionSpec of one parameter (``path``: a key path or "a/b/c" string; ``shape`` of the leaf)."""
    names = path.split("/") if isinstance(path, str) else _path_names(path)
    role, leaf = _role(names)
    nd = len(shape)
    if role is None:
        if nd <= 1:
            return P()
        raise ValueError(f"sharding: no rule for parameter {'/'.join(names)!r} of shape {tuple(shape)} "
                         "(add one to kvquant_jax.sharding.WEIGHT_RULES)")
    if role == "replicated" or leaf == "active" or nd == 0:
        return P()
    col = role in ("q_col", "kv_col", "ffn_col", "vocab_cols")
    # which axis holds N (output) / K (input) for this leaf layout
    if role == "vocab_rows":
        axis = nd - 2                                   # embed [V, H]: V
    elif leaf == "codes":                               # QuantLinear codes [..., N, K]
        axis = nd - 2 if col else nd - 1
    elif leaf == "scale":                               # [..., N]
        if not col:
            return P()
        axis = nd - 1
    else:                                               # float [..., K, N] (and w_float)
        axis = nd - 1 if col else nd - 2
    if role == "kv_col" and not kv_heads_sharded(num_kv_heads, model):
        return P()
    if shape[axis] % model:
        return P()                                      # FFN width / vocabulary the model axis does not divide
    spec: list[Any] = [None] * nd
    spec[axis] = MODEL
    return P(*spec)


def param_specs(params, cfg, mesh) -> Any:
    """PartitionSpecs for a parameter pytree (stacked or unstacked layers, W8A8 leaves included); ``cfg`` needs
    ``num_heads`` and ``num_kv_heads``.  Checks the mesh against the head counts first."""
    _, m = _sizes(mesh)
    check_mesh(mesh, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads)
    return jax.tree_util.tree_map_with_path(
        lambda p, a: param_spec(p, np.shape(a), model=m, num_kv_heads=cfg.num_kv_heads), params)


def place(x, sharding: NamedSharding):
    """Put one array onto ``sharding`` (works across processes: every process passes the same global value)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and x.is_fully_addressable and jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def place_params(params, cfg, mesh: Mesh):
    """``params`` laid out by :func:`param_specs` on ``mesh``."""
    return map_specs(lambda a, s: place(a, NamedSharding(mesh, s)), params, param_specs(params, cfg, mesh))


# ----------------------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------------------
#: activation name -> (logical axes); "heads" / "kv_heads" / "vocab" go over model (kv_heads only when sharded)
ACTIVATIONS: dict[str, tuple] = {
    "tokens": ("batch", None),                      # int32 [B, T]
    "lengths": ("batch",),                          # int32 [B] (also num_new)
    "hidden": ("batch", None, None),                # [B, T, H]: replicated over model between layers
    "q": ("batch", None, "heads", None),            # [B, T, Hq, D] (the attention output too)
    "kv": ("batch", None, "kv_heads", None),        # [B, T, Hkv, D]
    "q_decode": ("batch", "heads", None),           # [B, Hq, D] (one decode step)
    "kv_decode": ("batch", "kv_heads", None),       # [B, Hkv, D]
    "logits": ("batch", None, "vocab"),             # float32 [B, T, V]
}


def activation_spec(name: str, *, kv_sharded: bool = True, vocab_sharded: bool = True,
                    heads_sharded: bool = True) -> P:
    """The PartitionSpec of activation ``name`` (:data:`ACTIVATIONS`)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r} (known: {', '.join(ACTIVATIONS)})")
    on = {"batch": DATA, "heads": MODEL if heads_sharded else None, "kv_heads": MODEL if kv_sharded else None,
          "vocab": MODEL if vocab_sharded else None, None: None}
    return P(*(on[a] for a in ACTIVATIONS[name]))


# ----------------------------------------------------------------------------------------------------------------
# The cache
# ----------------------------------------------------------------------------------------------------------------
def _abstract(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), tree)


def layer_specs(scheme, state, *, model: int, batch: int, num_kv_heads: int, stacked: bool = False,
                compute: bool = False, layout: tuple | None = None):
    """PartitionSpecs of one layer state (``stacked``: a group state ``[L_g, ...]``) from the scheme's
    ``field_axes``, as a pytree of the state's own type.

    ``compute=False``: the STORED layout (``heads_replicated`` fields replicated); ``compute=True``: what a
    per-device computation over local heads receives (``heads_replicated`` sliced with the heads).  Every declared
    ``batch`` axis must have size ``batch`` and every head axis ``num_kv_heads`` (else ``TypeError`` naming the
    scheme and field: a wrong declaration would silently shard the wrong axis).

    ``layout``: the state is a paged-cache group (``cache.paged.FieldLayout`` per field): in a ``paged`` field
    (a pool) the declared batch axis is the page axis (any size); every batch / page axis is then replicated
    (the paged path runs with ``data = 1``, :func:`check_paged_mesh`)."""
    unstacked = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), state) if stacked \
        else _abstract(state)
    axes = scheme.field_axes(unstacked)
    kv_on = MODEL if kv_heads_sharded(num_kv_heads, model) else None
    names = [f.name for f in dataclasses.fields(unstacked)]
    if set(axes) != set(names):
        raise TypeError(f"{type(scheme).__name__}.field_axes names {sorted(axes)}, the state has {sorted(names)}")
    pools = {f.name for f in layout if f.kind == PAGED} if layout is not None else set()
    specs = {}
    for name in names:
        shape, ax = getattr(unstacked, name).shape, axes[name]
        if len(ax) != len(shape):
            raise TypeError(f"{type(scheme).__name__}.field_axes[{name!r}] has {len(ax)} axes for a field of "
                            f"shape {tuple(shape)}")
        spec = []
        for size, a in zip(shape, ax):
            if a == BATCH and layout is not None:
                if size != batch and name not in pools:
                    raise TypeError(f"{type(scheme).__name__}: per-sequence field {name!r} axis declared batch has "
                                    f"size {size}, the cache batch is {batch}")
                spec.append(None)
            elif a == BATCH:
                if size != batch:
                    raise TypeError(f"{type(scheme).__name__}: field {name!r} axis declared batch has size {size}, "
                                    f"the cache batch is {batch}")
                spec.append(DATA)
            elif a in (HEADS, HEADS_REPLICATED):
                if size != num_kv_heads:
                    raise TypeError(f"{type(scheme).__name__}: field {name!r} axis declared heads has size {size}, "
                                    f"the cache has {num_kv_heads} KV heads")
                spec.append(kv_on if (a == HEADS or compute) else None)
            elif a is None:
                spec.append(None)
            else:
                raise TypeError(f"{type(scheme).__name__}.field_axes[{name!r}]: unknown axis {a!r}")
        specs[name] = P(*(([None] if stacked else []) + spec))
    return type(unstacked)(**specs)


def cache_specs(cache, mesh):
    """PartitionSpecs of a whole :class:`KVCache` (a KVCache pytree of ``P``), checking the mesh first.  A paged
    cache (``cache.paged.PagedKVCache``, or any cache value with ``layouts``: ``attention.paged.PagedStep``) gets
    :func:`paged_cache_specs`."""
    if hasattr(cache, "layouts"):
        return paged_cache_specs(cache, mesh)
    d, m = _sizes(mesh)
    check_mesh(mesh, batch=cache.batch, num_kv_heads=cache.num_kv_heads)
    groups = tuple(layer_specs(s, g, model=m, batch=cache.batch, num_kv_heads=cache.num_kv_heads, stacked=True)
                   for (s, _, _), g in zip(cache.schemes, cache.groups))
    return cache.replace(groups=groups, lengths=P(DATA))


def paged_cache_specs(cache, mesh):
    """PartitionSpecs of a paged cache value (``PagedKVCache`` or ``PagedStep``: ``groups``, ``layouts``,
    ``schemes``, ``lengths [B]``, ``num_kv_heads``; same pytree type): pools and per-sequence fields with their KV
    heads over ``model`` (:func:`layer_specs` with the group's ``layout``), every other array (page table,
    lengths, a step's write mask and window starts) replicated.  Checks the mesh (:func:`check_paged_mesh`)."""
    _, m = _sizes(mesh)
    check_paged_mesh(mesh, num_kv_heads=cache.num_kv_heads)
    groups = tuple(layer_specs(s, g, model=m, batch=cache.batch, num_kv_heads=cache.num_kv_heads, stacked=True,
                               layout=lay)
                   for (s, _, _), g, lay in zip(cache.schemes, cache.groups, cache.layouts))
    return jax.tree.map(lambda _: P(), cache.replace(groups=())).replace(groups=groups)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def map_specs(f, tree, specs):
    """``f(leaf, spec)`` over a pytree and its PartitionSpec pytree (specs are leaves, not tuples)."""
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    if len(spec_leaves) != len(leaves):
        raise ValueError(f"{len(spec_leaves)} specs for {len(leaves)} arrays")
    return jax.tree.unflatten(treedef, [f(a, s) for a, s in zip(leaves, spec_leaves)])


def place_cache(cache: KVCache, mesh: Mesh) -> KVCache:
    """``cache`` laid out by :func:`cache_specs` on ``mesh``."""
    return map_specs(lambda a, s: place(a, NamedSharding(mesh, s)), cache, cache_specs(cache, mesh))


def constrain_cache(cache: KVCache) -> KVCache:
    """Inside jit under :func:`mesh_context`: pin every cache array to its :func:`cache_specs` layout (so the
    successor cache a step returns keeps the layout it was given, and donation reuses the buffers); no mesh:
    unchanged."""
    mesh = active_mesh()
    if mesh is None:
        return cache
    return map_specs(lambda a, s: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s)), cache,
                     cache_specs(cache, mesh))


# ----------------------------------------------------------------------------------------------------------------
# Per-device bytes
# ----------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Local:
    """A field's per-device shard as far as the byte ledger looks (``nbytes``, ``shape``)."""

    shape: tuple
    dtype: Any

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize


def _local_shape(shape, spec: P, sizes: dict[str, int]) -> tuple:
    out = list(shape)
    for i, ax in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        if ax is not None:
            out[i] //= sizes[ax]
    return tuple(out)


def device_ledger(cache: KVCache, mesh) -> dict[str, int]:
    """The cache's bytes on ONE device by ledger category (``quant.ledger`` categories, each scheme's own
    ``layer_nbytes`` applied to the per-device shard shapes of :func:`cache_specs`): a field sharded on both axes
    holds ``total / (data * model)`` bytes per device, a replicated one all of them.  Every device holds the same
    (the mesh divides every sharded axis)."""
    d, m = _sizes(mesh)
    sizes = {DATA: d, MODEL: m}
    local = map_specs(lambda a, s: _Local(_local_shape(np.shape(a), s, sizes), a.dtype), cache,
                      cache_specs(cache, mesh))
    return measured_nbytes(local)


def addressable_bytes(cache: KVCache) -> dict[Any, int]:
    """Bytes each addressable device really holds for ``cache`` (summed over the arrays' addressable shards)."""
    out: dict[Any, int] = {}
    for a in jax.tree.leaves(cache):
        for sh in a.addressable_shards:
            out[sh.device] = out.get(sh.device, 0) + int(sh.data.nbytes)
    return out


def to_host(x) -> np.ndarray:
    """A (possibly multi-process, not fully addressable) array as one NumPy array on every process."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


# ----------------------------------------------------------------------------------------------------------------
# Several hosts
# ----------------------------------------------------------------------------------------------------------------
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "KVQ_COORDINATOR", "KVQ_NUM_PROCESSES", "KVQ_PROCESS_ID"


def distributed_args(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, env=None) -> tuple[str, int, int] | None:
    """``(coordinator "host:port", process count, process id)`` from the arguments, else the environment
    (:data:`ENV_COORDINATOR` ...); None when no coordinator is named (single process).  Checks the values."""
    env = os.environ if env is None else env
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    if coordinator is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ValueError("several processes need a coordinator address (--coordinator HOST:PORT or "
                             f"{ENV_COORDINATOR})")
        return None
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator {coordinator!r} is not HOST:PORT")
    vals = {}
    for name, given, var in (("num_processes", num_processes, ENV_NUM_PROCESSES),
                             ("process_id", process_id, ENV_PROCESS_ID)):
        raw = given if given is not None else env.get(var)
        if raw is None:
            raise ValueError(f"a coordinator is set but {name} is not (flag or {var})")
        try:
            vals[name] = int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {raw!r}") from None
        if isinstance(raw, bool) or str(raw).strip() != str(vals[name]):
            raise ValueError(f"{name} must be an integer, got {raw!r}")
    n, i = vals["num_processes"], vals["process_id"]
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"process_id {i} must lie in [0, num_processes={n})")
    return coordinator, n, i


def wait_for_coordinator(address: str, timeout_s: float, *, what: str = "") -> None:
    """Poll a TCP connection to ``address`` ("host:port") until it accepts or ``timeout_s`` passes; then raise
    ``TimeoutError`` naming the address (``what``: who was waiting, for the message)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(1.0, max(timeout_s, 0.1))):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}no coordinator answered at {address} within {timeout_s:g} s (start "
                                   f"process 0 there first, or check --coordinator / {ENV_COORDINATOR}): "
                                   f"{e.strerror or e}") from None
            time.sleep(0.2)


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, timeout_s: int = 300) -> bool:
    """``jax.distributed.initialize`` from arguments or the environment (see :func:`distributed_args`); must run
    before any other JAX call.  Returns False (nothing done) without a coordinator.  On CPU the cross-process
    collectives use gloo.  A process other than 0 first waits up to ``timeout_s`` for the coordinator's port
    (process 0 serves it) and raises ``TimeoutError`` naming the address and the process when it never answers
    (JAX itself would abort the whole process on that deadline, with no Python exception)."""
    args = distributed_args(coordinator, num_processes, process_id)
    if args is None:
        return False
    addr, n, i = args
    t0 = time.monotonic()
    if i != 0:
        wait_for_coordinator(addr, timeout_s, what=f"process {i} of {n}: ")
    # CPU devices of several processes talk through gloo (harmless where the accelerators have their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    left = max(1, int(timeout_s - (time.monotonic() - t0)))
    jax.distributed.initialize(addr, num_processes=n, process_id=i, initialization_timeout=left)
    return True
