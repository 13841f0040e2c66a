"""The decode tuning table (pallas_kernels/decode_tuning.py): strict validation, bucket selection, and the table
``experiments/check_mgpu_decode.py --tune-from RESULTS --tune PATH`` builds (fastest parity-passing candidate)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from pallas_kernels import decode_tuning as dt

from experiment_scripts import load_experiment

REPO = Path(__file__).resolve().parents[2]
# the shipped table's source: two device-clock runs of 2026-12-04 (pooled by --tune-from A,B)
RESULTS = ("docs/results/decode_mgpu/2026-12-04-device-clock/run1/check_mgpu_decode.json,"
           "docs/results/decode_mgpu/2026-12-04-device-clock/run2/check_mgpu_decode.json")
WS = {"block_t": 128, "num_splits": None, "max_concurrent_steps": 6, "precision": "bf16x2", "compute_wgs": 2}
V1 = {"block_t": 128, "num_splits": None, "max_concurrent_steps": 3, "precision": "bf16x2", "upcast": False}


def _entry(t, impl, variant, us, v1_us, fmt="int8", config=None):
    return dict(format=fmt, head_dim=128, group=4, T=t, impl=impl, variant=variant,
                config=dict(config or (WS if impl == "mgpu_ws" else V1)), us=us, v1_us=v1_us, candidates=3)


def _table():
    return dict(schema=dt.SCHEMA, device_kind="NVIDIA H200", jax="0.11.2", date="2026-12-02", command="python x",
                source="results.json", shape=dict(B=8, hq=32, hkv=8, d=128),
                entries=[_entry(1024, "mgpu_ws", "ws small", 30.0, 40.0),
                         _entry(4096, "mgpu", "default", 70.0, 70.0),
                         _entry(16384, "mgpu_ws", "ws c4 bt64", 200.0, 300.0,
                                config=dict(WS, block_t=64, compute_wgs=4, max_concurrent_steps=8))])


@pytest.mark.parametrize("cap,t", [(256, 1024), (1024, 1024), (2048, 1024), (4096, 4096), (10000, 4096),
                                   (16384, 16384), (1 << 20, 16384)],
                         ids=["below-smallest", "at-smallest", "between-1", "at-middle", "between-2", "at-largest",
                              "above-largest"])
def test_bucket_is_the_largest_measured_T_at_or_below_the_capacity(cap, t):
    table = dt.validate_table(_table(), "t.json")
    impl, fields, why = dt.choose("NVIDIA H200", "int8", 128, 4, cap, table)
    want_impl, want_bt = {1024: ("mgpu_ws", 128), 4096: ("mgpu", 128), 16384: ("mgpu_ws", 64)}[t]
    assert impl == want_impl and f"at T={t}" in why and why.startswith("table t.json: ")
    assert dt.IMPLS[impl](**fields).block_t == want_bt
    if t == 16384:
        assert fields["compute_wgs"] == 4 and "ws c4 bt64 200.0 µs vs v1 default 300.0 µs at T=16384" in why
    if t == 4096:
        assert "v1 default 70.0 µs" in why


def test_no_entry_is_v1_default_and_says_so():
    table = dt.validate_table(_table(), "t.json")
    for args in (("NVIDIA H200", "int4", 128, 4), ("NVIDIA H200", "int8", 64, 4), ("NVIDIA H200", "int8", 128, 8)):
        impl, fields, why = dt.choose(*args, 32768, table)
        assert (impl, fields) == ("mgpu", {}) and "no table entry" in why
    impl, fields, why = dt.choose("NVIDIA H100 80GB HBM3", "int8", 128, 4, 32768, table)
    assert (impl, fields) == ("mgpu", {}) and "no table entry" in why
    impl, _, why = dt.choose("NVIDIA B200", "int8", 128, 4, 32768)             # no shipped table for it
    assert impl == "mgpu" and "no table entry" in why


def _set(path, value):
    def edit(t):
        *head, last = path
        node = t
        for k in head:
            node = node[k]
        if value is KeyError:
            del node[last]
        else:
            node[last] = value
    return edit


MALFORMED = {
    "schema": (_set(["schema"], "other/2"), "'schema'"),
    "device_kind-missing": (_set(["device_kind"], KeyError), "'device_kind'"),
    "jax-empty": (_set(["jax"], ""), "'jax'"),
    "command-not-str": (_set(["command"], 3), "'command'"),
    "unknown-top": (_set(["extra"], 1), "'extra'"),
    "shape": (_set(["shape", "B"], 0), "'shape.B'"),
    "shape-missing-key": (_set(["shape", "d"], KeyError), "'shape.d'"),
    "shape-unknown-key": (_set(["shape", "T"], 4), "'shape.T'"),
    "shape-hkv-not-dividing": (_set(["shape", "hkv"], 5), "'shape.hkv'"),
    "shape-list-empty": (_set(["shape"], []), "'shape'"),
    "shape-list-item": (_set(["shape"], [dict(B=8, hq=32, hkv=8, d=128), dict(B=64, hq=9, hkv=3, d=-64)]),
                        "'shape[1].d'"),
    "shape-listed-twice": (_set(["shape"], [dict(B=8, hq=32, hkv=8, d=128)] * 2), "'shape'"),
    "entry-of-no-timed-shape": (_set(["entries", 1, "head_dim"], 64), "'entries[1]'"),
    "entries-empty": (_set(["entries"], []), "'entries'"),
    "entry-not-object": (_set(["entries", 1], [1]), "'entries[1]'"),
    "impl": (_set(["entries", 0, "impl"], "xla"), "'entries[0].impl'"),
    "triton-for-a-packed-payload": (_set(["entries", 0, "impl"], "triton"), "'entries[0].impl'"),
    "config-field": (_set(["entries", 0, "config", "warps"], 4), "'entries[0].config.warps'"),
    "config-v1-field-on-ws": (_set(["entries", 2, "config", "split_query"], False), "'entries[2].config.split_query'"),
    "config-value": (_set(["entries", 0, "config", "block_t"], [64]), "'entries[0].config.block_t'"),
    "us": (_set(["entries", 0, "us"], -1.0), "'entries[0].us'"),
    "v1_us-nan": (_set(["entries", 2, "v1_us"], float("nan")), "'entries[2].v1_us'"),
    "v1-winner-v1_us": (_set(["entries", 1, "v1_us"], 71.0), "'entries[1].v1_us'"),
    "winner-slower-than-v1": (_set(["entries", 0, "us"], 41.0), "'entries[0].us'"),
    "T-zero": (_set(["entries", 1, "T"], 0), "'entries[1].T'"),
    "T-bool": (_set(["entries", 1, "T"], True), "'entries[1].T'"),
    "head_dim-missing": (_set(["entries", 0, "head_dim"], KeyError), "'entries[0].head_dim'"),
    "entry-unknown": (_set(["entries", 0, "why"], "x"), "'entries[0].why'"),
    "duplicate": (lambda t: t["entries"].append(copy.deepcopy(t["entries"][0])), "'entries[3]'"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_table_names_the_file_and_field(tmp_path, name):
    edit, field = MALFORMED[name]
    t = _table()
    edit(t)
    path = tmp_path / "decode_bad.json"
    path.write_text(json.dumps(t))
    with pytest.raises(ValueError) as e:
        dt.load_table(str(path))
    assert "decode_bad.json" in str(e.value) and f"field {field}" in str(e.value), str(e.value)


def test_good_table_round_trips_and_bad_json_is_named(tmp_path):
    path = tmp_path / "decode_x.json"
    path.write_text(json.dumps(_table()))
    table = dt.load_table(str(path))
    assert table.name == "decode_x.json" and len(table.entries) == 3 and table.device_kind == "NVIDIA H200"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="decode_x.json: not valid JSON"):
        dt.load_table(str(path))


# ---------------------------------------------------------------------------------------------------------------
# experiments/check_mgpu_decode.py --tune-from RESULTS --tune PATH
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    return load_experiment("check_mgpu_decode")


def _check(impl, fmt, label, ok=True):
    return dict(case=dict(b=3, hkv=2, g=4, d=128, n=512), format=fmt, q_dtype="bfloat16", precision=label,
                impl=impl, rel_err=1e-6 if ok else 0.5, tol=1e-3, finite=True, ok=ok)


def _row(impl, fmt, variant, us, err=2e-6, **cfg):
    base = dict(V1, split_query=False) if impl == "mgpu" else dict(WS, upcast=False, blocks_per_update=1,
                                                                    v_first=None, memory_registers=None,
                                                                    compute_registers=None)
    return dict(T=1024, impl=impl, format=fmt, variant=variant, us=us, rel_err=err, config=dict(base, **cfg))


def _synthetic_results():
    """int8: the fastest rows have a failed parity group (c4), the reduced-precision numerics, or a high own error:
    "ws" wins.  int4: v1 wins (its two repeats: median).  bf16: v1's parity failed: no entry."""
    check = [_check("mgpu", f, "bf16x2", ok=f != "bf16") for f in ("int8", "int4", "bf16")]
    check += [_check("mgpu_ws", f, g) for f in ("int8", "int4", "bf16") for g in ("ws", "ws default", "ws bf16")]
    check += [_check("mgpu_ws", "int8", "ws c4", ok=False)]
    rows = [dict(T=1024, impl="cudnn", format="bf16", variant="", us=10.0),
            _row("mgpu", "int8", "default", 100.0),
            _row("mgpu_ws", "int8", "ws", 80.0),
            _row("mgpu_ws", "int8", "ws c4 bt64", 50.0, compute_wgs=4, block_t=64),         # parity failed
            _row("mgpu_ws", "int8", "ws prec bf16", 40.0, precision="bf16"),               # other numerics
            _row("mgpu_ws", "int8", "ws s8", 45.0, err=5e-3, max_concurrent_steps=8),      # own error too high
            dict(T=1024, impl="mgpu_ws", format="int8", variant="ws u2", skipped=True, error="skipped"),
            _row("mgpu", "int4", "default", 60.0), _row("mgpu", "int4", "default (rep 2)", 50.0),
            _row("mgpu_ws", "int4", "ws", 56.0),
            _row("mgpu", "bf16", "default", 100.0), _row("mgpu_ws", "bf16", "ws", 90.0)]
    return dict(date="2026-12-02T00:00:00+00:00", shape=dict(B=8, hq=32, hkv=8, d=128), device="gpu:NVIDIA H200",
                jax="0.11.2", rows=rows, check=check,
                ws_child={"ws": dict(ok=True), "ws default": dict(ok=True), "ws c4": dict(ok=False, why="HIGH")})


