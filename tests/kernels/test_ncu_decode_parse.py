"""``experiments/ncu_decode.py`` without a GPU: ncu ``--csv`` parsing (units, thousands separators, metric -> field),
the row of a case that matched no kernel / that ncu refused a metric in (a fake ``ncu`` that writes canned logs), and
the default kernel-name patterns against the names in the lowered kernels; the mgpu_kivi cases (the Mosaic GPU KIVI
kernel on kivi2 / kivi4: case list, ncu / child command lines, the child on CPU through the kernel's plain-JAX twin)
and the local-memory (spill) metrics."""
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


def _fake_ncu(tmp_path, mode="ok"):
    fake = tmp_path / "ncu.py"
    fake.write_text(f"HDR = {_HDR!r}\nKERNEL = {K!r}\n"
                    f"LINE = {_line('{}', '{}', 'gpu__time_duration.sum', 'nsecond', '229,250')!r}\n" + FAKE)
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!/bin/sh\nexec {sys.executable} {fake} \"$@\"\n")
    ncu.chmod(0o755)
    (tmp_path / "ncu.py.mode").write_text(mode)
    return ncu


def test_driver_with_fake_ncu(nd, tmp_path):
    ncu = _fake_ncu(tmp_path)
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


# ---------------------------------------------------------------------------------------------------------------
# mgpu_kivi: the Mosaic GPU KIVI kernel on kivi2 / kivi4 (check_mgpu_kivi.py's timed inputs), next to the Triton one
# ---------------------------------------------------------------------------------------------------------------
def _shape_args(**kw):
    import types
    base = dict(T=[32768], B=8, hq=32, hkv=8, d=128, warmup=3, calls=3)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_kivi_cases_and_child_argv(nd):
    a = _shape_args(formats=["kivi2", "kivi4"], impls=["mgpu_kivi", "triton"])
    cases = nd.build_cases(a)
    assert [(c["impl"], c["format"], c["T"]) for c in cases] == [
        ("mgpu_kivi", "kivi2", 32768), ("triton", "kivi2", 32768), ("mgpu_kivi", "kivi4", 32768),
        ("triton", "kivi4", 32768)]
    assert a.skipped == []
    assert nd.KERNEL_REGEX["mgpu_kivi"] == nd.KERNEL_REGEX["v1"] == "mosaic_gpu"
    argv = nd.child_argv(a, cases[0], "/tmp/x.child.json")
    assert argv[1] == nd.HERE and "--child" in argv
    for flag, val in (("--impl", "mgpu_kivi"), ("--format", "kivi2"), ("--T", "32768"), ("--B", "8"), ("--hq", "32"),
                      ("--hkv", "8"), ("--d", "128"), ("--sets", "1")):
        assert argv[argv.index(flag) + 1] == val, flag
    assert "--interpret" not in argv and "--config" not in argv
    assert nd.child_argv(a, cases[1], "/tmp/y.json")[argv.index("--impl") + 1] == "triton"


def test_kivi_pairs_that_make_no_sense_are_skipped_with_the_reason(nd):
    a = _shape_args(T=[4096, 32768], formats=["int4", "kivi2", "int2"], impls=["v1", "mgpu_kivi", "triton"])
    got = [(c["impl"], c["format"]) for c in nd.build_cases(a)]
    assert got == [("v1", "int4"), ("triton", "int4"), ("mgpu_kivi", "kivi2"), ("triton", "kivi2"),
                   ("triton", "int2")] * 2
    why = {(i, f): w for i, f, w in a.skipped}
    assert sorted(why) == [("mgpu_kivi", "int2"), ("mgpu_kivi", "int4"), ("v1", "int2"), ("v1", "kivi2")]
    assert "kivi2, kivi4 only" in why[("mgpu_kivi", "int4")]
    assert "mgpu_kivi" in why[("v1", "kivi2")] and "mgpu_kivi" not in why[("v1", "int2")]
    # the old behaviour: without mgpu_kivi asked for, a KIVI format is the Triton kernel's only
    a = _shape_args(formats=["kivi4"], impls=["v1", "ws", "triton", "cudnn"])
    assert [(c["impl"], c["format"]) for c in nd.build_cases(a)] == [("triton", "kivi4")]


