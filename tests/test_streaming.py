"""streaming: overlapped averaging on real processes, checked against a hand computation.

Two gloo ranks on 127.0.0.1 train a tiny model with BatchNorm (float and integer buffers) on 128
samples, batches of 16: 4 steps per epoch and worker. (Its first layer has no bias: a bias before
BatchNorm gets no gradient and would never move, which would hide whether it was averaged.) A recording subclass keeps, for every
average, each rank's snapshot w_s, its weights just before the average is applied (w_now) and
just after, and the global model g before and after; the test then recomputes

    g_after = mean_ranks(w_s)        w_after = mean_ranks(w_s) + (w_now - w_s)

for the tensors of the fragment sent, and checks every other tensor did not move.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data
from dptrain.config import build_config
from dptrain.errors import UserError
from dptrain.strategies import Sync, build_strategy
from dptrain.strategies.collectives import module_state
from dptrain.strategies.streaming import Streaming, split_fragments
from dptrain.train.trainer import Trainer

N, BATCH, SEED = 128, 16, 3
STEPS_PER_EPOCH = N // 2 // BATCH  # 4


def _data():
    return toy_data(N)


def _model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _names_in_send_order(model):
    """State-dict names in module_state order (parameters, floating buffers, integer buffers)."""
    floating, integer = module_state(model)
    name_of = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
    return [name_of[id(t)] for t in floating + integer], floating + integer


MODEL_BYTES = sum(t.numel() * t.element_size() for t in _model().state_dict().values())  # 107 floats + 1 int64


class Recording(Streaming):
    """Streaming that keeps what each average was made of (the test's only view into the strategy)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []

    def _start(self, step, wait_at):
        super()._start(step, wait_at)
        self.events.append({"fragment": self._pending.fragment, "sent_at": step, "snapshot": _state(self.model),
                            "global_before": _state(self._global_model),
                            "bytes": sum(s.flat.numel() * s.flat.element_size() for s in self._pending.sends)})

    def _complete(self, step):
        event = self.events[-1]
        event["applied_at"], event["before"] = step, _state(self.model)
        super()._complete(step)
        event["after"], event["global_after"] = _state(self.model), _state(self._global_model)


def _train_worker(rank, world, strategy, epochs):
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=BATCH, seed=SEED, verbose=False)
    trainer.fit((x, y), epochs=epochs)
    final = strategy.finish()
    return _state(final), strategy.comm_bytes, getattr(strategy, "events", None)


def _check_events(results, fragments=1):
    """Every recorded average of both ranks against the hand computation; returns the events of rank 0."""
    (_, _, events0), (_, _, events1) = results
    names, tensors = _names_in_send_order(_model())
    groups = [[names[i] for i in group] for group in split_fragments(tensors, fragments)]
    assert len(events0) == len(events1) > 0
    for e0, e1 in zip(events0, events1):
        assert (e0["fragment"], e0["sent_at"], e0["applied_at"]) == (e1["fragment"], e1["sent_at"], e1["applied_at"])
        sent = set(groups[e0["fragment"]])
        for key in names:
            for mine in (e0, e1):
                if key not in sent:  # not in this fragment: untouched
                    assert torch.equal(mine["after"][key], mine["before"][key]), key
                    assert torch.equal(mine["global_after"][key], mine["global_before"][key]), key
                    continue
                snapshots = (e0["snapshot"][key], e1["snapshot"][key])
                if key.endswith("num_batches_tracked"):
                    average = torch.maximum(*snapshots)
                    assert torch.equal(mine["after"][key], average + (mine["before"][key] - mine["snapshot"][key]))
                else:
                    average = (snapshots[0] + snapshots[1]) / 2
                    expected = average + (mine["before"][key] - mine["snapshot"][key])
                    assert torch.allclose(mine["after"][key], expected, atol=1e-6), key
                assert torch.allclose(mine["global_after"][key], average, atol=1e-6), key
            assert torch.equal(e0["global_after"][key], e1["global_after"][key]), key  # g is the same everywhere
        assert not all(torch.equal(e0["snapshot"][k], e1["snapshot"][k]) for k in sent)  # real averaging
    return events0


