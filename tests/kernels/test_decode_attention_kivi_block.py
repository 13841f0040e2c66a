"""KIVI ``KernelConfig(kivi_update="block")``: the logits of all ``bt / G`` key groups of a block in one tile, ONE
online-softmax update and ONE PV per block -- contiguous and paged kernels (Triton-structured, interpreted on CPU;
Mosaic TPU interpreter for one case each) vs the float64 oracle.

Ragged windows (full / offset start ending one past a group boundary / one row; dead rows poisoned with NaN), GQA
4 and 3, D 64 and 128, KIVI-2 and KIVI-4 with 32-token key groups and 32-channel V groups, blocks of 2 and 4
groups.  The checks have teeth: the block path is asserted to be the one traced, and the same kernel with each
group's columns shifted by one group misses the oracle.
"""
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.abi.reference import decode_attention_reference
from kvquant_jax.abi.regions import KVOperand, Region
from kvquant_jax.attention.synthetic import kivi_formats, random_region
from pallas_kernels import decode_attention as da
from pallas_kernels import paged_decode_attention as pk
from experiment_scripts import load_experiment
from test_decode_attention_common import rel_err

B, HKV, N, G = 3, 2, 256, 32
TOL = 1e-3


def _case(rng, bits, gqa, d, block):
    kf, vf = kivi_formats(bits, G, 32)
    start = np.array([0, 5, 0], np.int32)
    end = np.array([N, block + G + 1, 1], np.int32)
    reg = random_region(rng, kf, vf, B, HKV, N, d, start, end)
    q = jnp.asarray(rng.standard_normal((B, HKV * gqa, d)).astype(np.float32))
    kn = jnp.asarray(rng.standard_normal((B, HKV, d)).astype(np.float32))
    vn = jnp.asarray(rng.standard_normal((B, HKV, d)).astype(np.float32))
    ref = decode_attention_reference(np.asarray(q), [reg], k_new=kn, v_new=vn)
    return q, reg, kn, vn, ref


@pytest.fixture
def path_spy(monkeypatch):
    """Counts traces of the block-logits function and of the per-group ``_logits`` (channel-scaled K)."""
    calls = {"block": 0, "group": 0}
    block_fn, group_fn = da._logits_channel_block, da._logits

    def block(*a, **k):
        calls["block"] += 1
        return block_fn(*a, **k)

    def group(qv, tile, rr, j, sp):
        calls["group"] += sp.kf.scale == "channel"
        return group_fn(qv, tile, rr, j, sp)

    monkeypatch.setattr(da, "_logits_channel_block", block)
    monkeypatch.setattr(da, "_logits", group)
    return calls


def _shifted(monkeypatch):
    """Misplace every group's columns by one group (what a wrong tile assembly would do)."""
    fn = da._logits_channel_block
    monkeypatch.setattr(da, "_logits_channel_block", lambda qv, tile, sp: jnp.roll(fn(qv, tile, sp), G, axis=1))


@pytest.mark.parametrize("bits,gqa,d,block", [(2, 4, 128, 64), (2, 3, 64, 128), (4, 4, 64, 128), (4, 3, 128, 64)])
def test_contiguous_block_update_matches_oracle(rng, path_spy, monkeypatch, bits, gqa, d, block):
    q, reg, kn, vn, ref = _case(rng, bits, gqa, d, block)
    cfg = da.KernelConfig(block_t=block, num_splits=2, precision="f32", kivi_update="block")
    run = lambda: da.decode_attention(q, [reg], k_new=kn, v_new=vn, backend="gpu", interpret=True,  # noqa: E731
                                      config=cfg)
    out = run()
    assert path_spy["block"] > 0 and path_spy["group"] == 0, path_spy
    assert rel_err(out, ref) < TOL
    grp = da.decode_attention(q, [reg], k_new=kn, v_new=vn, backend="gpu", interpret=True,
                              config=da.KernelConfig(block_t=block, num_splits=2, precision="f32"))
    assert path_spy["group"] > 0                               # the default still takes one update per group
    np.testing.assert_allclose(np.asarray(out), np.asarray(grp), rtol=2e-4, atol=2e-5)
    _shifted(monkeypatch)
    assert rel_err(run(), ref) > 1e-2                           # misplaced group columns are caught


