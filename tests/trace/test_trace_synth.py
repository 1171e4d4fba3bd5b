from __future__ import annotations

import numpy as np
import pytest

from asynccache.errors import ConfigError
from asynccache.trace.synth import TokenSynthesizer


def test_same_id_same_tokens_different_ids_differ() -> None:
    syn = TokenSynthesizer(vocab_size=151936, block_size=512)
    a = syn.tokens(np.array([0, 5, 9]), 1200)
    b = syn.tokens(np.array([0, 5, 11]), 1100)
    assert a.shape == (1200,) and b.shape == (1100,)
    assert np.array_equal(a[:1024], b[:1024])  # blocks 0 and 5 shared
    assert not np.array_equal(a[1024:1100], b[1024:1100])
    again = TokenSynthesizer(vocab_size=151936, block_size=512).tokens(np.array([0, 5, 9]), 1200)
    assert np.array_equal(a, again)
    assert a.min() >= 0 and a.max() < 151936


def test_every_block_is_distinct_even_with_a_tiny_vocabulary() -> None:
    syn = TokenSynthesizer(vocab_size=3, block_size=8, max_block_id=200)
    blocks = syn.blocks(np.arange(201))
    assert len({row.tobytes() for row in blocks}) == 201
    assert blocks.max() < 3


def test_partial_last_block_is_a_prefix_of_the_full_block() -> None:
    syn = TokenSynthesizer(vocab_size=1000, block_size=16)
    full = syn.tokens(np.array([4, 7]), 32)
    part = syn.tokens(np.array([4, 7]), 21)
    assert np.array_equal(full[:21], part)


def test_bad_arguments() -> None:
    syn = TokenSynthesizer(vocab_size=1000, block_size=16)
    with pytest.raises(ConfigError):
        syn.tokens(np.array([1, 2]), 40)  # 3 blocks' worth for 2 ids
    with pytest.raises(ConfigError):
        syn.blocks(np.array([-1]))
    with pytest.raises(ConfigError):
        TokenSynthesizer(vocab_size=2, block_size=2, max_block_id=2**40)
