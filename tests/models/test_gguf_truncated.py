"""Issue Q.4: a truncated or corrupted GGUF gives "file truncated or corrupt: expected N bytes for tensor T, file has
M" and what to do, never an IndexError or a reshape error."""
import hashlib

import numpy as np
import pytest

from kvquant_jax.models.gguf import GGUFError, load_gguf


def _write_llama(path, seed=0):
    """A complete 1-layer llama GGUF with random non-zero weights."""
    import gguf

    rng = np.random.default_rng(seed)
    h, f, v, heads, kv, d = 8, 16, 11, 2, 1, 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(16)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,),
              "blk.0.ffn_norm.weight": (h,), "blk.0.attn_q.weight": (heads * d, h),
              "blk.0.attn_k.weight": (kv * d, h), "blk.0.attn_v.weight": (kv * d, h),
              "blk.0.attn_output.weight": (h, heads * d), "blk.0.ffn_gate.weight": (f, h),
              "blk.0.ffn_up.weight": (f, h), "blk.0.ffn_down.weight": (h, f)}
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    for n, a in arrays.items():
        w.add_tensor(n, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return arrays


def test_complete_file_loads_exactly(tmp_path):
    p = tmp_path / "ok.gguf"
    arrays = _write_llama(p)
    cfg, params = load_gguf(p, rope_pairing="interleaved")
    np.testing.assert_array_equal(params["embed"], arrays["token_embd.weight"])
    np.testing.assert_array_equal(params["layers"]["w_down"][0], arrays["blk.0.ffn_down.weight"].T)
    assert cfg.num_layers == 1 and cfg.vocab_size == 11


@pytest.mark.parametrize("keep", [0.999, 0.97, 0.8, 0.6])
def test_truncated_tensor_data(tmp_path, keep):
    import gguf

    p = tmp_path / "cut.gguf"
    _write_llama(p)
    full = p.read_bytes()
    tensors = {t.name: (t.data_offset, t.n_bytes) for t in gguf.GGUFReader(str(p)).tensors}
    cut = full[: int(len(full) * keep)]
    p.write_bytes(cut)
    # the oracle: the first tensor (in file order) whose extent passes the end of the cut file
    name, (off, n) = min(((k, v) for k, v in tensors.items() if v[0] + v[1] > len(cut)), key=lambda kv: kv[1][0])
    with pytest.raises(GGUFError) as e:
        load_gguf(p)
    msg = str(e.value)
    assert "file truncated or corrupt" in msg
    assert f"expected {n} bytes for tensor {name}" in msg and f"file has {len(cut)} bytes" in msg
    assert hashlib.sha256(cut).hexdigest() in msg and "re-fetch" in msg


@pytest.mark.parametrize("keep", [8, 24, 60, 200])
def test_truncated_header(tmp_path, keep):
    p = tmp_path / "cut.gguf"
    _write_llama(p)
    p.write_bytes(p.read_bytes()[:keep])
    with pytest.raises(GGUFError, match="truncated or corrupt|not a readable GGUF") as e:
        load_gguf(p)
    assert "re-fetch" in str(e.value)


def test_corrupt_tensor_dims_via_load_model(tmp_path):
    """A flipped byte in a tensor's dimension (a tensor that claims far more bytes than the file has)."""
    import gguf

    from kvquant_jax.models import load_model

    p = tmp_path / "bad.gguf"
    _write_llama(p)
    r = gguf.GGUFReader(str(p))
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    dims_off = t.field.offset + 8 + len(t.name) + 4       # name length u64, name, n_dims u32, then dims u64
    data = bytearray(p.read_bytes())
    assert int.from_bytes(data[dims_off:dims_off + 8], "little") == 8
    data[dims_off + 3] ^= 0x40
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="file truncated or corrupt: expected .* bytes for tensor token_embd.weight"):
        load_model(str(p))
