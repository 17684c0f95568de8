"""Counter-based initialisation: a shard is exactly the slice of the full tensor, drawn alone."""

import torch

from tests.helpers.init import init_full
from workers.parallel.initializer import BLOCK, Cat, NormalInit, Zeros, materialize


def test_shard_is_the_slice_of_the_full_tensor():
    full_init = NormalInit(7, "layers.0.experts.down", (4, 6, 10), 0.02)
    full = full_init.materialize()
    assert torch.equal(full, init_full(7, "layers.0.experts.down", (4, 6, 10), 0.02))
    shard = full_init.narrow(0, 2, 2).narrow(2, 5, 5).materialize()  # EP rank 1 of 2, ETP rank 1 of 2
    assert torch.equal(shard, full[2:4, :, 5:10])
    # A row-parallel (last-dim) split costs only its own elements too.
    assert torch.equal(NormalInit(7, "w", (3, 8), 1.0).narrow(1, 6, 2).materialize(),
                       NormalInit(7, "w", (3, 8), 1.0).materialize()[:, 6:8])


def test_lazy_cat_and_zeros_narrow_like_tensors():
    a, b = NormalInit(1, "a", (3, 4), 1.0), NormalInit(1, "b", (5, 4), 1.0)
    cat = Cat([a, Zeros((2, 4)), b])
    full = materialize(cat)
    assert full.shape == (10, 4) and torch.equal(full[3:5], torch.zeros(2, 4))
    for start, length in [(0, 10), (2, 5), (4, 1), (5, 5)]:
        assert torch.equal(materialize(cat.narrow(0, start, length)), full[start : start + length])
    assert torch.equal(materialize(cat.narrow(1, 1, 2)), full[:, 1:3])


def test_values_depend_on_seed_name_and_position_only():
    x = NormalInit(3, "embedding", (1000, 1000), 1.0).materialize()
    assert abs(x.mean().item()) < 5e-3 and abs(x.std().item() - 1.0) < 5e-3
    assert abs((x**4).mean().item() - 3.0) < 0.05  # normal kurtosis
    assert abs(torch.corrcoef(torch.stack([x.flatten()[:-1], x.flatten()[1:]]))[0, 1].item()) < 5e-3
    assert not torch.equal(x[:10], NormalInit(4, "embedding", (1000, 1000), 1.0).materialize()[:10])
    assert not torch.equal(x[:10], NormalInit(3, "output", (1000, 1000), 1.0).materialize()[:10])


def test_shards_across_block_boundaries():
    # Short rows: several whole rows per block; long rows: tiles of BLOCK per row.
    for shape in [(3 * BLOCK // 7 + 5, 7), (3, 2 * BLOCK + 100), (2, 3, BLOCK + 1)]:
        init = NormalInit(5, "w", shape, 1.0)
        full = init.materialize()
        assert len(set(full.flatten().tolist())) > 0.999 * full.numel()  # no block repeats another
        for dim in range(len(shape)):
            n = shape[dim]
            for start, length in [(0, n // 2), (n // 3, n - n // 3), (n - 1, 1)]:
                got = init.narrow(dim, start, length).materialize()
                assert torch.equal(got, full.narrow(dim, start, length)), (shape, dim, start, length)
