"""Shared parity cases for the decode-attention kernel tests (no tests here: imported by test_decode_attention*.py)."""
import jax.numpy as jnp
import numpy as np

from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.abi.regions import KVFormat
from kvquant_jax.attention.synthetic import PRESETS, grouped_formats, kivi_formats, random_region

B, HKV, D, N = 3, 2, 32, 64

# name -> (K format, V format).  D = 32: "g" variants have 2 scale groups along D; KIVI keys close 16-token groups.
FORMATS = {
    **PRESETS,
    "int1": grouped_formats(1, 0),
    "int4g": grouped_formats(4, 16),
    "int2g": grouped_formats(2, 16),
    "kivi2": kivi_formats(2, 16, 16),
    "kivi4": kivi_formats(4, 16, 0),
    "kivi1": kivi_formats(1, 16, 8),
    "int8k_fp16v": (KVFormat("int8", "token", "symmetric"), KVFormat("fp16")),
}

GQA = (1, 3, 4, 8)


def windows(block: int):
    """Per-sequence live windows [start, end) exercising block / group boundaries and raggedness:
    full (ends on a block boundary), offset start + end one past a boundary, and a single row."""
    return np.array([0, 5, 0], np.int32), np.array([N, 2 * block + 1, 1], np.int32)


def make_case(rng, name, gqa, block, *, q_dtype=jnp.float32, with_new=True, qparam_dtype=jnp.float32):
    kf, vf = FORMATS[name]
    start, end = windows(block)
    reg = random_region(rng, kf, vf, B, HKV, N, D, start, end, qparam_dtype=qparam_dtype)
    q = jnp.asarray(rng.standard_normal((B, HKV * gqa, D)).astype(np.float32)).astype(q_dtype)
    kn = vn = None
    if with_new:
        kn = jnp.asarray(rng.standard_normal((B, HKV, D)).astype(np.float32))
        vn = jnp.asarray(rng.standard_normal((B, HKV, D)).astype(np.float32))
    ref = decode_attention_reference(np.asarray(q.astype(jnp.float32)), [reg], k_new=kn, v_new=vn)
    return q, reg, kn, vn, ref


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "non-finite output"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
