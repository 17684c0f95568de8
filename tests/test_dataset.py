"""The deterministic global sampler and token files."""

import numpy as np
import pytest
import torch

from workers.dataset import GlobalSampler, check_corpus, load_tokens


def test_builtin_tiny_is_bytes():
    tokens = load_tokens("builtin:tiny")
    assert len(tokens) > 4000 and tokens.max() < 256 and tokens.min() >= 0


def test_global_batch_is_independent_of_how_it_is_split():
    s = GlobalSampler("builtin:tiny", seq_length=16, seed=3, global_batch_size=8)
    full_x, full_y = s.batch(iteration=5)
    parts = [s.batch(5, start, 2) for start in range(0, 8, 2)]
    assert torch.equal(torch.cat([p[0] for p in parts]), full_x)
    assert torch.equal(full_y[:, :-1], full_x[:, 1:])  # labels are the next tokens
    other = GlobalSampler("builtin:tiny", seq_length=16, seed=3, global_batch_size=8)
    assert torch.equal(other.batch(5)[0], full_x)  # a fresh sampler (a restart) sees the same batch
    assert not torch.equal(s.batch(6)[0], full_x)
    assert not torch.equal(GlobalSampler("builtin:tiny", 16, 4, 8).batch(5)[0], full_x)


def test_state_dict_round_trip():
    s = GlobalSampler("builtin:tiny", 16, 3, 8)
    s.iteration = 7
    t = GlobalSampler("builtin:tiny", 16, 3, 8)
    t.load_state_dict(s.state_dict())
    assert t.iteration == 7
    with pytest.raises(ValueError, match="seed"):
        GlobalSampler("builtin:tiny", 16, 4, 8).load_state_dict(s.state_dict())


def test_npy_and_bin_token_files(tmp_path):
    ids = (np.arange(1000) * 7919 % 500).astype(np.int64)
    np.save(tmp_path / "t.npy", ids)
    ids.astype(np.uint16).tofile(tmp_path / "t.bin")
    assert np.array_equal(load_tokens(str(tmp_path / "t.npy")), ids)
    assert np.array_equal(load_tokens(str(tmp_path / "t.bin")), ids)
    check_corpus(str(tmp_path / "t.bin"), vocab_size=512, seq_length=64)
    with pytest.raises(ValueError, match="token id 499 >= model.vocab_size 256"):
        check_corpus(str(tmp_path / "t.npy"), vocab_size=256, seq_length=64)
    with pytest.raises(ValueError, match="fewer than seq_length"):
        check_corpus(str(tmp_path / "t.npy"), vocab_size=512, seq_length=2000)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokens(str(tmp_path / "missing.npy"))
    with pytest.raises(ValueError, match="unknown built-in corpus"):
        load_tokens("builtin:huge")
