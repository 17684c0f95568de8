"""Packed documents in one process (workers/data/packing.py, the ``packing`` of ModelChunk.forward):
a packed micro-batch's loss is the token-weighted mean of its documents' losses, each document run
alone through an unpacked model of its own length, and so are the gradients; the attention runs as
per-document fused-kernel blocks, and the sampler's masks follow Megatron's switches."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers.hf import MLA
from workers.config import ModelConfig
from workers.data.packing import DocumentRules, pack_window, position_ids
from workers.model.decoder import ModelChunk, ShardContext
from workers.parallel.context import document_attention
from workers.parallel.context_layout import document_split, row_blocks

SEQ = 24
# Row 0: four documents of uneven length; row 1: two (different rows, different blocks).
DOCS = ((0, 5, 6, 15, 24), (0, 11, 24))
DENSE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                    vocab_size=64, seq_length=SEQ)
MLA_CFG = dataclasses.replace(DENSE, **{k: v for k, v in MLA.items() if k != "num_query_groups"},
                              num_query_groups=4)


def _chunk(cfg: ModelConfig, seq: int) -> ModelChunk:
    cfg = dataclasses.replace(cfg, seq_length=seq)
    return ModelChunk(cfg, ShardContext(seed=3), list(range(cfg.num_layers)), pre_process=True,
                      post_process=True, positions=torch.arange(seq)).double().float()


def _grads(chunk) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in chunk.named_parameters()}


@pytest.mark.parametrize("cfg", [DENSE, MLA_CFG], ids=["gqa", "mla"])
def test_packed_loss_and_grads_are_the_documents_run_alone(cfg):
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, SEQ))
    # Labels inside each document; the last token of a document predicts nothing (mask 0).
    labels, mask = torch.zeros_like(tokens), torch.ones(2, SEQ)
    for r, cu in enumerate(DOCS):
        for a, b in zip(cu, cu[1:]):
            labels[r, a:b - 1] = tokens[r, a + 1:b]
            mask[r, b - 1] = 0.0
    count = mask.sum()
    packed = _chunk(cfg, SEQ)
    pos = torch.from_numpy(position_ids(DOCS, SEQ))
    logits = packed(tokens.t().contiguous(), packing=(pos.t().contiguous(), DOCS))
    losses = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), labels.t().reshape(-1), reduction="none")
    loss = (losses * mask.t().reshape(-1)).sum() / count
    loss.backward()

    want, want_grads = 0.0, None
    for r, cu in enumerate(DOCS):
        for a, b in zip(cu, cu[1:]):
            if b - a < 2:
                continue  # a one-token document has no loss token
            alone = _chunk(cfg, b - a)  # the same weights (a pure function of seed and name)
            out = alone(tokens[r, a:b].reshape(-1, 1))
            doc_loss = F.cross_entropy(out[:-1, 0], tokens[r, a + 1:b], reduction="sum") / count
            doc_loss.backward()
            want += doc_loss.item()
            g = _grads(alone)
            want_grads = g if want_grads is None else {n: want_grads[n] + g[n] for n in g}
    assert abs(loss.item() - want) <= 1e-5 * abs(want)
    for name, g in _grads(packed).items():
        err = (g - want_grads[name]).abs().max() / want_grads[name].abs().max()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_document_attention_runs_fused_blocks_inside_documents():
    """One fused-kernel block per document (rows with different documents apart), none across a
    boundary; the result is dense masked attention's."""
    pos = torch.arange(SEQ)
    blocks = row_blocks(DOCS, lambda cu: pos, lambda cu: pos)
    assert len(blocks) == 6 and all(b.causal for b in blocks)
    assert [(b.q.start, b.q.stop, b.b.start) for b in blocks] == [
        (0, 5, 0), (5, 6, 0), (6, 15, 0), (15, 24, 0), (0, 11, 1), (11, 24, 1)]
    torch.manual_seed(1)
    q = torch.randn(SEQ, 2, 4, 8, requires_grad=True)
    k, v = (torch.randn(SEQ, 2, 2, 8, requires_grad=True) for _ in range(2))
    out = document_attention(q, k, v, docs=DOCS)
    doc = torch.tensor([[np.searchsorted(cu, i, side="right") for i in range(SEQ)] for cu in DOCS])
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    dense = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                           attn_mask=allowed[:, None], enable_gqa=True).permute(2, 0, 1, 3)
    assert (out - dense).abs().max() < 1e-6
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(dense.square().sum(), (q, k, v))
    assert all((a - b).abs().max() < 1e-5 for a, b in zip(grads, want))


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_blocks_cover_each_document_causally_and_nothing_else(cp):
    """Every CP rank's gather plan covers exactly the (query, key) pairs of one document, key <= query."""
    from workers.parallel.context import gather_plan

    seq = 32
    docs = ((0, 3, 13, 14, 32), (0, 29, 32))
    for row, cu in enumerate(docs):
        held = document_split(seq, cp, cu)
        kpos = torch.cat(held)  # the gathered keys: rank-major
        for r in range(cp):
            seen = torch.zeros(len(held[r]), seq, dtype=torch.int64)
            for blk in gather_plan(seq, cp, r, docs):
                if blk.b.start not in (None, row):
                    continue
                piece = seen[blk.q, blk.k]
                piece += torch.ones_like(piece).tril() if blk.causal else 1
            doc = np.searchsorted(cu, np.arange(seq), side="right")
            want = torch.tensor([[int(doc[k] == doc[q] and k <= q) for k in kpos.tolist()] for q in held[r].tolist()])
            assert torch.equal(seen, want), (r, row)


