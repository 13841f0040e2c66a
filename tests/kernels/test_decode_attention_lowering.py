"""The compiled (non-interpreted) kernels lower on CPU for their target platforms: Pallas Triton for "cuda" and
Mosaic for "tpu" (``jit(...).trace(...).lower(lowering_platforms=...)`` runs the Pallas lowering rules -- block
shapes, supported ops, the inline-asm unpack -- without a device; the backend compilers themselves run only on
the device)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.attention.synthetic import PRESETS, kivi_formats, random_region
from pallas_kernels import decode_attention as da
from pallas_kernels import decode_attention_mgpu as mg
from pallas_kernels import decode_attention_mgpu_ws as ws

FORMATS = dict(bf16=PRESETS["bf16"], e4m3=PRESETS["e4m3"], int8=PRESETS["int8"], int2=PRESETS["int2"],
               qserve=PRESETS["qserve"], static_int4=PRESETS["static_int4"], kivi2=kivi_formats(2, 32, 32))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_kernel_lowers_for_target(rng, monkeypatch, platform, name):
    kf, vf = FORMATS[name]
    reg = random_region(rng, kf, vf, 2, 2, 512, 128, [0, 0], [300, 512], poison=False)
    q = jnp.asarray(rng.standard_normal((2, 8, 128)).astype(np.float32)).astype(jnp.bfloat16)
    backend = "gpu" if platform == "cuda" else "tpu"
    monkeypatch.setattr(da, "platform", lambda: backend)
    cfg = da.KernelConfig(block_t=256 if platform == "tpu" else 64, num_splits=2, num_warps=4, num_stages=3,
                          unpack="asm")
    fn = lambda q, r: da.decode_attention(q, [r], backend=backend, interpret=False, config=cfg)  # noqa: E731
    text = jax.jit(fn).trace(q, reg).lower(lowering_platforms=(platform,)).as_text()
    assert "decode_attention" in text


# Mosaic GPU (Hopper) kernels: pallas_kernels/decode_attention_mgpu.py (one warpgroup) and
# decode_attention_mgpu_ws.py (TMA warpgroup + two compute warpgroups).  Lowering runs the Pallas Mosaic GPU rules
# and the Mosaic module's verifier (FragmentedArray layouts, wgmma shapes, setmaxnreg, the SMEM budget) on CPU; ptxas,
# mbarrier protocols and numerics need the H200 (experiments/check_mgpu_decode.py).
MGPU_FORMATS = ("bf16", "fp16", "e4m3", "e5m2", "int8", "int4")


def _mgpu_case(rng, name, t=1024, d=128, g=4):
    kf, vf = PRESETS[name]
    reg = random_region(rng, kf, vf, 2, 2, t, d, [0, 0], [300, t], poison=False)
    q = jnp.asarray(rng.standard_normal((2, 2 * g, d)).astype(np.float32)).astype(jnp.bfloat16)
    return q, reg


def _lower_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("name", MGPU_FORMATS)
def test_mgpu_kernel_lowers_for_cuda(rng, name):
    q, reg = _mgpu_case(rng, name)
    cfgs = [mg.MgpuConfig(num_splits=2), mg.MgpuConfig(precision="bf16"), mg.MgpuConfig(barriers="explicit")]
    if PRESETS[name][0].is_int:
        cfgs.append(mg.MgpuConfig(upcast=True))
    texts = []
    for cfg in cfgs:
        text = _lower_cuda(lambda q, r, cfg=cfg: mg.decode_attention_mgpu(q, r, config=cfg), q, reg)
        assert "mosaic_gpu" in text
        texts.append(text)
    # the barrier mode is live: explicit barriers lower to another kernel than the default's; a bad mode is refused
    assert texts[2] != _lower_cuda(lambda q, r: mg.decode_attention_mgpu(q, r, config=mg.MgpuConfig()), q, reg)
    with pytest.raises(ValueError, match="barriers must be 'auto' or 'explicit', got 'none'"):
        _lower_cuda(lambda q, r: mg.decode_attention_mgpu(q, r, config=mg.MgpuConfig(barriers="none")), q, reg)


@pytest.mark.parametrize("name", MGPU_FORMATS)
def test_mgpu_ws_kernel_lowers_for_cuda(rng, name):
    q, reg = _mgpu_case(rng, name)
    cfgs = [ws.MgpuWsConfig(), ws.MgpuWsConfig(precision="bf16", num_splits=1),
            ws.MgpuWsConfig(blocks_per_update=2, max_concurrent_steps=4),
            ws.MgpuWsConfig(compute_wgs=4, block_t=64, max_concurrent_steps=4)]
    for cfg in cfgs:
        text = _lower_cuda(lambda q, r, cfg=cfg: ws.decode_attention_mgpu_ws(q, r, config=cfg), q, reg)
        assert "mosaic_gpu" in text


@pytest.mark.parametrize("g,d", [(8, 128), (4, 64), (4, 256), (3, 64)])
def test_mgpu_ws_kernel_lowers_for_cuda_shapes(rng, g, d):
    q, reg = _mgpu_case(rng, "int4", t=512, d=d, g=g)
    assert "mosaic_gpu" in _lower_cuda(lambda q, r: ws.decode_attention_mgpu_ws(q, r), q, reg)


def test_mgpu_ws_smem_overflow_is_a_lowering_error(rng):
    q, reg = _mgpu_case(rng, "int8", t=4096)
    cfg = ws.MgpuWsConfig(max_concurrent_steps=12, num_splits=1)      # 12 x 33 KB
    with pytest.raises(Exception, match="shared memory"):
        _lower_cuda(lambda q, r: ws.decode_attention_mgpu_ws(q, r, config=cfg), q, reg)


@pytest.mark.parametrize("cfg", [ws.MgpuWsConfig(), ws.MgpuWsConfig(compute_wgs=4, block_t=64, max_concurrent_steps=4),
                                 ws.MgpuWsConfig(compute_wgs=4, block_t=64, max_concurrent_steps=4,
                                                 memory_registers=40)],
                         ids=["c2", "c4", "c4-r40"])
def test_mgpu_ws_setmaxnreg_fits_the_launch(rng, monkeypatch, cfg):
    """What the kernel passes to setmaxnreg, per warpgroup, must fit the registers its launch owns: ptxas gives
    each of the 128 x num_threads threads floor(64K / threads) rounded down to 8, and setmaxnreg.inc blocks until
    the CTA's pool can pay (the first H200 run hung on compute_wgs=4 with 40 + 4 x 112 > 5 x 96)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    calls, launches = [], []
    set_max, kernel = plgpu.set_max_registers, plgpu.kernel

    def spy_set_max(n, *, action):
        calls.append((n, action))
        return set_max(n, action=action)

    def spy_kernel(*a, **k):
        launches.append(k.get("num_threads"))
        return kernel(*a, **k)

    monkeypatch.setattr(plgpu, "set_max_registers", spy_set_max)
    monkeypatch.setattr(plgpu, "kernel", spy_kernel)
    q, reg = _mgpu_case(rng, "bf16")
    assert "mosaic_gpu" in _lower_cuda(lambda q, r: ws.decode_attention_mgpu_ws(q, r, config=cfg), q, reg)
    [wgs] = set(launches)
    [dec] = [n for n, a in calls if a == "decrease"]            # the TMA warpgroup
    [inc] = {n for n, a in calls if a == "increase"}            # every compute warpgroup
    per_thread = 65536 // (128 * wgs) // 8 * 8
    assert dec + (wgs - 1) * inc <= wgs * per_thread, (dec, inc, wgs, per_thread)
    assert all(n % 8 == 0 and 24 <= n <= 256 for n, _ in calls)


