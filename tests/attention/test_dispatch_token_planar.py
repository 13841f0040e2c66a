"""The token-planar route on a GPU: the s8 tensor-core kernel where it reads the layer, else the bf16 planar
kernel with the s8 refusal as the logged reason.

The platform and both kernel entry points are monkeypatched (CPU): the test records which entry served the layer;
the kernels' numerics are tested in tests/kernels/ (twins against float64) and on the GPU
(experiments/check_mgpu_planar.py, experiments/check_transposed_v_gpu.py)."""
from __future__ import annotations

import dataclasses
import logging

import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi.token_planar import TokenPlanarFormat
from kvquant_jax.attention import dispatch
from kvquant_jax.cache.token_planar import QServePlanarScheme, TokenPlanarScheme
from pallas_kernels import decode_attention_mgpu_planar as mp
from pallas_kernels import decode_attention_mgpu_planar_s8 as s8
from test_dispatch_tuned import _serve_scheme                       # the same one-step probe, transposed-V there


@pytest.fixture
def calls(monkeypatch):
    """A GPU on which the bf16 planar kernel accepts every layer (its Hopper check lifted); both token-planar
    entry points replaced by recorders appending the entry's name."""
    rec = []

    def fake(name):
        def f(q, fmt, operand, lengths, k_new=None, v_new=None, *, sm_scale=None, interpret=None, config=None):
            rec.append(name)
            return jnp.zeros(q.shape, jnp.float32)
        f.__name__ = name
        return f

    monkeypatch.setattr(dispatch, "platform", lambda: "gpu")
    monkeypatch.setitem(dispatch.FUSED_KERNELS, TokenPlanarFormat,
                        (fake("unrouted"), ("gpu",), mp.token_planar_layout_unsupported))
    monkeypatch.setattr(mp, "decode_attention_token_planar", fake("decode_attention_token_planar"))
    monkeypatch.setattr(s8, "decode_attention_token_planar_s8", fake("decode_attention_token_planar_s8"))
    dispatch.SERVED.clear()
    yield rec
    dispatch.SERVED.clear()


def _serve(scheme, g, impl="auto"):
    """One decode step of a half-full 1024-row, 2-KV-head, D 64 layer through the dispatcher: (served key, reason)."""
    return _serve_scheme(scheme, 1024, 64, g, impl=impl)


@pytest.mark.parametrize("scheme", [TokenPlanarScheme(bits=2), TokenPlanarScheme(bits=4), QServePlanarScheme()],
                         ids=["int2_planar", "int4_planar", "qserve4_planar"])
@pytest.mark.parametrize("impl", ["auto", "kernel"])
def test_gpu_route_prefers_s8_and_logs_why(calls, caplog, scheme, impl):
    with caplog.at_level(logging.INFO, logger="kvquant_jax.attention"):
        key, why = _serve(scheme, g=3, impl=impl)                  # SmolLM2's 9 / 3 heads
    assert calls == ["decode_attention_token_planar_s8"] and key[0] == calls[0]
    assert why == dispatch.S8_ROUTE_REASON and "H100" in why
    assert any(why in r.getMessage() for r in caplog.records)


def test_gpu_route_says_why_not_s8(calls):
    """More than 8 query heads per KV head: the s8 kernel refuses (one 8-column limb tile), the bf16 kernel serves
    and the reason names the refusal."""
    key, why = _serve(TokenPlanarScheme(bits=2), g=9)
    assert calls == ["decode_attention_token_planar"] and key[0] == calls[0]
    assert why.startswith("s8 kernel refused: 9 query heads per KV head") and why.endswith("the bf16 planar kernel")


def test_reference_impl_and_cpu_take_neither(calls, monkeypatch):
    scheme = TokenPlanarScheme(bits=2)
    st, q = scheme.init_layer(1, 1024, 2, 64), jnp.ones((1, 6, 64), jnp.bfloat16)
    dispatch.decode_attention(q, scheme, st, jnp.array([512], jnp.int32), impl="reference")
    monkeypatch.setattr(dispatch, "platform", lambda: "cpu")
    key, _ = _serve(TokenPlanarScheme(bits=4), g=3)                 # "auto" on CPU: the float reference
    assert calls == [] and key[0] == "reference"


