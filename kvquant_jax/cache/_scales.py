"""Per-layer calibrated scale tables for schemes whose scales are unbatched layer state (FP8, static INT)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def layer_scale_table(values, first: int, n: int, heads: int, per_tensor: bool, what: str) -> jnp.ndarray:
    """Rows ``[first, first + n)`` of a GLOBAL-layer scale table (``[L]`` or ``[L, Hkv]``) as float32 ``[n, Hkv]``.

    Raises ``ValueError`` naming ``what`` when the table is too short, has the wrong width (a per-tensor scheme
    takes one value per layer), or holds a value that is not a finite, positive, normal float32.
    """
    arr = np.asarray(values, np.float32)
    sel = arr[first:first + n]
    if sel.shape[0] != n:
        raise ValueError(f"{what} has {arr.shape[0]} layers, need layer {first + n - 1}")
    sel = sel.reshape(n, -1)
    if per_tensor and sel.shape[1] != 1:
        raise ValueError(f"{what}: a per-tensor scheme needs one value per layer")
    if sel.shape[1] not in (1, heads):
        raise ValueError(f"{what} has {sel.shape[1]} values per layer for {heads} KV heads")
    if not (np.isfinite(sel).all() and (sel >= np.finfo(np.float32).tiny).all()):
        raise ValueError(f"{what} must be finite, positive and normal")
    return jnp.asarray(np.broadcast_to(sel, (n, heads)).copy())
