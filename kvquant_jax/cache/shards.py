"""Reductions a scheme's append makes ACROSS rows of other sequences or heads, made exact on a device mesh.

Under :func:`kvquant_jax.attention.sharded.local_layer` a layer's append runs once per device on its own
sequences (``batch`` over mesh axis ``data``) and KV heads (``heads`` over ``model``).  A quantity that the
unsharded append computes over the whole batch or over all heads (FP8 warm-up scales: the absmax over every
sequence, and for a per-tensor scale over every head; "is any sequence started") must then be reduced over those
mesh axes too, or each shard would calibrate its own scale (the TP-dependent accuracy seen in other servers).
:func:`shard_max` does that reduction when the current trace is split (:func:`split_over`, set by the wrapper) and
is the identity otherwise, so the same scheme code is exact sharded and unsharded (max is order-independent: the
result is bit-identical).
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

from kvquant_jax.cache.interface import BATCH, HEADS

__all__ = ["split_over", "shard_max", "shard_any"]

_SPLIT: contextvars.ContextVar[dict] = contextvars.ContextVar("kvq_shard_split", default={})


@contextlib.contextmanager
def split_over(**axes):
    """Within the block, traced code runs per shard: ``axes`` maps a logical axis (``batch``, ``heads``) to the
    mesh axis name it is split over (None: not split)."""
    token = _SPLIT.set({k: v for k, v in axes.items() if v is not None})
    try:
        yield
    finally:
        _SPLIT.reset(token)


def shard_max(x: jax.Array, over: str) -> jax.Array:
    """``x`` (already reduced over this shard's rows of logical axis ``over``: BATCH or HEADS) reduced with max
    over every shard of that axis; the identity when the trace is not split over it."""
    if over not in (BATCH, HEADS):
        raise ValueError(f"shard_max: over must be {BATCH!r} or {HEADS!r}, got {over!r}")
    axis = _SPLIT.get().get(over)
    return x if axis is None else jax.lax.pmax(x, axis)


def shard_any(x: jax.Array, over: str) -> jax.Array:
    """Logical OR of the bool ``x`` over every shard of ``over`` (see :func:`shard_max`)."""
    return shard_max(x.astype(jnp.int32), over) > 0
