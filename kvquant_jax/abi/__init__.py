"""The kernel ABI: what a KV-cache scheme hands a decode-attention consumer, below ``cache/`` and ``pallas_kernels/``.

* :mod:`~kvquant_jax.abi.regions`: ``Region`` / ``KVOperand`` / ``KVFormat`` (explicit arrays in the documented
  physical layouts plus static formats) and their shape checks;
* :mod:`~kvquant_jax.abi.reference`: the float64 NumPy oracle and the float32 ``jax.numpy`` reference over regions;
* :mod:`~kvquant_jax.abi.rope`: the RoPE convention (``half_split`` / ``interleaved``) and its angle tables;
* :mod:`~kvquant_jax.abi.kvquant`: the KVQuant layer layout (``KVQuantLayerState``), its static kernel format
  (``KVQuantFormat``) and its float32 decode;
* :mod:`~kvquant_jax.abi.transposed_v`: the per-token INT8/INT4 layout the Mosaic GPU kernel reads in place
  (two's-complement codes, V stored token-minor), its static format (``TransposedVFormat``) and float32 decode.

Imports only ``kvquant_jax.quant`` (number formats) and JAX: a kernel reads this package, never a scheme class or
the model.
"""
