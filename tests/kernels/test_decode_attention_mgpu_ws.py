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


# ---------------------------------------------------------------------------------------------------------------
# CPU: a model of _ws_call's mbarrier protocol under random interleavings (the kernel's runtime behaviour is not
# checkable on CPU; this checks the plan it implements: ring slots, consumed / full barriers, the turn ring)
# ---------------------------------------------------------------------------------------------------------------
class _Bar:
    def __init__(self):
        self.phase = 0

    def arrive(self):                      # every barrier of the plan completes on one warpgroup's arrival
        self.phase += 1


def _run_protocol(nbs, stages, c, u, seed, regs=None):
    """Memory warpgroup + ``c`` compute warpgroups as generators, one random step at a time.  Fails on a deadlock,
    on a waiter two phases behind (Mosaic tracks ONE parity bit per thread and barrier), on a slot refilled before
    its owner consumed it, or on turns out of block order.

    ``regs = (memory, compute)``: the ``setmaxnreg`` each warpgroup starts with (None: the kernel's own
    :func:`ws._resolve` numbers).  The CTA owns ``register_pool(c)`` registers per thread slot (what the launch
    gave its ``c + 1`` warpgroups); ``setmaxnreg.inc`` waits until the pool can pay for it (PTX), so numbers that
    do not fit leave one compute warpgroup blocked there forever and the turn ring deadlocks."""
    rnd = np.random.default_rng(seed)
    if regs is None:
        r = ws._resolve(ws.MgpuWsConfig(compute_wgs=c, blocks_per_update=u), mg.KVFormat("bf16"))
        regs = (r.memory_registers, r.compute_registers)
    launch = ws.register_pool(c) // (c + 1)                 # per thread, every warpgroup, at launch
    pool = [0]                                              # registers per thread slot not held by a warpgroup
    full, consumed, turn = [_Bar() for _ in range(stages)], [_Bar() for _ in range(stages)], [_Bar() for _ in range(c)]
    slot, waits, order = [None] * stages, {}, []

    def setmaxnreg(n):
        while pool[0] < n - launch:                         # .inc blocks; .dec (n < launch) always goes through
            yield
        pool[0] -= n - launch

    def wait(who, bar):
        k = waits.get((who, id(bar)), 0)
        while bar.phase - k < 1:
            yield
        assert bar.phase - k == 1, f"warpgroup {who} is {bar.phase - k} phases behind"
        waits[(who, id(bar))] = k + 1

    def memory():
        yield from setmaxnreg(regs[0])

        def issue(i):
            assert slot[i % stages] is None, f"slot {i % stages} refilled before block {slot[i % stages]} was used"
            slot[i % stages] = i
            full[i % stages].arrive()
        for i in range(stages):
            issue(i)
            yield
        for i in range(stages, nbs):
            yield from wait("mem", consumed[i % stages])
            issue(i)
            yield

    def compute(w):
        yield from setmaxnreg(regs[1])
        if w == c - 1:
            turn[0].arrive()

        def in_turn(tag):
            yield from wait(w, turn[w])
            order.append(tag)
            turn[(w + 1) % c].arrive()
        for j in range(nbs // (c * u)):
            first = (c * j + w) * u
            for b in range(u):
                yield from wait(w, full[(first + b) % stages])
                assert slot[(first + b) % stages] == first + b
            yield
            yield from in_turn(first)
            yield
            for b in range(u):
                slot[(first + b) % stages] = None
                consumed[(first + b) % stages].arrive()
        yield from in_turn(None)

    live = {"mem": memory(), **{w: compute(w) for w in range(c)}}
    for _ in range(100000):
        if not live:
            break
        k = list(live)[rnd.integers(len(live))]
        try:
            next(live[k])
        except StopIteration:
            del live[k]
    assert not live, "deadlock"
    assert [t for t in order if t is not None] == list(range(0, nbs, u))


@pytest.mark.parametrize("c,u", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_ws_barrier_protocol_model(c, u):
    for nbs in (c * u, 2 * c * u, 3 * c * u, 8 * c * u):
        for stages in range(c * u, min(nbs, 8) + 1, c * u):
            for seed in range(8):
                _run_protocol(nbs, stages, c, u, seed)


def test_ws_register_plan_fits_the_pool():
    """The first H200 run hung on compute_wgs=4 with 40 + 4 x 112 registers (> the 5 x 96 a 640-thread CTA owns):
    the resolved numbers must fit, the C = 2 ones stay what passed on the device, and a bad pair is refused."""
    assert ws.register_pool(2) == 3 * 168 and ws.register_pool(4) == 5 * 96
    kf = mg.KVFormat("bf16")
    for c in (2, 4):
        r = ws._resolve(ws.MgpuWsConfig(compute_wgs=c), kf)
        assert r.memory_registers + c * r.compute_registers <= ws.register_pool(c)
        assert r.memory_registers >= 24 and r.compute_registers % 8 == 0 and r.memory_registers % 8 == 0
    r2 = ws._resolve(ws.MgpuWsConfig(), kf)
    assert (r2.memory_registers, r2.compute_registers) == (40, 232)
    r4 = ws._resolve(ws.MgpuWsConfig(compute_wgs=4, memory_registers=40), kf)
    assert r4.compute_registers == 104
    with pytest.raises(ValueError, match="block forever"):
        ws._resolve(ws.MgpuWsConfig(compute_wgs=4, memory_registers=40, compute_registers=112), kf)
    with pytest.raises(ValueError, match="multiple of 8"):
        ws._resolve(ws.MgpuWsConfig(compute_registers=230), kf)


def test_ws_barrier_protocol_model_catches_register_oversubscription():
    """The plan of the first device run (C = 4, 40 + 4 x 112 registers): the model must deadlock on it."""
    for seed in range(4):
        with pytest.raises(AssertionError, match="deadlock"):
            _run_protocol(8, 4, 4, 1, seed, regs=(40, 112))
    _run_protocol(8, 4, 4, 1, 0, regs=(40, 104))
    _run_protocol(8, 4, 4, 1, 0, regs=(32, 112))


def test_ws_barrier_protocol_model_catches_a_bad_ring():
    """A ring that is not a multiple of C x U hands one slot to two warpgroups: the model must notice."""
    with pytest.raises(AssertionError):
        for seed in range(20):
            _run_protocol(8, 3, 2, 1, seed)


# ---------------------------------------------------------------------------------------------------------------
# The transposed-V entry point (a cache stored in the kernel's layout, kvquant_jax.abi.transposed_v)
# ---------------------------------------------------------------------------------------------------------------
def _np_pack_signed(q: np.ndarray, bits: int) -> np.ndarray:
    """Independent packing oracle: signed codes [..., n] -> two's-complement bytes, element 2i in the low nibble."""
    u = (q.astype(np.int64) & ((1 << bits) - 1)).astype(np.uint8)
    return u if bits == 8 else (u[..., 0::2] | (u[..., 1::2] << 4)).astype(np.uint8)


def _vt_case(rng, bits, b=2, hkv=2, g=4, d=64, c=256):
    """Random non-zero codes and scales in the transposed-V layout + their float64 K / V (``[B, Hkv, C, D]``)."""
    from kvquant_jax.abi.transposed_v import TransposedVFormat
    from kvquant_jax.cache.per_token_vt import TransposedVLayerState

    qmax = 2 ** (bits - 1) - 1
    qk = rng.integers(-qmax, qmax + 1, (b, hkv, c, d))
    qv = rng.integers(-qmax, qmax + 1, (b, hkv, c, d))
    sk = rng.uniform(0.5, 1.5, (b, hkv, c, 1)).astype(np.float16) / qmax
    sv = rng.uniform(0.5, 1.5, (b, hkv, c, 1)).astype(np.float16) / qmax
    st = TransposedVLayerState(k_codes=jnp.asarray(_np_pack_signed(qk, bits)),
                               v_codes=jnp.asarray(_np_pack_signed(np.swapaxes(qv, 2, 3), bits)),
                               k_scale=jnp.asarray(sk), v_scale=jnp.asarray(sv))
    k = qk * sk.astype(np.float64)
    v = qv * sv.astype(np.float64)
    return TransposedVFormat(bits=bits), st, k, v


def _np_oracle(q, k, v, lengths, kn, vn):
    """float64 NumPy decode attention: q [B, Hq, D] over rows [0, lengths[b]) of k, v [B, Hkv, C, D] + the current
    token kn, vn [B, Hkv, D] in the same softmax."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    q4 = q.reshape(b, hkv, hq // hkv, d)
    kk = np.concatenate([k, kn[:, :, None]], axis=2)
    vv = np.concatenate([v, vn[:, :, None]], axis=2)
    s = np.einsum("bhgd,bhtd->bhgt", q4, kk) / np.sqrt(d)
    live = np.arange(kk.shape[2])[None, :] < lengths[:, None]
    live[:, -1] = True
    s = np.where(live[:, None, None, :], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhgt,bhtd->bhgd", p, vv).reshape(b, hq, d)


@pytest.mark.parametrize("bits", [8, 4])
def test_ws_transposed_v_plain_jax_path_matches_numpy_oracle(rng, bits):
    """CPU: the ws transposed-V entry builds v1's operands and (interpret / non-GPU) runs the plain-JAX partials."""
    fmt, st, k, v = _vt_case(rng, bits)
    b, hkv, _, d = k.shape
    q = rng.standard_normal((b, hkv * 4, d))
    kn, vn = rng.standard_normal((b, hkv, d)), rng.standard_normal((b, hkv, d))
    lengths = np.array([256, 131], np.int32)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    out = ws.decode_attention_transposed_v_ws(f32(q), fmt, st, jnp.asarray(lengths), f32(kn), f32(vn),
                                              config=ws.MgpuWsConfig(compute_wgs=4, block_t=64))
    assert out.dtype == jnp.float32 and out.shape == q.shape
    want = _np_oracle(q, k, v, lengths, kn, vn)
    assert _rel(out, want) < 1e-3
    v1 = mg.decode_attention_transposed_v(f32(q), fmt, st, jnp.asarray(lengths), f32(kn), f32(vn))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(v1))          # same operands, same partials


def test_ws_transposed_v_config_check_says_why(rng):
    fmt, st, _, _ = _vt_case(rng, 4, c=384)
    c4 = ws.MgpuWsConfig(compute_wgs=4, block_t=64, max_concurrent_steps=8)
    assert "block" in ws.transposed_v_ws_config_unsupported(fmt, st, 64, 4, c4)       # 6 blocks for 4 warpgroups
    assert ws.transposed_v_ws_config_unsupported(fmt, st, 64, 4, ws.MgpuWsConfig(block_t=64)) is None
    assert "compute_wgs" in ws.transposed_v_ws_config_unsupported(fmt, st, 64, 4, ws.MgpuWsConfig(compute_wgs=3))
    assert "block_t" in mg.transposed_v_config_unsupported(fmt, st, 64, 4, mg.MgpuConfig(block_t=256))
    assert mg.transposed_v_config_unsupported(fmt, st, 64, 4, mg.MgpuConfig(block_t=64)) is None
    fmt, st, _, _ = _vt_case(rng, 4, c=256)
    assert ws.transposed_v_ws_config_unsupported(fmt, st, 64, 4, c4) is None
    assert "num_splits" in ws.transposed_v_ws_config_unsupported(fmt, st, 64, 4, ws.MgpuWsConfig(num_splits=8))
    q = jnp.ones((2, 8, 64), jnp.bfloat16)
    assert ws.transposed_v_ws_unsupported(q, fmt, st, c4) == mg.transposed_v_device_unsupported(q)
    assert ws.transposed_v_ws_unsupported(q.astype(jnp.float32), fmt, st, c4)      # never None: f32 q, or not Hopper
