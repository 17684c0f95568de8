"""The deterministic global sampler and token files."""

import numpy as np
import pytest
import torch

from workers.data.corpus import check_corpus, load_tokens
from workers.data.dataset import GlobalSampler


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


# --- Megatron indexed datasets, blends, splits, validation batches --------------------------

from workers.data.seeding import stable_seed  # noqa: E402
from workers.data.blend import parse_blend, parse_split, split_bookends  # noqa: E402
from workers.data.corpus import data_form_problem  # noqa: E402
from workers.data.dataset import check_data, eval_index  # noqa: E402
from workers.data.indexed import IndexedDatasetWriter  # noqa: E402


def write_docs(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            w.add_document(doc)
    return str(prefix)


def labelled_docs(num_docs, base=0, length=lambda i: 20 + i % 7):
    """Document i holds only the token base + i, so a window tells which documents it read."""
    return [[base + i] * length(i) for i in range(num_docs)]


def test_sampler_without_split_keeps_the_original_windows():
    """split=None draws exactly the windows the sampler drew before splits existed."""
    s = GlobalSampler("builtin:tiny", seq_length=16, seed=3, global_batch_size=4)
    tokens = torch.from_numpy(load_tokens("builtin:tiny"))
    for index in (0, 1, 17):
        g = torch.Generator().manual_seed(stable_seed(3, f"sample/{index}"))
        start = int(torch.randint(0, len(tokens) - 16 - 1 + 1, (1,), generator=g))
        assert torch.equal(s.sample(index), tokens[start:start + 17])


def test_megatron_prefix_and_its_bin_path(tmp_path):
    prefix = write_docs(tmp_path / "corpus_text_document", labelled_docs(30), dtype=np.int32)  # not raw uint16
    expected = np.concatenate(labelled_docs(30))
    assert np.array_equal(load_tokens(prefix), expected)
    assert np.array_equal(load_tokens(prefix + ".bin"), expected)  # .bin beside an .idx is the dataset
    s = GlobalSampler(prefix, seq_length=8, seed=1, global_batch_size=4)
    x, y = s.batch(0)
    assert x.shape == (4, 8) and x.dtype == torch.int64 and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="no .*missing.bin \\+ .*missing.idx"):
        load_tokens(str(tmp_path / "missing"))


def test_split_bookends_are_megatrons():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98,2") == pytest.approx([0.98, 0.02, 0.0])
    ends = split_bookends("969, 30, 1")
    assert ends[0] == pytest.approx((0.0, 0.969)) and ends[1] == pytest.approx((0.969, 0.999))
    assert ends[2] == pytest.approx((0.999, 1.0))
    assert split_bookends("98,2,0")[2] is None
    assert split_bookends(None) == [(0.0, 1.0), None, None]


def test_split_cuts_documents_with_megatrons_rounding(tmp_path):
    # 10 documents, split 25,75: int(round(0.25 * 10)) = round(2.5) = 2 (round half to even) -> docs 0, 1 train.
    prefix = write_docs(tmp_path / "d", labelled_docs(10, length=lambda i: 12))
    s = GlobalSampler(prefix, seq_length=8, seed=0, global_batch_size=8, split="25,75")
    assert set(torch.cat(s.batch(3)).unique().tolist()) <= {0, 1}
    assert {0, 1} <= set(torch.cat([s.batch(i)[0] for i in range(4)]).unique().tolist())
    assert set(torch.cat(s.batch(0, split="valid")).unique().tolist()) <= set(range(2, 10))


def test_train_and_validation_read_disjoint_documents(tmp_path):
    prefix = write_docs(tmp_path / "d", labelled_docs(100))
    s = GlobalSampler(prefix, seq_length=8, seed=0, global_batch_size=8, split="90,8,2")
    train = torch.cat([s.batch(i)[0] for i in range(20)]).unique().tolist()
    valid = torch.cat([s.validation_batch(e, j, 3)[0] for e in range(3) for j in range(3)]).unique().tolist()
    test = torch.cat([s.batch(i, split="test")[0] for i in range(3)]).unique().tolist()
    assert max(train) < 90 and len(train) > 60
    assert 90 <= min(valid) and max(valid) < 98
    assert set(test) <= {98, 99}


