"""async: merges are commutative, never lost, staleness is bounded, ema and delayed-nesterov follow their
formulas, compressed payloads are counted to the byte and resumes continue the service exactly."""

from __future__ import annotations

import itertools
import os
import signal
import time

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed
from dptrain.runtime.membership import Evicted
from dptrain.strategies.asynchronous import Async, GlobalModel, flat_state, members_key
from dptrain.strategies.compression import ErrorFeedback, decode, payload_bytes
from dptrain.train.trainer import Trainer


def test_delta_merges_in_any_order_give_the_mean_of_the_workers():
    rng = np.random.default_rng(0)
    base = torch.from_numpy(rng.normal(size=50).astype(np.float32))
    locals_ = [base + torch.from_numpy(rng.normal(size=50).astype(np.float32)) for _ in range(4)]
    expected = torch.stack(locals_).mean(dim=0)
    for order in itertools.permutations(range(4)):
        model = GlobalModel(base, workers=4)
        for position, rank in enumerate(order):
            _, version, staleness = model.apply(rank, locals_[rank] - base, base_version=0)
            assert staleness == position and version == position + 1
        assert torch.allclose(model.state, expected, atol=1e-6), order
        assert model.merges == [1, 1, 1, 1] and model.max_staleness_seen == 3


def test_ema_merge_is_the_reference_rule_and_halves_the_early_workers():
    base = torch.zeros(3)
    model = GlobalModel(base, workers=4, merge="ema")
    for rank in range(4):
        model.apply(rank, torch.full((3,), float(2 ** rank)), base_version=rank)
    # G = (((0 + 1)/2 + 2)/2 + 4)/2 + 8)/2: worker k is weighted 2^-(W-k)
    expected = 1 / 16 + 2 / 8 + 4 / 4 + 8 / 2
    assert torch.allclose(model.state, torch.full((3,), expected))


# -- real processes ----------------------------------------------------------------------------

def _data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int64)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


class DelayedAsync(Async):
    """Merges after a rank-specific delay (forcing the merge order) and records what it sent."""

    def __init__(self, delays, **kwargs):
        super().__init__(**kwargs)
        self.delays, self.sent = delays, []

    def merge_now(self):
        time.sleep(self.delays[self.ctx.rank])
        self.sent.append(flat_state(self.model))
        return super().merge_now()


def _ordered_worker(rank, world, delays):
    x, y = _data()
    strategy = DelayedAsync(delays)
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy, batch_size=8,
                      seed=5, verbose=False)
    summary = trainer.fit((x, y), epochs=1)
    return strategy.sent[0], flat_state(model), summary.strategy_results["merges"], strategy.max_staleness_seen


@pytest.mark.parametrize("delays", [(0.0, 0.6, 1.2), (1.2, 0.6, 0.0)], ids=["order-012", "order-210"])
def test_one_merge_each_in_a_forced_order_equals_the_synchronous_average(delays):
    results = run_distributed(_ordered_worker, 3, delays)
    locals_ = torch.stack([r[0] for r in results])
    final = results[0][1]
    assert torch.allclose(final, locals_.mean(dim=0), atol=1e-6)
    assert all(torch.equal(r[1], final) for r in results)
    assert results[0][2] == [1, 1, 1]
    staleness = [r[3] for r in results]
    order = sorted(range(3), key=lambda rank: delays[rank])
    assert [staleness[rank] for rank in order] == [0, 1, 2]


def _many_epochs_worker(rank, world):
    x, y = _data(n=64, seed=rank)
    strategy = Async()
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "cross-entropy", strategy, batch_size=16,
                      seed=0, verbose=False)
    summary = trainer.fit((x, y), epochs=20)
    version = strategy.global_model.version if rank == 0 else None
    return summary.strategy_results["merges"], version


def test_no_merge_is_lost_when_four_workers_merge_many_tiny_epochs_at_once():
    results = run_distributed(_many_epochs_worker, 4)
    merges, version = results[0]
    assert merges == [20, 20, 20, 20]
    assert version == 80