def test_tune_from_picks_the_fastest_parity_passing_candidate(bench, tmp_path):
    src, out = tmp_path / "results.json", tmp_path / "decode_test.json"
    src.write_text(json.dumps(_synthetic_results()))
    bench.main(["--tune-from", str(src), "--tune", str(out)])
    table = dt.load_table(str(out))
    assert table.command == f"python experiments/check_mgpu_decode.py --tune-from {src} --tune {out}"
    assert table.source == str(src) and table.device_kind == "NVIDIA H200" and table.date.startswith("2026-12-02")
    by_fmt = {e.format: e for e in table.entries}
    assert sorted(by_fmt) == ["int4", "int8"]                        # bf16: v1 failed parity, no entry
    e8 = by_fmt["int8"]
    assert (e8.impl, e8.variant, e8.us, e8.v1_us, e8.candidates) == ("mgpu_ws", "ws", 80.0, 100.0, 2)
    e4 = by_fmt["int4"]
    assert (e4.impl, e4.variant, e4.us, e4.v1_us) == ("mgpu", "default", 55.0, 55.0)   # median of 60 and 50
    impl, fields, why = dt.choose("NVIDIA H200", "int8", 128, 4, 2048, table)
    assert impl == "mgpu_ws" and fields["max_concurrent_steps"] == 6
    assert why == "table decode_test.json: ws 80.0 µs vs v1 default 100.0 µs at T=1024 (capacity 2048)"


