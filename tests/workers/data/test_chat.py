"""The chat data path (workers/data/chat.py): the assistant-token mask equals transformers'
``return_assistant_tokens_mask`` on a template with generation markers and is exactly each
assistant turn with its end-of-turn token on two templates without (ChatML, Llama-3); bad records
are refused naming the file and line; best-fit-decreasing packing fills >= 95% of the slots on a
long-tailed length distribution, deterministically; packed rows hold each document from position 0
with its mask on the labels."""

import numpy as np
import pytest

from tests.helpers.chat import CONVERSATIONS, chat_tokenizer, write_jsonl
from workers.data.chat import ChatDataError, ChatDataset, assistant_mask, load_tokenizer, pack, render


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {name: chat_tokenizer(root / name, name) for name in ("chatml-generation", "chatml", "llama3")}


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_the_mask_is_transformers_assistant_mask_on_a_generation_template(tokenizers, conversation):
    tok = load_tokenizer(tokenizers["chatml-generation"])
    want = tok.apply_chat_template(conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = assistant_mask(tok, conversation, "assistant", "x")
    assert ids == list(want["input_ids"]) and mask == list(want["assistant_masks"])
    assert sum(mask) > 0


@pytest.mark.parametrize("name, eot", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_the_mask_is_each_assistant_turn_and_its_end_of_turn_token(tokenizers, name, eot):
    tok = load_tokenizer(tokenizers[name])
    ids, mask = assistant_mask(tok, CONVERSATIONS[0], "assistant", "x")
    spans, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(i)
        elif current:
            spans.append(tok.decode(current))
            current = []
    spans += [tok.decode(current)] if current else []
    assert spans == [f"I am fine{eot}", f"it is four{eot}"]
    _, last = assistant_mask(tok, CONVERSATIONS[0], "last_assistant", "x")
    assert tok.decode([i for i, m in zip(ids, last) if m]) == f"it is four{eot}"
    assert assistant_mask(tok, CONVERSATIONS[0], "all", "x")[1] == [1] * len(ids)


@pytest.mark.parametrize("record, needle", [
    ({"text": "hi"}, "line 2: no messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "line 2: unknown role 'wizard'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
     "line 2: an empty assistant turn"),
])
def test_bad_records_are_refused_naming_file_and_line(tmp_path, tokenizers, record, needle):
    path = write_jsonl(tmp_path / "data.jsonl", [{"messages": CONVERSATIONS[1]}, record])
    with pytest.raises(ChatDataError, match=f"data.jsonl {needle}"):
        ChatDataset(path, tokenizers["chatml"], 64, 1)


def test_a_tokenizer_without_a_template_and_an_overlong_sample_are_refused(tmp_path, tokenizers):
    bare = chat_tokenizer(tmp_path / "bare", None)
    path = write_jsonl(tmp_path / "data.jsonl", [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(ChatDataError, match="the tokenizer has no chat template"):
        ChatDataset(path, bare, 64, 1)
    with pytest.raises(ChatDataError, match="data.jsonl line 1: .* tokens, more than seq_length 8"):
        ChatDataset(path, tokenizers["chatml"], 8, 1, overflow="error")
    ok = ChatDataset(write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "how are you?", "completion": " fine"}]), bare, 32, 1,
                     fmt="prompt_completion")
    tokens, labels, mask, _, _ = ok.row(0)
    tok = load_tokenizer(bare)
    assert tok.decode(labels[mask == 1].tolist()) == " fine<|endoftext|>"


def test_packing_fills_long_tailed_lengths_deterministically():
    s = 1024
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(s / 8) - 0.5, 1.0, 5000).astype(int), 1, s)
    a, b = pack(lengths, s, seed=3), pack(lengths, s, seed=3)
    assert a.rows == b.rows and pack(lengths, s, seed=4).rows != a.rows
    assert sorted(i for row in a.rows for i in row) == list(range(len(lengths)))
    assert all(lengths[row].sum() <= s for row in a.rows)
    assert a.stats["efficiency"] >= 0.95, a.stats


def test_a_packed_row_restarts_positions_and_masks_the_labels(tmp_path, tokenizers):
    path = write_jsonl(tmp_path / "data.jsonl", [{"messages": c} for c in CONVERSATIONS] * 3)
    data = ChatDataset(path, tokenizers["llama3"], 128, 1)
    tok = load_tokenizer(tokenizers["llama3"])
    tokens, labels, mask, positions, cu = data.row(0)
    assert cu[0] == 0 and cu[-1] == 128 and len(cu) >= 3
    for a, b in zip(cu, cu[1:]):
        assert positions[a:b].tolist() == list(range(b - a))
    assert "<|eot_id|>" in tok.decode(labels[mask == 1].tolist()) and "user" not in tok.decode(labels[mask == 1].tolist())
    assert data.stats["samples"] == 6 and 0 < data.stats["loss_token_share"] < 1
