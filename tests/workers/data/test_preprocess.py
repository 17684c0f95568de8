"""`raytron preprocess`: a tiny local tokenizer, Megatron's .idx layout, read back by raytron."""

import argparse
import json
import struct

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from api.cli import preprocess_cmd  # noqa: E402
from workers.data.preprocess import HFTokenizer, preprocess  # noqa: E402
from workers.data.corpus import load_tokens  # noqa: E402
from workers.data.dataset import GlobalSampler  # noqa: E402
from workers.data.indexed import IndexedDataset  # noqa: E402

VOCAB = {"<unk>": 0, "<s>": 1, "</s>": 2, "the": 3, "cat": 4, "sat": 5, "dog": 6, "ran": 7, "a": 8, "title": 9}


def make_tokenizer(directory, vocab=VOCAB, bos=True, eos="</s>"):
    """A WordLevel tokenizer that prepends <s> (a post-processor, like Llama's BOS), saved as HF does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    if eos:
        (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": "<s>"}))
    return str(directory)


def megatron_idx(dtype_code, lengths, doc_index, itemsize):
    """The .idx bytes of Megatron's _IndexWriter, written out with struct."""
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int) * itemsize if lengths else []
    out = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index))
    out += b"".join(struct.pack("<i", n) for n in lengths)
    out += b"".join(struct.pack("<q", int(p)) for p in pointers)
    return out + b"".join(struct.pack("<q", d) for d in doc_index)


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_jsonl_to_megatron_dataset_and_back(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    src = write_lines(tmp_path / "in.jsonl", [
        json.dumps({"text": "the cat sat", "title": "a title"}),
        "",  # blank lines are skipped
        json.dumps({"text": ["the dog", "ran"], "title": "title"}),  # a list is one document of sentences
        json.dumps({"text": "", "title": "a"}),  # empty text: still <s> (tokenizer("") gives it), then EOD
    ])
    calls = []
    result = preprocess(src, tok, str(tmp_path / "out" / "corpus"), json_keys=["text", "title"], append_eod=True,
                        progress=lambda done, total: calls.append((done, total)))
    prefix = str(tmp_path / "out" / "corpus_text_document")
    assert result.outputs == {"text": prefix, "title": str(tmp_path / "out" / "corpus_title_document")}
    assert result.documents == 3 and result.dtype == "uint16" and result.vocab_size == len(VOCAB)
    # Megatron's Encoder: each sentence with its special tokens (<s>), EOD on the last sentence.
    text_ids = [1, 3, 4, 5, 2] + [1, 3, 6] + [1, 7, 2] + [1, 2]
    assert result.tokens["text"] == len(text_ids)
    assert (tmp_path / "out" / "corpus_text_document.bin").read_bytes() == struct.pack(f"<{len(text_ids)}H", *text_ids)
    assert (tmp_path / "out" / "corpus_text_document.idx").read_bytes() == megatron_idx(
        8, [5, 3, 3, 2], [0, 1, 3, 4], itemsize=2)
    ds = IndexedDataset(prefix)
    assert ds.document(0).tolist() == [1, 3, 4, 5, 2] and ds.document(1).tolist() == [1, 3, 6, 1, 7, 2]
    assert IndexedDataset(result.outputs["title"]).document(2).tolist() == [1, 8, 2]
    assert load_tokens(prefix).tolist() == text_ids
    x, y = GlobalSampler(prefix, seq_length=4, seed=0, global_batch_size=2).batch(0)
    assert x.shape == (2, 4) and torch_equal_shift(x, y)
    assert calls[-1][0] == calls[-1][1] == (tmp_path / "in.jsonl").stat().st_size


def torch_equal_shift(x, y):
    return bool((x[:, 1:] == y[:, :-1]).all())


def test_plain_text_one_document_per_line_without_special_tokens(tmp_path):
    tok = HFTokenizer(make_tokenizer(tmp_path / "tok"), include_special_tokens=False)
    src = write_lines(tmp_path / "in.txt", ["the cat", "", "dog ran sat"])
    result = preprocess(src, tok, str(tmp_path / "c"))
    ds = IndexedDataset(result.outputs["text"])
    assert [ds.document(i).tolist() for i in range(ds.num_documents)] == [[3, 4], [6, 7, 5]]


def test_empty_documents_without_special_tokens_have_no_sequence(tmp_path):
    tok = HFTokenizer(make_tokenizer(tmp_path / "tok"), include_special_tokens=False)
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "the"}), json.dumps({"text": ["", "  "]}),
                                              json.dumps({"text": "cat"})])
    result = preprocess(src, tok, str(tmp_path / "c"), append_eod=True)
    assert (tmp_path / "c_text_document.idx").read_bytes() == megatron_idx(8, [2, 2], [0, 1, 1, 2], itemsize=2)
    assert IndexedDataset(result.outputs["text"]).tokens.tolist() == [3, 2, 4, 2]