def _staleness_worker(rank, world, max_staleness):
    x, y = _data(n=256)
    strategy = Async(max_staleness=max_staleness)
    model = _model()
    # rank 1 is a 5x straggler: rank 0 merges many epochs while rank 1 is inside one
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), "cross-entropy", strategy, batch_size=8,
                      seed=0, verbose=False).emulate_straggler(5.0 if rank == 1 else 1.0)
    summary = trainer.fit((x, y), epochs=4)
    return summary.strategy_results["refreshes"], summary.strategy_results["merges"]


def test_a_worker_behind_the_staleness_bound_refreshes_before_it_continues():
    refreshes, merges = run_distributed(_staleness_worker, 2, 0)[0]
    assert refreshes[1] > 0
    assert merges == [4, 4]
    refreshes, _ = run_distributed(_staleness_worker, 2, None)[0]
    assert refreshes == [0, 0]


# -- delayed-nesterov: server momentum on the merged deltas ------------------------------------

def test_delayed_nesterov_follows_the_hand_computation():
    # W = 2, beta = 0.5, lr = 0.8; deltas 1, 2, 3, 4, 5 (rounds {1, 2}, {3, 4}, then 5 alone):
    #   d=1: G = 0 + 0.8*1/2                     = 0.4   (A = 1)
    #   d=2: m = 0.5*0 + (1+2)/2 = 1.5;  G += 0.8*(2/2 + 0.5*1.5) = 1.4   -> 1.8
    #   d=3: G += 0.8*3/2 = 1.2                  -> 3.0   (A = 3)
    #   d=4: m = 0.5*1.5 + (3+4)/2 = 4.25; G += 0.8*(4/2 + 0.5*4.25) = 3.3 -> 6.3
    #   d=5: G += 0.8*5/2 = 2.0                  -> 8.3   (A = 5, one merge into the round)
    model = GlobalModel(torch.zeros(3), workers=2, merge="delayed-nesterov", server_momentum=0.5, server_lr=0.8)
    states = []
    for i, d in enumerate([1.0, 2.0, 3.0, 4.0, 5.0]):
        state, version, _ = model.apply(i % 2, torch.full((3,), d), base_version=version if i else 0)
        states.append(state[0].item())
    assert states == pytest.approx([0.4, 1.8, 3.0, 6.3, 8.3], abs=1e-6)
    assert torch.allclose(model.momentum, torch.full((3,), 4.25))
    assert torch.equal(model.round_sum, torch.full((3,), 5.0)) and model.round_merges == 1
    assert model.version == 5 and model.merges == [3, 2]


def _rounds_by_torch_nesterov(base, rounds, beta, lr):
    """The global at each round end computed independently: torch's Nesterov SGD on -mean(round's deltas)."""
    anchor = base.clone().requires_grad_(True)
    optimizer = torch.optim.SGD([anchor], lr=lr, momentum=beta, nesterov=True)
    ends = []
    for deltas in rounds:
        anchor.grad = -torch.stack(deltas).mean(dim=0)
        optimizer.step()
        ends.append(anchor.detach().clone())
    return ends


def test_at_each_round_end_the_order_inside_the_round_does_not_matter_and_it_is_the_nesterov_step():
    rng = np.random.default_rng(3)
    base = torch.from_numpy(rng.normal(size=40).astype(np.float32))
    rounds = [[torch.from_numpy(rng.normal(size=40).astype(np.float32)) for _ in range(3)] for _ in range(3)]
    expected = _rounds_by_torch_nesterov(base, rounds, beta=0.9, lr=0.7)
    for order in itertools.permutations(range(3)):
        model = GlobalModel(base, workers=3, merge="delayed-nesterov", server_momentum=0.9, server_lr=0.7)
        for number, deltas in enumerate(rounds):
            for rank in order:
                model.apply(rank, deltas[rank], base_version=0)
            assert torch.allclose(model.state, expected[number], atol=1e-5), (order, number)


