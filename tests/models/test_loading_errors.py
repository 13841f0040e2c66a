"""Bad model inputs give clear errors: unknown path, other architecture, unsupported tensor type, corrupt file."""
import numpy as np
import pytest

from kvquant_jax.models import load_model
from kvquant_jax.models.gguf import GGUFError, load_gguf


def _write_gguf(path, arch="llama", tensor_dtype=np.float32):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tensor("token_embd.weight", np.zeros((11, 8), tensor_dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a known name"):
        load_model(str(tmp_path / "nope.gguf"))


def test_gguf_of_another_architecture(tmp_path):
    p = tmp_path / "gpt2.gguf"
    _write_gguf(p, arch="gpt2")
    with pytest.raises(GGUFError, match="architecture is 'gpt2'"):
        load_gguf(p)


def test_missing_tensor(tmp_path):
    p = tmp_path / "tiny.gguf"
    _write_gguf(p)
    with pytest.raises(GGUFError, match="missing tensor"):
        load_gguf(p)


def test_not_a_gguf(tmp_path):
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_gguf(p)


def test_unsupported_tensor_type(monkeypatch):
    from kvquant_jax.models import gguf as g

    class T:
        name = "blk.0.attn_q.weight"

        class tensor_type:
            name = "IQ2_XXS"

    with pytest.raises(GGUFError, match="unsupported GGUF tensor type IQ2_XXS"):
        g.dequantize_tensor(T())