def test_triton_is_a_candidate_only_on_full_precision_payloads(bench, tmp_path):
    """bf16: the Triton kernel (read in place, like Mosaic) wins where it was faster and loses where it was not or
    failed its parity; where it was not timed at all the point gets no entry (the Triton kernel keeps serving); int8: a faster Triton row is no candidate (the dispatcher serves INT8 with Mosaic only, a transposed-V cache)."""
    res = _synthetic_results()
    res["check"] = [c for c in res["check"] if not (c["format"] == "bf16" and c["impl"] == "mgpu")]
    res["check"].append(_check("mgpu", "bf16", "bf16x2"))
    triton = lambda fmt, us, t=1024, err=3e-6: dict(T=t, impl="triton", format=fmt, variant="", us=us,  # noqa: E731
                                                   rel_err=err)
    res["rows"] += [triton("bf16", 70.0), triton("int8", 10.0),
                    dict(_row("mgpu", "bf16", "default", 40.0), T=4096), triton("bf16", 45.0, t=4096),
                    dict(_row("mgpu", "bf16", "default", 60.0), T=8192), triton("bf16", 30.0, t=8192, err=0.1),
                    dict(_row("mgpu", "bf16", "default", 60.0), T=16384)]
    src, out = tmp_path / "results.json", tmp_path / "decode_test.json"
    src.write_text(json.dumps(res))
    bench.main(["--tune-from", str(src), "--tune", str(out)])
    table = dt.load_table(str(out))
    by = {(e.format, e.T): e for e in table.entries}
    e = by[("bf16", 1024)]
    assert (e.impl, e.variant, e.us, e.v1_us, e.candidates) == ("triton", "default", 70.0, 100.0, 3)
    assert e.config == ()
    assert by[("bf16", 4096)].impl == "mgpu"                       # v1 40 µs beat Triton 45 µs
    assert by[("bf16", 8192)].impl == "mgpu"                       # Triton 30 µs, but its own error is too high
    assert ("bf16", 16384) not in by                               # Triton not timed: no entry, it keeps serving
    assert by[("int8", 1024)].impl == "mgpu_ws"                    # the 10 µs Triton INT8 row is no candidate
    impl, fields, why = dt.choose("NVIDIA H200", "bf16", 128, 4, 2048, table, fallback="triton")
    assert (impl, fields) == ("triton", {})
    assert why == "table decode_test.json: triton default 70.0 µs vs v1 default 100.0 µs at T=1024 (capacity 2048)"


