"""kvquant_jax: live-data quantization (per-token activations, K/V cache schemes) for LLM serving in JAX/Pallas."""

__version__ = "0.1.0"
