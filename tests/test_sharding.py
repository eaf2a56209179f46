"""Sharding: every epoch visits each sample exactly once across the workers, in equal steps, in a reproducible order."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dptrain.errors import UserError
from dptrain.data.sharding import SHUFFLES, batches, derive_seed, epoch_indices, steps_per_epoch

seeds = st.integers(0, 2**40)
epochs = st.integers(0, 10_000)


@st.composite
def layouts(draw, min_per_worker=1):
    """(n_samples, world) with at least `min_per_worker` samples per worker."""
    world = draw(st.integers(1, 9))
    n = draw(st.integers(world * min_per_worker, 3000))
    return n, world


def all_ranks(n, world, epoch, seed, shuffle):
    return [epoch_indices(n, rank, world, epoch, seed, shuffle) for rank in range(world)]


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), epoch=epochs, seed=seeds, shuffle=st.sampled_from(SHUFFLES))
def test_ranks_together_visit_every_sample_exactly_once_with_shards_differing_by_at_most_one(layout, epoch, seed, shuffle):
    n, world = layout
    shards = all_ranks(n, world, epoch, seed, shuffle)
    assert np.array_equal(np.sort(np.concatenate(shards)), np.arange(n))
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=150, deadline=None)
@given(layout=layouts(), batch_size=st.integers(1, 64), epoch=epochs, seed=seeds, shuffle=st.sampled_from(SHUFFLES))
def test_every_rank_takes_steps_per_epoch_nonempty_batches_of_at_most_batch_size(layout, batch_size, epoch, seed, shuffle):
    n, world = layout
    steps = steps_per_epoch(n, world, batch_size)
    shards = all_ranks(n, world, epoch, seed, shuffle)
    unequal_shards = len({len(shard) for shard in shards}) > 1
    for shard in shards:
        cut = batches(shard, steps)
        assert len(cut) == steps
        assert np.array_equal(np.concatenate(cut), shard)  # batches keep the visiting order, drop nothing
        sizes = [len(batch) for batch in cut]
        assert min(sizes) >= 1
        if batch_size == 1 and unequal_shards:
            # the documented exception: the larger shards put two samples in one step
            assert max(sizes) <= 2
        else:
            assert max(sizes) <= batch_size


def test_batch_size_one_with_unequal_shards_puts_two_samples_in_one_step_of_the_larger_shard():
    assert steps_per_epoch(5, 2, 1) == 2
    small, large = (batches(epoch_indices(5, rank, 2, 0, 0, "none"), 2) for rank in range(2))
    assert [len(b) for b in small] == [1, 1]
    assert [len(b) for b in large] == [2, 1]


@pytest.mark.parametrize("n, world, batch_size, steps", [
    (1, 1, 1, 1), (1, 1, 64, 1), (100, 1, 32, 4), (100, 3, 32, 2), (9, 9, 4, 1), (10, 9, 1, 1), (64, 2, 32, 1),
    (65, 2, 32, 2),
])
def test_steps_per_epoch_exact_values(n, world, batch_size, steps):
    assert steps_per_epoch(n, world, batch_size) == steps


@pytest.mark.parametrize("n, world", [(0, 1), (1, 2), (8, 9)])
def test_steps_per_epoch_rejects_fewer_samples_than_workers(n, world):
    with pytest.raises(UserError, match=rf"has {n} samples, fewer than the {world} workers"):
        steps_per_epoch(n, world, 32)


def test_unknown_shuffle_mode_is_a_value_error():
    with pytest.raises(ValueError, match="shuffle must be one of"):
        epoch_indices(10, 0, 1, 0, 0, "random")


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), epoch=epochs, seed=seeds)
def test_global_order_is_one_permutation_sliced_by_rank_whatever_the_world(layout, epoch, seed):
    n, world = layout
    permutation = epoch_indices(n, 0, 1, epoch, seed, "global")
    assert np.array_equal(np.concatenate(all_ranks(n, world, epoch, seed, "global")), permutation)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(min_per_worker=20), epoch=epochs, seed=seeds)
def test_global_order_is_new_each_epoch_and_the_same_for_the_same_seed_and_epoch(layout, epoch, seed):
    # With at least 20 samples the chance that two permutations agree is below 1/20!.
    n, world = layout
    order = np.concatenate(all_ranks(n, world, epoch, seed, "global"))
    assert np.array_equal(np.concatenate(all_ranks(n, world, epoch, seed, "global")), order)
    assert not np.array_equal(np.concatenate(all_ranks(n, world, epoch + 1, seed, "global")), order)
    assert not np.array_equal(np.concatenate(all_ranks(n, world, epoch, seed + 1, "global")), order)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(min_per_worker=20), epoch=epochs, seed=seeds)
def test_local_keeps_each_rank_on_its_file_order_shard_and_reorders_it_each_epoch(layout, epoch, seed):
    n, world = layout
    for rank in range(world):
        shard = epoch_indices(n, rank, world, epoch, seed, "none")
        this_epoch = epoch_indices(n, rank, world, epoch, seed, "local")
        next_epoch = epoch_indices(n, rank, world, epoch + 1, seed, "local")
        assert np.array_equal(np.sort(this_epoch), shard)
        assert np.array_equal(np.sort(next_epoch), shard)
        assert not np.array_equal(this_epoch, next_epoch)
        assert np.array_equal(epoch_indices(n, rank, world, epoch, seed, "local"), this_epoch)


@settings(max_examples=60, deadline=None)
@given(layout=layouts(), epoch=epochs, seed=seeds)
def test_none_is_each_rank_contiguous_slice_in_file_order_in_every_epoch(layout, epoch, seed):
    n, world = layout
    for rank in range(world):
        expected = np.arange(rank * n // world, (rank + 1) * n // world)
        assert np.array_equal(epoch_indices(n, rank, world, epoch, seed, "none"), expected)


def test_derive_seed_is_reproducible_63_bit_and_distinct_for_small_tuples():
    pairs = {derive_seed(seed, epoch) for seed in range(30) for epoch in range(30)}
    triples = {derive_seed(seed, epoch, rank) for seed in range(10) for epoch in range(10) for rank in range(1, 10)}
    assert len(pairs) == 900 and len(triples) == 900
    assert all(0 <= value < 2**63 for value in pairs | triples)
    assert derive_seed(7, 3) == derive_seed(7, 3)


def test_seeds_of_2_to_the_32_and_above_get_their_own_global_orders():
    assert derive_seed(2**32, 0) != derive_seed(0, 1)
    assert not np.array_equal(epoch_indices(100, 0, 1, 0, 2**32, "global"), epoch_indices(100, 0, 1, 1, 0, "global"))


def test_the_rest_of_an_epoch_after_a_commit_holds_every_row_not_read_yet_once_over_the_new_world():
    """allreduce's commits (--commit-every-steps): after 4 of 15 steps over 3 workers, rank 2 is lost; the rest
    of the epoch is every row none of them had read, shared over the 2 left; after 3 more of its steps rank 1 is
    lost too, and the rest of that goes to rank 0 alone. Every row of the epoch is read exactly once."""
    import numpy as np

    from dptrain.data.sampler import EpochPlan, PlanBatches, Rest

    whole = Rest.whole(1, 1437, (0, 1, 2), 32, 0, "global")
    assert whole.steps == 15 and [len(part) for part in whole.parts] == [479, 479, 479]
    first = whole.after(4, (0, 1), 32)
    read_before = [np.concatenate(np.array_split(part, 15)[:4]) for part in whole.parts]
    assert first.read == ((0, 128), (1, 128), (2, 128)) and first.read_by((2,)) == 128
    assert [len(part) for part in first.parts] == [527, 526] and first.steps == 17 and first.done == 4
    second = first.after(7, (0,), 32)
    assert second.read_by((1, 2)) == 128 + 128 + sum(len(b) for b in np.array_split(first.parts[1], 17)[:3])
    rows = np.concatenate([*read_before, *(np.concatenate(np.array_split(part, 17)[:3]) for part in first.parts),
                           *second.parts])
    assert len(rows) == 1437 and len(np.unique(rows)) == 1437
    # a reader of the rest: the steps before the commit are skipped, the rest's come with the epoch's step numbers
    plan = EpochPlan(steps=23, rows=lambda epoch: np.arange(10), rest=first, rank=1)
    batches = PlanBatches(plan)
    batches.set_epoch(1, 4)
    assert len(batches) == 17 and np.array_equal(np.concatenate(list(batches)), first.parts[1])
    batches.set_epoch(2)
    assert len(batches) == 23 and np.array_equal(np.concatenate(list(batches)), np.arange(10))
