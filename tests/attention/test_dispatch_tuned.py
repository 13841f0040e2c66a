"""Dispatch by measurement: a transposed-V layer on a GPU goes to Mosaic v1 or the warp-specialized kernel as the
shipped tuning table (pallas_kernels/tuning/decode_h200.json) says, with its config, and the reason is logged once.

The platform / device kind and the two kernel entry points are monkeypatched (CPU): the test records which entry
was called with which config; the kernels' numerics are tested in tests/kernels/ and on the H200."""
from __future__ import annotations

import logging

import jax.numpy as jnp
import pytest

from kvquant_jax.abi.transposed_v import TransposedVFormat
from kvquant_jax.attention import dispatch
from kvquant_jax.cache.per_token_vt import TransposedVPerTokenScheme
from pallas_kernels import decode_attention_mgpu as mg
from pallas_kernels import decode_attention_mgpu_ws as ws


@pytest.fixture
def calls(monkeypatch):
    """A GPU of ``device_kind`` "NVIDIA H200" on which the Mosaic kernels accept every layer; both transposed-V
    entry points replaced by recorders appending ``(entry, config)``."""
    rec = []

    def fake(name):
        def f(q, fmt, state, lengths, k_new=None, v_new=None, *, sm_scale=None, interpret=None, config=None):
            rec.append((name, config))
            return jnp.zeros(q.shape, jnp.float32)
        f.__name__ = name
        return f

    monkeypatch.setattr(dispatch, "platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_device_kind", lambda: "NVIDIA H200")
    monkeypatch.setitem(dispatch.FUSED_KERNELS, TransposedVFormat, (fake("unrouted"), ("gpu",), lambda *a: None))
    monkeypatch.setattr(mg, "decode_attention_transposed_v", fake("decode_attention_transposed_v"))
    monkeypatch.setattr(ws, "decode_attention_transposed_v_ws", fake("decode_attention_transposed_v_ws"))
    dispatch.SERVED.clear()
    yield rec
    dispatch.SERVED.clear()