def test_interpreted_s8_entry_matches_the_bf16_entry_and_the_reference():
    """Unpatched, on CPU: the s8 layer entry (its plain-JAX twin) agrees with the bf16 planar entry and with the
    dispatcher's float reference on a filled int2_planar layer (random, non-zero K / V; 3 query heads per KV
    head), so the route changes the kernel, not the answer."""
    rng = np.random.default_rng(7)
    scheme, b, hkv, d, cap, n = TokenPlanarScheme(bits=2), 2, 2, 64, 512, 300
    st = scheme.init_layer(b, cap, hkv, d)
    k = jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, n, hkv, d)), jnp.float32)
    lengths = jnp.full((b,), n, jnp.int32)
    st = scheme.append_layer(st, jnp.zeros((b,), jnp.int32), k, v, lengths)
    q = jnp.asarray(rng.standard_normal((b, 3 * hkv, d)), jnp.float32)
    kn = jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.float32)
    vn = jnp.asarray(rng.standard_normal((b, hkv, d)), jnp.float32)
    fmt, operand = scheme.fused_decode_operand(st, lengths)
    got = s8.decode_attention_token_planar_s8(q, fmt, operand, lengths, kn, vn, interpret=True)
    bf16 = mp.decode_attention_token_planar(q, fmt, operand, lengths, kn, vn, interpret=True)
    ref = dispatch.decode_attention(q, scheme, st, lengths, kn, vn, impl="reference", out_dtype=jnp.float32)
    scale = float(jnp.max(jnp.abs(ref)))
    assert float(jnp.max(jnp.abs(got - ref))) / scale < 5e-5
    assert float(jnp.max(jnp.abs(got - bf16))) / scale < 5e-5
    assert float(jnp.max(jnp.abs(got))) > 0.1 * scale


def test_gpu_route_falls_back_when_the_s8_spec_is_refused(calls, monkeypatch):
    """A layer the s8 kernel's spec refuses (here: over a shared-memory budget lowered for the test) goes to the bf16
    kernel at routing time, the reason naming shared memory -- not a refusal raised while tracing the s8 call."""
    monkeypatch.setattr(s8, "SMEM_BUDGET", 16 * 1024)
    key, why = _serve(TokenPlanarScheme(bits=2), g=4)
    assert calls == ["decode_attention_token_planar"] and key[0] == calls[0]
    assert why.startswith("s8 kernel refused: ~") and "shared memory" in why and "budget" in why


def test_s8_layout_check_takes_the_config():
    """``token_planar_s8_layout_unsupported`` builds the kernel's spec with the given config: the default fits a
    D 256 layer, eight pipeline stages do not (shared memory), two do, and an unknown limb path is named."""
    scheme = TokenPlanarScheme(bits=2)
    st = scheme.init_layer(1, 2048, 1, 256)
    fmt, operand = scheme.fused_decode_operand(st, jnp.array([2048], jnp.int32))
    q = jnp.ones((1, 4, 256), jnp.bfloat16)
    assert s8.token_planar_s8_layout_unsupported(q, fmt, operand) is None
    why = s8.token_planar_s8_layout_unsupported(q, fmt, operand, s8.PlanarS8Config(limb_path="i8"))
    assert "limb_path='i8'" in why
    deep = s8.PlanarS8Config(num_splits=1, max_concurrent_steps=8)                 # 8 blocks, 8 stages of 33 KB
    assert "shared memory" in s8.token_planar_s8_layout_unsupported(q, fmt, operand, deep)
    shallow = dataclasses.replace(deep, max_concurrent_steps=2)
    assert s8.token_planar_s8_layout_unsupported(q, fmt, operand, shallow) is None
