"""Checkpoint files, atomicity and refusal, in one process (the multi-rank reshard tests are
in test_checkpoint_reshard.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.parity import job_of, tiny_spec
from tests.helpers.checkpoints import checkpointer, trained, trainer  # noqa: F401

pytestmark = pytest.mark.slow


def iterations(root) -> list[int]:
    from workers.checkpoint.storage import Storage, list_checkpoints

    return [c.iteration for c in list_checkpoints(Storage.from_uri(str(root)))]


def test_same_layout_resume_is_bit_exact_and_keeps_data_position(tmp_path):
    from workers.checkpoint.reader import load_checkpoint

    t = trained(2)
    checkpointer(tmp_path).save(t)
    want = [t.train_step()["loss"] for _ in range(2)]
    fresh = trainer()
    assert load_checkpoint(fresh, str(tmp_path)) == {"iteration": 2, "path": str(tmp_path / "iter_0000002")}
    assert fresh.optimizer.num_steps == 2
    assert [fresh.train_step()["loss"] for _ in range(2)] == want


def test_rng_state_is_restored(tmp_path):
    import torch

    from workers.checkpoint.reader import load_checkpoint

    t = trained(1)
    torch.manual_seed(5)
    checkpointer(tmp_path).save(t)
    want = torch.rand(3)
    torch.manual_seed(6)
    load_checkpoint(trainer(), str(tmp_path))
    assert torch.equal(torch.rand(3), want)


@pytest.mark.parametrize("fail_at_write", [0, 1, 2, 3])
def test_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, fail_at_write):
    """A crash after any number of the save's file writes (data, rank index, merged index,
    manifest) leaves the previous checkpoint the latest, loadable, and the debris ignored."""
    from workers.checkpoint import storage as checkpoint_storage
    from workers.checkpoint.reader import CheckpointReader

    t = trained(1)
    checkpointer(tmp_path).save(t)
    t.train_step()
    real, calls = checkpoint_storage.Storage.write, []

    def crashing_write(self, path, chunks):
        if len(calls) == fail_at_write:
            self.fs.open_output_stream(path).close()  # a half-written file
            raise OSError("disk gone")
        calls.append(path)
        return real(self, path, chunks)

    monkeypatch.setattr(checkpoint_storage.Storage, "write", crashing_write)
    with pytest.raises(OSError, match="disk gone"):
        checkpointer(tmp_path).save(t)
    monkeypatch.undo()
    assert iterations(tmp_path) == [1]
    assert any(p.name.startswith(".iter_0000002.tmp-") for p in tmp_path.iterdir())
    assert CheckpointReader.open(str(tmp_path)).iteration == 1
    # The next successful save clears the debris.
    checkpointer(tmp_path).save(t)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000001", "iter_0000002"]


def test_async_save_overlaps_training_and_surfaces_errors(tmp_path, monkeypatch):
    from workers.checkpoint import storage as checkpoint_storage

    t = trained(1)
    ck = checkpointer(tmp_path, async_save=True)
    ck.save(t)
    t.train_step()  # trains while the write may still run
    ck.wait()
    assert iterations(tmp_path) == [1]
    monkeypatch.setattr(checkpoint_storage.Storage, "write", lambda *a: (_ for _ in ()).throw(OSError("no space")))
    ck.save(t)  # returns; the error is the background thread's
    with pytest.raises(OSError, match="no space"):
        ck.wait()


def test_keep_last_prunes_older_checkpoints(tmp_path):
    t = trainer()
    ck = checkpointer(tmp_path, keep_last=2)
    for _ in range(3):
        t.train_step()
        ck.save(t)
    assert iterations(tmp_path) == [2, 3]
    with pytest.raises(ValueError, match="keep_last 0"):
        checkpointer(tmp_path, keep_last=0)


def test_file_uri_and_damage_detection(tmp_path):
    from workers.checkpoint.reader import CheckpointReader, load_checkpoint

    t = trained(1)
    checkpointer(f"file://{tmp_path}").save(t)
    t.train_step()
    checkpointer(f"file://{tmp_path}").save(t)
    data = tmp_path / "iter_0000002" / "rank_00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte flipped
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="CRC-32 mismatch"):
        load_checkpoint(trainer(), f"file://{tmp_path}")
    with pytest.raises(ValueError, match="CRC-32 mismatch"):
        CheckpointReader.open(str(tmp_path / "iter_0000002")).verify()
    data.write_bytes(bytes(raw[:-4]))  # truncated: discovery falls back to iteration 1
    assert iterations(tmp_path) == [1]
    assert load_checkpoint(trainer(), f"file://{tmp_path}")["iteration"] == 1


def test_another_model_is_refused_with_the_differences(tmp_path):
    from workers.checkpoint.reader import load_checkpoint

    checkpointer(tmp_path).save(trainer())
    with pytest.raises(ValueError, match=r"model.hidden_size: 32 there, 64 in this job"):
        load_checkpoint(trainer(model={"hidden_size": 64}), str(tmp_path))
    with pytest.raises(ValueError, match=r"model.num_layers: 2 there, 4 in this job"):
        load_checkpoint(trainer(model={"num_layers": 4}), str(tmp_path))
    # A manifest that lies about the config is still caught by the tensor shapes.
    manifest = tmp_path / "iter_0000000" / "manifest.json"
    m = json.loads(manifest.read_text())
    m["model"]["ffn_hidden_size"] = 128
    manifest.write_text(json.dumps(m))
    with pytest.raises(ValueError, match="has shape"):
        load_checkpoint(trainer(model={"ffn_hidden_size": 128}), str(tmp_path / "iter_0000000"))


def test_nothing_to_load_is_a_clear_error(tmp_path):
    from workers.checkpoint.reader import load_checkpoint

    with pytest.raises(ValueError, match="no complete checkpoint"):
        load_checkpoint(trainer(), str(tmp_path))


def test_object_store_commit_is_the_manifest(tmp_path):
    """On a filesystem that is not local (pyarrow's in-memory mock stands in for s3/gs),
    directories are not renamed: the manifest alone commits, and discovery finds it."""
    import pyarrow.fs as pafs

    from workers.checkpoint.reader import CheckpointReader, load_checkpoint
    from workers.checkpoint.storage import Storage, latest_checkpoint, list_checkpoints

    store = Storage(pafs._MockFileSystem(), "/bucket/job")
    ck = checkpointer(tmp_path, keep_last=2)
    ck.root = store
    t = trainer()
    for _ in range(3):
        t.train_step()
        ck.save(t)
    found = list_checkpoints(store)
    assert [c.iteration for c in found] == [2, 3]
    assert all(c.storage.root.rsplit("/", 1)[1].startswith(".iter_") for c in found)
    fresh = trainer()
    assert load_checkpoint(fresh, CheckpointReader(latest_checkpoint(store).storage))["iteration"] == 3
    want = t.train_step()["loss"]
    assert fresh.train_step()["loss"] == want


def test_a_checkpointer_serves_one_layout(tmp_path):
    ck = checkpointer(tmp_path)
    ck.save(trainer())
    with pytest.raises(ValueError, match="one Checkpointer per Trainer"):
        ck.save(trainer(parallel={"use_distributed_optimizer": True}))


def test_keep_best_keeps_the_lowest_metric_beside_the_last(tmp_path):
    """keep_last 1, keep_best 2 by val_loss: the newest checkpoint and the two with the lowest val_loss
    survive every commit; a checkpoint saved without the metric is never a best one."""
    from workers.checkpoint.storage import Storage, list_checkpoints

    ck = checkpointer(tmp_path, keep_last=1, keep_best=2, best_metric="val_loss")
    t = trainer()
    val = {1: 3.0, 2: 1.0, 3: 2.5, 4: None, 5: 0.5, 6: 4.0}
    reports = []
    for it, v in val.items():
        t.train_step()
        ck.save(t, {"val_loss": v, "lm_loss": 10.0 - it})
        reports.append(ck.take_retention())
    assert iterations(tmp_path) == [2, 5, 6]  # mutation: best ones pruned like the rest -> [6]
    assert ck.take_retention() is None  # once per commit
    assert reports[2] == {"iteration": 3, "pruned": ["iter_0000001"], "kept": [
        {"iteration": 2, "why": "best val_loss 1"}, {"iteration": 3, "why": "last and best val_loss 2.5"}]}
    assert reports[4]["pruned"] == ["iter_0000003", "iter_0000004"]  # 4 has no val_loss: never a best one
    assert reports[-1] == {"iteration": 6, "pruned": [], "kept": [
        {"iteration": 2, "why": "best val_loss 1"}, {"iteration": 5, "why": "best val_loss 0.5"},
        {"iteration": 6, "why": "last"}]}
    saved = {c.iteration: c.manifest["metrics"] for c in list_checkpoints(Storage.from_uri(str(tmp_path)))}
    assert saved == {2: {"val_loss": 1.0, "lm_loss": 8.0}, 5: {"val_loss": 0.5, "lm_loss": 5.0},
                     6: {"val_loss": 4.0, "lm_loss": 4.0}}