def test_driver_kivi_command_lines(nd, tmp_path):
    ncu = _fake_ncu(tmp_path)
    out = tmp_path / "out"
    res = nd.main(["--ncu", str(ncu), "--impls", "mgpu_kivi,triton", "--formats", "kivi2,kivi4", "--T", "32768",
                   "--out", str(out), "--metrics", "gpu__time_duration.sum", "--case-timeout", "60"])
    want = [("mgpu_kivi", "kivi2", "mosaic_gpu"), ("triton", "kivi2", "decode_attention"),
            ("mgpu_kivi", "kivi4", "mosaic_gpu"), ("triton", "kivi4", "decode_attention")]
    assert [(r["impl"], r["format"], r["status"]) for r in res["rows"]] == [(i, f, "ok") for i, f, _ in want]
    calls = [c.split() for c in (tmp_path / "ncu.py.calls").read_text().splitlines()]
    assert len(calls) == 4
    for argv, (impl, fmt, regex) in zip(calls, want):
        assert argv[argv.index("--kernel-name") + 1] == f"regex:{regex}"
        child = argv[argv.index("--child"):]
        assert child[child.index("--impl") + 1] == impl and child[child.index("--format") + 1] == fmt
        assert child[child.index("--T") + 1] == "32768" and child[child.index("--B") + 1] == "8"
    # a request with nothing to profile is refused with the reason
    with pytest.raises(SystemExit, match="mgpu_kivi: the Mosaic GPU KIVI kernel reads kivi2, kivi4 only"):
        nd.main(["--ncu", str(ncu), "--impls", "mgpu_kivi", "--formats", "int4", "--out", str(out)])