def test_a_failed_ws_child_group_refuses_its_variants(bench):
    res = _synthetic_results()
    res["ws_child"]["ws default"] = dict(ok=False, why="timed out")
    row = next(r for r in res["rows"] if r.get("variant") == "ws" and r["format"] == "int8")
    assert "timed out" in bench.tune_refusal(res, row)
    assert bench.tune_refusal(res, next(r for r in res["rows"] if r.get("variant") == "default")) is None


def _assert_rebuilt(bench, tmp_path, table_file, results):
    """The shipped ``pallas_kernels/tuning/<table_file>`` equals what ``--tune-from <results>`` builds (all but the
    paths in ``command`` / ``source``), and it names those results."""
    shipped = json.loads((REPO / "pallas_kernels" / "tuning" / table_file).read_text())
    out = tmp_path / table_file
    bench.main(["--tune-from", ",".join(str(REPO / p) for p in results.split(",")), "--tune", str(out)])
    built = json.loads(out.read_text())
    assert {k: v for k, v in built.items() if k not in ("command", "source")} == \
           {k: v for k, v in shipped.items() if k not in ("command", "source")}
    assert shipped["source"] == results and f"--tune-from {results}" in shipped["command"]


def test_shipped_table_is_the_committed_results_tuned(bench, tmp_path):
    """pallas_kernels/tuning/decode_h200.json == what --tune-from builds from the committed H200 results."""
    _assert_rebuilt(bench, tmp_path, "decode_h200.json", RESULTS)
    table = dt.table_for("NVIDIA H200")
    assert table is not None and table.name == "decode_h200.json"
    impl, fields, why = dt.choose("NVIDIA H200", "int8", 128, 4, 32768)
    assert impl == "mgpu_ws" and fields["compute_wgs"] == 2 and fields["v_first"] is False
    assert why == "table decode_h200.json: ws late-v 158.2 µs vs v1 default 169.2 µs at T=32768"
    assert dt.choose("NVIDIA H200", "int4", 128, 4, 65536)[0] == "mgpu_ws"
    assert dt.choose("NVIDIA H200", "int4", 128, 4, 8192)[0] == "mgpu"      # T = 4096 bucket: v1 won there