def test_with_momentum_the_global_depends_on_how_merges_group_into_rounds_not_only_on_their_sum():
    # Four deltas, W = 2. Under `delta` every order gives one global (their mean, added). Under
    # delayed-nesterov the order inside a round does not matter, but which deltas form each round
    # and which round comes first do: the 24 orders give 3 pairings x 2 orders of the pairs = 6.
    rng = np.random.default_rng(4)
    deltas = [torch.from_numpy(rng.normal(size=10).astype(np.float32)) for _ in range(4)]
    finals = {"delta": {}, "delayed-nesterov": {}}
    for merge in finals:
        for order in itertools.permutations(range(4)):
            model = GlobalModel(torch.zeros(10), workers=2, merge=merge)
            for rank in order:
                model.apply(rank % 2, deltas[rank], base_version=0)
            finals[merge][order] = model.state

    def groups(results):
        distinct = []
        for state in results.values():
            if not any(torch.allclose(state, seen, atol=1e-5) for seen in distinct):
                distinct.append(state)
        return distinct

    assert len(groups(finals["delta"])) == 1
    assert len(groups(finals["delayed-nesterov"])) == 6
    for order, state in finals["delayed-nesterov"].items():
        swapped = (order[1], order[0], order[3], order[2])  # the same pairs, each in the other order
        assert torch.allclose(state, finals["delayed-nesterov"][swapped], atol=1e-5)


def test_delayed_nesterov_without_momentum_at_lr_1_is_the_delta_merge_merge_for_merge():
    rng = np.random.default_rng(5)
    base = torch.from_numpy(rng.normal(size=30).astype(np.float32))
    plain = GlobalModel(base, workers=3)
    nesterov = GlobalModel(base, workers=3, merge="delayed-nesterov", server_momentum=0.0, server_lr=1.0)
    for i in range(7):
        delta = torch.from_numpy(rng.normal(size=30).astype(np.float32))
        assert torch.equal(plain.apply(i % 3, delta, 0)[0], nesterov.apply(i % 3, delta, 0)[0])


def test_the_service_state_saved_mid_round_continues_exactly(tmp_path):
    rng = np.random.default_rng(6)
    base = torch.from_numpy(rng.normal(size=20).astype(np.float32))
    deltas = [torch.from_numpy(rng.normal(size=20).astype(np.float32)) for _ in range(8)]

    def fresh():
        return GlobalModel(base, workers=3, merge="delayed-nesterov", server_momentum=0.9, server_lr=0.7)

    uninterrupted = fresh()
    for i, delta in enumerate(deltas):
        uninterrupted.apply(i % 3, delta, 0)
    first = fresh()
    for i, delta in enumerate(deltas[:5]):  # one round and two merges into the next
        first.apply(i % 3, delta, 0)
    torch.save(first.state_dict(), tmp_path / "service.pt")
    saved = torch.load(tmp_path / "service.pt", weights_only=True)
    assert saved["round_merges"] == 2 and saved["version"] == 5
    resumed, global_only = fresh(), fresh()
    resumed.load_state_dict(saved)
    global_only.state.copy_(saved["state"])  # what a checkpoint without the server momentum would continue
    for i, delta in enumerate(deltas[5:], start=5):
        resumed.apply(i % 3, delta, 0)
        global_only.apply(i % 3, delta, 0)
    assert torch.equal(resumed.state, uninterrupted.state)
    assert torch.equal(resumed.momentum, uninterrupted.momentum) and resumed.version == 8
    assert not torch.allclose(global_only.state, uninterrupted.state, atol=1e-3)


# -- through real ranks: delayed-nesterov and compressed payloads ------------------------------

