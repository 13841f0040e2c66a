"""``experiments/profile_mgpu_s8.py`` without a GPU: the per-phase cycle count of a Mosaic GPU profiler trace (a
hand-made one: two warpgroups, nested re-entry of a phase, the time between phases), its summary and table, the
variant names it takes, and the refusal on CPU."""
import pytest

from experiment_scripts import load_experiment


@pytest.fixture(scope="module")
def prof():
    return load_experiment("profile_mgpu_s8")


def _events(tid, t0, steps, phases, dur, gap, nest=()):
    """One warpgroup's trace: per step each phase ``dur[p]`` cycles, ``gap`` cycles before each step; phases in
    ``nest`` are recorded again inside themselves (as a nested lowering would).  ``ts`` in 1e3 cycles."""
    ev, t = [], t0
    for _ in range(steps):
        t += gap
        for p in phases:
            ev.append(dict(name=p, ph="B", ts=t / 1e3, tid=tid))
            if p in nest:
                ev.append(dict(name=p, ph="B", ts=(t + 1) / 1e3, tid=tid))
                ev.append(dict(name=p, ph="E", ts=(t + dur[p] - 1) / 1e3, tid=tid))
            t += dur[p]
            ev.append(dict(name=p, ph="E", ts=t / 1e3, tid=tid))
    return ev


def test_phase_cycles_counts_each_phase_once_per_step(prof):
    phases = prof.s8.PROFILE_PHASES
    dur = {p: 100 * (i + 1) for i, p in enumerate(phases)}
    trace = {"traceEvents": _events(1, 0, 4, phases, dur, 50, nest=("s8_qk", "s8_pv"))
             + _events(2, 10_000, 4, phases, {p: 2 * v for p, v in dur.items()}, 150)}
    pc = prof.phase_cycles(trace)
    assert pc["ctas"] == 2 and pc["steps"] == [4, 4]
    assert pc["per_step"]["s8_qk"] == pytest.approx([100, 200]) and pc["per_step"]["s8_acc"] == pytest.approx([600, 1200])
    # the span runs from the first begin to the last end: the first gap is outside it, the next three inside
    assert pc["per_step"]["between"] == pytest.approx([50 * 3 / 4, 150 * 3 / 4])
    s = prof.summarize(pc)
    assert s["steps_per_cta"] == 4 and s["cycles_per_step"]["s8_qk"] == pytest.approx(150)
    assert sum(v for k, v in s["share"].items()) == pytest.approx(1.0)
    row = dict(format="int2", variant="default", T=32768, call_us=101.0, kernel_us=99.0, diff_vs_default=0.0,
               profile=s)
    lines = prof.table([row])
    assert len(lines) == 3 and "| int2 | default | 32768 | 101.0 | 99.0 | 0.0e+00 | 4 | 150 (" in lines[2]


def test_variants_and_cpu_refusal(prof, capsys):
    import jax
    import numpy as np

    assert prof.main(["--allow-cpu"]) == 0 and "needs a Hopper GPU" in capsys.readouterr().out
    assert prof.main([]) == 2
    # the variant names are check_mgpu_planar's s8 ones
    from kvquant_jax.abi.regions import KVFormat
    from kvquant_jax.attention.synthetic import random_region
    from pallas_kernels import decode_attention_mgpu_planar as mp

    kf = KVFormat("int2", "token", "symmetric")
    reg = random_region(np.random.default_rng(0), kf, kf, 2, 2, 1024, 128, [0, 0], [1024, 1024], poison=False)
    ops = mp.prepare_token_planar_region(reg)
    assert prof.variant_config("default", ops, 4) == prof.s8.PlanarS8Config()
    assert prof.variant_config("pv limbs 2", ops, 4).pv_limbs == 2
    both = prof.variant_config("pv limbs 2 + barriers auto", ops, 4)
    assert (both.pv_limbs, both.barriers) == (2, "auto")
    with pytest.raises(SystemExit, match="unknown variant 'nope'"):
        prof.variant_config("nope", ops, 4)
    assert jax.default_backend() == "cpu"