def test_kivi_child_on_cpu(nd, tmp_path):
    """The mgpu_kivi child builds check_mgpu_kivi's inputs and calls the kernel (its plain-JAX twin on CPU)."""
    info_out = tmp_path / "info.json"
    info = nd.main(["--child", "--impl", "mgpu_kivi", "--format", "kivi2", "--T", "512", "--B", "2", "--hq", "8",
                    "--hkv", "2", "--warmup", "1", "--calls", "1", "--interpret", "--info-out", str(info_out),
                    "--config", '{"max_concurrent_steps": 3}'])
    assert info["impl"] == "mgpu_kivi" and info["format"] == "kivi2" and info["interpret"] is True
    assert info["config"] == dict(num_splits=None, max_concurrent_steps=3, precision="bf16x2", wgmma_inflight=None,
                                  qk_plane_batch=0, offsets="highest", barriers="explicit")
    assert info["num_splits"] >= 1 and info["calls"] == 1 and info["compile_s"] > 0
    # the prepared operands (less start / end) + the bf16 query: BH=4, T=512, D=128, 2-bit codes (4 tokens / byte),
    # float16 K scale / min [BH, T/32, D], V scale / min [BH, D/32, T]
    codes = 2 * 4 * (512 // 4) * 128
    qparams = 2 * 4 * (512 // 32) * 128 * 2 + 2 * 4 * (128 // 32) * 512 * 2
    assert info["read_bytes"] == codes + qparams + 2 * 8 * 128 * 2
    assert json.loads(info_out.read_text())["read_bytes"] == info["read_bytes"]


def test_kivi_child_refusals(nd):
    with pytest.raises(SystemExit, match="mgpu_kivi: the Mosaic GPU KIVI kernel reads kivi2, kivi4 only"):
        nd.main(["--child", "--impl", "mgpu_kivi", "--format", "int4", "--T", "512"])
    with pytest.raises(SystemExit, match="v1: no kivi4 path"):
        nd.main(["--child", "--impl", "v1", "--format", "kivi4", "--T", "512"])
    with pytest.raises(SystemExit, match="--interpret: mgpu_kivi / mgpu_planar / mgpu_planar_s8 only"):
        nd.main(["--child", "--impl", "triton", "--format", "kivi2", "--T", "512", "--interpret"])
    with pytest.raises(SystemExit, match="mgpu_planar: the token-planar kernel reads int2, qserve, int4 only"):
        nd.main(["--child", "--impl", "mgpu_planar", "--format", "kivi2", "--T", "512"])
    with pytest.raises(SystemExit, match="mgpu_planar_s8: the token-planar kernel reads int2, qserve, int4 only"):
        nd.main(["--child", "--impl", "mgpu_planar_s8", "--format", "int8", "--T", "512"])
    with pytest.raises(SystemExit, match=r"v1: no int2 path \(read by the Triton kernel or the token-planar kernel"):
        nd.main(["--child", "--impl", "v1", "--format", "int2", "--T", "512"])


def test_planar_child_runs_the_twin_on_cpu(nd, capsys):
    """The mgpu_planar child builds check_mgpu_planar's inputs (prepared outside the profiled call) and calls the
    token-planar entry (its plain-JAX twin on CPU); the driver lists it for int2 / qserve / int4 only."""
    nd.main(["--child", "--impl", "mgpu_planar", "--format", "qserve", "--T", "512", "--B", "2", "--interpret"])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("NCU_CHILD")][-1]
    info = json.loads(line.split(" ", 1)[1])
    assert (info["impl"], info["format"], info["interpret"]) == ("mgpu_planar", "qserve", True) and info["num_splits"] >= 1
    a = _shape_args(formats=["int2", "qserve", "kivi2"], impls=["mgpu_planar", "mgpu_kivi"])
    got = [(c["impl"], c["format"]) for c in nd.build_cases(a)]
    assert got == [("mgpu_planar", "int2"), ("mgpu_planar", "qserve"), ("mgpu_kivi", "kivi2")]


def test_planar_s8_child_runs_the_twin_on_cpu(nd, capsys):
    """The mgpu_planar_s8 child: the same inputs through the s8 entry (its twin on CPU), its own config type."""
    nd.main(["--child", "--impl", "mgpu_planar_s8", "--format", "int2", "--T", "512", "--B", "2", "--interpret",
             "--config", '{"max_concurrent_steps": 3, "limb_path": "i16"}'])
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("NCU_CHILD")][-1]
    info = json.loads(line.split(" ", 1)[1])
    assert (info["impl"], info["format"], info["interpret"]) == ("mgpu_planar_s8", "int2", True)
    assert info["config"] == {"num_splits": None, "max_concurrent_steps": 3, "limb_path": "i16", "pv_limbs": 3,
                              "barriers": "explicit", "profile_dir": "", "qparams_early": None, "v_early": None,
                              "unmasked_full_blocks": True, "pack_planes": None, "step_blocks": None,
                              "merged_pv": False}
    assert info["num_splits"] >= 1


