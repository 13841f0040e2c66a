"""The one JAX tracer shim: host-side checks (error messages on concrete values) skip traced values.

``Tracer`` is ``jax.core.Tracer`` (the public alias on JAX 0.10 / 0.11), with the internal class as fallback if a
later JAX drops the alias.  Imported by every layer above (cache ops, kernels), so it lives at the bottom.
"""
from __future__ import annotations

import jax

Tracer = getattr(jax.core, "Tracer", None)
if Tracer is None:  # pragma: no cover - public alias present in JAX 0.10 / 0.11; keep a fallback all the same
    from jax._src.core import Tracer

__all__ = ["Tracer", "is_tracer"]


def is_tracer(*trees) -> bool:
    """True when any leaf of ``trees`` is a JAX tracer (inside jit / vmap / grad: values cannot be inspected)."""
    return any(isinstance(a, Tracer) for a in jax.tree_util.tree_leaves(trees))
