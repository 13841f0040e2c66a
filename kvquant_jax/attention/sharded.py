"""One layer's cache append and attention on a ``(data, model)`` mesh: each device works on its own sequences
and KV heads (``shard_map``).

:func:`local_layer` wraps what the model does per layer with the cache -- the scheme's append and the attention
call (the decode dispatch: Pallas kernels or the float32 reference; or the prefill attention).  Under
:func:`kvquant_jax.sharding.mesh_context` it runs inside ``jax.shard_map``: device ``(i, j)`` receives the
sequences of data shard ``i`` and the KV heads of model shard ``j`` (with the query heads of their GQA groups,
which are contiguous: query head ``h`` reads KV head ``h // G``), appends to and reads its own cache shard in place
and returns its heads of the output, so no cache buffer is gathered, scattered across devices or reduced.  (Left
to GSPMD, the batch-indexed row scatter of an append is partitioned with cache-sized all-gathers / all-reduces.)

The cache state's per-device layout is the scheme's own ``field_axes`` (``sharding.layer_specs``).  Reductions the
append makes across sequences or heads (FP8 warm-up scales) see the whole batch through
:func:`kvquant_jax.cache.shards.shard_max`; the per-sequence ``ok`` is AND-ed over the model shards.  A
``heads_replicated`` field (one per-tensor value broadcast to every head, stored replicated) enters replicated,
the append sees its first ``Hkv / model`` entries (all equal) and it leaves broadcast back to every head.  When
``Hkv < model`` the KV heads are replicated and every model shard appends and attends all heads (``q`` is
gathered over ``model``, the output is replicated; the row-parallel output projection takes its own slice).

:func:`shard_layer` is that per-device machinery for any layer body: :func:`local_layer` (the contiguous cache)
and the paged-direct step (``attention.paged.PagedStep.layer_step``: pools split over KV heads only, the batch,
page table and lengths replicated, ``batch_axis=None``) both run through it.
"""
from __future__ import annotations

from typing import Callable

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kvquant_jax import sharding as S
from kvquant_jax.cache.interface import HEADS_REPLICATED
from kvquant_jax.cache.shards import split_over

__all__ = ["local_layer", "shard_layer"]


def _replicated_fields(scheme, state) -> dict[str, int]:
    """``{field: axis}`` of the heads_replicated axis of each such field."""
    axes = scheme.field_axes(state)
    return {f: ax.index(HEADS_REPLICATED) for f, ax in axes.items() if HEADS_REPLICATED in ax}


def local_layer(attn: Callable, scheme, q: jax.Array, k: jax.Array, v: jax.Array, layer_state, lengths: jax.Array,
                num_new: jax.Array):
    """Append this forward's ``k, v`` to one layer and attend: ``(state', ok [B], out [B, T, Hq, D])``.

    ``attn(q, k, v, view, lengths, num_new) -> [B, T, Hq, D]`` is the attention over ``view`` (the appended state
    where ``scheme.append_keeps_old_view(T)``, else the old one).  ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]``,
    ``layer_state`` one (unstacked) layer of ``scheme``, ``lengths, num_new: int32 [B]``.  Without a mesh the same
    computation runs unsharded.  Raises ``ValueError`` naming the sizes when the mesh does not divide them."""
    t = q.shape[1]

    def step(q, k, v, st, lengths, num_new):
        st2, ok = scheme.append_layer_with_status(st, lengths, k, v, num_new)
        view = st2 if scheme.append_keeps_old_view(t) else st
        return st2, ok, attn(q, k, v, view, lengths, num_new)

    mesh = S.active_mesh()
    if mesh is None:
        return step(q, k, v, layer_state, lengths, num_new)
    S.check_mesh(mesh, batch=q.shape[0], num_heads=q.shape[2], num_kv_heads=k.shape[2])
    specs = S.layer_specs(scheme, layer_state, model=int(mesh.shape[S.MODEL]), batch=q.shape[0],
                          num_kv_heads=k.shape[2])
    return shard_layer(step, scheme, q, k, v, layer_state, specs, lengths, num_new)


def shard_layer(step: Callable, scheme, q: jax.Array, k: jax.Array, v: jax.Array, layer_state, specs, *per_seq,
                batch_axis: str | None = S.DATA):
    """``step(q, k, v, state, *per_seq) -> (state', ok [B], out [B, T, Hq, D])`` run per device of the active mesh
    (``shard_map``) on its sequences and KV heads (module doc): the body of :func:`local_layer` and of the
    paged-direct layer step (``attention.paged.PagedStep``).

    ``q [B, T, Hq, D]``, ``k, v [B, T, Hkv, D]``; ``layer_state`` one layer of ``scheme`` laid out by ``specs``
    (``sharding.layer_specs``, stored layout); ``per_seq``: arrays with a leading batch axis ``[B, ...]`` (lengths,
    num_new, a page table ...).  ``batch_axis``: the mesh axis the batch axis of ``q, k, v``, ``per_seq`` and
    ``ok`` is split over (``data``; None: replicated, the paged cache).  Cross-shard reductions of the append go
    through ``cache.shards`` (:func:`~kvquant_jax.cache.shards.split_over`), ``heads_replicated`` fields are
    sliced to the local heads and broadcast back, ``ok`` is AND-ed over ``model``."""
    mesh = S.active_mesh()
    d, m = int(mesh.shape[S.DATA]), int(mesh.shape[S.MODEL])
    hkv = k.shape[2]
    split_heads = S.kv_heads_sharded(hkv, m) and m > 1
    heads = S.MODEL if split_heads else None
    rows = P(batch_axis, None, heads, None)
    repl = _replicated_fields(scheme, layer_state) if split_heads else {}
    local_h = hkv // m

    def per_device(q, k, v, st, *per_seq):
        fields = {f.name: getattr(st, f.name) for f in dataclasses.fields(st)}
        for name, axis in repl.items():        # every entry holds the same per-tensor value: take the local count
            fields[name] = jax.lax.slice_in_dim(fields[name], 0, local_h, axis=axis)
        with split_over(batch=batch_axis if d > 1 else None, heads=heads):
            st2, ok, out = step(q, k, v, type(st)(**fields), *per_seq)
        fields = {f.name: getattr(st2, f.name) for f in dataclasses.fields(st2)}
        for name, axis in repl.items():
            a = jax.lax.slice_in_dim(fields[name], 0, 1, axis=axis)
            fields[name] = jnp.repeat(a, hkv, axis=axis)
        if split_heads:                         # a sequence is ok iff it is ok on every head of every shard
            ok = jax.lax.pmin(ok.astype(jnp.int32), S.MODEL) > 0
        return type(st2)(**fields), ok, out

    seq_specs = tuple(P(batch_axis, *([None] * (jnp.ndim(a) - 1))) for a in per_seq)
    smap = jax.shard_map(per_device, mesh=mesh, in_specs=(rows, rows, rows, specs) + seq_specs,
                         out_specs=(specs, P(batch_axis), rows), check_vma=False)
    return smap(q, k, v, layer_state, *per_seq)