def test_every_applied_average_is_the_mean_of_the_snapshots_plus_the_local_progress_since():
    # K = 3, D = 2 over 3 epochs of 4 steps: sends after steps 3, 6, 9, 12. The one of step 3 would
    # land at 5 but is drained at the epoch end (4); 6 lands at 8 (its wait step and an epoch end);
    # 9 lands at 11; 12 is drained at once by the epoch end (no progress since: replicas equal g).
    # D = 2 is the default, half the period rounded up.
    assert Streaming(every_steps=3).overlap == 2
    results = run_distributed(_train_worker, 2, Recording(every_steps=3), 3)
    events = _check_events(results)
    assert [(e["sent_at"], e["applied_at"]) for e in events] == [(3, 4), (6, 8), (9, 11), (12, 12)]
    moved = [not torch.equal(e["before"]["0.weight"], e["snapshot"]["0.weight"]) for e in events]
    assert moved == [True, True, True, False]  # the correction mattered except for the last
    (state0, bytes0, _), (state1, bytes1, _) = results
    for key in state0:
        assert torch.equal(state0[key], state1[key]), key
        assert torch.equal(state0[key], events[-1]["global_after"][key]), key  # the end is g, no final average
    assert bytes0 == bytes1 == MODEL_BYTES * (1 + 4)  # broadcast + 4 whole-model sends


def test_epoch_periods_send_overlap_steps_before_the_epoch_end_and_land_on_it():
    # K = 4 steps (one epoch), D = 2 by default: sent after steps 2 and 6, applied at the epoch ends 4 and 8.
    results = run_distributed(_train_worker, 2, Recording(every=1), 2)
    events = _check_events(results)
    assert [(e["sent_at"], e["applied_at"]) for e in events] == [(2, 4), (6, 8)]
    (state0, bytes0, _), (state1, bytes1, _) = results
    for key in state0:
        assert torch.equal(state0[key], state1[key]), key
    assert bytes0 == bytes1 == MODEL_BYTES * (1 + 2 + 1)  # broadcast, 2 averages, the final blocking one


@pytest.mark.parametrize("streaming,sync", [
    (dict(every_steps=3, overlap_steps=0), dict(every_steps=3)),
    (dict(every=1, overlap_steps=0), dict(every=1)),
], ids=["local-sgd", "epochs"])
def test_overlap_zero_is_sync_with_the_same_period(streaming, sync):
    (stream0, stream_bytes0, _), (stream1, _, _) = run_distributed(_train_worker, 2, Streaming(**streaming), 3)
    (sync0, sync_bytes0, _), (sync1, _, _) = run_distributed(_train_worker, 2, Sync(**sync), 3)
    for key in sync0:
        assert torch.allclose(stream0[key], sync0[key], atol=1e-6), key
        assert torch.equal(stream0[key], stream1[key]) and torch.equal(sync0[key], sync1[key]), key
    assert stream_bytes0 == sync_bytes0


def test_fragments_rotate_and_each_tensor_is_averaged_once_per_f_periods():
    fragments = 3
    # K = 2, D = 1, 3 epochs: 6 sends (after steps 2, 4, ..., 12), each landing a step later, except
    # those sent at an epoch end (4, 8, 12), which the epoch end drains at once.
    results = run_distributed(_train_worker, 2, Recording(every_steps=2, overlap_steps=1, fragments=fragments), 3)
    events = _check_events(results, fragments)
    assert [e["fragment"] for e in events] == [0, 1, 2, 0, 1, 2]
    assert [(e["sent_at"], e["applied_at"]) for e in events] == [(2, 3), (4, 4), (6, 7), (8, 8), (10, 11), (12, 12)]
    names, tensors = _names_in_send_order(_model())
    groups = split_fragments(tensors, fragments)
    assert sorted(i for group in groups for i in group) == list(range(len(names)))  # each tensor in one fragment
    group_bytes = [sum(tensors[i].numel() * tensors[i].element_size() for i in group) for group in groups]
    assert [e["bytes"] for e in events] == group_bytes * 2
    for window in (events[0:3], events[3:6]):  # every F consecutive periods average every tensor once
        averaged = [key for e in window for key in names
                    if not torch.equal(e["global_after"][key], e["global_before"][key])]
        assert sorted(averaged) == sorted(names)
    (state0, bytes0, _), (state1, bytes1, _) = results
    for key in state0:
        assert torch.equal(state0[key], state1[key]), key  # the final blocking average
    assert bytes0 == bytes1 == MODEL_BYTES * (1 + 2 + 1)  # broadcast, every fragment twice, final average