RESULTS_H100 = ("docs/results/decode_mgpu/2026-12-06-dense-route-h100/b/tune4k/check_mgpu_decode.json,"
                "docs/results/decode_mgpu/2026-12-06-dense-route-h100/c/tune32k/check_mgpu_decode.json")


def test_shipped_h100_table_is_the_committed_results_tuned(bench, tmp_path):
    """pallas_kernels/tuning/decode_h100.json == what --tune-from builds from the committed H100 results; there
    Triton was timed on bf16, lost to Mosaic v1 "bt 64" at both T, so a bf16 layer goes to v1 with block_t 64."""
    _assert_rebuilt(bench, tmp_path, "decode_h100.json", RESULTS_H100)
    kind = "NVIDIA H100 80GB HBM3"
    table = dt.table_for(kind)
    assert table is not None and table.name == "decode_h100.json" and len(table.entries) == 6
    impl, fields, why = dt.choose(kind, "bf16", 128, 4, 4096, fallback="triton")
    assert impl == "mgpu" and fields["block_t"] == 64
    assert why == "table decode_h100.json: v1 bt 64 51.3 µs vs v1 default 53.3 µs at T=4096"
    assert dt.choose(kind, "int8", 128, 4, 32768)[0] == "mgpu_ws"
    assert dt.choose(kind, "int4", 128, 4, 8192)[0] == "mgpu"               # T = 4096 bucket: v1 won there
    assert dt.choose(kind, "fp16", 128, 4, 4096, fallback="triton")[0] == "triton"   # not measured


def test_a_variant_timed_fewer_times_than_v1_is_not_compared(bench, tmp_path):
    """v1 default timed twice (median 55 µs): a ws variant timed once at 40 µs is not compared (noise alone can
    make one of many once-timed variants the fastest); timed twice (40, 45 µs), it wins."""
    res = _synthetic_results()
    rows = [r for r in res["rows"] if not (r["format"] == "int4" and r["impl"] == "mgpu_ws")]
    once = rows + [_row("mgpu_ws", "int4", "ws", 40.0)]
    twice = once + [_row("mgpu_ws", "int4", "ws (rep 2)", 45.0)]
    picked = {}
    for name, rs in (("once", once), ("twice", twice)):
        src, out = tmp_path / f"{name}.json", tmp_path / f"decode_{name}.json"
        src.write_text(json.dumps(dict(res, rows=rs)))
        bench.main(["--tune-from", str(src), "--tune", str(out)])
        picked[name] = next(e for e in dt.load_table(str(out)).entries if e.format == "int4")
    assert (picked["once"].impl, picked["once"].us, picked["once"].candidates) == ("mgpu", 55.0, 1)
    assert (picked["twice"].impl, picked["twice"].variant, picked["twice"].us) == ("mgpu_ws", "ws", 42.5)
    assert picked["twice"].v1_us == 55.0 and picked["twice"].candidates == 2


def test_tune_from_several_runs_pools_their_rows(bench, tmp_path):
    """Two runs: a variant timed in both is compared with v1's median over both; a ws group that failed in either
    run refuses its variants; runs timed by different clocks are refused."""
    a, b = _synthetic_results(), _synthetic_results()
    for r in (a, b):
        r["clock"] = "device"
        r["rows"] = [x for x in r["rows"] if x.get("format") == "int8" and x.get("variant") in ("default", "ws")]
    a["rows"][0]["us"], b["rows"][0]["us"] = 100.0, 60.0           # v1: median of medians 80
    a["rows"][1]["us"], b["rows"][1]["us"] = 70.0, 70.0            # ws: 70
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "decode_test.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    bench.main(["--tune-from", f"{pa},{pb}", "--tune", str(out)])
    (e8,) = dt.load_table(str(out)).entries
    assert (e8.impl, e8.variant, e8.us, e8.v1_us) == ("mgpu_ws", "ws", 70.0, 80.0)
    b["ws_child"]["ws"] = dict(ok=False, why="timed out")           # the ws group failed in run b
    pb.write_text(json.dumps(b))
    bench.main(["--tune-from", f"{pa},{pb}", "--tune", str(out)])
    (e8,) = dt.load_table(str(out)).entries
    assert (e8.impl, e8.variant, e8.us) == ("mgpu", "default", 80.0)
    b["clock"] = "host"
    pb.write_text(json.dumps(b))
    with pytest.raises(ValueError, match="differ in clock"):
        bench.main(["--tune-from", f"{pa},{pb}", "--tune", str(out)])


