"""LLaMA-family model configuration."""
from __future__ import annotations

import dataclasses
import json
from typing import Any


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

    def __post_init__(self):
        if self.rope_pairing not in ("half_split", "interleaved"):
            raise ValueError(f"rope_pairing must be 'half_split' or 'interleaved', got {self.rope_pairing!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
