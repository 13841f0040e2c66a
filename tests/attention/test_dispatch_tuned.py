"""Dispatch by measurement: a transposed-V layer on a GPU goes to Mosaic v1 or the warp-specialized kernel as the
shipped tuning table (pallas_kernels/tuning/decode_h200.json) says, with its config, and the reason is logged once.
A full-precision layer goes to Mosaic v1 / ws or keeps the Triton kernel as a synthetic table says (the shipped H200
table has no bf16 point: Triton was never timed there).

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
from pallas_kernels.decode_tuning import table_for as SHIPPED_TABLE_FOR


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


def _serve_scheme(scheme, cap, d, g, q_dtype=jnp.bfloat16, impl="auto"):
    """Decode one token of a 1-sequence, 2-KV-head layer of ``cap`` rows (half full) through the dispatcher;
    ``(served key, reason)``."""
    st = scheme.init_layer(1, cap, 2, d)
    q = jnp.ones((1, 2 * g, d), q_dtype)
    out = dispatch.decode_attention(q, scheme, st, jnp.array([cap // 2], jnp.int32), impl=impl)
    assert out.shape == q.shape and out.dtype == q.dtype
    (key,) = dispatch.SERVED
    return key, dispatch.SERVED[key]


def _serve(bits, cap, d=128, g=4, impl="auto"):
    return _serve_scheme(TransposedVPerTokenScheme(bits=bits), cap, d, g, impl=impl)


def test_table_picks_ws_late_v_for_int8_at_32k_and_logs_why(calls, caplog):
    with caplog.at_level(logging.INFO, logger="kvquant_jax.attention"):
        key, why = _serve(8, 32768)
    [(entry, cfg)] = calls
    assert entry == "decode_attention_transposed_v_ws" and key[0] == entry and "C=32768" in key[1]
    assert isinstance(cfg, ws.MgpuWsConfig) and (cfg.compute_wgs, cfg.block_t, cfg.max_concurrent_steps) == (2, 128, 4)
    assert cfg.v_first is False
    assert why == "table decode_h200.json: ws late-v 158.2 µs vs v1 default 169.2 µs at T=32768"
    [msg] = [r.getMessage() for r in caplog.records if "served" in r.getMessage()]
    assert why in msg and all(r.levelno == logging.INFO for r in caplog.records)


def test_table_picks_ws_default_for_int4_above_the_largest_bucket(calls):
    _, why = _serve(4, 65536, impl="kernel")                  # "kernel" on a GPU consults the table too
    [(entry, cfg)] = calls
    assert entry == "decode_attention_transposed_v_ws" and (cfg.compute_wgs, cfg.block_t) == (2, 128)
    assert why == "table decode_h200.json: ws 131.3 µs vs v1 default 133.9 µs at T=32768 (capacity 65536)"


def test_table_keeps_v1_where_v1_was_faster(calls):
    _, why = _serve(8, 8192)                                   # bucket T = 4096: v1 beat every ws variant
    [(entry, cfg)] = calls
    assert entry == "decode_attention_transposed_v" and isinstance(cfg, mg.MgpuConfig)
    assert (cfg.block_t, cfg.max_concurrent_steps) == (128, 3)
    assert "v1 default 29.7 µs, fastest of 3 measured at T=4096 (capacity 8192)" in why


@pytest.mark.parametrize("bits,d,g,kind", [(4, 64, 4, "NVIDIA H200"), (8, 128, 8, "NVIDIA H200"),
                                           (8, 128, 4, "NVIDIA H100 PCIe")],
                         ids=["other-head_dim", "other-group", "other-device"])
def test_no_table_entry_is_v1_default(calls, monkeypatch, bits, d, g, kind):
    monkeypatch.setattr(dispatch, "_device_kind", lambda: kind)
    _, why = _serve(bits, 32768, d=d, g=g)
    assert calls == [("decode_attention_transposed_v", None)] and "no table entry" in why


def test_h100_table_is_read_on_an_h100(calls, monkeypatch):
    monkeypatch.setattr(dispatch, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    _, why = _serve(8, 32768)
    [(entry, cfg)] = calls
    assert entry == "decode_attention_transposed_v_ws" and (cfg.compute_wgs, cfg.v_first) == (2, None)
    assert why == "table decode_h100.json: ws 201.6 µs vs v1 default 208.9 µs at T=32768"


def test_ws_config_that_does_not_fit_the_layer_falls_back_to_v1(calls):
    _, why = _serve(8, 32768 + 128)                        # 257 blocks of 128: not a multiple of 2 warpgroups
    assert calls == [("decode_attention_transposed_v", None)]
    assert why.startswith("table decode_h200.json: ws late-v 158.2 µs vs v1 default 169.2 µs at T=32768")
    assert "does not fit this layer" in why and "v1 default" in why


def test_v1_config_that_does_not_fit_the_layer_falls_back_to_v1_default(calls, monkeypatch):
    monkeypatch.setattr(dispatch.decode_tuning, "choose", lambda *a: ("mgpu", {"block_t": 256}, "table t.json: x"))
    _, why = _serve(8, 384)                                    # 384 rows: not a multiple of block_t = 256
    assert calls == [("decode_attention_transposed_v", None)]
    assert why.startswith("table t.json: x, but that v1 config does not fit this layer (") and "256" in why


def test_fp8_transposed_v_layer_asks_the_table_by_its_fp8_payload(calls, monkeypatch):
    """``fp8_e4m3_vt`` takes the transposed-V route: the table is asked for payload "e4m3" (no entry in the shipped
    tables: v1 default), and an "e4m3" entry's config reaches the kernel."""
    from kvquant_jax.cache.registry import make_scheme
    scheme = make_scheme("fp8_e4m3_vt")
    asked = []
    real_choose = dispatch.decode_tuning.choose

    def spy(kind, payload, *a, **kw):
        asked.append(payload)
        return real_choose(kind, payload, *a, **kw)

    monkeypatch.setattr(dispatch.decode_tuning, "choose", spy)
    key, why = _serve_scheme(scheme, 4096, 128, 4)
    assert asked == ["e4m3"] and calls == [("decode_attention_transposed_v", None)] and "no table entry" in why
    assert "fp8='e4m3'" in key[1] and "C=4096" in key[1]
    calls.clear()
    dispatch.SERVED.clear()
    monkeypatch.setattr(dispatch.decode_tuning, "choose",
                        lambda kind, payload, *a, **kw: ("mgpu", {"block_t": 128}, f"table t.json: {payload}"))
    _, why = _serve_scheme(scheme, 4096, 128, 4)
    [(entry, cfg)] = calls
    assert entry == "decode_attention_transposed_v" and cfg.block_t == 128 and why == "table t.json: e4m3"


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