def test_a_v1_variant_may_win_and_says_which():
    """A v1 config other than the default (e.g. "bt 64", bf16 at 4K on the H100) is a winner like any other: its
    v1_us is v1 default's, and the reason names both."""
    t = _table()
    t["entries"][1] = _entry(4096, "mgpu", "bt 64", 60.0, 70.0, config=dict(V1, block_t=64))
    table = dt.validate_table(t, "t.json")
    impl, fields, why = dt.choose("NVIDIA H200", "int8", 128, 4, 4096, table)
    assert impl == "mgpu" and dt.IMPLS[impl](**fields).block_t == 64
    assert why == "table t.json: v1 bt 64 60.0 µs vs v1 default 70.0 µs at T=4096"


def test_a_table_of_several_shapes_keys_entries_by_head_dim_and_group():
    """``shape`` as a list: each entry belongs to the shape of its (head_dim, group); ``choose`` keeps them apart."""
    t = _table()
    t["shape"] = [dict(B=8, hq=32, hkv=8, d=128), dict(B=64, hq=9, hkv=3, d=64)]
    t["entries"].append(dict(_entry(8192, "mgpu", "bt 64", 90.0, 95.0, config=dict(V1, block_t=64)), head_dim=64,
                             group=3))
    table = dt.validate_table(t, "t.json")
    assert len(table.shapes) == 2 and dict(table.shapes[1]) == dict(B=64, hq=9, hkv=3, d=64)
    impl, fields, why = dt.choose("NVIDIA H200", "int8", 64, 3, 32768, table)
    assert (impl, fields["block_t"]) == ("mgpu", 64) and "v1 bt 64 90.0 µs vs v1 default 95.0 µs at T=8192" in why
    impl, fields, why = dt.choose("NVIDIA H200", "int8", 128, 4, 32768, table)
    assert (impl, fields["block_t"]) == ("mgpu_ws", 64)
    impl, fields, why = dt.choose("NVIDIA H200", "int8", 64, 4, 32768, table)
    assert (impl, fields) == ("mgpu", {}) and "no table entry" in why


def test_tune_from_runs_of_two_shapes_lists_both(bench, tmp_path):
    """--tune-from A,B with A and B timed at different shapes: one table, ``shape`` a list, the entries of each
    shape keyed by its (d, hq / hkv); two shapes with the same (d, hq / hkv) at one (format, T), or runs on two
    devices, are refused."""
    a = _synthetic_results()
    b = _synthetic_results()
    b["shape"] = dict(B=64, hq=9, hkv=3, d=64)
    b["date"] = "2026-12-03T00:00:00+00:00"
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "decode_test.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    bench.main(["--tune-from", f"{pa},{pb}", "--tune", str(out)])
    table = dt.load_table(str(out))
    assert [dict(sh) for sh in table.shapes] == [a["shape"], b["shape"]] and table.date.startswith("2026-12-03")
    keys = sorted((e.format, e.head_dim, e.group) for e in table.entries)
    assert keys == [("int4", 64, 3), ("int4", 128, 4), ("int8", 64, 3), ("int8", 128, 4)]
    c = _synthetic_results()
    c["shape"] = dict(B=16, hq=32, hkv=8, d=128)                        # same (d, group) as a at the same T
    pc = tmp_path / "c.json"
    pc.write_text(json.dumps(c))
    with pytest.raises(ValueError, match=r"both give an entry for \(format, head_dim, group, T\)"):
        bench.main(["--tune-from", f"{pa},{pc}", "--tune", str(out)])
    b["device"] = "gpu:NVIDIA H100 80GB HBM3"
    pb.write_text(json.dumps(b))
    with pytest.raises(ValueError, match="runs differ in device"):
        bench.main(["--tune-from", f"{pa},{pb}", "--tune", str(out)])
