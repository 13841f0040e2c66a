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