# ---------------------------------------------------------------------------------------------------------------
# A full-precision (bf16 / fp16) layer: the Mosaic kernels read it in place; the table says whether they beat Triton
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture
def dense_calls(monkeypatch):
    """A Hopper GPU of ``device_kind`` "NVIDIA H200" whose tuning table is :func:`_dense_table`; the Mosaic v1 / ws
    region entries and the Triton region kernel replaced by recorders appending ``(entry, config, regions)``."""
    rec = []

    def fake_mosaic(name):
        def f(q, region, *, k_new=None, v_new=None, sm_scale=None, config=None, out_dtype=None):
            rec.append((name, config, 1))
            return jnp.zeros(q.shape, out_dtype or q.dtype)
        f.__name__ = name
        return f

    def fake_triton(q, regions, **kw):
        rec.append(("triton", kw.get("config"), len(regions)))
        return jnp.zeros(q.shape, kw.get("out_dtype") or q.dtype)

    monkeypatch.setattr(dispatch, "platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_device_kind", lambda: "NVIDIA H200")
    monkeypatch.setattr(mg, "dense_region_device_unsupported",
                        lambda q: "float32 query" if q.dtype == jnp.float32 else None)
    monkeypatch.setattr(mg, "decode_attention_mgpu", fake_mosaic("decode_attention_mgpu"))
    monkeypatch.setattr(ws, "decode_attention_mgpu_ws", fake_mosaic("decode_attention_mgpu_ws"))
    monkeypatch.setattr(dispatch.kernel, "decode_attention", fake_triton)
    monkeypatch.setattr(dispatch.kernel, "kernel_unsupported", lambda *a, **k: None)
    table = _dense_table()
    monkeypatch.setattr(dispatch.decode_tuning, "table_for",
                        lambda kind, tables=None: table if kind == "NVIDIA H200" else None)
    dispatch.SERVED.clear()
    yield rec
    dispatch.SERVED.clear()


def _dense_table():
    """A validated table "t.json" for "NVIDIA H200" with two bf16 D128 G4 points where Mosaic v1 beat Triton
    (the shipped H200 table has none: Triton was never timed there)."""
    from pallas_kernels import decode_tuning as dt
    v1 = {"block_t": 128, "num_splits": None, "max_concurrent_steps": 3, "precision": "bf16x2", "upcast": False}
    entries = [{"format": "bf16", "head_dim": 128, "group": 4, "T": t, "impl": "mgpu", "variant": "default",
                "config": v1, "us": us, "v1_us": us, "candidates": 3} for t, us in ((4096, 42.2), (32768, 248.9))]
    return dt.validate_table({"schema": dt.SCHEMA, "device_kind": "NVIDIA H200", "jax": "0.11.2", "date": "d",
                              "command": "c", "source": "s", "shape": {"B": 8, "hq": 32, "hkv": 8, "d": 128},
                              "entries": entries}, "t.json")


