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


@pytest.mark.parametrize("family, template", [("llama", "llama3"), ("qwen3", "chatml")])
def test_a_packed_chat_microbatch_is_transformers_per_sample_loss_over_assistant_tokens(tmp_path, family, template):
    """Two packed rows of chat samples through raytron's model (per-document attention, positions from
    0 in each document) against transformers' model of the family (tiny, the weights copied by name)
    run on each sample alone: the loss (the mean over the assistant tokens) and every gradient, 1e-5."""
    import dataclasses

    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from workers.config import ModelConfig
    from workers.data.packing import pack_rows
    from workers.hf.families import hf_config
    from workers.hf.interop import to_hf
    from workers.model.decoder import ModelChunk, ShardContext

    seq = 64
    tok = chat_tokenizer(tmp_path / "tok", template)
    records = [{"messages": c} for c in CONVERSATIONS] + [{"messages": [
        {"role": "user", "content": "tell me a story about a cat"},
        {"role": "assistant", "content": "a cat sat on a mat. it is fine"}]}]
    data = ChatDataset(write_jsonl(tmp_path / "chat.jsonl", records * 2), tok, seq, 1)
    batch = pack_rows([data.row(k) for k in range(2)])
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                      vocab_size=320, seq_length=seq, qk_layernorm=family == "qwen3")
    m = dataclasses.asdict(cfg)
    ours = ModelChunk(cfg, ShardContext(seed=5), [0, 1], pre_process=True, post_process=True,
                      positions=torch.arange(seq))
    hf = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    theirs = hf[1](hf[0](**hf_config(m))).float()

    def hub(named) -> dict:
        out = {}
        for name, t in named:
            out.update(to_hf(name, t.view(2, -1, t.shape[-1]) if name.endswith("gate_up.weight") else t, m))
        return out

    theirs.load_state_dict(hub((n, p.detach()) for n, p in ours.named_parameters()), strict=True)
    count = batch.loss_mask.sum()
    logits = ours(batch.tokens.t().contiguous(), packing=(batch.position_ids.t().contiguous(), batch.cu_seqlens))
    losses = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), batch.labels.t().reshape(-1), reduction="none")
    loss = (losses * batch.loss_mask.t().reshape(-1)).sum() / count
    loss.backward()
    want = 0.0
    for k in range(2):
        for i in data.packed.rows[k]:
            ids, mask = torch.from_numpy(data.ids[i]), torch.from_numpy(data.masks[i])
            out = theirs(input_ids=ids[None]).logits[0]
            sample = (F.cross_entropy(out[:-1], ids[1:], reduction="none") * mask[1:]).sum() / count
            sample.backward()
            want += sample.item()
    assert abs(loss.item() - want) <= 1e-5 * want
    got = hub((n, p.grad) for n, p in ours.named_parameters())
    for name, p in theirs.named_parameters():
        err = (got[name] - p.grad).abs().max() / p.grad.abs().max()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


@pytest.mark.parametrize("streaming", [False, True])
def test_the_batch_stats_are_the_batchs_own(tmp_path, tokenizers, streaming):
    """What the progress line, the console and TensorBoard show of a chat step: its loss tokens are
    the packed global batch's loss-mask sum, and the efficiency its real tokens over its slots."""
    from types import SimpleNamespace

    from workers.data.chat_sampler import ChatSampler

    path = write_jsonl(tmp_path / "data.jsonl", [{"messages": c} for c in CONVERSATIONS] * 5)
    t = SimpleNamespace(chat_data=path, chat_tokenizer=tokenizers["chatml"], seed=2, chat_format="messages",
                        chat_loss_on="assistant", chat_overflow="truncate", global_batch_size=3,
                        chat_streaming=streaming)
    sampler = ChatSampler(t, 48)
    for it in range(3):
        batch, stats = sampler.batch(it), sampler.batch_stats(it)
        assert stats["loss_tokens"] == float(batch.loss_mask.sum())
        # every sample has a loss token and the padding document none: the documents with one are real
        real = sum(b - a for r, cu in enumerate(batch.cu_seqlens) for a, b in zip(cu, cu[1:])
                   if float(batch.loss_mask[r, a:b].sum()) > 0)
        assert stats["packing_efficiency"] == real / (3 * 48) and 0 < stats["loss_token_share"] < 1


