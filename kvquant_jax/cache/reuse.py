"""Prefix reuse goes through the schema (design notes 0x05E, 0x0AB).

A stored prefix cache may serve a request only if every layer's schema equals the request's: KV precision and code
convention, K/V axes and group sizes, residual rule, qparam dtype, pre- vs post-RoPE keys, RoPE theta / pairing,
layout and kernel ABI, calibration artifact, model and tokenizer identity.  Two caches of the same prompt are not
interchangeable if one stores pre-RoPE per-channel keys and the other post-RoPE FP8 keys.
"""
from __future__ import annotations

import jax.numpy as jnp

from kvquant_jax.cache import ops
from kvquant_jax.cache.interface import CacheScheme, KVCache
from kvquant_jax.cache.schema import Compatibility, IncompatibleSchemaError, check_compatible


def prefix_compatibility(prefix: KVCache, request, *, ignore: tuple[str, ...] = ()) -> Compatibility:
    """Every differing schema field between ``prefix``'s layers and ``request`` (a scheme, or a per-layer
    sequence of schemes / schemas), as ``("layer{i}.field", prefix_value, request_value)`` triples."""
    want = (request,) * prefix.num_layers if isinstance(request, CacheScheme) or hasattr(request, "to_dict") \
        else tuple(request)
    if len(want) != prefix.num_layers:
        return Compatibility((("num_layers", prefix.num_layers, len(want)),))
    diffs = []
    for i, (have, req) in enumerate(zip(prefix.schemas, want)):
        diffs += [(f"layer{i}.{f}", a, b) for f, a, b in check_compatible(have, req, ignore=ignore).differences]
    return Compatibility(tuple(diffs))


def reuse_prefix(prefix: KVCache, request, *, batch: int | None = None, capacity: int | None = None,
                 ignore: tuple[str, ...] = ()) -> KVCache:
    """A request cache that starts from ``prefix``'s rows.

    Args:
      prefix: the stored prefix cache (any batch; with ``batch`` set it must hold one sequence).
      request: the request's scheme, or per-layer schemes (mixed policy).
      batch: fork the single prefix sequence into this many request sequences.
      capacity: grow (or shrink) the static capacity for the request.
      ignore: schema fields not to compare (e.g. ``("kernel_family",)`` when only the consumer changes).
    Raises:
      IncompatibleSchemaError: naming every differing field of every layer.
    """
    compat = prefix_compatibility(prefix, request, ignore=ignore)
    if not compat.ok:
        raise IncompatibleSchemaError("prefix reuse", compat)
    out = prefix
    if batch is not None:
        if prefix.batch != 1:
            raise ValueError(f"reuse_prefix: batch= forks ONE prefix sequence, the prefix holds {prefix.batch}")
        out = ops.fork(out, jnp.zeros((batch,), jnp.int32))
    if capacity is not None and capacity != out.capacity:
        out = ops.resize(out, capacity)
    return out
