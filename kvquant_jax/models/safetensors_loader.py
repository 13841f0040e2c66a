"""Load a HF-style LLaMA folder (``config.json`` + ``*.safetensors`` + optional ``tokenizer.json``)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvquant_jax.models.config import LlamaConfig


def load_hf_folder(path: str | Path, *, rope_pairing: str = "half_split") -> tuple[LlamaConfig, dict]:
    """Read a LLaMA/Mistral checkpoint folder. Weights in HF order use half-split RoPE natively; with
    ``rope_pairing="interleaved"`` Q/K rows are permuted to the interleaved order (logits unchanged)."""
    from safetensors.numpy import load_file

    path = Path(path)
    cfgd = json.loads((path / "config.json").read_text())
    arch = (cfgd.get("architectures") or ["?"])[0]
    if cfgd.get("model_type") not in ("llama", "mistral") and "Llama" not in arch and "Mistral" not in arch:
        raise ValueError(f"{path}: model_type {cfgd.get('model_type')!r} / {arch} is not a LLaMA-family model")
    heads = cfgd["num_attention_heads"]
    kv = cfgd.get("num_key_value_heads", heads)
    hidden = cfgd["hidden_size"]
    head_dim = cfgd.get("head_dim") or hidden // heads
    cfg = LlamaConfig(
        vocab_size=cfgd["vocab_size"], hidden_size=hidden, intermediate_size=cfgd["intermediate_size"],
        num_layers=cfgd["num_hidden_layers"], num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        rope_theta=float(cfgd.get("rope_theta", 10000.0)), rope_pairing=rope_pairing,
        rms_eps=float(cfgd.get("rms_norm_eps", 1e-5)), max_position=int(cfgd.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(cfgd.get("tie_word_embeddings", False)), bos_id=int(cfgd.get("bos_token_id") or 1),
        eos_id=int(cfgd.get("eos_token_id") if isinstance(cfgd.get("eos_token_id"), int) else 2), name=path.name)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    w: dict[str, np.ndarray] = {}
    for f in files:
        for k, a in load_file(str(f)).items():
            w[k] = np.asarray(a, dtype=np.float32)

    def lin(name):  # torch [out, in] -> [in, out]
        return w[name].T

    def perm(a, n):  # HF [n*d, in] -> interleaved-pair order
        d2 = a.shape[0] // n // 2
        return a.reshape(n, 2, d2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    layers: dict[str, list] = {k: [] for k in ("attn_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w_gate", "w_up",
                                               "w_down")}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        wq, wk = w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"]
        if rope_pairing == "interleaved":
            wq, wk = perm(wq, heads), perm(wk, kv)
        layers["attn_norm"].append(w[p + "input_layernorm.weight"])
        layers["wq"].append(wq.T)
        layers["wk"].append(wk.T)
        layers["wv"].append(lin(p + "self_attn.v_proj.weight"))
        layers["wo"].append(lin(p + "self_attn.o_proj.weight"))
        layers["ffn_norm"].append(w[p + "post_attention_layernorm.weight"])
        layers["w_gate"].append(lin(p + "mlp.gate_proj.weight"))
        layers["w_up"].append(lin(p + "mlp.up_proj.weight"))
        layers["w_down"].append(lin(p + "mlp.down_proj.weight"))
    params = {"embed": w["model.embed_tokens.weight"], "final_norm": w["model.norm.weight"],
              "layers": {k: np.stack(v) for k, v in layers.items()}}
    if not cfg.tie_embeddings:
        params["lm_head"] = w["lm_head.weight"].T
    return cfg, params