@pytest.mark.parametrize("cp", [2, 4])
def test_document_split_gives_every_rank_both_ends_of_every_document(cp):
    """Megatron's THD split: each rank holds chunks i and 2cp-1-i of every document, all ranks the
    same number of tokens, even where documents are not multiples of 2 cp; one document is cp_positions."""
    from workers.parallel.context import cp_positions

    cu = (0, 3, 13, 14, 40, 64)
    held = document_split(64, cp, cu)
    assert sorted(torch.cat(held).tolist()) == list(range(64))
    assert all(len(h) == 64 // cp for h in held)
    for a, b in zip(cu, cu[1:]):
        sizes = [sum(a <= p < b for p in h.tolist()) for h in held]
        assert max(sizes) - min(sizes) <= 2
        if b - a >= 2 * cp:
            first, last = [min(p for p in h.tolist() if a <= p < b) for h in held], [
                max(p for p in h.tolist() if a <= p < b) for h in held]
            assert first == sorted(first) and last == sorted(last, reverse=True)  # rank 0: both ends
    assert all(torch.equal(h, cp_positions(64, cp, r)) for r, h in enumerate(document_split(64, cp, (0, 64))))


def test_pack_window_follows_megatrons_switches():
    window = np.array([5, 7, 0, 9, 9, 4, 0, 3, 8])  # EOD = 0; an indexed boundary at 8
    rules = DocumentRules(True, True, True, 0)
    tokens, labels, mask, pos, docs = pack_window(window, [8], rules)
    assert docs == (0, 3, 7, 8)
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    # no loss across a boundary (positions 2, 6, 7) and none at an EOD input (2, 6)
    assert mask.tolist() == [1, 1, 0, 1, 1, 1, 0, 0]
    assert labels.tolist() == window[1:].tolist()
    plain = pack_window(window, [8], DocumentRules(eod_mask_loss=True, eod_token_id=0))
    assert plain[4] == (0, 8) and plain[3].tolist() == list(range(8)) and plain[2].tolist() == [1, 1, 0, 1, 1, 1, 0, 1]


@pytest.mark.parametrize("cfg", [DENSE, MLA_CFG], ids=["gqa", "mla"])
def test_position_ids_reach_rope_per_row(cfg):
    """Without reset_attention_mask RoPE is not translation-invariant across documents: each row's
    output is that of an unpacked model whose positions are the row's position ids."""
    torch.manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (SEQ, 2))
    pos = torch.from_numpy(position_ids(DOCS, SEQ)).t().contiguous()
    whole = ((0, SEQ), (0, SEQ))
    got = _chunk(cfg, SEQ)(tokens, packing=(pos, whole))
    for r in range(2):
        plain = ModelChunk(cfg, ShardContext(seed=3), list(range(cfg.num_layers)), pre_process=True,
                           post_process=True, positions=pos[:, r])
        assert (got[:, r] - plain(tokens[:, r:r + 1])[:, 0]).abs().max() < 1e-5


def test_sampler_packs_at_the_indexed_datasets_boundaries(tmp_path):
    """An indexed dataset's sequences are the documents: each window is cut where one starts."""
    from workers.data.dataset import GlobalSampler
    from workers.data.indexed import write_indexed_dataset

    lengths = [7, 3, 12, 5, 9, 20, 4, 11, 6, 15]
    stream = np.arange(sum(lengths)) + 1  # unique ids: a window names its offset
    ends = np.cumsum(lengths)
    write_indexed_dataset(tmp_path / "docs", np.split(stream, ends[:-1]))
    rules = DocumentRules(reset_position_ids=True, reset_attention_mask=True)
    sampler = GlobalSampler(str(tmp_path / "docs"), 16, 5, 4, split=None, rules=rules)
    batch = sampler.batch(0)
    for r in range(4):
        offset = int(np.flatnonzero(stream == int(batch.tokens[r, 0]))[0])
        inner = tuple(int(e - offset) for e in ends if offset < e < offset + 16)
        assert batch.cu_seqlens[r] == (0, *inner, 16)
        assert torch.equal(batch.position_ids[r], torch.from_numpy(position_ids((batch.cu_seqlens[r],), 16)[0]))
        cut = [e - offset - 1 for e in ends if offset < e <= offset + 16]
        assert batch.loss_mask[r].nonzero().flatten().tolist() == [i for i in range(16) if i not in cut]


