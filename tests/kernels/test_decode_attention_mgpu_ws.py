"""Warp-specialized Mosaic GPU decode attention (pallas_kernels/decode_attention_mgpu_ws.py).

CPU: the launch plan (splits, ring slots, block ownership) and the wrapper on the plain-JAX twin against the float64
oracle; the kernel's lowering for "cuda" is in test_decode_attention_lowering.py.  GPU (Hopper only): the kernel
against the oracle, ragged poisoned cases with the current token in the same softmax, and against v1.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi.reference import decode_attention_reference
from pallas_kernels import decode_attention_mgpu as mg
from pallas_kernels import decode_attention_mgpu_ws as ws

from test_decode_attention_mgpu import FORMATS, _case, _hopper, _rel


def test_ws_spec_splits_and_slots(rng):
    _, reg, _, _ = _case(rng, "int4", n=32768 // 8)                 # 32 blocks of 128, BH = 6
    ops = mg.prepare_region(reg)
    sp, cfg = ws._ws_spec(ops, 4, None, jnp.bfloat16)
    assert sp.bt == 128 and sp.nbs % 2 == 0 and sp.ns * sp.nbs == 32
    assert sp.stages % 2 == 0 and sp.stages <= sp.nbs
    sp2, _ = ws._ws_spec(ops, 4, ws.MgpuWsConfig(blocks_per_update=2, max_concurrent_steps=6), jnp.bfloat16)
    assert sp2.nbs % 4 == 0 and sp2.stages == 4                       # rounded down to a multiple of 2 x 2
    sp4, cfg4 = ws._ws_spec(ops, 4, ws.MgpuWsConfig(compute_wgs=4, max_concurrent_steps=6), jnp.bfloat16)
    assert sp4.nbs % 4 == 0 and sp4.stages == 4 and cfg4.compute_registers == 112
    assert cfg.compute_registers == 232
    with pytest.raises(ValueError, match="compute_wgs"):
        ws._ws_spec(ops, 4, ws.MgpuWsConfig(compute_wgs=3), jnp.bfloat16)
    with pytest.raises(ValueError, match="num_splits"):
        ws._ws_spec(ops, 4, ws.MgpuWsConfig(num_splits=32), jnp.bfloat16)
    with pytest.raises(ValueError, match="blocks_per_update"):
        ws._ws_spec(ops, 4, ws.MgpuWsConfig(blocks_per_update=3), jnp.bfloat16)


def test_ws_unsupported_says_why(rng):
    _, reg, _, _ = _case(rng, "int2", n=256)
    assert ws.mgpu_ws_unsupported(reg, 128)
    _, reg, _, _ = _case(rng, "int4", n=128)                          # one block: nothing for warpgroup 1
    assert "block_t" in ws.mgpu_ws_unsupported(reg, 128)
    _, reg, _, _ = _case(rng, "int4", n=256)
    assert ws.mgpu_ws_unsupported(reg, 128) is None
    assert ws.mgpu_ws_unsupported(reg, 128, ws.MgpuWsConfig(blocks_per_update=2))


@pytest.mark.parametrize("name", FORMATS)
def test_ws_interpret_matches_oracle(rng, name):
    q, reg, kn, vn = _case(rng, name)
    ref = decode_attention_reference(q, [reg], k_new=kn, v_new=vn)
    out = ws.decode_attention_mgpu_ws(q, reg, k_new=kn, v_new=vn, interpret=True, out_dtype=jnp.float32)
    assert _rel(out, ref) < 1e-5


gpu = pytest.mark.skipif(not _hopper(), reason="Mosaic GPU kernel needs a Hopper (sm_90) GPU")


@gpu
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("u,c", [(1, 2), (2, 2), (1, 4)])
def test_ws_kernel_parity(rng, name, u, c):
    q, reg, kn, vn = _case(rng, name, n=1024)
    q = q.astype(jnp.bfloat16)
    ref = decode_attention_reference(q.astype(jnp.float32), [reg], k_new=kn, v_new=vn)
    cfg = ws.MgpuWsConfig(blocks_per_update=u, compute_wgs=c, block_t=64, max_concurrent_steps=4)
    out = jax.jit(lambda q, r, kn, vn: ws.decode_attention_mgpu_ws(
        q, r, k_new=kn, v_new=vn, config=cfg, out_dtype=jnp.float32))(q, reg, kn, vn)
    assert np.isfinite(np.asarray(out)).all()
    assert _rel(out, ref) < 1e-3
