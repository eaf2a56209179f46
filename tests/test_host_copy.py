"""The state live membership and the LR guard keep lives in host memory, in buffers allocated once (issue 38,
item 3): a run's kept copies take no memory on the model's device, and keeping another reuses a dropped one's."""

from __future__ import annotations

import torch

from dptrain.train import state as state_module
from dptrain.train.host_copy import host_copy, tensors
from dptrain.strategies.allreduce import AllReduce
from dptrain.train.trainer import Trainer



def _tree():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                              "strategy": {"residual": torch.arange(6.0), "plain": [1, (2, 3)], "none": None}}


def test_a_host_copy_is_equal_shares_no_storage_and_keeps_the_module_versions():
    model, optimizer, tree = _tree()
    copied = host_copy(tree)
    pairs = list(zip(tensors(tree), tensors(copied)))
    assert len(pairs) == len(list(tensors(tree))) > 8
    for source, kept in pairs:
        assert torch.equal(source, kept) and kept.device.type == "cpu"
        assert kept.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    assert copied["model"]._metadata == tree["model"]._metadata  # what load_state_dict reads (BatchNorm's version)
    assert copied["strategy"]["plain"] == [1, (2, 3)] and copied["strategy"]["none"] is None
    before = copied["model"]["0.weight"].clone()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the model trains on: the copy does not move
    assert torch.equal(copied["model"]["0.weight"], before)


def test_copying_into_a_dropped_copy_reuses_its_buffers_and_allocates_where_a_shape_changed():
    model, optimizer, tree = _tree()
    first = host_copy(tree)
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    tree["model"] = model.state_dict()
    tree["strategy"]["residual"] = torch.arange(7.0)  # another shape: a new buffer
    second = host_copy(tree, into=first)
    assert second["model"]["0.weight"] is first["model"]["0.weight"]
    assert torch.equal(second["model"]["0.weight"], model[0].weight)
    reused = [a is b for a, b in zip(tensors(second["optimizer"]), tensors(first["optimizer"]))]
    assert reused and all(reused)
    assert second["strategy"]["residual"] is not first["strategy"]["residual"]
    assert torch.equal(second["strategy"]["residual"], torch.arange(7.0))


def test_a_run_with_commits_keeps_two_states_in_host_buffers_allocated_once(monkeypatch, tmp_path):
    """allreduce with --min-workers and a commit every 2 steps: every epoch start and commit keeps this rank's
    state; after the first two, every one is copied into the buffers of the one it drops."""
    taken: list[dict] = []
    snapshot = state_module.TrainState.snapshot

    def recording(self, history, position=None, into=None):
        taken.append(snapshot(self, history, position, into))
        return taken[-1]

    monkeypatch.setattr(state_module.TrainState, "snapshot", recording)
    torch.manual_seed(0)
    x, y = torch.randn(96, 8), torch.randint(0, 3, (96,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), strategy=AllReduce(), min_workers=1,
                      commit_every_steps=2, batch_size=16, verbose=False, progress=False)
    trainer.fit((x, y), epochs=3)
    assert len(taken) == 3 * (1 + 2)  # per epoch of 6 steps: its start, after steps 2 and 4
    model_tensors = {id(t) for t in model.state_dict().values()}
    buffers = [{id(t) for t in tensors({k: v for k, v in kept.items() if k in ("model", "optimizer")})}
               for kept in taken]
    assert all(not ids & model_tensors for ids in buffers)
    # The first state has no optimizer moments yet; from the third on, each is copied into a dropped one's
    # buffers: two full sets in all, none allocated after the third state.
    assert set().union(*buffers[3:]) <= set().union(*buffers[:3])
    assert len(set().union(*buffers)) == 2 * len(buffers[-1])
    for kept in taken:
        assert all(t.device.type == "cpu" for t in tensors(kept))


def test_the_lr_guard_keeps_the_good_average_in_one_host_buffer_and_restores_it():
    from dptrain.train.health import LRGuard

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    guard = LRGuard(4.0, restore=True, log=lambda line: None)
    guard.start(model, 1.0)
    kept = guard.good_state()
    with torch.no_grad():
        model.weight.add_(1.0)
    guard.keep(model)  # a newer good average: into the same buffers
    assert guard.good_state()["weight"] is kept["weight"] and torch.equal(kept["weight"], model.weight)
    assert kept["weight"].untyped_storage().data_ptr() != model.weight.untyped_storage().data_ptr()
    good = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.mul_(-7.0)  # diverged
    guard.recover(2, model, optimizer, None)
    assert torch.equal(model.weight, good) and guard.scale == 2.0