def _serve(bits, cap, d=128, g=4, impl="auto"):
    scheme = TransposedVPerTokenScheme(bits=bits)
    st = scheme.init_layer(1, cap, 2, d)
    q = jnp.ones((1, 2 * g, d), jnp.bfloat16)
    out = dispatch.decode_attention(q, scheme, st, jnp.array([cap // 2], jnp.int32), impl=impl)
    assert out.shape == q.shape and out.dtype == q.dtype
    (key,) = dispatch.SERVED
    return key, dispatch.SERVED[key]


def test_table_picks_ws_late_v_for_int8_at_32k_and_logs_why(calls, caplog):
    with caplog.at_level(logging.INFO, logger="kvquant_jax.attention"):
        key, why = _serve(8, 32768)
    [(entry, cfg)] = calls
    assert entry == "decode_attention_transposed_v_ws" and key[0] == entry and "C=32768" in key[1]
    assert isinstance(cfg, ws.MgpuWsConfig) and (cfg.compute_wgs, cfg.block_t, cfg.max_concurrent_steps) == (2, 128, 4)
    assert cfg.v_first is False
    assert why == "table decode_h200.json: ws late-v 158.2 µs vs v1 169.2 µs at T=32768"
    [msg] = [r.getMessage() for r in caplog.records if "served" in r.getMessage()]
    assert why in msg and all(r.levelno == logging.INFO for r in caplog.records)


def test_table_picks_ws_default_for_int4_above_the_largest_bucket(calls):
    _, why = _serve(4, 65536, impl="kernel")                  # "kernel" on a GPU consults the table too
    [(entry, cfg)] = calls
    assert entry == "decode_attention_transposed_v_ws" and (cfg.compute_wgs, cfg.block_t) == (2, 128)
    assert why == "table decode_h200.json: ws 131.3 µs vs v1 133.9 µs at T=32768 (capacity 65536)"


def test_table_keeps_v1_where_v1_was_faster(calls):
    _, why = _serve(8, 8192)                                   # bucket T = 4096: v1 beat every ws variant
    [(entry, cfg)] = calls
    assert entry == "decode_attention_transposed_v" and isinstance(cfg, mg.MgpuConfig)
    assert (cfg.block_t, cfg.max_concurrent_steps) == (128, 3)
    assert "v1 default 29.7 µs, fastest of 3 measured at T=4096 (capacity 8192)" in why


@pytest.mark.parametrize("bits,d,g,kind", [(4, 64, 4, "NVIDIA H200"), (8, 128, 8, "NVIDIA H200"),
                                           (8, 128, 4, "NVIDIA H100 80GB HBM3")],
                         ids=["other-head_dim", "other-group", "other-device"])
def test_no_table_entry_is_v1_default(calls, monkeypatch, bits, d, g, kind):
    monkeypatch.setattr(dispatch, "_device_kind", lambda: kind)
    _, why = _serve(bits, 32768, d=d, g=g)
    assert calls == [("decode_attention_transposed_v", None)] and "no table entry" in why


def test_ws_config_that_does_not_fit_the_layer_falls_back_to_v1(calls):
    _, why = _serve(8, 32768 + 128)                        # 257 blocks of 128: not a multiple of 2 warpgroups
    assert calls == [("decode_attention_transposed_v", None)]
    assert why.startswith("table decode_h200.json: ws late-v 158.2 µs vs v1 169.2 µs at T=32768")
    assert "does not fit this layer" in why and "v1 default" in why


def test_v1_config_that_does_not_fit_the_layer_falls_back_to_v1_default(calls, monkeypatch):
    monkeypatch.setattr(dispatch.decode_tuning, "choose", lambda *a: ("mgpu", {"block_t": 256}, "table t.json: x"))
    _, why = _serve(8, 384)                                    # 384 rows: not a multiple of block_t = 256
    assert calls == [("decode_attention_transposed_v", None)]
    assert why.startswith("table t.json: x, but that v1 config does not fit this layer (") and "256" in why


def test_cpu_does_not_consult_the_table(calls, monkeypatch):
    monkeypatch.setattr(dispatch, "platform", lambda: "cpu")
    key, why = _serve(8, 32768, impl="kernel")
    assert calls == [("unrouted", None)] and key[0] == "unrouted" and why == ""



def test_refused_fused_kernel_is_logged_with_the_region_path_that_served(calls, monkeypatch, caplog):
    """A layer the Mosaic kernel refuses and the region kernel serves is recorded once, as the region kernel with
    the refusal as its reason: no "reference served" entry (and no GPU-fallback warning) for it."""
    monkeypatch.setitem(dispatch.FUSED_KERNELS, TransposedVFormat,
                        (mg.decode_attention_transposed_v, ("gpu",), lambda *a: "float32 query"))
    region_calls = []

    def fake_region_kernel(q, regions, **kw):
        region_calls.append(len(regions))
        return jnp.zeros(q.shape, kw.get("out_dtype") or q.dtype)

    monkeypatch.setattr(dispatch.kernel, "decode_attention", fake_region_kernel)
    monkeypatch.setattr(dispatch.kernel, "kernel_unsupported", lambda *a, **k: None)
    with caplog.at_level(logging.INFO, logger="kvquant_jax.attention"):
        key, why = _serve(8, 1024)
    assert calls == [] and region_calls == [1]
    assert key[0] == "pallas_decode_v1" and "TransposedVFormat" in key[1]
    assert why == "decode_attention_transposed_v refused: float32 query"
    msgs = [r for r in caplog.records if "served" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].levelno == logging.INFO and "reference" not in msgs[0].getMessage()


def test_refused_fused_kernel_then_reference_keeps_both_reasons(calls, monkeypatch):
    monkeypatch.setitem(dispatch.FUSED_KERNELS, TransposedVFormat,
                        (mg.decode_attention_transposed_v, ("gpu",), lambda *a: "float32 query"))
    monkeypatch.setattr(dispatch.kernel, "kernel_unsupported", lambda *a, **k: "no such region")
    key, why = _serve(8, 1024)
    assert key[0] == "reference" and why == "decode_attention_transposed_v refused: float32 query; no such region"
