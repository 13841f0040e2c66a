"""Prefix-cache content keys: the one-pass page keys equal keying each prefix alone, and every content field
(ids, their start position, model, tokenizer) changes the key."""
import numpy as np

from kvquant_jax.cache.prefix_cache import content_key, content_keys


def test_page_keys_equal_each_prefix_keyed_alone():
    ids = np.random.default_rng(3).integers(0, 49152, 16 * 7 + 5).astype(np.int64)   # 7 full pages + 5 rows
    keys = content_keys(ids, 2, 16, 7, "model-a", "tok-a")
    assert keys == [content_key(ids[: n * 16], 2, "model-a", "tok-a") for n in range(1, 8)]
    assert len(set(keys)) == 7
    # a list of ints, an int32 array and an int64 array of the same ids are the same content
    assert content_key(list(ids[:32]), 2, "model-a", "tok-a") == content_key(ids[:32].astype(np.int32), 2,
                                                                              "model-a", "tok-a") == keys[1]


def test_every_content_field_changes_the_key():
    ids = np.arange(100, 132)
    base = content_key(ids, 0, "m", "t")
    other = ids.copy()
    other[-1] += 1                                                # the last id of the last page
    assert content_key(other, 0, "m", "t") != base
    assert content_key(ids, 1, "m", "t") != base                  # the same ids at other positions
    assert content_key(ids, 0, "m2", "t") != base and content_key(ids, 0, "m", "t2") != base
    assert content_key(ids[:31], 0, "m", "t") != base             # a prefix is not the whole
    # the header cannot run into the ids: a model hash that ends like an encoded id is still another key
    assert content_key(ids[1:], 0, "m", "t") != content_key(ids, 0, "m", "t")
