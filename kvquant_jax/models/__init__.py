"""Models: LLaMA-family decoder, GGUF / safetensors loading, tokenizer, model acquisition."""
from kvquant_jax.models.config import LlamaConfig
from kvquant_jax.models.loader import LoadedModel, load_model

__all__ = ["LlamaConfig", "LoadedModel", "load_model"]