def test_fragments_are_contiguous_and_roughly_equal_in_bytes():
    tensors = [torch.zeros(n) for n in (100, 10, 100, 10, 5, 5)]
    assert split_fragments(tensors, 1) == [[0, 1, 2, 3, 4, 5]]
    assert split_fragments(tensors, 2) == [[0, 1, 2], [3, 4, 5]]  # cut at the first tensor reaching half
    assert split_fragments(tensors, 6) == [[0], [1], [2], [3], [4], [5]]
    with pytest.raises(UserError, match=r"--fragments 7 is more than the model's 6 tensors .*use at most 6"):
        split_fragments(tensors, 7)


def test_one_worker_communicates_nothing_and_trains_like_sync():
    x, y = _data()
    states = []
    for strategy in (Streaming(every_steps=2, overlap_steps=1), Sync(every_steps=2)):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        Trainer(model, optimizer, "cross-entropy", strategy, batch_size=BATCH, seed=SEED, verbose=False).fit(
            (x, y), epochs=2)
        states.append((_state(strategy.finish()), strategy.comm_bytes))
    (stream, stream_bytes), (sync, sync_bytes) = states
    assert stream_bytes == sync_bytes == 0
    assert all(torch.equal(stream[key], sync[key]) for key in sync)


def test_config_builds_the_strategy_from_its_flags():
    config = build_config({"strategy": "streaming", "sync_every_steps": 8, "overlap_steps": 3, "fragments": 2})
    strategy = build_strategy(config)
    assert isinstance(strategy, Streaming)
    assert (strategy.every_steps, strategy.overlap_steps, strategy.fragments) == (8, 3, 2)
    assert strategy.overlap == 3 and strategy.period == 8


@pytest.mark.parametrize("values,message", [
    ({"overlap_steps": -1}, "--overlap-steps must be at least 0 (got -1)"),
    ({"fragments": 0}, "--fragments must be at least 1 (got 0)"),
    ({"overlap_steps": "two"}, "--overlap-steps must be a whole number (got 'two')"),
    ({"overlap_steps": 5, "sync_every_steps": 4},
     "overlap_steps 5 is more than sync_every_steps 4; an average must land before the next one is sent, "
     "so use at most 4"),
])
def test_bad_values_are_one_sentence(values, message):
    with pytest.raises(UserError) as error:
        build_config({"strategy": "streaming", **values}, "the command line", flags=values)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def _checkpointed_worker(rank, world, out, epochs, resume):
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    strategy = Streaming(every_steps=3)  # the send after step 3 is still in flight at the end of epoch 1
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=BATCH, seed=SEED, verbose=False,
                      out=out, checkpoint_every=1 if out else 0, resume=resume)
    trainer.fit((x, y), epochs=epochs)
    return _state(strategy.finish()), strategy.comm_bytes, strategy.averages


def test_a_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(tmp_path):
    # end_epoch drains the average in flight before the checkpoint, and the checkpoint holds g.
    (clean, clean_bytes, clean_averages), _ = run_distributed(_checkpointed_worker, 2, None, 3, False)
    run_distributed(_checkpointed_worker, 2, str(tmp_path / "run"), 1, False)
    (resumed, resumed_bytes, resumed_averages), _ = run_distributed(_checkpointed_worker, 2, str(tmp_path / "run"), 3,
                                                                    True)
    assert all(torch.equal(clean[key], resumed[key]) for key in clean)
    assert (resumed_bytes, resumed_averages) == (clean_bytes, clean_averages) == (MODEL_BYTES * 5, 4)


