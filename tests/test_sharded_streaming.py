"""streaming across sharded replica groups (--shard hybrid): the same weights and evaluations as the unsharded
streaming run of as many replicas with S x the batch, each fragment sent as this rank's shards of its tensors
(the bytes counted, per rank), a checkpoint that resumes bit for bit, and one-line refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data
from dptrain.errors import UserError
from dptrain.strategies.streaming import Streaming, split_fragments
from dptrain.train.trainer import Trainer
from test_sharded import test_what_sharding_refuses_is_one_line_before_anything_runs as refused_in_one_line

N, BATCH, SEED, SIZE = 96, 4, 0, 2
RELATIVE = 1e-6  # the float tolerance of the equalities (sums in another order)
HYBRID = {"shard": "hybrid", "shard_size": SIZE}
# Averages every 2 steps, each landing 1 step later, one of 3 fragments each time: the replicas and g differ
# between averages, and every fragment is sent by shards.
SCHEDULE = {"every_steps": 2, "overlap_steps": 1, "fragments": 3}


def _model():
    # No BatchNorm: its statistics over a rank's half of a step's rows are not those over the whole step.
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))


def _train(rank, world, schedule, batch, epochs, sharded, out=None, resume=False):
    """Train with momentum SGD (its state is sharded too), evaluating g after each epoch; the full state on rank
    0, the test losses, this rank's bytes."""
    from dptrain.runtime.sharded import full_state

    x, y = toy_data(N)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    strategy = Streaming(**schedule)
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=batch, seed=SEED, verbose=False,
                      progress=False, out=out, resume=resume, checkpoint_every=1 if out else 0, **sharded)
    trainer.fit((x, y), toy_data(32), epochs=epochs)
    losses = [record["test_loss"] for record in trainer.recorder.history]
    return full_state(strategy.finish()), losses, strategy.comm_bytes


def _relative(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max()) for k in a)