@pytest.mark.parametrize("bits,cfg", [(8, ws.MgpuWsConfig(compute_wgs=4, block_t=64, max_concurrent_steps=8)),
                                      (4, ws.MgpuWsConfig(block_t=128, max_concurrent_steps=6))],
                         ids=["int8-c4-bt64", "int4-ws"])
def test_mgpu_ws_transposed_v_lowers_for_cuda(bits, cfg):
    """The ws entry over a transposed-V layer (the configs the H200 tuning table picks at T = 32K) lowers for
    "cuda" with ``interpret=False`` on v1's reinterpreted operands (no per-step conversion)."""
    from kvquant_jax.cache.per_token_vt import TransposedVPerTokenScheme

    scheme = TransposedVPerTokenScheme(bits=bits)
    st = scheme.init_layer(2, 1024, 2, 128)
    q = jnp.ones((2, 8, 128), jnp.bfloat16)
    lengths = jnp.array([1024, 300], jnp.int32)
    assert ws.transposed_v_ws_config_unsupported(scheme.kernel_format, st, 128, 4, cfg) is None
    fn = lambda q, st, n: ws.decode_attention_transposed_v_ws(  # noqa: E731
        q, scheme.kernel_format, st, n, interpret=False, config=cfg)
    assert "mosaic_gpu" in _lower_cuda(fn, q, st, lengths)


