"""Float storage names <-> JAX dtypes: the names schemas and ``cast_params`` take, and the conversion scripts use
(``bench_engine --model smollm2`` passed "bfloat16" to ``cast_params`` and died with a bare KeyError)."""
import jax.numpy as jnp
import numpy as np
import pytest

from kvquant_jax.models.llama import cast_params
from kvquant_jax.quant.dtypes import float_dtype, storage_name


@pytest.mark.parametrize("dtype, name", [(jnp.bfloat16, "bf16"), ("bfloat16", "bf16"), (np.float32, "fp32"),
                                         ("float16", "fp16"), (jnp.dtype("float32"), "fp32")])
def test_storage_name_of_a_jax_dtype(dtype, name):
    assert storage_name(dtype) == name
    assert jnp.dtype(float_dtype(name)) == jnp.dtype(dtype)


def test_unknown_names_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="bfloat16.*storage_name"):
        float_dtype("bfloat16")
    with pytest.raises(ValueError, match="int8.*no float storage name"):
        storage_name(jnp.int8)


def test_cast_params_takes_storage_names_and_keeps_norms_fp32():
    params = {"layers": {"attn_norm": np.ones(4, np.float32), "wq": np.full((2, 2), 1.5, np.float32)}}
    out = cast_params(params, storage_name("bfloat16"))
    assert out["layers"]["wq"].dtype == jnp.bfloat16 and out["layers"]["attn_norm"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out["layers"]["wq"], np.float32), params["layers"]["wq"])
    with pytest.raises(ValueError, match="unknown float storage name 'bfloat16'"):
        cast_params(params, "bfloat16")