class RecordingAsync(Async):
    """Records each merge: (the delta this worker had, the global version its merge produced)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.record = []

    def merge_now(self):
        delta = flat_state(self.model) - self.base
        staleness = super().merge_now()
        self.record.append((delta, self.base_version))
        return staleness


def _recording_worker(rank, world, merge, compression, epochs):
    x, y = _data(n=64, seed=rank)
    strategy = RecordingAsync(merge=merge, compression=compression, server_momentum=0.9, server_lr=0.7)
    model = _model()
    initial = flat_state(model)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy, batch_size=16,
                      seed=rank, verbose=False).emulate_straggler(2.0 if rank == 1 else 1.0)
    summary = trainer.fit((x, y), epochs=epochs)
    return {"initial": initial, "record": strategy.record, "final": flat_state(model), "comm": strategy.comm_bytes,
            "merges": summary.strategy_results["merges"], "residual": strategy.feedback.residual}


def _replay(results, merge, compression, beta=0.9, lr=0.7):
    """The global model from the merges in the order the service applied them, by the rule written out."""
    workers = len(results)
    feedback = [ErrorFeedback(compression) for _ in results]
    merges = sorted((version, rank, delta) for rank, r in enumerate(results) for delta, version in r["record"])
    assert [version for version, _, _ in merges] == list(range(1, len(merges) + 1))  # none lost, none twice
    state = results[0]["initial"].clone()
    momentum, round_sum, count = torch.zeros_like(state), torch.zeros_like(state), 0
    for _, rank, delta in merges:
        if compression != "none":  # what the service received: this worker's rounded delta + residual
            delta = decode(compression, feedback[rank].encode(delta), delta.numel())
        if merge == "delta":
            state = state + delta / workers
            continue
        round_sum, count = round_sum + delta, count + 1
        if count < workers:
            state = state + lr * delta / workers
        else:
            momentum = beta * momentum + round_sum / workers
            state = state + lr * (delta / workers + beta * momentum)
            round_sum, count = torch.zeros_like(state), 0
    return state, feedback


# Rank 1 of _model(): its state is 75 float32 values (300 bytes); an exchange's header and reply are 4 int64 each.
NUMEL, HEADER = 75, 32


@pytest.mark.parametrize("merge,compression", [("delayed-nesterov", "none"), ("delayed-nesterov", "int8"),
                                               ("delta", "fp16")])
def test_two_ranks_merge_by_the_rule_and_count_the_encoded_bytes(merge, compression):
    epochs = 3
    results = run_distributed(_recording_worker, 2, merge, compression, epochs)
    expected, feedback = _replay(results, merge, compression)
    for r in results:
        assert torch.allclose(r["final"], expected, atol=1e-5)
    assert results[0]["merges"] == [epochs, epochs]
    if compression != "none":  # each worker's residual is what its own payloads dropped
        for rank, r in enumerate(results):
            assert torch.allclose(r["residual"], feedback[rank].residual, atol=1e-7)
            assert r["residual"].abs().max() > 0
    # Rank 1's bytes: the initial broadcast, per merge its header and encoded delta out and the
    # reply and float32 global back, its DONE and the answer, the final broadcast.
    model_bytes = 4 * NUMEL
    per_merge = HEADER + payload_bytes(compression, NUMEL) + HEADER + model_bytes
    assert payload_bytes(compression, NUMEL) == {"none": 300, "int8": 75 + 4, "fp16": 150}[compression]
    assert results[1]["comm"] == model_bytes + epochs * per_merge + 2 * HEADER + model_bytes


def _resume_worker(rank, world, out, merge, compression, stop_after, epochs):
    x, y = _data(n=64)
    strategy = Async(merge=merge, compression=compression, server_momentum=0.9, server_lr=0.7)
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), "cross-entropy", strategy,
                      batch_size=16, seed=0, verbose=False, out=out, checkpoint_every=1, resume=stop_after is None)
    trainer.fit((x, y), epochs=stop_after or epochs)
    return flat_state(model), strategy.state_dict()


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_resumed_run_continues_the_server_momentum_and_the_residual_exactly(tmp_path, compression):
    # One worker: every merge ends a round, so the momentum moves the model every epoch.
    merge = "delayed-nesterov"
    straight, _ = run_distributed(_resume_worker, 1, str(tmp_path / "a"), merge, compression, 4, 4)[0]
    _, saved = run_distributed(_resume_worker, 1, str(tmp_path / "b"), merge, compression, 2, 4)[0]
    assert saved["global"]["momentum"].abs().max() > 0 and saved["global"]["version"] == 2
    if compression != "none":
        assert saved["feedback"]["residual"].abs().max() > 0
    resumed, _ = run_distributed(_resume_worker, 1, str(tmp_path / "b"), merge, compression, None, 4)[0]
    assert torch.equal(resumed, straight)


def test_compression_with_the_ema_merge_is_one_sentence(capsys, monkeypatch):
    from dptrain import cli
    monkeypatch.setenv("DPTRAIN_DEBUG", "0")
    code = cli.main(["train", "--strategy", "async", "--merge", "ema", "--compression", "int8"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == ("dptrain: error: invalid settings in the command line: compression int8 applies to async "
                        "merges of deltas (delta, delayed-nesterov), not to merge ema, which sends whole models")
    with pytest.raises(ValueError, match="compression fp16 needs a merge of deltas"):
        Async(merge="ema", compression="fp16")


def _ordered_nesterov_worker(rank, world, delays):
    x, y = _data()
    strategy = DelayedAsync(delays, merge="delayed-nesterov", server_momentum=0.9, server_lr=0.7)
    model = _model()
    base = flat_state(model)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy, batch_size=8,
                      seed=5, verbose=False)
    trainer.fit((x, y), epochs=1)
    return base, strategy.sent[0], flat_state(model), strategy.max_staleness_seen


@pytest.mark.parametrize("delays", [(0.0, 0.6), (0.6, 0.0)], ids=["order-01", "order-10"])
def test_one_round_over_two_real_ranks_is_the_nesterov_step_on_the_average_in_either_order(delays):
    # One merge each = one round: whichever rank merges first, the global after the round is
    # base + lr * (mean + beta * mean) (the momentum starts at zero, so m = mean).
    results = run_distributed(_ordered_nesterov_worker, 2, delays)
    base = results[0][0]
    mean = torch.stack([r[1] for r in results]).mean(dim=0) - base
    for r in results:
        assert torch.allclose(r[2], base + 0.7 * (mean + 0.9 * mean), atol=1e-6)
    first = min(range(2), key=lambda rank: delays[rank])
    assert [results[rank][3] for rank in (first, 1 - first)] == [0, 1]  # the forced order did happen


class Concluding(Async):
    """Records the global model that finish concluded (`concluded`), before the workers left make up the rows
    that no merge brought in (dptrain.train.make_up)."""

    def finish(self):
        model = super().finish()
        self.concluded = flat_state(model)
        return model


class LosingAsync(Concluding):
    """Live membership: rank 2 dies before it ever merges; ranks 0 and 1 merge once the service has left it
    out (the store holds generation 1), rank 1 after rank 0, and record what they sent and the global model
    that finish concluded (before the rows rank 2 took with it are made up)."""

    def merge_now(self):
        if self.ctx.rank == 2:
            os._exit(0)
        store, waited = self.ctx.group.store, time.monotonic()
        while not store.check([members_key(0, 1)]):  # (a blocking wait would hold up this process's heartbeat)
            assert time.monotonic() - waited < 30, "the service did not leave rank 2 out within 30 s"
            time.sleep(0.1)
        time.sleep(0.6 * self.ctx.rank)
        self.sent = flat_state(self.model)
        return super().merge_now()


def _losing_worker(rank, world):
    x, y = _data()
    strategy = LosingAsync()
    model = _model()
    start = flat_state(model)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy, batch_size=8,
                      seed=5, verbose=False, min_workers=2)
    summary = trainer.fit((x, y), epochs=1)
    return (start, strategy.sent, flat_state(model), summary.workers, summary.strategy_results["merges"],
            strategy.concluded, trainer.history)


def test_after_a_worker_is_lost_the_global_model_averages_over_the_workers_left():
    """Rank 2 of 3 dies unmerged: each merge then adds delta / 2, so the global model is the mean of the two
    survivors' models, not start + (d0 + d1) / 3 as if rank 2's share were a zero change. Then rank 2's share of
    the epoch, which no merge brought in, is trained by the two workers left from that global model, half each
    in batches of 8, and averaged: the final model equals that, redone here in one process."""
    from dptrain.data.sharding import epoch_indices

    results = run_distributed(_losing_worker, 3, lost=(2,))
    (start, sent0, final0, workers, merges, global0, history), (_, sent1, final1, _, _, global1, _) = results[:2]
    assert results[2] is None
    assert torch.allclose(global0, (sent0 + sent1) / 2, atol=1e-6) and torch.equal(global0, global1)
    assert not torch.allclose(global0, start + (sent0 - start + sent1 - start) / 3, atol=1e-4)
    assert torch.equal(final0, final1)
    assert workers == 2 and merges == [1, 1]

    x, y = _data()
    owed = epoch_indices(len(x), 2, 3, 0, seed=5)
    assert history[0]["rows_made_up"] == len(owed) == 32
    assert sum(worker["samples"] for worker in history[0]["workers"]) + len(owed) == len(x)
    trained = []
    for half in np.array_split(owed, 2):
        model = _model()
        torch.nn.utils.vector_to_parameters(global0.clone(), model.parameters())  # (views of its argument)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in np.array_split(half, -(-len(half) // 8)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.from_numpy(x[batch])), torch.from_numpy(y[batch])).backward()
            optimizer.step()
        trained.append(flat_state(model))
    assert torch.allclose(final0, (trained[0] + trained[1]) / 2, atol=1e-6)
    assert not torch.allclose(final0, global0, atol=1e-4)


class LeaderLosingAsync(Concluding):
    """Live membership over a served store: in epoch 1 the three ranks merge in the order 0, 1, 2; in epoch 2
    rank 0 dies (or freezes: `action`) as it is about to merge, and ranks 1 and 2 merge only once it did. A frozen
    rank 0 is woken by rank 2 after its last merge. Records each merge's base and what it sent."""

    def merge_now(self):
        store, epoch = self.ctx.group.store, self.merges + 1
        me = self.ctx.group.members[self.ctx.rank]
        if epoch == 2 and me == 0:
            wait_for(store, "test/epoch-1-merged")
            if self.action == "kill-last":  # once the others are done: they take over as they wait for the end
                wait_for(store, "test/epoch-2-merged-1")
                wait_for(store, "test/epoch-2-merged-2")
            store.set("test/rank-0-dies", str(os.getpid()))
            if self.action != "freeze":
                os._exit(0)
            os.kill(os.getpid(), signal.SIGSTOP)
        if epoch == 1:
            time.sleep(0.6 * me)
        elif self.action == "kill-last":  # 1, then 2, after all three merged epoch 1
            wait_for(store, "test/epoch-1-merged")
            time.sleep(0.6 * (me - 1))
        else:
            wait_for(store, "test/rank-0-dies")
            time.sleep(0.3)
        self.bases.append((self.base.clone(), self.base_version))
        self.sent.append(flat_state(self.model))
        staleness = super().merge_now()
        self.after = (self.base.clone(), self.base_version)
        if epoch == 1 and me == 2:
            store.set("test/epoch-1-merged", "1")
        if epoch == 2:
            store.set(f"test/epoch-2-merged-{me}", "1")
        if epoch == 2 and me == 2 and self.action == "freeze":
            os.kill(int(store.get("test/rank-0-dies")), signal.SIGCONT)
        return staleness


