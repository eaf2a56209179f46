"""async's account of who trained what (dptrain.strategies.async_records): a share of an epoch counts as trained
once its worker's merge brought it in; the shares without a record are what the workers left make up."""

from __future__ import annotations

from dptrain.strategies.async_records import TrainedShares, record_key


class Store:
    """A dict with the two calls signed.put and signed.read make."""

    def __init__(self):
        self.values = {}

    def set(self, key, value):
        self.values[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(key in self.values for key in keys)

    def get(self, key):
        return self.values[key]


def numbers(rank, samples=10):
    return {"rank": rank, "samples": samples, "train_loss": 1.0, "train_seconds": 0.1, "comm_bytes": 0}


def test_an_epoch_counts_as_trained_only_once_a_merge_brought_it_in_and_then_it_is_in_the_store():
    store, shares = Store(), TrainedShares()
    shares.begin(0, (0, 1))
    shares.finished(1, numbers(1), merged=False, store=store)  # --sync-every 2: epoch 1 waits for the merge
    assert shares.untrained(1) == [(0, 0, 2), (0, 1, 2)] and not store.values
    shares.finished(2, numbers(1), merged=True, store=store)
    assert sorted(store.values) == [record_key(1, 1), record_key(1, 2)]
    assert shares.untrained(2) == [(0, 0, 2), (1, 0, 2)]  # rank 0's share of both epochs: no record here


def test_rank_0_reads_the_others_records_from_the_store_and_a_lost_workers_unmerged_epochs_are_owed():
    store, worker, rank0 = Store(), TrainedShares(), TrainedShares()
    for shares in (worker, rank0):
        shares.begin(0, (0, 1, 2))
    worker.finished(1, numbers(2), merged=True, store=store)  # rank 2 merged epoch 1, then was lost
    rank0.change(2, (0, 1))  # from epoch 3 (from 0: 2) the two left share the data
    for epoch in (1, 2, 3):
        rank0.finished(epoch, numbers(0), merged=True, store=None)
        rank0.add({str(epoch): {"1": numbers(1)}})  # rank 1's, gathered at the end (JSON keys)
    rank0.read_missing(store, 3)
    assert rank0.untrained(3) == [(1, 2, 3)]  # rank 2's third of epoch 2, never merged; epoch 3 is 2 workers'
    assert sorted(rank0.records[1]) == [0, 1, 2] and sorted(rank0.records[3]) == [0, 1]


def test_a_forged_or_misnamed_record_in_the_store_is_not_taken():
    store, shares = Store(), TrainedShares()
    shares.begin(0, (0, 1))
    store.set(record_key(1, 1), '{"rank": 0, "samples": 5}')  # another rank's numbers under rank 1's key
    shares.read_missing(store, 1)
    assert shares.untrained(1) == [(0, 0, 2), (0, 1, 2)]


def test_plans_and_records_survive_a_checkpoint_and_a_resume_keeps_the_plans_before_it():
    shares = TrainedShares()
    shares.begin(0, (0, 1, 2))
    shares.change(3, (0, 2))
    shares.finished(1, numbers(0), merged=True, store=None)
    shares.finished(2, numbers(0), merged=False, store=None)  # waiting: the file carries its work in the model
    state = shares.state_dict()
    resumed = TrainedShares()
    resumed.load_state_dict(state)
    resumed.begin(4, (0, 1, 2, 3))  # resumed after epoch 4 on 4 workers
    assert resumed.plans == [(0, (0, 1, 2)), (3, (0, 2)), (4, (0, 1, 2, 3))]
    assert sorted(resumed.records) == [1, 2] and resumed.members_at(3) == (0, 2)
    assert (1, 0, 3) not in resumed.untrained(2)  # rank 0's epoch 2 counts (its waiting epoch was saved)


def test_an_older_checkpoint_without_plans_owes_nothing_for_the_epochs_before_the_resume():
    shares = TrainedShares()
    shares.begin(3, (0, 1))
    assert shares.untrained(3) == []
