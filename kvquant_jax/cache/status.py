"""Appends that also report what the representation did to the rows: ``(cache, AppendStatus)``.

A scheme may define ``saturated_layer(state_after, k, v, num_new) -> int32 [B, 2]``: per sequence, the valid new K
and V elements it stored saturated (clipped to its largest finite code).  FP8 does (E4M3 saturates at 448 x scale,
E5M2 at 57344 x scale): saturation is FP8's documented representation choice -- a finite value beyond the range is
stored as +-max instead of being rejected -- and it is made *visible* here and in the eval report (kv_error
``k_saturated`` / ``v_saturated``), never silent.  The integer schemes reject values they cannot encode instead
(``ok`` False), so they never saturate; schemes without the method report 0.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.cache import ops
from kvquant_jax.cache.interface import KVCache


@dataclasses.dataclass(frozen=True)
class AppendStatus:
    """``ok``: the rows were published.  ``saturated``: int64 ``[L, B, 2]`` saturated K / V elements per layer and
    sequence of this append (0 for schemes that never saturate)."""

    ok: bool
    saturated: np.ndarray

    @property
    def total_saturated(self) -> int:
        return int(self.saturated.sum())


def saturation(cache_after: KVCache, layer_kv: Sequence, num_new) -> jax.Array:
    """int32 ``[L, B, 2]``: saturated K / V elements of the rows ``layer_kv`` under the scales of ``cache_after``
    (the cache the append produced).  Jit-able."""
    pairs = ops._layer_pairs(cache_after, layer_kv, "saturation")
    num_new = ops._as_num_new(cache_after, num_new)
    out = []
    for (scheme, first, n), st in zip(cache_after.schemes, cache_after.groups):
        fn = getattr(scheme, "saturated_layer", None)
        if fn is None:
            out.append(jnp.zeros((n, cache_after.batch, 2), jnp.int32))
            continue
        ks, vs = ops._stack_group(pairs, first, n)
        out.append(jax.vmap(fn, in_axes=(0, 0, 0, None))(st, ks, vs, num_new))
    return jnp.concatenate(out, axis=0)


def try_append_with_status(cache: KVCache, layer_kv: Sequence, num_new):
    """Jit-able :func:`ops.try_append` plus the saturation counts: ``(cache', ok, saturated [L, B, 2])``."""
    new, ok = ops.try_append(cache, layer_kv, num_new)
    return new, ok, saturation(new, layer_kv, num_new)


def append_with_status(cache: KVCache, layer_kv: Sequence, num_new) -> tuple[KVCache, AppendStatus]:
    """Eager :func:`ops.append` (same checks, raises the same errors) that also returns an :class:`AppendStatus`
    with the saturation counts."""
    new = ops.append(cache, layer_kv, num_new)
    pairs = tuple((jnp.asarray(k), jnp.asarray(v)) for k, v in layer_kv)
    sat = _saturation_jit(new, pairs, jnp.asarray(np.broadcast_to(np.asarray(num_new), (cache.batch,)), jnp.int32))
    return new, AppendStatus(ok=True, saturated=np.asarray(sat, np.int64))


_saturation_jit = jax.jit(saturation)
