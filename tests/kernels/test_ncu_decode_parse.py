"""``experiments/ncu_decode.py`` without a GPU: ncu ``--csv`` parsing (units, thousands separators, metric -> field),
the row of a case that matched no kernel / that ncu refused a metric in (a fake ``ncu`` that writes canned logs), and
the default kernel-name patterns against the names in the lowered kernels."""
import json
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from experiment_scripts import load_experiment

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def nd():
    return load_experiment("ncu_decode")


_HDR = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _line(kid, kernel, metric, unit, value):
    return (f'"{kid}","4242","python3.12","127.0.0.1","{kernel}","1","13","(384, 1, 1)","(64, 4, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


K = "body_mosaic_gpu_kernel"
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
# ncu's auto units (the default) with thousands separators, ncu's own chatter and the application's output around it
AUTO = "\n".join([
    "==PROF== Connected to process 4242 (/usr/bin/python3.12)",
    "NCU_CHILD {\"impl\": \"ws\"}",
    '==PROF== Profiling "body_mosaic_gpu_kernel" - 0: 0%....50%....100% - 31 passes',
    _HDR,
    _line(0, K, "dram__bytes_read.sum", "Mbyte", "276.04"),
    _line(0, K, "dram__bytes_write.sum", "Kbyte", "1,310.72"),
    _line(0, K, "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", "35.61"),
    _line(0, K, "gpu__time_duration.sum", "usecond", "229.25"),
    _line(0, K, "launch__registers_per_thread", "register/thread", "168"),
    _line(0, K, "launch__shared_mem_per_block_dynamic", "Kbyte/block", "206.85"),
    _line(0, K, "launch__shared_mem_per_block_static", "byte/block", "0"),
    _line(0, K, "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum", "", "1,048,576"),
    _line(0, K, "sm__warps_active.avg.pct_of_peak_sustained_active", "%", "18.72"),
    _line(0, K, "smsp__warps_eligible.avg.per_cycle_active", "warp", "0.21"),
    _line(0, K, STALL.format("long_scoreboard"), "", "3.41"),
    _line(0, K, STALL.format("barrier"), "", "1.02"),
    _line(0, K, STALL.format("wait"), "", "2.18"),
    _line(0, K, STALL.format("selected"), "", "9.00"),
    _line(0, K, STALL.format("mio_throttle"), "", "0.07"),
    _line(0, K, STALL.format("math_pipe_throttle"), "", "0.55"),
    _line(0, K, STALL.format("sleeping"), "", "n/a"),
    "==PROF== Disconnected from process 4242",
])
# --print-units base: ns / bytes, big numbers with separators
BASE = "\n".join([
    _HDR,
    _line(3, "decode_attention_int4_int4", "gpu__time_duration.sum", "nsecond", "305,120"),
    _line(3, "decode_attention_int4_int4", "dram__bytes_read.sum", "byte", "276,037,632"),
    _line(3, "decode_attention_int4_int4", "launch__shared_mem_per_block_dynamic", "byte/block", "49,152"),
    _line(3, "decode_attention_int4_int4", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", "18.9"),
])


def test_units(nd):
    assert nd.unit_scale("Mbyte") == (1e6, "byte")
    assert nd.unit_scale("KiB") == (1024.0, "byte")
    assert nd.unit_scale("usecond") == (pytest.approx(1e-6), "second")
    assert nd.unit_scale("msecond") == (pytest.approx(1e-3), "second")
    assert nd.unit_scale("nsecond") == (pytest.approx(1e-9), "second")
    assert nd.unit_scale("Kbyte/block") == (1e3, "byte/block")
    assert nd.unit_scale("Tbyte/second") == (1e12, "byte/second")
    f, u = nd.unit_scale("byte/usecond")
    assert u == "byte/second" and f == pytest.approx(1e6)
    assert nd.unit_scale("%") == (1.0, "%")
    assert nd.unit_scale("register/thread") == (1.0, "register/thread")
    assert nd.parse_number("1,048,576") == 1048576.0
    assert nd.parse_number("1,310.72") == 1310.72
    assert nd.parse_number("n/a") is None


def test_parse_auto_units(nd):
    launches = nd.parse_ncu_csv(AUTO)
    assert len(launches) == 1
    la = launches[0]
    assert la["kernel"] == K and la["grid_size"] == "(64, 4, 1)"
    r = nd.launch_fields(la)
    assert r["duration_us"] == pytest.approx(229.25)
    assert r["dram_read_bytes"] == pytest.approx(276.04e6)
    assert r["dram_write_bytes"] == pytest.approx(1310.72e3)
    assert r["dram_pct_peak"] == pytest.approx(35.61)
    assert r["achieved_occupancy_pct"] == pytest.approx(18.72)
    assert r["registers_per_thread"] == 168
    assert r["smem_dynamic_bytes"] == pytest.approx(206.85e3)
    assert r["smem_static_bytes"] == 0
    assert r["smem_bank_conflicts"] == 1048576
    assert r["eligible_warps_per_cycle"] == pytest.approx(0.21)
    # the stalls: each reason its own value, sorted, "selected" (issuing) out of the top list, n/a dropped
    assert r["stalls"]["long_scoreboard"] == pytest.approx(3.41)
    assert r["stalls"]["barrier"] == pytest.approx(1.02)
    assert r["stalls"]["wait"] == pytest.approx(2.18)
    assert r["stalls"]["mio_throttle"] == pytest.approx(0.07)
    assert r["stalls"]["math_pipe_throttle"] == pytest.approx(0.55)
    assert "sleeping" not in r["stalls"]
    assert [k for k, _ in r["top_stalls"]] == ["long_scoreboard", "wait", "barrier", "math_pipe_throttle"]
    assert r["dram_read_tbps"] == pytest.approx(276.04e6 / 229.25e-6 / 1e12)


def test_parse_base_units(nd):
    r = nd.launch_fields(nd.parse_ncu_csv(BASE)[0])
    assert r["kernel"] == "decode_attention_int4_int4"
    assert r["duration_us"] == pytest.approx(305.12)
    assert r["dram_read_bytes"] == 276037632
    assert r["smem_dynamic_bytes"] == 49152
    assert r["dram_pct_peak"] == pytest.approx(18.9)


def test_unit_mismatch_is_an_error(nd):
    bad = BASE.replace('"nsecond","305,120"', '"byte","305,120"')
    with pytest.raises(ValueError, match="not a time"):
        nd.launch_fields(nd.parse_ncu_csv(bad)[0])


def test_no_csv_and_messages(nd):
    assert nd.parse_ncu_csv("==PROF== nothing\n") == []
    text = ("==PROF== Connected to process 1\n==WARNING== No kernels were profiled.\n"
            "==WARNING== Profiling kernels launched by child processes requires the --target-processes all option.\n")
    row = nd.case_row(dict(impl="v1", format="int4", T=32768), text, rc=0, regex="mosaic_gpu")
    assert row["status"] == "no kernel matched regex:mosaic_gpu" and row["launches"] == 0
    err = ('==ERROR== Failed to find metric regex:^sm__pipe_tensor_op_gmma_cycles_active\\.'
           '(sum|avg|min|max)(\\.(pct_of_peak_sustained_active))?$\n')
    msg = nd.ncu_messages(err)
    assert msg["bad_metrics"] == ["sm__pipe_tensor_op_gmma_cycles_active"]
    assert nd.refused(nd.METRICS, msg["bad_metrics"]) == [
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"]
    row = nd.case_row(dict(impl="v1", format="int4", T=32768), err, rc=1, regex="mosaic_gpu")
    assert row["status"] == "ncu failed" and row["ncu_errors"]


def test_row_and_markdown(nd):
    info = dict(read_bytes=270_000_000)
    row = nd.case_row(dict(impl="ws", format="int4", T=32768, variant="default"), AUTO, info=info, rc=0,
                      regex="mosaic_gpu")
    assert row["status"] == "ok"
    assert row["dram_read_over_expected"] == pytest.approx(276.04e6 / 270e6)
    res = dict(date="d", ncu_version="v", shape=dict(B=8, hq=32, hkv=8, d=128), metrics=[], warmup=3, rows=[row])
    md = nd.markdown(res)
    line = md.strip().splitlines()[-1]
    assert "| 32768 | ws | int4 | default | `body_mosaic_gpu_kernel` | 229.2 | 276.0 (1.02x) | 1.20 | 35.6 | 18.7 |" \
        in line
    assert "| 168 | 202.0 | 1048576 | long_scoreboard 3.41, wait 2.18" in line


# ---------------------------------------------------------------------------------------------------------------
# the driver against a fake ncu (no GPU, no child run): a refused metric is dropped and the case re-run; a regex
# that matches nothing gives a row that says so, with the names of an unfiltered listing pass
# ---------------------------------------------------------------------------------------------------------------
FAKE = textwrap.dedent('''\
    import sys
    a = sys.argv[1:]
    log = a[a.index("--log-file") + 1]
    metrics = a[a.index("--metrics") + 1].split(",")
    filtered = "--kernel-name" in a
    mode = open(sys.argv[0] + ".mode").read().strip()
    with open(sys.argv[0] + ".calls", "a") as f:
        f.write(" ".join(a) + "\\n")
    with open(log, "w") as f:
        if any(m.startswith("sm__pipe_tensor_op_gmma") for m in metrics):
            f.write("==ERROR== Failed to find metric regex:^sm__pipe_tensor_op_gmma_cycles_active\\\\.(sum|avg)$\\n")
            sys.exit(1)
        if mode == "nomatch" and filtered:
            f.write("==WARNING== No kernels were profiled.\\n")
            sys.exit(0)
        f.write(HDR + "\\n")
        for kid, k in enumerate(["input_fusion_1", "body_mosaic_gpu_kernel"] if not filtered else [KERNEL]):
            f.write(LINE.format(kid, k) + "\\n")
    ''')


def test_driver_with_fake_ncu(nd, tmp_path):
    fake = tmp_path / "ncu.py"
    fake.write_text(f"HDR = {_HDR!r}\nKERNEL = {K!r}\n"
                    f"LINE = {_line('{}', '{}', 'gpu__time_duration.sum', 'nsecond', '229,250')!r}\n" + FAKE)
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    ncu.chmod(0o755)
    (tmp_path / "ncu.py.mode").write_text("ok")
    out = tmp_path / "out"
    res = nd.main(["--ncu", str(ncu), "--impls", "v1", "--formats", "int4", "--out", str(out), "--case-timeout", "60"])
    (row,) = res["rows"]
    assert row["status"] == "ok" and row["kernel"] == K and row["duration_us"] == pytest.approx(229.25)
    assert row["dropped_metrics"] == ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"]
    calls = (tmp_path / "ncu.py.calls").read_text().splitlines()
    assert len(calls) == 2
    first = calls[0].split()
    for flag, val in (("--clock-control", "none"), ("--target-processes", "all"), ("--kernel-name", "regex:mosaic_gpu"),
                      ("--launch-skip", "3"), ("--launch-count", "1")):
        assert first[first.index(flag) + 1] == val
    assert "--csv" in first and "--child" in first and first[first.index("--impl") + 1] == "v1"
    assert json.loads((out / "ncu_decode.json").read_text())["rows"][0]["status"] == "ok"
    assert "body_mosaic_gpu_kernel" in (out / "ncu_decode.md").read_text()

    (tmp_path / "ncu.py.mode").write_text("nomatch")
    os.remove(tmp_path / "ncu.py.calls")
    res = nd.main(["--ncu", str(ncu), "--impls", "ws", "--formats", "int4", "--out", str(out),
                   "--kernel-regex", "ws=nothing_like_this", "--metrics", "gpu__time_duration.sum"])
    (row,) = res["rows"]
    assert row["status"] == "no kernel matched regex:nothing_like_this"
    assert row["kernels_seen"] == ["input_fusion_1", "body_mosaic_gpu_kernel"]
    assert "no kernel matched regex:nothing_like_this; seen: input_fusion_1" in (out / "ncu_decode.md").read_text()


# ---------------------------------------------------------------------------------------------------------------
# the default patterns against the names in the lowered modules (the device kernel names themselves -- Mosaic's
# outlined "<host function>_kernel", cuDNN's -- are only seen on the device)
# ---------------------------------------------------------------------------------------------------------------
def test_default_patterns_match_lowered_names(nd, rng, monkeypatch):
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(REPO))
    from kvquant_jax.attention.synthetic import PRESETS, random_region
    from pallas_kernels import decode_attention as da
    from pallas_kernels import decode_attention_mgpu as mg
    from pallas_kernels import decode_attention_mgpu_ws as ws

    kf, vf = PRESETS["int4"]
    reg = random_region(rng, kf, vf, 2, 2, 512, 128, [0, 0], [300, 512], poison=False)
    q = jnp.asarray(rng.standard_normal((2, 8, 128)).astype(np.float32)).astype(jnp.bfloat16)
    monkeypatch.setattr(da, "platform", lambda: "gpu")
    cfg = da.KernelConfig(block_t=64, num_splits=2, num_warps=4, num_stages=3)
    fns = {"v1": lambda q, r: mg.decode_attention_mgpu(q, r),
           "ws": lambda q, r: ws.decode_attention_mgpu_ws(q, r),
           "triton": lambda q, r: da.decode_attention(q, [r], backend="gpu", interpret=False, config=cfg)}
    for impl, fn in fns.items():
        text = jax.jit(fn).trace(q, reg).lower(lowering_platforms=("cuda",)).as_text()
        names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
        hits = sorted(n for n in names if re.search(nd.KERNEL_REGEX[impl], n))
        assert hits, impl
        if impl in ("v1", "ws"):
            assert "body_mosaic_gpu" in names        # the host function; ncu shows its outlined device kernel
        else:
            assert "decode_attention_int4_int4" in names


def test_triton_only_formats_are_profiled_with_the_triton_kernel_only(nd):
    import types
    a = types.SimpleNamespace(T=[32768], formats=["int4", "kivi2"], impls=["v1", "ws", "triton", "cudnn"])
    got = [(c["impl"], c["format"]) for c in nd.build_cases(a)]
    assert got == [("v1", "int4"), ("ws", "int4"), ("triton", "int4"), ("triton", "kivi2")]