@pytest.mark.parametrize("platform,block_t", [("cuda", 64), ("cuda", 128), ("tpu", 256)])
@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_block_update_lowers_for_target(rng, monkeypatch, platform, bits, block_t):
    """``KernelConfig(kivi_update="block")`` (one online-softmax update per block: the group logits assembled
    with iota-masked selects, no concatenate) lowers for Triton ("cuda") and Mosaic ("tpu") at D = 128; the block
    path is asserted to be the one traced."""
    kf, vf = kivi_formats(bits, 32, 32)
    reg = random_region(rng, kf, vf, 2, 2, 512, 128, [0, 0], [300, 512], poison=False)
    q = jnp.asarray(rng.standard_normal((2, 8, 128)).astype(np.float32)).astype(jnp.bfloat16)
    backend = "gpu" if platform == "cuda" else "tpu"
    monkeypatch.setattr(da, "platform", lambda: backend)
    traced = []
    block_fn = da._logits_channel_block
    monkeypatch.setattr(da, "_logits_channel_block",
                        lambda qv, tile, sp: traced.append(sp.bt) or block_fn(qv, tile, sp))
    # Mosaic: the [bt / G, D] channel-scale tile needs 8 sublanes, so TPU KIVI blocks are >= 8 G = 256 rows
    cfg = da.KernelConfig(block_t=block_t, num_splits=2, num_warps=4, num_stages=3, unpack="asm",
                          kivi_update="block")
    fn = lambda q, r: da.decode_attention(q, [r], backend=backend, interpret=False, config=cfg)  # noqa: E731
    text = jax.jit(fn).trace(q, reg).lower(lowering_platforms=(platform,)).as_text()
    assert "decode_attention" in text
    assert traced and set(traced) == {block_t}


# pallas_kernels/decode_attention_mgpu_kivi.py (KIVI on Mosaic GPU): the shapes experiments/check_mgpu_kivi.py checked
# on the H200 (2026-12-04); lowering checks the 8-bit ops allowed (AND only), the N-stacked wgmma shapes, the
# column slices of the accumulators and the TMA tile sizes (>= 128 bytes) on CPU.
@pytest.mark.parametrize("bits,kg,vg,d,g,precision,inflight,qk_batch", [
    (2, 32, 32, 128, 4, "bf16x2", 0, 0), (2, 32, 32, 128, 4, "bf16", 0, 0), (4, 32, 32, 128, 4, "bf16x2", 0, 0),
    (2, 16, 0, 64, 3, "bf16x2", 0, 0), (4, 64, 16, 64, 1, "bf16", 0, 0), (2, 32, 32, 128, 4, "bf16x2", 2, 0),
    (2, 32, 32, 128, 4, "bf16x2", 0, 1), (2, 16, 0, 64, 3, "bf16x2", 1, 3)])
def test_mgpu_kivi_kernel_lowers_for_cuda(rng, bits, kg, vg, d, g, precision, inflight, qk_batch):
    from pallas_kernels import decode_attention_mgpu_kivi as mk

    kf, vf = kivi_formats(bits, kg, vg)
    reg = random_region(rng, kf, vf, 2, 2, 1024, d, [0, 0], [300, 1024], poison=False, qparam_dtype=jnp.float16)
    q = jnp.asarray(rng.standard_normal((2, 2 * g, d)).astype(np.float32)).astype(jnp.bfloat16)
    cfg = mk.KiviMgpuConfig(num_splits=2, precision=precision, wgmma_inflight=inflight, qk_plane_batch=qk_batch)
    text = _lower_cuda(lambda q, r: mk.decode_attention_mgpu_kivi(q, r, config=cfg), q, reg)
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("name,q_dtype", [("kivi2_planar", jnp.bfloat16), ("kivi4_planar", jnp.float32)])
def test_kivi_planar_route_lowers_for_cuda(name, q_dtype):
    """The dispatcher's fused entry over a token-planar KIVI cache layer read in place (reshape + uint8 -> int8
    bitcast of the stored arrays, the ring tail and the current token in the same softmax) lowers to ONE Mosaic GPU
    kernel."""
    from kvquant_jax.cache.registry import make_scheme
    from pallas_kernels import decode_attention_mgpu_kivi as mk

    scheme = make_scheme(name)
    st = scheme.init_layer(2, 1024, 2, 128)
    q = jnp.ones((2, 8, 128), q_dtype)
    kn = jnp.ones((2, 2, 128), jnp.float32)

    def fn(q, st, lengths, kn):
        fmt, op = scheme.fused_decode_operand(st, lengths)
        return mk.decode_attention_kivi_planar(q, fmt, op, k_new=kn, v_new=kn, interpret=False)

    text = _lower_cuda(fn, q, st, jnp.array([700, 1000], jnp.int32), kn)
    assert text.count("mosaic_gpu") >= 1 and "body_mosaic_gpu" in text