def wait_for(store, key):
    """(A blocking store wait would hold up this process's heartbeat.)"""
    waited = time.monotonic()
    while not store.check([key]):
        assert time.monotonic() - waited < 30, f"{key} was not set within 30 s"
        time.sleep(0.05)


def _leader_losing_worker(rank, world, merge, action):
    x, y = _data()
    strategy = LeaderLosingAsync(merge=merge)
    strategy.bases, strategy.sent, strategy.action = [], [], action
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy, batch_size=8,
                      seed=5, verbose=False, min_workers=2)
    try:
        summary = trainer.fit((x, y), epochs=2)
    except Evicted as evicted:  # rank 0, frozen and woken once the others took over
        return str(evicted)
    return (strategy.bases, strategy.sent, strategy.concluded, summary.workers, summary.strategy_results["merges"],
            strategy.after, trainer.history)


@pytest.mark.parametrize("merge,action", [("delta", "kill"), ("delayed-nesterov", "kill"), ("delta", "freeze")])
def test_when_rank_0_is_lost_the_others_take_over_from_the_newest_global_model_any_of_them_had(merge, action):
    """Rank 0 holds the global model; once it is gone (its store served elsewhere), ranks 1 and 2 regroup, the
    lower serves, and the global model starts again from the newest one either was given: rank 2's, after the
    three merges of epoch 1 (version 3). Their epoch-2 deltas, each against its own base, are then merged over 2
    workers: final = g3 + (local1 - g2) / 2 + (local2 - g3) / 2. delayed-nesterov's momentum, lost with rank 0,
    starts again at zero, and both survivors' merges make up its first round of 2.

    A frozen rank 0 is left out after its heartbeat stopped for 3 s, as a dead one; woken after the others took
    over, it finds that in the store and stops (Evicted), so that it never goes on as a second global model."""
    results = run_distributed(_leader_losing_worker, 3, merge, action, lost=(0,) if action == "kill" else (),
                              served=True)
    if action == "kill":
        assert results[0] is None
    else:
        assert results[0] == ("rank 0: the other workers went on without this one and its merge service (they "
                              "judged it gone: no heartbeat, frozen or too slow) and took the global model over; "
                              "it stops")
    (bases1, sent1, final1, workers, merges, _, history), (bases2, sent2, final2, _, _, _, _) = results[1:]
    assert [version for _, version in bases1] == [0, 2] and [version for _, version in bases2] == [0, 3]
    g2, g3 = bases1[1][0], bases2[1][0]
    delta = (sent1[1] - g2) + (sent2[1] - g3)
    if merge == "delta":
        expected = g3 + delta / 2
    else:  # the round's last merge: global += lr * (d / W + beta * m), m = A / W, from a fresh zero momentum
        expected = g3 + (delta / 2) + 0.9 * (delta / 2)
    assert torch.allclose(final1, expected, atol=1e-6)
    assert not torch.allclose(final1, g3 + delta / 3, atol=1e-4)  # not merged as if rank 0 still counted
    assert torch.equal(final1, final2)
    assert workers == 2 and merges == [2, 2]
    # rank 0's share of epoch 2, never merged, is trained by the two left at the end (test_async's make-up test)
    assert [record.get("rows_made_up") for record in history] == [None, 32]


def test_when_rank_0_is_lost_after_the_others_last_merged_they_take_over_as_they_wait_for_the_end():
    """Ranks 1 and 2 merge their last epoch (1 at version 4, then 2 at 5) and wait for rank 0 to conclude the run;
    rank 0 dies instead, before its own last merge. They take over there: the final model is the global model of
    version 5, which rank 2 was given, and rank 0's last epoch is not in it."""
    results = run_distributed(_leader_losing_worker, 3, "delta", "kill-last", lost=(0,), served=True)
    assert results[0] is None
    (_, _, final1, workers, merges, after1, _), (_, _, final2, _, _, after2, _) = results[1], results[2]
    assert after1[1] == 4 and after2[1] == 5
    assert torch.equal(final1, after2[0]) and torch.equal(final2, after2[0])
    assert workers == 2 and merges == [2, 2]
