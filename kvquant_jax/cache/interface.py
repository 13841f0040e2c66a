"""The contract every KV-cache scheme implements, and the whole-model cache value the model threads through.

Physical layout (all schemes)
-----------------------------
One *layer state* is a ``flax.struct.dataclass`` whose array fields are head-major: ``[B, Hkv, C, ...]`` (batch,
KV head, capacity rows, per-row payload).  ``C`` is the static capacity.  Row ``i`` of sequence ``b`` holds logical
token position ``i`` (prefix rows included, see ``KVCache.lengths``).  Head-major is the layout the decode kernel
reads: one ``(b, h)`` program streams contiguous token rows.

Frontiers are functions of the committed length
-----------------------------------------------
A layer state never stores its own length.  The single committed ``lengths: int32[B]`` lives on :class:`KVCache`,
and every scheme derives its frontiers (quantized region, residual window, closed groups) from it with pure
functions.  ``append_layer`` may only write physical slots that are *invisible* at the old length (rows beyond the
old frontier, free ring slots); it never edits a row the old length exposes.  Publication is then one update of
``lengths`` for all layers at once.  This is the prepare/publish split of design notes 0x05D/0x0CA obtained from
data layout plus purity: if the step's inputs are non-finite the model keeps the old ``lengths`` and raises, and the
returned cache is logically identical to the old one even when its buffers were donated.

The contract a one-row append must meet under donation: it writes only slots invisible at the old length.
Multi-row appends (prefill) are atomic by purity (the caller keeps the old value).
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from kvquant_jax.cache.schema import CacheSchema

LayerState = Any  # a flax.struct.dataclass pytree with [B, Hkv, C, ...] arrays


class CacheScheme(abc.ABC):
    """A cache scheme: static (hashable) description + pure functions over one layer's state.

    Subclasses are frozen dataclasses so they can be static arguments of ``jax.jit``.
    """

    @property
    @abc.abstractmethod
    def schema(self) -> CacheSchema:
        """The full ABI schema of the stored representation."""

    @abc.abstractmethod
    def init_layer(self, batch: int, capacity: int, num_kv_heads: int, head_dim: int) -> LayerState:
        """Empty state for one layer. Arrays are ``[B, Hkv, C, ...]``; contents of invisible rows are unspecified."""

    @abc.abstractmethod
    def append_layer(self, state: LayerState, lengths: jax.Array, k: jax.Array, v: jax.Array,
                     num_new: jax.Array) -> LayerState:
        """Append rows for one layer.

        Args:
          state: the layer state at committed ``lengths`` (int32 ``[B]``).
          k, v: float ``[B, T, Hkv, D]``; keys in the stage the schema declares (post-RoPE unless
            ``schema.key_stage == "pre_rope"``).
          num_new: int32 ``[B]`` in ``[0, T]``. Rows ``t < num_new[b]`` go to positions ``lengths[b] + t``;
            other rows are padding and must not influence any stored code or qparam.
        Returns the successor state for committed length ``lengths + num_new``.  Capacity is checked by the
        caller (statically); writes only slots invisible at ``lengths`` (see module doc).
        """

    @abc.abstractmethod
    def materialize_layer(self, state: LayerState, lengths: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Dequantize every region (the oracle / reference view).

        Returns ``(k, v, valid)``: float32 ``[B, Hkv, C, D]`` twice and bool ``[B, C]``; rows at or beyond
        ``lengths[b]`` are zero and invalid.  Keys are in the schema's stored stage.
        """

    def validate_layer(self, state: LayerState, lengths: jax.Array) -> None:
        """Raise ``ValueError`` if an invariant of the stored representation is broken (host-side, not jitted)."""
        del state, lengths

    def layer_nbytes(self, state: LayerState) -> dict[str, int]:
        """Real ``nbytes`` of one layer state by ledger category (see ``kvquant_jax.quant.ledger``)."""
        raise NotImplementedError


@struct.dataclass
class KVCache:
    """The whole model's cache: one value, published whole.

    Attributes:
      groups: tuple of stacked layer states, one per run of consecutive layers sharing a scheme; arrays of group
        ``g`` are ``[L_g, B, Hkv, C, ...]`` so the model can ``lax.scan`` over them.
      lengths: int32 ``[B]``: committed rows per sequence (prefix rows included).
      schemes: static tuple of ``(scheme, first_layer, num_layers)``, one per group.
      capacity: static row capacity ``C``.
    """

    groups: tuple
    lengths: jax.Array
    schemes: tuple = struct.field(pytree_node=False)
    capacity: int = struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def num_layers(self) -> int:
        return sum(n for _, _, n in self.schemes)

    def scheme_for_layer(self, layer: int) -> CacheScheme:
        for scheme, first, n in self.schemes:
            if first <= layer < first + n:
                return scheme
        raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")


def _runs(per_layer: tuple[CacheScheme, ...]) -> list[tuple[CacheScheme, int, int]]:
    runs: list[tuple[CacheScheme, int, int]] = []
    for i, s in enumerate(per_layer):
        if runs and runs[-1][0] == s:
            runs[-1] = (s, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, i, 1))
    return runs


def init_cache(schemes: CacheScheme | tuple[CacheScheme, ...] | list, *, num_layers: int, batch: int,
               capacity: int, num_kv_heads: int, head_dim: int) -> KVCache:
    """Empty cache. ``schemes`` is one scheme for all layers, or a per-layer sequence (mixed policy)."""
    if isinstance(schemes, CacheScheme):
        per_layer = (schemes,) * num_layers
    else:
        per_layer = tuple(schemes)
        if len(per_layer) != num_layers:
            raise ValueError(f"mixed policy lists {len(per_layer)} schemes for {num_layers} layers")
    if batch < 1 or capacity < 1:
        raise ValueError(f"batch ({batch}) and capacity ({capacity}) must be >= 1")
    groups = []
    runs = _runs(per_layer)
    for scheme, _, n in runs:
        one = scheme.init_layer(batch, capacity, num_kv_heads, head_dim)
        groups.append(jax.tree.map(lambda a, n=n: jnp.broadcast_to(a, (n,) + a.shape).copy(), one))
    return KVCache(groups=tuple(groups), lengths=jnp.zeros((batch,), jnp.int32), schemes=tuple(runs),
                   capacity=capacity)


def check_room(cache: KVCache, num_new) -> None:
    """Host-side capacity check: raise before any work if ``lengths + num_new`` would exceed capacity."""
    import numpy as np

    lengths = np.asarray(jax.device_get(cache.lengths))
    need = lengths + np.asarray(num_new)
    if (need > cache.capacity).any():
        b = int(np.argmax(need))
        raise ValueError(f"sequence {b} needs {int(need[b])} cache rows but capacity is {cache.capacity} "
                         f"(committed {int(lengths[b])}, appending {int(np.asarray(num_new).reshape(-1)[b] if np.ndim(num_new) else num_new)})")


def layer_state(cache: KVCache, layer: int):
    """The (unstacked) state of one layer and its scheme."""
    for g, (scheme, first, n) in enumerate(cache.schemes):
        if first <= layer < first + n:
            return scheme, jax.tree.map(lambda a: a[layer - first], cache.groups[g])
    raise IndexError(f"layer {layer} out of range")


def replace_fields(obj, **kw):
    return dataclasses.replace(obj, **kw)