def test_validation_windows_are_drawn_independently_of_training_windows():
    # Equal train and validation halves: were the draws shared, the offsets would repeat.
    s = GlobalSampler("builtin:tiny", seq_length=16, seed=3, global_batch_size=4, split="50,50")
    tokens = load_tokens("builtin:tiny")
    half = int(round(0.5 * len(tokens)))
    train_offsets = [_offset(tokens, s.sample(k)) for k in range(8)]
    valid_offsets = [_offset(tokens, s.sample(k, "valid")) - half for k in range(8)]
    assert all(o < half for o in train_offsets) and all(o >= 0 for o in valid_offsets)
    assert train_offsets != valid_offsets


def _offset(tokens, window):
    """Where ``window`` starts in ``tokens`` (first match)."""
    w = window.numpy()
    for j in range(len(tokens) - len(w) + 1):
        if tokens[j] == w[0] and np.array_equal(tokens[j:j + len(w)], w):
            return j
    raise AssertionError("window not found")


def test_validation_batches_are_layout_independent_and_deterministic(tmp_path):
    prefix = write_docs(tmp_path / "d", labelled_docs(60))
    s = GlobalSampler(prefix, seq_length=8, seed=5, global_batch_size=8, split="80,20,0")
    full = s.validation_batch(eval_index=2, eval_iter=1, eval_iters=3)
    parts = [s.validation_batch(2, 1, 3, start, 2) for start in range(0, 8, 2)]  # dp 4, micro 2
    assert torch.equal(torch.cat([p[0] for p in parts]), full[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), full[1])
    assert torch.equal(full[0], s.batch(2 * 3 + 1, split="valid")[0])  # one stream across evaluations
    again = GlobalSampler(prefix, 8, 5, 8, split="80,20,0")  # after a restart
    assert torch.equal(again.validation_batch(2, 1, 3)[0], full[0])
    assert not torch.equal(s.validation_batch(2, 2, 3)[0], full[0])
    with pytest.raises(ValueError, match="outside"):
        s.validation_batch(0, 3, 3)


def test_eval_index_follows_megatrons_eval_points():
    assert [eval_index(i, 5) for i in (0, 4, 5, 9, 10, 15)] == [None, None, 0, None, 1, 2]
    assert eval_index(10, None) is None


def test_weighted_blend_follows_megatrons_blending_indices(tmp_path):
    a = write_docs(tmp_path / "a", labelled_docs(20, base=0))
    b = write_docs(tmp_path / "b", labelled_docs(20, base=100))
    s = GlobalSampler(["0.7", a, "0.3", b], seq_length=8, seed=2, global_batch_size=10)
    source = ["a" if int(s.sample(i)[0]) < 100 else "b" for i in range(10)]
    # build_blending_indices by hand: sample i goes where weight * max(i, 1) - taken is largest.
    assert source == list("abaabaabaa")
    x, _ = s.batch(0)
    parts = torch.cat([s.batch(0, start, 5)[0] for start in (0, 5)])
    assert torch.equal(parts, x)
    assert ((torch.cat([s.batch(i)[0] for i in range(10)]) < 100).all(dim=1).sum()) == 70
    # The k-th sample taken from "b" is b's own sample k: its window depends on (seed, b, k) only.
    s2 = GlobalSampler(["0.5", a, "0.5", b], seq_length=8, seed=2, global_batch_size=10)
    assert torch.equal(s.sample(1), s2.sample(1))  # both: b's sample 0
    assert torch.equal(s.sample(4), s2.sample(3))  # both: b's sample 1
    assert GlobalSampler(["0.7", a, "0.3", b], 8, 2, 10).sample(4).tolist() == s.sample(4).tolist()


def test_unweighted_blend_weights_by_size(tmp_path):
    a = write_docs(tmp_path / "a", labelled_docs(30, base=0, length=lambda i: 30))  # 900 tokens
    b = write_docs(tmp_path / "b", labelled_docs(10, base=100, length=lambda i: 30))  # 300 tokens
    s = GlobalSampler([a, b], seq_length=8, seed=0, global_batch_size=8)
    from_a = sum(int(s.sample(i)[0]) < 100 for i in range(40))
    assert from_a == 30