@pytest.mark.parametrize("precision,tol", [("bf16x2", 1e-4), ("bf16", 5e-3)])
def test_contiguous_block_update_precision_modes(rng, path_spy, precision, tol):
    q, reg, kn, vn, ref = _case(rng, 2, 4, 64, 128)
    cfg = da.KernelConfig(block_t=128, num_splits=2, precision=precision, kivi_update="block")
    out = da.decode_attention(q, [reg], k_new=kn, v_new=vn, backend="gpu", interpret=True, config=cfg)
    assert path_spy["block"] > 0 and path_spy["group"] == 0
    assert rel_err(out, ref) < tol


def test_contiguous_block_update_tpu_interpreter(rng, path_spy):
    q, reg, kn, vn, ref = _case(rng, 4, 4, 64, 64)
    cfg = da.KernelConfig(block_t=256, num_splits=1, precision="f32", kivi_update="block")
    out = da.decode_attention(q, [reg], k_new=kn, v_new=vn, backend="tpu", interpret=True, config=cfg)
    assert path_spy["block"] > 0 and path_spy["group"] == 0
    assert rel_err(out, ref) < TOL


def _paged(rng, reg: Region, page: int):
    """The contiguous region's rows as pages scattered over a pool (+ a NaN trash page), and its page table."""
    m = N // page
    perm = rng.permutation(B * m)

    def pool(x, rows_per_page):
        x = np.asarray(x)
        b, h, n = x.shape[:3]
        pages = x.reshape(b, h, m, rows_per_page, *x.shape[3:]).swapaxes(1, 2).reshape(b * m, h, rows_per_page,
                                                                                       *x.shape[3:])
        out = np.empty((b * m + 1,) + pages.shape[1:], pages.dtype)
        out[perm] = pages
        out[-1] = np.nan if np.issubdtype(out.dtype, np.floating) else 0
        return jnp.asarray(out)

    def op(o: KVOperand, channel: bool):
        per = page // G if channel else page
        return KVOperand(data=pool(o.data, page), scale=pool(o.scale, per),
                         zero=None if o.zero is None else pool(o.zero, per), fmt=o.fmt)

    preg = Region(k=op(reg.k, True), v=op(reg.v, False), start=reg.start, end=reg.end)
    table = jnp.asarray(perm.reshape(B, m).astype(np.int32))
    return preg, table


@pytest.mark.parametrize("bits,gqa,d,page,backend", [(2, 4, 128, 64, "gpu"), (4, 3, 64, 128, "gpu"),
                                                     (2, 3, 64, 128, "gpu"), (4, 4, 128, 64, "gpu"),
                                                     (2, 4, 64, 64, "tpu")])
def test_paged_block_update_matches_oracle(rng, path_spy, monkeypatch, bits, gqa, d, page, backend):
    q, reg, kn, vn, ref = _case(rng, bits, gqa, d, page)
    preg, table = _paged(rng, reg, page)
    run = lambda upd: pk.paged_decode_attention(q, preg, table, k_new=kn, v_new=vn,  # noqa: E731
                                                backend=backend, interpret=True, precision="f32",
                                                num_splits=2, kivi_update=upd)
    out = run("block")
    assert path_spy["block"] > 0 and path_spy["group"] == 0, path_spy
    assert rel_err(out, ref) < TOL
    np.testing.assert_allclose(np.asarray(out), np.asarray(run("group")), rtol=2e-4, atol=2e-5)
    if backend == "gpu":
        _shifted(monkeypatch)
        assert rel_err(run("block"), ref) > 1e-2


def test_bad_kivi_update_raises(rng):
    q, reg, kn, vn, _ = _case(rng, 2, 4, 64, 64)
    with pytest.raises(ValueError, match="kivi_update"):
        da.decode_attention(q, [reg], backend="gpu", interpret=True, config=da.KernelConfig(kivi_update="page"))
    preg, table = _paged(rng, reg, 64)
    with pytest.raises(ValueError, match="kivi_update"):
        pk.paged_decode_attention(q, preg, table, backend="gpu", interpret=True, kivi_update="tile")


def test_bench_format_suffix_selects_the_option():
    """``experiments/bench_decode_attention.py --formats kivi2:kivi_update=block`` patches KernelConfig fields."""

    bench = load_experiment("bench_decode_attention")
    assert bench.config_updates(["kivi_update=block", "block_t=128"]) == {"kivi_update": "block", "block_t": 128}
    with pytest.raises(ValueError, match="KernelConfig field"):
        bench.config_updates(["kivi_updates=block"])
