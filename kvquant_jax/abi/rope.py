"""Rotary position embedding under both pairing conventions.

``half_split``: channel ``i`` rotates with ``i + d/2`` (HF transformers' LLaMA).
``interleaved``: channel ``2i`` rotates with ``2i + 1`` (GPT-J / llama.cpp's row order for GGUF Q/K).
Both use frequency ``theta ** (-2i / d)`` for pair ``i``; they differ only in which channels form a pair.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape ``positions.shape + (head_dim // 2,)`` in float32."""
    inv = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / jnp.float32(head_dim)))
    ang = positions.astype(jnp.float32)[..., None] * inv
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, pairing: str = "half_split",
               inverse: bool = False) -> jax.Array:
    """Rotate ``x: [..., T, H, D]`` at ``positions: [..., T]``; returns x's dtype (math in float32).

    ``inverse=True`` applies the rotation by ``-angle`` (undo a rotation, e.g. pre-RoPE key recovery).
    """
    d = x.shape[-1]
    cos, sin = rope_angles(positions, d, theta)
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    if inverse:
        sin = -sin
    xf = x.astype(jnp.float32)
    if pairing == "half_split":
        x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
        out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    elif pairing == "interleaved":
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(xf.shape)
    else:
        raise ValueError(f"unknown rope pairing {pairing!r}")
    return out.astype(x.dtype)


def pairing_permutation(head_dim: int, src: str, dst: str):
    """Index array ``p`` with ``x_dst = x_src[..., p]`` converting per-head channel order between conventions."""
    half = head_dim // 2
    if src == dst:
        return np.arange(head_dim)
    # interleaved channel 2i+j  <->  half-split channel i + j*half
    inter_to_half = np.array([2 * (c % half) + c // half for c in range(head_dim)])  # half index c -> inter idx
    if src == "interleaved" and dst == "half_split":
        return inter_to_half
    if src == "half_split" and dst == "interleaved":
        return np.argsort(inter_to_half)
    raise ValueError(f"unknown pairing conversion {src} -> {dst}")