# pallas_kernels/decode_attention_mgpu_planar.py (per-token INT2 / INT4 on the token-planar kernel): every zero
# convention of K and V (symmetric reads no zero array; offset / min one row), V groups, D 64 / 128 / 256
@pytest.mark.parametrize("bits,kz,vz,vg,d,g,precision", [
    (2, "symmetric", "symmetric", 0, 128, 4, "bf16x2"), (4, "offset", "offset", 0, 128, 4, "bf16x2"),
    (2, "min", "offset", 16, 64, 3, "bf16"), (4, "symmetric", "min", 64, 256, 8, "bf16x2"),
    (2, "offset", "symmetric", 32, 64, 1, "bf16x2")])
def test_mgpu_planar_kernel_lowers_for_cuda(rng, bits, kz, vz, vg, d, g, precision):
    from kvquant_jax.abi.regions import KVFormat
    from pallas_kernels import decode_attention_mgpu_kivi as mk
    from pallas_kernels import decode_attention_mgpu_planar as mp

    kf, vf = KVFormat(f"int{bits}", "token", kz), KVFormat(f"int{bits}", "token", vz, vg)
    reg = random_region(rng, kf, vf, 2, 2, 1024, d, [0, 0], [300, 1024], poison=False, qparam_dtype=jnp.float16)
    q = jnp.asarray(rng.standard_normal((2, 2 * g, d)).astype(np.float32)).astype(jnp.bfloat16)
    cfg = mk.KiviMgpuConfig(num_splits=2, precision=precision)
    text = _lower_cuda(lambda q, r: mp.decode_attention_mgpu_planar(q, r, config=cfg, interpret=False), q, reg)
    assert "mosaic_gpu" in text


# pallas_kernels/decode_attention_mgpu_planar_s8.py (the same operands on s8 tensor cores): int8 register-A wgmmas
# into int32 accumulators (QK and PV), the 16-bit transposed limb store into a swizzled scratch and the converting
# WGMMA-layout load (PlanarS8Config.limb_path "i16" and "bf16"), every zero convention, V groups 0 / 64,
# D 64 / 128 / 256, GQA 1 / 3 / 4 / 8, pipeline depth 2 and 3, 3 and 2 PV limbs (the refused 32-bit path lowers
# in tests/kernels/test_decode_attention_mgpu_planar_s8.py's debug micro kernels)
@pytest.mark.parametrize("bits,kz,vz,vg,d,g,stages,limb_path,pv_limbs", [
    (2, "symmetric", "symmetric", 0, 128, 4, 2, "i16", 3), (4, "offset", "offset", 0, 128, 4, 3, "i16", 3),
    (4, "symmetric", "min", 64, 256, 8, 2, "i16", 3), (4, "min", "symmetric", 0, 64, 3, 2, "i16", 3),
    (2, "offset", "min", 0, 64, 1, 3, "i16", 3),
    (2, "symmetric", "symmetric", 0, 128, 4, 2, "bf16", 3), (4, "symmetric", "min", 64, 256, 8, 2, "bf16", 3),
    (4, "offset", "offset", 0, 128, 4, 3, "bf16", 3), (2, "offset", "min", 0, 64, 1, 3, "bf16", 3),
    (2, "symmetric", "symmetric", 0, 128, 4, 2, "i16", 2), (4, "offset", "offset", 0, 128, 4, 2, "i16", 2),
    (2, "min", "offset", 64, 128, 8, 3, "i16", 2), (4, "symmetric", "min", 64, 256, 8, 2, "bf16", 2)])
def test_mgpu_planar_s8_kernel_lowers_for_cuda(rng, bits, kz, vz, vg, d, g, stages, limb_path, pv_limbs):
    from kvquant_jax.abi.regions import KVFormat
    from pallas_kernels import decode_attention_mgpu_planar as mp
    from pallas_kernels import decode_attention_mgpu_planar_s8 as s8

    kf, vf = KVFormat(f"int{bits}", "token", kz), KVFormat(f"int{bits}", "token", vz, vg)
    reg = random_region(rng, kf, vf, 2, 2, 1024, d, [0, 0], [300, 1024], poison=False, qparam_dtype=jnp.float16)
    q = jnp.asarray(rng.standard_normal((2, 2 * g, d)).astype(np.float32)).astype(jnp.bfloat16)
    cfg = s8.PlanarS8Config(num_splits=2, max_concurrent_steps=stages, limb_path=limb_path, pv_limbs=pv_limbs)
    text = _lower_cuda(lambda q, r: s8.decode_attention_mgpu_planar_s8_prepared(
        q, mp.prepare_token_planar_region(r), config=cfg, interpret=False), q, reg)
    assert "mosaic_gpu" in text