class Restoring(Streaming):
    """Streaming that keeps its replica and g as a checkpoint left them (the test's view into the restore)."""

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.restored = (_state(self.model), _state(self._global_model) if self._global_model is not None else None)


def _resumed_worker(rank, world, out, epochs, resume):
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    strategy = Restoring(every_steps=3)
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=BATCH, seed=SEED, verbose=False,
                      out=out, checkpoint_every=1, resume=resume)
    trainer.fit((x, y), epochs=epochs)
    return getattr(strategy, "restored", None), _state(strategy.finish())


@pytest.mark.parametrize("before, after", [(1, 2), (2, 3)])
def test_a_resume_on_another_number_of_workers_starts_every_rank_from_the_writers_g(tmp_path, before, after):
    # Each rank takes the replica at its place (beyond the writers: a copy of one), and g, the same in every file;
    # written by one worker alone (no g), g is the model every rank copies.
    run_distributed(_resumed_worker, before, str(tmp_path / "run"), 1, False)
    files = [torch.load(tmp_path / "run" / "checkpoints" / "epoch-000001" / f"rank-{rank:05d}.pt", weights_only=True)
             for rank in range(before)]
    resumed = run_distributed(_resumed_worker, after, str(tmp_path / "run"), 2, True)
    for rank, ((replica, global_), _) in enumerate(resumed):
        written = files[rank % before]
        assert all(torch.equal(replica[key], written["model"][key]) for key in replica), rank
        expected = written["strategy"]["global_model"] if before > 1 else written["model"]
        assert expected and all(torch.equal(global_[key], expected[key]) for key in global_), rank
    finals = [final for _, final in resumed]
    assert all(torch.equal(finals[0][key], other[key]) for other in finals[1:] for key in finals[0])


def test_bench_checks_each_strategy_with_its_own_settings():
    # `--option sync_every_steps=4` applies to sync and streaming only: the bench validates those runs with it
    # and names a strategy that cannot take it before any run starts.
    from dptrain.bench.matrix import BenchSpec, check

    train = {"model": "mlp", "dataset": "digits", "epochs": 1, "sync_every_steps": 4}
    check(BenchSpec(strategies=["sync", "streaming"], workers=[2], train=train, baselines=False))
    with pytest.raises(UserError, match="key 'sync_every_steps' in the bench settings applies to strategies sync, streaming and hierarchical, not allreduce"):
        check(BenchSpec(strategies=["streaming", "allreduce"], workers=[2], train=train, baselines=False))


def test_a_wait_for_an_average_that_never_comes_names_the_frozen_rank(tmp_path):
    # Rank 1 freezes (SIGSTOP) at its 30th step; rank 0 sends after step 32 and waits at step 34 (K = 4,
    # D = 2): the wait times out after --timeout and becomes one line naming rank 1, not a hang.
    from test_train_cli import misbehave

    result = misbehave(tmp_path, "stop", "--strategy", "streaming", "--sync-every-steps", "4", "--timeout", "8",
                       "--out", "frozen")
    assert result.returncode != 0
    assert "rank 0: after_step failed" in result.stderr, result.stderr[-2000:]
    assert "rank 1 stopped responding" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "frozen" / "summary.json").exists()


@pytest.mark.parametrize("args,message", [
    (["--fragments", "50"], "--fragments 50 is more than the model's 6 tensors (parameters and buffers); use at most 6"),
    (["--sync-every-steps", "4", "--overlap-steps", "5"], "overlap_steps 5 is more than sync_every_steps 4"),
])
def test_bad_streaming_flags_exit_2_with_one_line_before_anything_is_written(tmp_path, args, message):
    from test_train_cli import DIGITS, dptrain

    result = dptrain("train", *DIGITS, "--strategy", "streaming", *args, "--out", "bad", cwd=tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dptrain: error:") and message in lines[0], result.stderr
    assert not (tmp_path / "bad").exists()
