"""Decoder configuration: LLaMA and Gemma-3 as two configs of one decoder (``kvquant_jax.models.llama``).

The decoder layer is composed from documented components, each a config field with the LLaMA value as default:
norm convention (``norm_offset``), QK-norm (``qk_norm``), post-attention / post-MLP norms (``post_norms``), MLP
activation (``mlp_activation``: SwiGLU or GeGLU), RoPE base per layer type (``rope_theta`` / ``rope_theta_local``),
attention window per layer (``layer_types`` + ``sliding_window``), query scale (``query_scale``), embedding scale
(``embed_scale``), tied head (``tie_embeddings``) and final logit soft-capping (``final_logit_softcap``).  A config
with every default is exactly the LLaMA decoder it always was.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any


MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("global", "local")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static description of a LLaMA-family decoder (hashable: a ``jit`` static argument).

    Attributes:
      vocab_size, hidden_size, intermediate_size, num_layers: model sizes.
      num_heads, num_kv_heads, head_dim: attention geometry (GQA when num_kv_heads < num_heads).
      rope_theta: RoPE base. rope_pairing: "half_split" (channel i pairs with i + d/2, HF convention) or
        "interleaved" (2i pairs with 2i+1, the order llama.cpp's converter writes Q/K rows in).
      rms_eps: RMSNorm epsilon. max_position: trained context length. tie_embeddings: lm_head = embedding^T.
      bos_id, eos_id: special token ids. name: model identity string. sha256: weights file hash ("" if unknown).
      arch: "llama" or "gemma3" (identity; behaviour comes from the component fields below).
      norm_offset: RMSNorm multiplies by ``(norm_offset + w)``: 0 for LLaMA and for Gemma weights as llama.cpp's
        converter stores them (the file already holds ``1 + w``); 1 for Gemma weights in transformers' convention.
      qk_norm: RMSNorm over head_dim of q and k (weights ``q_norm`` / ``k_norm [D]``) before RoPE (Gemma-3).
      post_norms: RMSNorm of the attention output (``post_attn_norm``) and of the MLP output (``post_ffn_norm``)
        before each residual add (Gemma-3); the pre-MLP norm is ``ffn_norm`` in both architectures.
      mlp_activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh GELU approximation).
      layer_types: per layer "global" (full causal attention) or "local" (sliding window); () = all global.
      sliding_window: W of local layers: a query at position p attends keys p - W < s <= p (transformers'
        convention); 0 = none.
      rope_theta_local: RoPE base of local layers (None = ``rope_theta``).
      query_scale: attention logit scale (None = 1/sqrt(head_dim)); Gemma: ``query_pre_attn_scalar ** -0.5``.
      embed_scale: the embedding rows are multiplied by it (Gemma: sqrt(hidden), rounded to float32).
      final_logit_softcap: logits = c * tanh(logits / c) when > 0 (0 = off).
      activation: the projection precision policy every forward uses by default (None = float matmuls), a
        hashable ``linear(x, w, name)`` hook such as ``kvquant_jax.models.w8a8.W8A8Policy``; set it together with
        params from that policy's ``quantize_params`` (``kvquant_jax.models.w8a8.apply_policy`` does both).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_pairing: str = "half_split"
    rms_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    bos_id: int = 1
    eos_id: int = 2
    name: str = "llama"
    sha256: str = ""
    activation: Any = None
    arch: str = "llama"
    norm_offset: float = 0.0
    qk_norm: bool = False
    post_norms: bool = False
    mlp_activation: str = "silu"
    layer_types: tuple = ()
    sliding_window: int = 0
    rope_theta_local: float | None = None
    query_scale: float | None = None
    embed_scale: float = 1.0
    final_logit_softcap: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"mlp_activation must be one of {MLP_ACTIVATIONS}, got {self.mlp_activation!r}")
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types: unknown types {bad}; allowed {LAYER_TYPES}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types lists {len(self.layer_types)} layers for num_layers {self.num_layers}")
        if "local" in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"local layers need sliding_window >= 1, got {self.sliding_window}")
        if self.rope_pairing not in ("half_split", "interleaved"):
            raise ValueError(f"rope_pairing must be 'half_split' or 'interleaved', got {self.rope_pairing!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def bos_required(self) -> bool:
        """The model is evaluated and prompted with a leading BOS (Gemma: quality collapses without it)."""
        return self.arch == "gemma3"

    def layer_type(self, layer: int) -> str:
        """"local" (sliding window) or "global" for a static layer index."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return self.layer_types[layer] if self.layer_types else "global"

    @property
    def local_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "local")

    def layer_rope_theta(self, layer: int) -> float:
        if self.layer_type(layer) == "local" and self.rope_theta_local is not None:
            return float(self.rope_theta_local)
        return float(self.rope_theta)

    def layer_window(self, layer: int) -> int:
        """The attention window of a layer (0 = unbounded)."""
        return self.sliding_window if self.layer_type(layer) == "local" else 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)


#: the same class under its architecture-neutral name
DecoderConfig = LlamaConfig
