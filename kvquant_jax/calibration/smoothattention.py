"""SmoothAttention (QServe, Lin et al. 2024): flatten key outliers before KV4 by moving them into the queries.

Per layer and KV head ``h``, a positive vector ``lam [D]``::

    q' = q * lam,  k' = k / lam   =>   q'.k' = q.k     (every query head of the GQA group of ``h`` uses lam_h)

folded OFFLINE into the projection weights (``wq`` columns of the group's query heads ``*= lam``, ``wk`` columns
``/= lam``).  The model applies RoPE after the projections, so the scale must commute with the rotation: RoPE
rotates each channel PAIR ``(i, j)`` by a 2x2 rotation ``R``, and ``diag(a, b) R = R diag(a, b)`` only when
``a == b``.  Hence **equal scales on each RoPE pair**, under the model's own pairing:

* ``"half_split"``: channel ``i`` pairs with ``i + D/2``;
* ``"interleaved"``: channel ``2i`` pairs with ``2i + 1``.

``lam_i = max(m_i, m_j) ** alpha`` for the pair ``(i, j)`` (``alpha = 0.5``), ``m`` the per-channel key absmax,
and ``lam = 1`` for an all-zero pair.  Statistics: by default POST-RoPE keys (``"k_post_rope"`` of
:func:`kvquant_jax.calibration.smoothquant.collect_stats`), i.e. the rows the KV cache stores; since the rotation
mixes exactly the two channels of a pair, the pair maximum is nearly the same for pre-RoPE keys
(``key_stage="pre_rope"`` uses those).  Unequal scales inside a pair break the equivalence
(:func:`unpaired_lambda` exists to test exactly that).

Shapes: key statistics ``[L, Hkv, D]`` float32; ``lam`` the same.
"""
from __future__ import annotations

import jax.numpy as jnp

from kvquant_jax.models.config import LlamaConfig


def pair_max(m, pairing: str) -> jnp.ndarray:
    """``[..., D]`` -> ``[..., D]`` where each channel holds the max over its RoPE pair."""
    m = jnp.asarray(m, jnp.float32)
    d = m.shape[-1]
    if d % 2:
        raise ValueError(f"pair_max: head_dim must be even, got {d}")
    if pairing == "half_split":
        return jnp.maximum(m, jnp.roll(m, d // 2, axis=-1))
    if pairing == "interleaved":
        p = jnp.max(m.reshape(m.shape[:-1] + (d // 2, 2)), axis=-1, keepdims=True)
        return jnp.broadcast_to(p, m.shape[:-1] + (d // 2, 2)).reshape(m.shape)
    raise ValueError(f"pair_max: unknown rope pairing {pairing!r}; expected 'half_split' or 'interleaved'")


def smooth_attention_lambda(k_absmax, pairing: str, alpha: float = 0.5) -> jnp.ndarray:
    """``lam [L, Hkv, D]`` from key-channel absmax ``[L, Hkv, D]``: pair-max ** alpha, 1 for all-zero pairs."""
    if not 0.0 <= float(alpha) <= 1.0:
        raise ValueError(f"smooth_attention_lambda: alpha must be in [0, 1], got {alpha}")
    m = pair_max(k_absmax, pairing)
    return jnp.where(m > 0, jnp.power(jnp.where(m > 0, m, jnp.float32(1)), jnp.float32(alpha)), jnp.float32(1))


def unpaired_lambda(k_absmax, alpha: float = 0.5) -> jnp.ndarray:
    """Per-channel ``max|K_i| ** alpha`` WITHOUT the pair constraint (wrong under RoPE; for tests/ablation)."""
    m = jnp.asarray(k_absmax, jnp.float32)
    return jnp.where(m > 0, jnp.power(jnp.where(m > 0, m, jnp.float32(1)), jnp.float32(alpha)), jnp.float32(1))


def check_pairs_equal(lam, pairing: str) -> None:
    """Raise ``ValueError`` when ``lam [..., D]`` differs inside any RoPE pair (would break q.k equivalence)."""
    lam = jnp.asarray(lam, jnp.float32)
    if bool(jnp.any(pair_max(lam, pairing) != lam)):
        raise ValueError(f"SmoothAttention: scales differ inside a RoPE pair under pairing {pairing!r}; RoPE would "
                         "not commute with the rescale")


def apply_smooth_attention(params, cfg: LlamaConfig, lam, *, check: bool = True) -> dict:
    """Fold ``lam [L, Hkv, D]`` into ``wq`` (``*= lam`` for each query head of the group) and ``wk`` (``/= lam``).

    Returns a new params pytree. ``check`` verifies the pair constraint under ``cfg.rope_pairing`` first."""
    lam = jnp.asarray(lam, jnp.float32)
    n, hkv, g, d = cfg.num_layers, cfg.num_kv_heads, cfg.group_size, cfg.head_dim
    if lam.shape != (n, hkv, d):
        raise ValueError(f"apply_smooth_attention: lam must have shape {(n, hkv, d)}, got {lam.shape}")
    if bool(jnp.any(~(lam > 0)) | jnp.any(~jnp.isfinite(lam))):
        raise ValueError("apply_smooth_attention: lam must be finite and > 0")
    if check:
        check_pairs_equal(lam, cfg.rope_pairing)
    ly = dict(params["layers"])
    lam_q = jnp.broadcast_to(lam[:, :, None, :], (n, hkv, g, d)).reshape(n, 1, hkv * g * d)
    ly["wq"] = (ly["wq"].astype(jnp.float32) * lam_q).astype(ly["wq"].dtype)
    ly["wk"] = (ly["wk"].astype(jnp.float32) / lam.reshape(n, 1, hkv * d)).astype(ly["wk"].dtype)
    return {**params, "layers": ly}


def smooth_attention(params, cfg: LlamaConfig, stats: dict, *, alpha: float = 0.5,
                     key_stage: str = "post_rope") -> dict:
    """Stats (from ``collect_stats``) -> smoothed params. ``key_stage``: "post_rope" (default) or "pre_rope"."""
    if key_stage not in ("post_rope", "pre_rope"):
        raise ValueError(f"smooth_attention: key_stage must be 'post_rope' or 'pre_rope', got {key_stage!r}")
    lam = smooth_attention_lambda(stats[f"k_{key_stage}"], cfg.rope_pairing, alpha)
    return apply_smooth_attention(params, cfg, lam)