def test_large_vocabulary_uses_int32(tmp_path):
    vocab = {f"w{i}": i for i in range(70000)} | {"<unk>": 70000}
    tok = make_tokenizer(tmp_path / "tok", vocab=vocab, bos=False, eos=None)
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "w69999 w1"})])
    result = preprocess(src, tok, str(tmp_path / "big"))
    assert result.dtype == "int32"
    idx = (tmp_path / "big_text_document.idx").read_bytes()
    assert idx[17] == 4  # Megatron's dtype code for int32
    assert IndexedDataset(result.outputs["text"]).tokens.tolist() == [69999, 1]


@pytest.mark.parametrize("lines, match", [
    (['{"text": "the cat"}', '{"text": "the dog"', '{"text": "a"}'], r"in.jsonl:2: not valid JSON"),
    (['{"text": "the cat"}', '{"body": "the dog"}'], r"in.jsonl:2: no key 'text' \(the line has \['body'\]\)"),
    (['{"text": 3}'], r"in.jsonl:1: key 'text' holds int"),
    (['["the cat"]'], r"in.jsonl:1: expected a JSON object"),
])
def test_bad_lines_are_named(tmp_path, lines, match):
    tok = make_tokenizer(tmp_path / "tok")
    src = write_lines(tmp_path / "in.jsonl", lines)
    with pytest.raises(ValueError, match=match):
        preprocess(src, tok, str(tmp_path / "o"))
    assert not list(tmp_path.glob("o_*"))  # nothing half-written


def test_other_bad_input(tmp_path):
    tok = make_tokenizer(tmp_path / "tok", eos=None)
    src = write_lines(tmp_path / "in.jsonl", ['{"text": "the cat"}'])
    with pytest.raises(ValueError, match="does not exist"):
        preprocess(str(tmp_path / "nope.jsonl"), tok, str(tmp_path / "o"))
    with pytest.raises(ValueError, match="tokenizer .* does not exist"):
        preprocess(src, str(tmp_path / "no-tokenizer"), str(tmp_path / "o"))
    with pytest.raises(ValueError, match="no eos_token; name one with --eod-token"):
        preprocess(src, tok, str(tmp_path / "o"), append_eod=True)
    result = preprocess(src, HFTokenizer(tok, eod_token="</s>"), str(tmp_path / "o"), append_eod=True)
    assert IndexedDataset(result.outputs["text"]).tokens.tolist() == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="applies to JSONL input"):
        preprocess(write_lines(tmp_path / "in.txt", ["the"]), tok, str(tmp_path / "o"), json_keys=["body"])
    (tmp_path / "bad.txt").write_bytes(b"the cat\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"bad.txt:2: not UTF-8"):
        preprocess(str(tmp_path / "bad.txt"), tok, str(tmp_path / "o"))


def cli(argv):
    parser = argparse.ArgumentParser(prog="raytron")
    preprocess_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli(tmp_path, capsys):
    tok = make_tokenizer(tmp_path / "tok")
    src = write_lines(tmp_path / "in.jsonl", [json.dumps({"text": "the cat sat"})] * 3)
    out = str(tmp_path / "ds")
    assert cli(["preprocess", src, "--tokenizer", tok + "/tokenizer.json", "--output-prefix", out,
                "--append-eod", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["outputs"] == {"text": out + "_text_document"} and report["documents"] == 3
    assert IndexedDataset(out + "_text_document").tokens.tolist() == [1, 3, 4, 5, 2] * 3
    assert cli(["preprocess", src + ".missing", "--tokenizer", tok, "--output-prefix", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("raytron preprocess: error: input") and "does not exist" in err[0]