def test_parse_blend_like_megatron():
    assert parse_blend(["0.7", "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    assert parse_blend([0.7, "a", 0.3, "b"]) == (["a", "b"], [0.7, 0.3])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["a", "b", "c"]) == (["a", "b", "c"], None)
    with pytest.raises(ValueError, match="not a mix"):
        parse_blend(["0.7", "a", "b"])
    with pytest.raises(ValueError, match="empty blend"):
        parse_blend([])
    with pytest.raises(ValueError, match="positive sum"):
        parse_blend(["0", "a", "0", "b"])


@pytest.mark.parametrize("split", ["", "a,b", "1,2,3,4", "0,0,0", "-1,2"])
def test_bad_split_is_refused(split):
    with pytest.raises(ValueError, match="training.split"):
        parse_split(split)


def test_data_errors_name_the_corpus_the_split_and_the_fix(tmp_path):
    small = write_docs(tmp_path / "small", labelled_docs(4, length=lambda i: 5))  # train: round(0.8 * 4) = 3 docs, 15 tokens
    with pytest.raises(ValueError, match="train split of training.data .*small.* 15 tokens, fewer than "
                                         "seq_length\\+1 = 17"):
        GlobalSampler(small, seq_length=16, seed=0, global_batch_size=2, split="80,20,0")
    s = GlobalSampler("builtin:tiny", 16, 0, 2, split="100,0,0")
    with pytest.raises(ValueError, match="leaves no valid data"):
        s.validation_batch(0, 0, 1)
    with pytest.raises(ValueError, match="leaves no valid data"):
        GlobalSampler("builtin:tiny", 16, 0, 2).batch(0, split="valid")  # split None: all training
    big = write_docs(tmp_path / "big", [[300] * 50], dtype=np.int32)
    with pytest.raises(ValueError, match="big.* token id 300 >= model.vocab_size 256"):
        check_data(["0.5", "builtin:tiny", "0.5", big], vocab_size=256, seq_length=8)
    check_data(["0.5", "builtin:tiny", "0.5", big], vocab_size=512, seq_length=8, split="969,30,1")
    assert "raytron preprocess" in data_form_problem("corpus.jsonl")
    assert data_form_problem(["0.5", "a", "0.5", "b.txt"]) is not None
    assert data_form_problem(["0.5", "a", "0.5", "b"]) is None and data_form_problem("data/wiki_text_document") is None


# --- the spec fields --------------------------------------------------------------------------

from service.spec.spec import parse_spec, to_job_config  # noqa: E402


def spec(**training):
    return {"training": {"train_iters": 4, "global_batch_size": 4, "micro_batch_size": 2, **training}}


def test_spec_data_split_and_eval_fields():
    t = to_job_config(parse_spec(spec())).training
    assert (t.data, t.split, t.eval_interval, t.eval_iters) == ("builtin:tiny", "969,30,1", None, 10)
    t = to_job_config(parse_spec(spec(data=[0.7, "a/b_text_document", "0.3", "c"], split="98,2,0",
                                      eval_interval=2, eval_iters=3))).training
    assert t.data == ("0.7", "a/b_text_document", "0.3", "c") and hash(t)  # a tuple: the config stays frozen
    assert (t.split, t.eval_interval, t.eval_iters) == ("98,2,0", 2, 3)
    assert to_job_config(parse_spec(spec(data="data/wiki_text_document"))).training.data == "data/wiki_text_document"


@pytest.mark.parametrize("fields, needle", [
    (dict(data="corpus.jsonl"), "raytron preprocess"),
    (dict(data=["0.7", "a", "b"]), "weight, prefix pairs"),
    (dict(data=[]), "empty blend"),
    (dict(data=["-1", "a", "2", "b"]), "must be >= 0"),
    (dict(split="90,x"), "training.split '90,x'"),
    (dict(split="1,2,3,4"), "training.split '1,2,3,4'"),
    (dict(split="0,1,0"), "gives training no data"),
    (dict(split="100,0,0", eval_interval=2), "training.eval_interval 2 needs validation data"),
    (dict(eval_interval=0), "training.eval_interval"),
    (dict(eval_iters=-1), "training.eval_iters"),
])
def test_bad_data_fields_are_refused(fields, needle):
    with pytest.raises(ValueError) as e:
        parse_spec(spec(**fields))
    assert needle in str(e.value), str(e.value)


def test_no_evaluation_needs_no_validation_share():
    parse_spec(spec(split="100,0,0"))
    parse_spec(spec(split="100,0,0", eval_interval=2, eval_iters=0))
