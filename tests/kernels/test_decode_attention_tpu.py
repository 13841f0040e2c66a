"""The Mosaic-TPU-structured decode kernel (BlockSpec tiles, scalar-prefetched bounds, VMEM scratch) in the TPU
interpreter (``pltpu.InterpretParams()``) on CPU: the same parity cases as the GPU-structured kernel, on a
representative sample of payloads / schemes (the interpreter simulates DMAs and is slower)."""
import pytest

from pallas_kernels import decode_attention as da
from test_decode_attention_common import make_case, rel_err

# (format, GQA ratio, block rows): dense, fp8, symmetric INT8, packed INT2, QServe offsets, grouped per-token,
# static per-head INT4 and KIVI (per-channel key groups; TPU blocks hold 8 groups, so 2-group tiles are whole rows).
CASES = [("bf16", 3, 16), ("e4m3", 1, 16), ("int8", 4, 32), ("int2", 8, 16), ("qserve", 4, 16),
         ("int4g", 3, 16), ("static_int4", 2, 16), ("kivi2", 4, 32)]


@pytest.mark.parametrize("name,gqa,block", CASES)
def test_tpu_interpret_parity(rng, name, gqa, block):
    q, reg, kn, vn, ref = make_case(rng, name, gqa, block)
    out = da.decode_attention(q, [reg], k_new=kn, v_new=vn, backend="tpu", interpret=True,
                              config=da.KernelConfig(block_t=block, num_splits=2))
    assert rel_err(out, ref) < 1e-3
