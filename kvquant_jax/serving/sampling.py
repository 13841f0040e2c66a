"""Token sampling: greedy, temperature, top-k, top-p (nucleus). Pure functions of (logits, key)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 -> greedy. top_k 0 -> off. top_p 1.0 -> off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """logits float32 [B, V] -> int32 [B]."""
    if params.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = logits / jnp.float32(params.temperature)
    if params.top_k > 0:
        kth = jax.lax.top_k(x, params.top_k)[0][:, -1:]
        x = jnp.where(x < kth, jnp.float32(-jnp.inf), x)
    if params.top_p < 1.0:
        srt = jnp.sort(x, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(srt, axis=-1)
        cum = jnp.cumsum(probs, axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always keep the top token)
        keep = (cum - probs) < jnp.float32(params.top_p)
        thresh = jnp.min(jnp.where(keep, srt, jnp.float32(jnp.inf)), axis=-1, keepdims=True)
        x = jnp.where(x < thresh, jnp.float32(-jnp.inf), x)
    return jax.random.categorical(key, x, axis=-1).astype(jnp.int32)