@pytest.mark.parametrize("training, needle", [
    ({"reset_attention_mask": True, "eod_token_id": 10},
     "training.reset_attention_mask masks tokens out of the loss, which needs training.calculate_per_token_loss: true"),
    ({"eod_mask_loss": True, "calculate_per_token_loss": True},
     "training.eod_mask_loss needs training.eod_token_id"),
    ({"reset_position_ids": True},
     "find documents by training.eod_token_id in builtin:tiny (it has no document index); set eod_token_id"),
    ({"reset_position_ids": True, "eod_token_id": 256}, "training.eod_token_id 256 is not a token id of "
                                                        "model.vocab_size 256"),
])
def test_bad_packing_switches_are_refused_naming_the_fields(training, needle):
    from service.spec.spec import parse_spec

    spec = {"name": "packed", "training": {"global_batch_size": 4, "micro_batch_size": 1, **training},
            "resources": {"num_nodes": 1, "gpus_per_node": 1}}
    with pytest.raises(ValueError, match="training") as e:
        parse_spec(spec)
    assert needle in str(e.value)
    ok = {**training, "eod_token_id": 255, "calculate_per_token_loss": True}
    parse_spec({**spec, "training": {"global_batch_size": 4, "micro_batch_size": 1, **ok}})


def test_trainer_loss_is_the_mean_over_the_global_batchs_loss_tokens():
    """One process, two microbatches of two rows: the reported loss is sum(mask x token loss) over the
    global batch / its loss tokens (not a mean of microbatch means), the model run on each packed row."""
    from tests.helpers.parity import job_of, tiny_spec
    from workers.train.trainer import Trainer

    training = {"reset_position_ids": True, "reset_attention_mask": True, "eod_mask_loss": True, "eod_token_id": 32,
                "calculate_per_token_loss": True, "global_batch_size": 4, "micro_batch_size": 2, "eval_interval": None}
    trainer = Trainer(job_of(tiny_spec(training=training)), 0, 1)
    batch = trainer.sampler.batch(0)
    with torch.no_grad():
        logits = trainer.chunks[0](batch.tokens.t().contiguous(),
                                   packing=(batch.position_ids.t().contiguous(), batch.cu_seqlens))
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.t().reshape(-1), reduction="none")
    mask = batch.loss_mask.t().reshape(-1)
    want = float((losses * mask).sum() / mask.sum())
    firsts = [float((losses * mask).view(-1, 4)[:, rows].sum() / mask.view(-1, 4)[:, rows].sum())
              for rows in (slice(0, 2), slice(2, 4))]
    assert abs(sum(firsts) / 2 - want) > 1e-4  # the microbatches' loss tokens differ: the two means differ
    assert 0 < mask.sum() < mask.numel()
    assert abs(trainer.train_step()["loss"] - want) <= 1e-6 * want


def test_packed_loss_and_grads_match_transformers_llama_per_document():
    """The same packed micro-batch against transformers' LlamaForCausalLM (tiny, the weights copied
    by name) run on each document alone: loss and every gradient."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workers.hf.families import hf_config
    from workers.hf.interop import to_hf

    m = dataclasses.asdict(DENSE)

    def hub(named) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in named:
            out.update(to_hf(name, t.view(2, -1, t.shape[-1]) if name.endswith("gate_up.weight") else t, m))
        return out

    ours = _chunk(DENSE, SEQ)
    theirs = LlamaForCausalLM(LlamaConfig(**hf_config(m))).float()
    theirs.load_state_dict(hub((n, p.detach()) for n, p in ours.named_parameters()), strict=True)
    torch.manual_seed(4)
    tokens = torch.randint(0, DENSE.vocab_size, (2, SEQ))
    labels, mask = torch.zeros_like(tokens), torch.ones(2, SEQ)
    for r, cu in enumerate(DOCS):
        for a, b in zip(cu, cu[1:]):
            labels[r, a:b - 1], mask[r, b - 1] = tokens[r, a + 1:b], 0.0
    count = mask.sum()
    logits = ours(tokens.t().contiguous(), packing=(torch.from_numpy(position_ids(DOCS, SEQ)).t().contiguous(), DOCS))
    losses = F.cross_entropy(logits.reshape(-1, DENSE.vocab_size), labels.t().reshape(-1), reduction="none")
    loss = (losses * mask.t().reshape(-1)).sum() / count
    loss.backward()
    want = 0.0
    for r, cu in enumerate(DOCS):
        for a, b in zip(cu, cu[1:]):
            if b - a > 1:
                out = theirs(input_ids=tokens[r:r + 1, a:b]).logits[0]
                doc_loss = F.cross_entropy(out[:-1], tokens[r, a + 1:b], reduction="sum") / count
                doc_loss.backward()
                want += doc_loss.item()
    assert abs(loss.item() - want) <= 1e-5 * want
    got = hub((n, p.grad) for n, p in ours.named_parameters())
    for name, p in theirs.named_parameters():
        err = (got[name] - p.grad).abs().max() / p.grad.abs().max()
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"