def test_configs_add_a_case_per_impl_and_reach_the_child(nd, tmp_path):
    """``--configs IMPL=JSON`` profiles IMPL once more with those fields, per T and format it reads, under a case
    name of its own; the child gets them as ``--config``; a malformed item is refused by name."""
    a = _shape_args(T=[4096, 32768], formats=["int2", "kivi2"], impls=["mgpu_planar_s8", "triton"],
                    configs=[("mgpu_planar_s8", '{"pv_limbs": 2}')])
    cases = nd.build_cases(a)
    got = [(c["impl"], c["format"], c["T"], c.get("config", "")) for c in cases]
    assert got == [("mgpu_planar_s8", "int2", 4096, ""), ("mgpu_planar_s8", "int2", 4096, '{"pv_limbs": 2}'),
                   ("triton", "int2", 4096, ""), ("triton", "kivi2", 4096, "")] + [
        ("mgpu_planar_s8", "int2", 32768, ""), ("mgpu_planar_s8", "int2", 32768, '{"pv_limbs": 2}'),
        ("triton", "int2", 32768, ""), ("triton", "kivi2", 32768, "")]
    names = [nd._case_name(c) for c in cases]
    assert len(set(names)) == len(names) and "mgpu_planar_s8_int2_T4096_c0" in names
    argv = nd.child_argv(a, cases[1], str(tmp_path / "i.json"))
    assert argv[argv.index("--config") + 1] == '{"pv_limbs": 2}'
    for bad, needle in (("mgpu_planar_s8", "IMPL=JSON"), ("nope={}", "IMPL=JSON"),
                        ("mgpu_planar_s8={pv", "not JSON"), ("mgpu_planar_s8=[2]", "JSON object")):
        with pytest.raises(SystemExit, match=needle):
            nd.main(["--configs", bad, "--impls", "mgpu_planar_s8", "--formats", "int2", "--ncu", "false"])


def test_kivi_pattern_matches_the_lowered_kernel_once_per_call(nd, rng):
    """The profiled program (``decode_attention_mgpu_kivi_prepared`` on prepared operands) holds ONE Mosaic GPU
    kernel, ``body_mosaic_gpu``, that the mgpu_kivi pattern matches: ``--launch-skip <warmup>`` counts calls."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(REPO))
    from kvquant_jax.attention.synthetic import kivi_formats, random_region
    from pallas_kernels import decode_attention_mgpu_kivi as mk

    kf, vf = kivi_formats(2, 32, 32)
    reg = random_region(rng, kf, vf, 2, 2, 512, 128, [0, 0], [300, 512], poison=False, qparam_dtype=jnp.float16)
    q = jnp.asarray(rng.standard_normal((2, 8, 128)).astype(np.float32)).astype(jnp.bfloat16)
    ops = jax.jit(mk.prepare_kivi_region)(reg)
    text = jax.jit(lambda q, o: mk.decode_attention_mgpu_kivi_prepared(q, o, out_dtype=jnp.float32)).trace(
        q, ops).lower(lowering_platforms=("cuda",)).as_text()
    assert "body_mosaic_gpu" in set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    assert re.search(nd.KERNEL_REGEX["mgpu_kivi"], "body_mosaic_gpu_kernel")
    assert len(re.findall(r"custom_call @mosaic_gpu\w*", text)) == 1


def test_local_memory_metrics(nd):
    for m in ("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum", "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"):
        assert m in nd.METRICS
    assert "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum" not in nd.METRICS      # an alternate only
    text = "\n".join([
        _HDR,
        _line(0, K, "gpu__time_duration.sum", "usecond", "229.25"),
        _line(0, K, "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum", "Kbyte", "1,536"),
        _line(0, K, "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum", "byte", "0"),
        _line(0, K, "smsp__sass_inst_executed_op_local_ld.sum", "inst", "4,096"),
    ])
    r = nd.launch_fields(nd.parse_ncu_csv(text)[0])
    assert r["local_load_bytes"] == pytest.approx(1.536e6) and r["local_store_bytes"] == 0
    assert r["local_load_inst"] == 4096
    # an ncu without the byte counters: the sector counts (32 bytes each)
    sec = "\n".join([_HDR, _line(0, K, "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum", "sector", "1,000")])
    assert nd.launch_fields(nd.parse_ncu_csv(sec)[0])["local_store_bytes"] == 32000
    alt = nd.ALTERNATES["l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"]
    assert alt == "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum"
    row = nd.case_row(dict(impl="mgpu_kivi", format="kivi2", T=32768, variant="default"), text, rc=0,
                      regex="mosaic_gpu")
    md = nd.markdown(dict(date="d", shape=dict(B=8, hq=32, hkv=8, d=128), warmup=3, rows=[row]))
    assert "| 1500.0 / 0.0 | ok |" in md.strip().splitlines()[-1]
