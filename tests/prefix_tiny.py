"""Tiny random LLaMA models for the prefix / IntactKV / PrefixQuant tests (importable: tests/ is on sys.path)."""
from __future__ import annotations

import numpy as np

from kvquant_jax.models.config import LlamaConfig


def tiny_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2,
                head_dim=16, rope_theta=10000.0, rope_pairing="half_split", rms_eps=1e-5, max_position=512,
                tie_embeddings=True, bos_id=1, eos_id=2, name="tiny", sha256="tiny-model-a")
    base.update(kw)
    return LlamaConfig(**base)


def tiny_params(cfg: LlamaConfig, seed: int = 0, scale: float = 0.25) -> dict:
    """Random float32 weights in the loader's layout (see kvquant_jax.models.gguf.load_gguf)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    h, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    hq, hk = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def w(*shape):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-2])).astype(np.float32)

    layers = {"attn_norm": (1 + 0.1 * rng.standard_normal((L, h))).astype(np.float32),
              "ffn_norm": (1 + 0.1 * rng.standard_normal((L, h))).astype(np.float32),
              "wq": w(L, h, hq) * 4, "wk": w(L, h, hk) * 4, "wv": w(L, h, hk) * 4, "wo": w(L, hq, h),
              "w_gate": w(L, h, f) * 4, "w_up": w(L, h, f) * 4, "w_down": w(L, f, h)}
    params = {"embed": rng.standard_normal((cfg.vocab_size, h)).astype(np.float32),
              "final_norm": np.ones((h,), np.float32), "layers": layers}
    return {"embed": jnp.asarray(params["embed"]), "final_norm": jnp.asarray(params["final_norm"]),
            "layers": {k: jnp.asarray(v) for k, v in layers.items()}}
