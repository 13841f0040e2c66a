"""Calibration forward: per-layer K/V activations and their diagonal Fisher information (design notes 0x07C).

The LM loss is differentiated with respect to every layer's k_proj / v_proj OUTPUT by adding zero-valued
perturbations ``dk, dv: [L, B, T, Hkv, D]`` to them inside the model's own layer function
(:func:`kvquant_jax.models.llama.decoder_layer`, through its attention hook): ``k_pre + dk`` is rotated like the key and
``v + dv`` enters attention, so ``dL/d(dk) = dL/dk_pre`` (the PRE-RoPE key gradient) and ``dL/d(dv) = dL/dv``.
The diagonal Fisher is the squared gradient, element by element (one sequence's loss per element: sequences of
a batch do not interact, so a batched gradient of the summed loss is the per-sequence gradient).

For post-RoPE statistics (the ablation) the same gradient is rotated: ``k_post = R_p k_pre`` gives
``dL/dk_post = R_p dL/dk_pre`` (R orthogonal), see :func:`to_post_rope`.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.llama import attend, decoder_layer, logits_from_hidden, token_nll
from kvquant_jax.models.rope import apply_rope


@functools.partial(jax.jit, static_argnames=("cfg",))
def kv_with_gradients(params, cfg: LlamaConfig, tokens: jax.Array):
    """K/V activations and loss gradients of one batch ``tokens: int32 [B, T]`` (positions ``0..T-1``).

    Returns ``(k_pre, v, grad_k, grad_v, nll)``: float32 ``[L, B, T, Hkv, D]`` four times (keys PRE-RoPE;
    gradients of the summed next-token NLL w.r.t. the pre-RoPE k_proj and v_proj outputs) and the per-token NLL
    ``[B, T - 1]``.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    num_new = jnp.full((b,), t, jnp.int32)
    zeros = jnp.zeros((cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim), jnp.float32)

    def loss_fn(dk, dv):
        x = params["embed"][tokens]

        def body(x, inp):
            lp, dk_l, dv_l = inp

            def attn_fn(q, k, v):
                kp = k.astype(jnp.float32) + apply_rope(dk_l, positions, cfg.rope_theta, cfg.rope_pairing)
                return attend(q, kp.astype(k.dtype), (v.astype(jnp.float32) + dv_l).astype(v.dtype), num_new, None)

            x, k, v = decoder_layer(cfg, x, lp, positions, attn_fn)
            return x, (k.astype(jnp.float32), v.astype(jnp.float32))

        x, (ks, vs) = jax.lax.scan(body, x, (params["layers"], dk, dv))
        nll = token_nll(logits_from_hidden(params, cfg, x), tokens)
        return jnp.sum(nll), (ks, vs, nll)

    (_, (ks, vs, nll)), (gk, gv) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(zeros, zeros)
    k_pre = apply_rope(ks, positions, cfg.rope_theta, cfg.rope_pairing, inverse=True)
    return k_pre, vs, gk, gv, nll


def to_post_rope(x: np.ndarray, cfg: LlamaConfig) -> np.ndarray:
    """Rotate pre-RoPE keys (or pre-RoPE key gradients) ``[..., T, Hkv, D]`` at positions ``0..T-1``."""
    t = x.shape[-3]
    pos = jnp.arange(t, dtype=jnp.int32)
    out = jax.jit(apply_rope, static_argnames=("theta", "pairing"))(jnp.asarray(x), pos, theta=cfg.rope_theta,
                                                                    pairing=cfg.rope_pairing)
    return np.asarray(out)


@dataclasses.dataclass
class KVActivations:
    """Calibration activations of ``N`` samples of ``T`` tokens: float32 ``[L, N, T, Hkv, D]`` arrays.

    ``k`` is PRE-RoPE; ``grad_k``/``grad_v`` are the LM-loss gradients (Fisher = their squares); ``starts`` are the
    token offsets of the samples in the tokenized corpus; ``nll`` the mean next-token NLL of the samples.
    """

    k: np.ndarray
    v: np.ndarray
    grad_k: np.ndarray
    grad_v: np.ndarray
    starts: np.ndarray
    nll: float

    @property
    def num_samples(self) -> int:
        return int(self.k.shape[1])

    @property
    def seq_len(self) -> int:
        return int(self.k.shape[2])


def sample_starts(num_tokens: int, num_samples: int, seq_len: int, seed: int) -> np.ndarray:
    """Offsets of ``num_samples`` disjoint ``seq_len``-token windows, drawn with ``seed`` (sorted)."""
    n_windows = num_tokens // seq_len
    if num_samples < 1 or seq_len < 2:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} and {seq_len}")
    if n_windows < num_samples:
        raise ValueError(f"calibration corpus has {num_tokens} tokens: only {n_windows} windows of {seq_len} "
                         f"tokens for {num_samples} samples")
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n_windows, num_samples, replace=False)).astype(np.int64) * seq_len


def collect(params, cfg: LlamaConfig, token_ids, *, num_samples: int, seq_len: int, seed: int,
            batch_size: int = 1, progress: bool = False) -> KVActivations:
    """Run :func:`kv_with_gradients` over ``num_samples`` seeded windows of ``token_ids`` (the calibration corpus,
    tokenized without BOS) and stack the results on the host."""
    ids = np.asarray(token_ids, np.int32)
    starts = sample_starts(ids.size, num_samples, seq_len, seed)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    shape = (cfg.num_layers, num_samples, seq_len, cfg.num_kv_heads, cfg.head_dim)
    out = {n: np.empty(shape, np.float32) for n in ("k", "v", "grad_k", "grad_v")}
    nll_sum = 0.0
    it = range(0, num_samples, batch_size)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="calibration forward+backward", unit="batch")
    for i in it:
        sl = slice(i, min(i + batch_size, num_samples))
        tokens = np.stack([ids[s:s + seq_len] for s in starts[sl]])
        k, v, gk, gv, nll = kv_with_gradients(params, cfg, jnp.asarray(tokens))
        for name, arr in zip(("k", "v", "grad_k", "grad_v"), (k, v, gk, gv)):
            out[name][:, sl] = np.asarray(arr)
        nll_sum += float(jnp.sum(nll))
    return KVActivations(starts=starts, nll=nll_sum / (num_samples * (seq_len - 1)), **out)
