"""``experiments/timing.py``'s device clock: kernels of a Perfetto trace assigned to the host annotation of their
repetition, busy = union of their intervals (overlaps once), span = first start to last end, per call."""
import pytest

from experiment_scripts import load_experiment
from perfetto_traces import complete, write_trace


@pytest.fixture(scope="module")
def timing():
    return load_experiment("timing")


def test_kernels_go_to_their_repetition_and_overlaps_count_once(timing, tmp_path):
    p = tmp_path / "perfetto_trace.json.gz"
    x = complete
    write_trace(p, [
        x(2, 20, "kvq_rep_0", 0.0, 1000.0), x(2, 20, "kvq_rep_1", 1000.0, 2000.0),
        x(2, 20, "PjitFunction(f)", 10.0, 900.0),                    # host, not a repetition marker
        x(1, 10, "decode", 700.0, 240.0), x(1, 10, "combine", 950.0, 10.0),      # rep 0: busy 250, span 260
        x(1, 10, "decode", 1500.0, 200.0), x(1, 10, "combine", 1600.0, 150.0),  # rep 1: overlap -> busy 250
        x(1, 11, "decode", 1500.0, 200.0),                           # the ops line: not counted again
        x(1, 10, "warmup", 5000.0, 99.0)])                           # outside every repetition
    reps, kernels = timing.read_trace(str(p))
    assert [r[0] for r in reps] == [0, 1]
    assert len(kernels) == 5
    dt = timing.split_by_rep(reps, kernels, calls=2)
    assert dt.busy == pytest.approx((125e-6, 125e-6))
    assert dt.span == pytest.approx((130e-6, 125e-6))
    assert dt.host == pytest.approx((500e-6, 1000e-6))
    assert dt.kernels == pytest.approx({"decode": 440.0, "combine": 160.0})
    assert dt.median == pytest.approx(125e-6)


def test_a_repetition_without_kernels_gives_none(timing, tmp_path):
    p = tmp_path / "perfetto_trace.json.gz"
    write_trace(p, [complete(2, 20, "kvq_rep_0", 0.0, 100.0), complete(2, 20, "kvq_rep_1", 200.0, 100.0),
                    complete(1, 10, "decode", 50.0, 10.0)])
    assert timing.split_by_rep(*timing.read_trace(str(p))) is None


def test_device_seconds_on_cpu_is_none_and_the_probe_falls_back_to_host(timing):
    import jax
    import jax.numpy as jnp

    if jax.default_backend() != "cpu":
        pytest.skip("CPU behaviour")
    f = jax.jit(lambda x: x * 2)
    assert timing.device_seconds(f, jnp.ones(64), reps=2) is None
    assert timing.copy_tbps(2, clock="device") > 0