def _serve_dense(cap, dtype="bf16", d=128, g=4, q_dtype=jnp.bfloat16, impl="auto"):
    from kvquant_jax.cache.full import FullPrecisionScheme
    return _serve_scheme(FullPrecisionScheme(dtype=dtype), cap, d, g, q_dtype, impl)


def test_dense_bf16_layer_goes_to_mosaic_v1_where_the_table_measured_it(dense_calls, caplog):
    with caplog.at_level(logging.INFO, logger="kvquant_jax.attention"):
        key, why = _serve_dense(32768)
    [(entry, cfg, n)] = dense_calls
    assert entry == "decode_attention_mgpu" and key[0] == entry and "T=32768" in key[1]
    assert isinstance(cfg, mg.MgpuConfig) and cfg.block_t == 128
    assert why.startswith("table t.json: v1 default") and "at T=32768" in why


def test_dense_bf16_layer_on_an_h100_reads_the_shipped_table(dense_calls, monkeypatch):
    """The shipped H100 table timed Triton on bf16: Mosaic v1 with block_t 64 beat it (and v1 default)."""
    from pallas_kernels import decode_tuning as dt
    monkeypatch.setattr(dt, "table_for", SHIPPED_TABLE_FOR)
    monkeypatch.setattr(dispatch, "_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    key, why = _serve_dense(4096)
    [(entry, cfg, _)] = dense_calls
    assert entry == "decode_attention_mgpu" and cfg.block_t == 64
    assert why == "table decode_h100.json: v1 bt 64 51.3 µs vs v1 default 53.3 µs at T=4096"


@pytest.mark.parametrize("kind,dtype,d", [("NVIDIA H100 PCIe", "bf16", 128), ("NVIDIA H200", "fp16", 128),
                                          ("NVIDIA H200", "bf16", 64)],
                         ids=["no-table-for-the-device", "fp16-not-measured", "head_dim-not-measured"])
def test_dense_layer_without_a_table_entry_keeps_triton(dense_calls, monkeypatch, kind, dtype, d):
    monkeypatch.setattr(dispatch, "_device_kind", lambda: kind)
    key, why = _serve_dense(4096, dtype=dtype, d=d)
    assert dense_calls == [("triton", None, 1)] and key[0] == "pallas_decode_v1"
    assert "no table entry" in why and why.endswith("the Triton kernel")


def test_dense_layer_keeps_triton_where_the_table_measured_triton_faster(dense_calls, monkeypatch):
    seen = []

    def choose(*a, **k):
        seen.append(k.get("fallback"))
        return "triton", {}, "table t.json: triton default 40.0 µs vs v1 default 42.0 µs at T=4096"
    monkeypatch.setattr(dispatch.decode_tuning, "choose", choose)
    key, why = _serve_dense(4096)
    assert seen == ["triton"] and dense_calls == [("triton", None, 1)] and key[0] == "pallas_decode_v1"
    assert why == "table t.json: triton default 40.0 µs vs v1 default 42.0 µs at T=4096"


def test_dense_layer_ws_winner_is_served_by_the_ws_kernel(dense_calls, monkeypatch):
    monkeypatch.setattr(dispatch.decode_tuning, "choose",
                        lambda *a, **k: ("mgpu_ws", {"compute_wgs": 2, "block_t": 128}, "table t.json: ws"))
    _serve_dense(32768)
    [(entry, cfg, _)] = dense_calls
    assert entry == "decode_attention_mgpu_ws" and (cfg.compute_wgs, cfg.block_t) == (2, 128)


def test_dense_layer_table_config_that_does_not_fit_falls_back_to_v1_default(dense_calls, monkeypatch):
    monkeypatch.setattr(dispatch.decode_tuning, "choose",
                        lambda *a, **k: ("mgpu", {"block_t": 256}, "table t.json: x"))
    key, why = _serve_dense(384)                              # 384 rows: not a multiple of block_t = 256
    assert dense_calls == [("decode_attention_mgpu", None, 1)]
    assert why.startswith("table t.json: x, but that v1 config does not fit this layer (") and "v1 default" in why


def test_dense_layer_mosaic_cannot_read_keeps_triton_and_says_why(dense_calls):
    key, why = _serve_dense(96)                               # 96 rows: not a multiple of 64
    assert dense_calls == [("triton", None, 1)] and key[0] == "pallas_decode_v1"
    assert "Mosaic v1 refused" in why and "block_t" in why


def test_dense_layer_float32_query_keeps_triton(dense_calls):
    key, why = _serve_dense(4096, q_dtype=jnp.float32)
    assert dense_calls == [("triton", None, 1)] and why == "Mosaic GPU refused: float32 query"


def test_dense_route_not_taken_on_cpu_or_interpreted(dense_calls, monkeypatch):
    monkeypatch.setattr(dispatch, "platform", lambda: "cpu")
    key, _ = _serve_dense(4096, impl="kernel")
    assert dense_calls == [("triton", None, 1)] and key[0] == "pallas_decode_v1"
