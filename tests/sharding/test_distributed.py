"""Several hosts on one machine: 2 localhost processes (loopback only) x 4 CPU devices each run a sharded greedy
decode (jax.distributed, data=2 x model=4 over the 8 global devices) whose tokens equal the single-process
unsharded result; a process whose coordinator never answers fails with a clear timeout."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvquant_jax.models.testing import random_params, tiny_config

HERE = Path(__file__).resolve().parent
CFG = tiny_config(vocab_size=128, num_heads=8, num_kv_heads=8, hidden_size=64, intermediate_size=128, num_layers=2,
                  head_dim=32)
PROMPTS = [[5, 17, 33, 9], [44, 2 + 100, 7], [8, 9, 10, 11, 12], [90]]
STEPS = 24
SPEC = "int4"


def params():
    return random_params(CFG, seed=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(port, n, i):
    env = dict(os.environ, KVQ_COORDINATOR=f"127.0.0.1:{port}", KVQ_NUM_PROCESSES=str(n), KVQ_PROCESS_ID=str(i),
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parents[1]), env.get("PYTHONPATH", "")])
    return env


def _worker(port, n, i, timeout):
    return subprocess.Popen([sys.executable, str(HERE / "distributed_worker.py"), str(timeout)],
                            env=_env(port, n, i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _last_json(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, text[-3000:]
    return json.loads(lines[-1])


@pytest.mark.slow
def test_two_processes_sharded_decode_equals_single_process():
    from kvquant_jax.cache.registry import make_scheme
    from kvquant_jax.serving.generate import generate

    port = _free_port()
    procs = [_worker(port, 2, i, 120) for i in range(2)]
    ref = generate(params(), CFG, PROMPTS, max_new_tokens=STEPS, scheme=make_scheme(SPEC, rope_theta=CFG.rope_theta),
                   eos_id=-1).tokens
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=540)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out, err))
    for rc, out, err in outs:
        assert rc == 0, err[-3000:]
    got = _last_json(outs[0][1])["tokens"]
    assert got == ref
    assert len(np.unique(np.concatenate(ref))) > 4


def test_missing_coordinator_times_out_with_a_clear_message():
    port = _free_port()                  # nobody listens there: process 1 of 2 waits for a coordinator
    p = _worker(port, 2, 1, 3)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 3, (out[-2000:], err[-3000:])
    msg = _last_json(out)["error"]
    assert f"no coordinator answered at 127.0.0.1:{port} within 3 s" in msg and "process 1 of 2" in msg