def _shard_bytes(parameter: torch.Tensor, place: int) -> int:
    """The bytes of rank `place`'s shard of `parameter` in a group of SIZE ranks: FSDP2 chunks the rows as
    torch.chunk does (ceil(rows / S) each, the last ones fewer or none)."""
    rows = parameter.shape[0]
    chunk = -(-rows // SIZE)
    held = max(0, min(rows, (place + 1) * chunk) - place * chunk)
    return held * parameter[0].numel() * parameter.element_size()


def test_hybrid_streaming_equals_unsharded_streaming_and_sends_each_fragment_by_shards():
    epochs = 2
    unsharded = run_distributed(_train, 2, SCHEDULE, SIZE * BATCH, epochs, {})
    hybrid = run_distributed(_train, 4, SCHEDULE, BATCH, epochs, HYBRID)
    assert _relative(hybrid[0][0], unsharded[0][0]) < RELATIVE
    # g (what is evaluated) is the same too: it differs from the replicas after an overlapped average.
    assert len(hybrid[0][1]) == epochs
    assert all(abs(a - b) <= RELATIVE * abs(b) for a, b in zip(hybrid[0][1], unsharded[0][1]))
    assert all(rank[1] == hybrid[0][1] for rank in hybrid)

    # Bytes, rank by rank: rank 0's broadcast of the whole model; each step, FSDP's all-gather of a unit's
    # shard before its forward and before its backward and the reduce-scatter of its padded gradient; each
    # evaluation (g after each epoch, the final model after its final average), one all-gather of its shards;
    # across the groups, per send this rank's shards of that send's
    # fragment, and at the end its shards of the whole model (the last send's fragment left the replicas
    # apart). Fragment j % 3 is sent j-th, cut from the whole tensors as on the unsharded run.
    parameters = list(_model().parameters())
    whole = sum(p.numel() * p.element_size() for p in parameters)
    padded = sum(-(-p.shape[0] // SIZE) * SIZE * p[0].numel() * 4 for p in parameters)
    fragments = split_fragments(parameters, SCHEDULE["fragments"])
    steps = epochs * (N // 2 // (SIZE * BATCH))
    sends = [fragments[send % len(fragments)] for send in range(steps // SCHEDULE["every_steps"])]
    assert len(sends) == 6 and fragments == [[0], [1, 2], [3, 4, 5]]
    for rank, (_, _, sent) in enumerate(hybrid):
        place = rank % SIZE
        across = sum(_shard_bytes(parameters[i], place) for fragment in sends for i in fragment)
        across += sum(_shard_bytes(p, place) for p in parameters)
        assert sent == whole + steps * 2 * padded + (epochs + 1) * padded // SIZE + across, rank
    # ... which are the unsharded run's sends split over the shards: rank 0 and rank 1 sent them between them.
    full_sends = sum(parameters[i].numel() * 4 for fragment in sends for i in fragment) + whole
    assert [sent for _, _, sent in unsharded] == [whole + full_sends] * 2
    parts = [hybrid[place][2] - whole - steps * 2 * padded - (epochs + 1) * padded // SIZE for place in range(SIZE)]
    assert sum(parts) == full_sends and parts[0] != parts[1]


def test_hybrid_streaming_with_epoch_periods_equals_unsharded_streaming():
    # The average sent 2 steps before each epoch's end and applied at it (the epoch-end drain), 2 fragments.
    schedule = {"every": 1, "overlap_steps": 2, "fragments": 2}
    unsharded = run_distributed(_train, 2, schedule, SIZE * BATCH, 2, {})[0]
    hybrid = run_distributed(_train, 4, schedule, BATCH, 2, HYBRID)[0]
    assert _relative(hybrid[0], unsharded[0]) < RELATIVE
    assert all(abs(a - b) <= RELATIVE * abs(b) for a, b in zip(hybrid[1], unsharded[1]))


def test_a_hybrid_streaming_checkpoint_resumes_bit_for_bit(tmp_path):
    whole = run_distributed(_train, 4, SCHEDULE, BATCH, 2, HYBRID, str(tmp_path / "whole"))[0]
    run_distributed(_train, 4, SCHEDULE, BATCH, 1, HYBRID, str(tmp_path / "cut"))
    saved = torch.load(tmp_path / "cut" / "checkpoints" / "epoch-000001" / "rank-00001.pt", weights_only=True)
    assert saved["model"]["0.weight"].shape == (8, 6)  # rank 1's half of the 16 x 6 weight
    assert saved["strategy"]["global_model"]["0.weight"].shape == (8, 6)  # and of g's
    resumed = run_distributed(_train, 4, SCHEDULE, BATCH, 2, HYBRID, str(tmp_path / "cut"), True)[0]
    assert all(torch.equal(resumed[0][key], whole[0][key]) for key in whole[0])
    assert resumed[1] == whole[1]  # g evaluated after epoch 2 the same


def test_a_hybrid_streaming_checkpoint_resumed_on_more_ranks_goes_on_as_the_unsharded_run_does(tmp_path):
    # Written by 2 groups of 2 after epoch 1, resumed by 3 groups: rank j of each new group continues from rank
    # j's shards of a writing group (the third a copy of the first), g included; the unsharded run written by 2
    # workers and resumed by 3 does the same (streaming resumes on another world at an epoch end).
    # (N = 96 rows split evenly over 2 and 3 replicas, and each step's over a group's 2 ranks: see "Which rows a
    # rank reads" in docs/how-to/sharding.md for uneven steps.)
    for world, sharded, batch in ((4, HYBRID, BATCH), (2, {}, SIZE * BATCH)):
        run_distributed(_train, world, SCHEDULE, batch, 1, sharded, str(tmp_path / f"{world}"))
        for name in ("model.pt", "summary.json"):
            (tmp_path / f"{world}" / name).unlink()
    hybrid = run_distributed(_train, 6, SCHEDULE, BATCH, 2, HYBRID, str(tmp_path / "4"), True)[0]
    unsharded = run_distributed(_train, 3, SCHEDULE, SIZE * BATCH, 2, {}, str(tmp_path / "2"), True)[0]
    assert _relative(hybrid[0], unsharded[0]) < RELATIVE
    assert len(hybrid[1]) == 2 and all(abs(a - b) <= RELATIVE * abs(b) for a, b in zip(hybrid[1], unsharded[1]))


def _one_group(rank, world, name):
    from dptrain import registry

    x, y = toy_data(N)
    model = _model()
    strategy = registry.load("strategy", name)()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy,
                      batch_size=BATCH, verbose=False, progress=False, shard="full")
    try:
        trainer.fit((x, y), epochs=1)
    except UserError as error:
        return str(error)
    return None


@pytest.mark.parametrize("name", ["streaming", "sync", "fedavg", "async"])
def test_averaging_over_one_replica_group_is_refused_from_python_in_the_command_lines_words(name):
    lines = run_distributed(_one_group, 2, name)
    assert lines == [f"--shard full makes one replica group of all 2 ranks: {name} has nothing to average across "
                     "groups; it needs 2 replica groups or more of at least 2 ranks each (4 ranks or more), or "
                     "--shard none"] * 2


@pytest.mark.parametrize("args,line", [
    (["--shard", "full", "--strategy", "streaming"],
     "--shard full makes one replica group of all the ranks: streaming has nothing to average across groups; give "
     "--shard hybrid with a --shard-size that makes 2 replica groups or more, or --shard none"),
    (["--shard", "hybrid", "--shard-size", "2", "--strategy", "streaming", "--min-workers", "1"],
     "--shard hybrid with --min-workers (counted in replica groups) is refused with --strategy streaming "
     "(allreduce or sync only)"),
    (["--shard", "hybrid", "--strategy", "hierarchical"],
     "--shard hybrid is refused with --strategy hierarchical: --shard full/hybrid runs with --strategy allreduce, "
     "sync, streaming, fedavg or async"),
])
def test_what_sharded_streaming_refuses_is_one_line_before_anything_runs(tmp_path, args, line):
    refused_in_one_line(tmp_path, args, line)  # exit code 2, that one line on stderr, no traceback, nothing written
