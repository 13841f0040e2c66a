"""RoPE for the model package: the convention and tables live in the kernel ABI (:mod:`kvquant_jax.abi.rope`).

Kept so ``models``/``calibration`` code reads RoPE where it reads the rest of the model; nothing is defined here.
"""
from kvquant_jax.abi.rope import apply_rope, pairing_permutation, rope_angles

__all__ = ["apply_rope", "pairing_permutation", "rope_angles"]