def test_a_stream_packs_every_sample_once_per_epoch_in_one_order(tmp_path, tokenizers):
    """Streaming (buffers of 4 samples): one epoch's rows hold every sample's tokens exactly once,
    the rows are the same read forwards or again from the start (a restart), and the next epoch
    follows."""
    from types import SimpleNamespace

    from workers.data.chat_sampler import ChatStream

    records = [{"messages": c} for c in CONVERSATIONS] * 3 + [{"messages": CONVERSATIONS[1][:1] + [
        {"role": "assistant", "content": "hello world"}]}]
    path = write_jsonl(tmp_path / "data.jsonl", records)
    t = SimpleNamespace(chat_data=path, chat_tokenizer=tokenizers["chatml"], seed=2, chat_format="messages",
                        chat_loss_on="assistant", chat_overflow="truncate")
    stream, whole = ChatStream(t, 64, buffer=4), ChatDataset(path, tokenizers["chatml"], 64, 2)
    want = sorted(tuple(ids[:-1]) for ids in whole.ids)
    got, k = [], 0
    while len(got) < len(want):
        tokens, _, mask, _, cu = stream.row(k)
        got += [tuple(tokens[a:b]) for a, b in zip(cu, cu[1:]) if mask[a:b].any()]
        k += 1
    assert sorted(got) == want
    again = ChatStream(t, 64, buffer=4)
    for j in (k, 0, k - 1, k + 2):  # forwards, back to the start, and into the next epoch
        assert all(np.array_equal(a, b) for a, b in zip(stream.row(j)[:4], again.row(j)[:4]))


def test_preprocessed_chat_data_packs_the_same_rows(tmp_path, tokenizers):
    """`raytron preprocess --format chat` writes the rendered samples and masks once as Megatron
    indexed datasets (read back by this project's reader of Megatron's format); a job on the prefix
    gets exactly the rows of the same records rendered at start."""
    from workers.data.chat_preprocess import LOSS_MASK, TOKENS, preprocess_chat
    from workers.data.indexed import IndexedDataset

    path = write_jsonl(tmp_path / "data.jsonl", [{"messages": c} for c in CONVERSATIONS] * 4)
    out = preprocess_chat(path, tokenizers["llama3"], str(tmp_path / "sft"), seq_length=48)
    assert out["samples"] == 8 and out["chat_data"] == str(tmp_path / "sft")
    assert len(IndexedDataset(str(tmp_path / "sft") + TOKENS)) == 8 == len(IndexedDataset(str(tmp_path / "sft") + LOSS_MASK))
    rendered, mapped = ChatDataset(path, tokenizers["llama3"], 48, 3), ChatDataset(str(tmp_path / "sft"), None, 48, 3)
    assert len(rendered) == len(mapped) and mapped.stats["loss_token_share"] == rendered.stats["loss_token_share"]
    for k in range(len(rendered)):
        assert all(np.array_equal(a, b) for a, b in zip(rendered.row(k)[:4], mapped.row(k)[:4]))
        assert rendered.row(k)[4] == mapped.row(k)[4]
    with pytest.raises(ChatDataError, match="preprocess again with --seq-length 16"):
        ChatDataset(str(tmp_path / "sft"), None, 16, 3)


def test_parquet_arrow_and_a_directory_give_the_jsonl_rows(tmp_path, tokenizers):
    """The same records as JSONL, Parquet, an Arrow file and a directory of JSONL parts pack to the
    same rows (read with Hugging Face datasets)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"messages": c} for c in CONVERSATIONS] * 3
    jsonl = write_jsonl(tmp_path / "data.jsonl", records)
    table = pa.Table.from_pylist(records)
    pq.write_table(table, tmp_path / "data.parquet")
    with pa.OSFile(str(tmp_path / "data.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    parts = tmp_path / "parts"
    parts.mkdir()
    write_jsonl(parts / "a.jsonl", records[:4])
    write_jsonl(parts / "b.jsonl", records[4:])
    want = ChatDataset(jsonl, tokenizers["chatml"], 64, 1)
    for source in (tmp_path / "data.parquet", tmp_path / "data.arrow", parts):
        got = ChatDataset(str(source), tokenizers["chatml"], 64, 1)
        assert len(got) == len(want), source
        for k in range(len(want)):
            assert all(np.array_equal(a, b) for a, b in zip(got.row(k)[:4], want.row(k)[:4])), source
