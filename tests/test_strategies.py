"""Exact semantics of the strategies on real processes: averages, equivalences, byte counts."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data, toy_model
from dptrain.strategies import AllReduce, Async, FedAvg, Sync
from dptrain.strategies.collectives import average_module, broadcast_module
from dptrain.data import sharding
from dptrain.train.trainer import Trainer


class Odd(nn.Module):
    """Nested modules, a layer without bias, a bare parameter, BatchNorm buffers (float and int)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 3, bias=False), nn.BatchNorm1d(3))
        self.head = nn.ModuleDict({"out": nn.Linear(3, 2)})
        self.scale = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return self.head["out"](self.inner(x)) * self.scale


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _average_worker(rank, world):
    torch.manual_seed(100 + rank)  # deliberately different replicas
    model = Odd()
    model.train()
    model(torch.randn(8, 4))  # moves BatchNorm statistics, num_batches_tracked = 1
    if rank == 1:
        model(torch.randn(8, 4))  # num_batches_tracked = 2 on rank 1 only
    before = _state(model)
    sent = average_module(model)
    return before, _state(model), sent


def test_average_module_is_the_exact_mean_of_parameters_and_buffers():
    (before0, after0, sent0), (before1, after1, sent1) = run_distributed(_average_worker, 2)
    assert not torch.equal(before0["inner.0.weight"], before1["inner.0.weight"])
    for key, value in before0.items():
        if value.is_floating_point():
            expected = (before0[key] + before1[key]) / 2
            assert torch.allclose(after0[key], expected, atol=1e-7), key
        else:
            assert after0[key].item() == max(before0[key].item(), before1[key].item()) == 2, key
        assert torch.equal(after0[key], after1[key]), key
    # 3*4 + 3 + 3 (BN affine) + 2*3 + 2 + 2 params, 3 + 3 running stats, all float32; one int64 counter
    floats = (12 + 3 + 3 + 6 + 2 + 2) + (3 + 3)
    assert sent0 == sent1 == floats * 4 + 8


def _broadcast_worker(rank, world):
    torch.manual_seed(rank)
    model = Odd()
    sent = broadcast_module(model, src=0)
    return _state(model), sent


def test_broadcast_module_copies_rank0_everywhere():
    (state0, _), (state1, _) = run_distributed(_broadcast_worker, 2)
    torch.manual_seed(0)
    reference = _state(Odd())
    for key in reference:
        assert torch.equal(state0[key], reference[key]) and torch.equal(state1[key], reference[key])


# -- training equivalences -------------------------------------------------------------------

N, BATCH, SEED = 128, 16, 3


def _data():
    return toy_data(N)


def _model():
    return toy_model()


def _params(model):
    return sum(p.numel() for p in model.parameters())


def _train_worker(rank, world, strategy, epochs):
    x, y = _data()
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    trainer = Trainer(model, optimizer, "cross-entropy", strategy, batch_size=BATCH, seed=SEED, verbose=False)
    trainer.fit((x, y), epochs=epochs)
    final = strategy.finish()
    return _state(final), strategy.comm_bytes


def _worker_batches(rank, world, epoch):
    x, y = _data()
    steps = sharding.steps_per_epoch(N, world, BATCH)
    order = sharding.epoch_indices(N, rank, world, epoch, SEED, "global")
    return [(torch.from_numpy(x[b]), torch.from_numpy(y[b])) for b in sharding.batches(order, steps)]


def test_allreduce_equals_single_process_training_on_the_union_of_batches():
    epochs = 2
    (state0, bytes0), (state1, bytes1) = run_distributed(_train_worker, 2, AllReduce(), epochs)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    loss_fn = nn.CrossEntropyLoss()
    steps = 0
    for epoch in range(epochs):
        for (x0, y0), (x1, y1) in zip(_worker_batches(0, 2, epoch), _worker_batches(1, 2, epoch)):
            loss = loss_fn(model(torch.cat([x0, x1])), torch.cat([y0, y1]))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
    for key, value in _state(model).items():
        assert torch.allclose(state0[key], value, atol=1e-5), key
        assert torch.equal(state0[key], state1[key]), key
    parameter_bytes = _params(model) * 4
    assert steps == 2 * (N // 2 // BATCH)
    assert bytes0 == bytes1 == parameter_bytes * (1 + steps)  # initial broadcast + one gradient per step


def test_allreduce_fp16_compression_halves_the_gradient_bytes():
    (_, bytes0), _ = run_distributed(_train_worker, 2, AllReduce(compression="fp16"), 1)
    steps = N // 2 // BATCH
    parameter_bytes = _params(_model()) * 4
    assert bytes0 == parameter_bytes + steps * parameter_bytes // 2


def test_sync_equals_the_average_of_independently_trained_workers():
    (state0, bytes0), (state1, bytes1) = run_distributed(_train_worker, 2, Sync(every=1), 1)
    replicas = []
    for rank in range(2):
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        for x, y in _worker_batches(rank, 2, 0):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        replicas.append(_state(model))
    for key in replicas[0]:
        expected = (replicas[0][key] + replicas[1][key]) / 2
        assert not torch.allclose(replicas[0][key], replicas[1][key])
        assert torch.allclose(state0[key], expected, atol=1e-6), key
        assert torch.equal(state0[key], state1[key]), key
    assert bytes0 == bytes1 == 2 * _params(_model()) * 4  # initial broadcast + one average


def test_sync_every_two_epochs_and_local_sgd_count_their_averages():
    steps_per_epoch = N // 2 // BATCH
    (_, bytes_epochs), _ = run_distributed(_train_worker, 2, Sync(every=2), 4)
    (_, bytes_steps), _ = run_distributed(_train_worker, 2, Sync(every_steps=2), 1)
    (_, bytes_final), _ = run_distributed(_train_worker, 2, Sync(every=2), 3)
    model_bytes = _params(_model()) * 4
    assert bytes_epochs == model_bytes * (1 + 2)  # epochs 2 and 4
    assert bytes_steps == model_bytes * (1 + steps_per_epoch // 2)
    assert bytes_final == model_bytes * (1 + 2)  # epoch 2, then finish() averages the diverged replicas


def _optimizer_state_worker(rank, world, mode):
    torch.manual_seed(rank)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = Sync(optimizer_state=mode)
    from dptrain.runtime.distributed import init_process_group
    from dptrain.runtime.env import detect

    strategy.setup(model, optimizer, init_process_group(detect()))
    model(torch.randn(4, 3) * (rank + 1)).sum().backward()
    optimizer.step()
    before = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    strategy.synchronise()
    after = [optimizer.state[p]["momentum_buffer"].clone() if p in optimizer.state else None
             for p in model.parameters()]
    return before, after, strategy.comm_bytes


@pytest.mark.parametrize("mode", ["keep", "reset", "average"])
def test_sync_optimizer_state_modes(mode):
    (before0, after0, bytes0), (before1, after1, _) = run_distributed(_optimizer_state_worker, 2, mode)
    model_bytes = (3 * 2 + 2) * 4
    if mode == "keep":
        assert all(torch.equal(a, b) for a, b in zip(before0, after0))
        assert bytes0 == 2 * model_bytes
    elif mode == "reset":
        assert after0 == [None, None] and after1 == [None, None]
    else:
        for b0, b1, a0, a1 in zip(before0, before1, after0, after1):
            assert torch.allclose(a0, (b0 + b1) / 2) and torch.equal(a0, a1)
        assert bytes0 == 3 * model_bytes  # broadcast, weights, momentum


def _outer_worker(rank, world, outer_lr, outer_momentum):
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    strategy = Sync(outer="nesterov", outer_lr=outer_lr, outer_momentum=outer_momentum)
    from dptrain.runtime.distributed import init_process_group
    from dptrain.runtime.env import detect

    strategy.setup(model, optimizer, init_process_group(detect()))
    start = model.weight.detach().clone()
    history = []
    for round_ in range(2):
        with torch.no_grad():
            model.weight.add_(torch.full_like(model.weight, float(rank + 1 + round_)))  # local "training"
        strategy.synchronise()
        history.append(model.weight.detach().clone())
    return start, history


def test_outer_nesterov_step_follows_the_formula():
    # outer_lr 1, momentum 0: the outer step adopts the plain average.
    (start, history), _ = run_distributed(_outer_worker, 2, 1.0, 0.0)
    assert torch.allclose(history[0], start + 1.5)
    # lr 0.5, Nesterov momentum 0.9 on the pseudo-gradient g = global - average.
    (start, history), (_, history1) = run_distributed(_outer_worker, 2, 0.5, 0.9)
    g1 = -torch.full_like(start, 1.5)  # average moved by +1.5
    buf = g1
    step1 = g1 + 0.9 * buf
    global1 = start - 0.5 * step1
    assert torch.allclose(history[0], global1, atol=1e-6)
    g2 = -torch.full_like(start, 2.5)  # round 2 moves the replicas by 2 and 3 from global1
    buf = 0.9 * buf + g2
    global2 = global1 - 0.5 * (g2 + 0.9 * buf)
    assert torch.allclose(history[1], global2, atol=1e-6)
    assert torch.equal(history[1], history1[1])


def test_one_worker_communicates_nothing():
    x, y = _data()
    for strategy in (AllReduce(), Sync()):
        model = _model()
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), "cross-entropy", strategy,
                          batch_size=BATCH, verbose=False)
        trainer.fit((x, y), epochs=1)
        assert strategy.comm_bytes == 0


class _Flagged(nn.Module):
    """A layer with a bool buffer that only rank 1's replica sets while it trains."""

    def __init__(self, rank):
        super().__init__()
        self.linear = nn.Linear(8, 3)
        self.rank = rank
        self.register_buffer("flag", torch.tensor([rank == 1, False]))  # unequal before the start

    def forward(self, x):
        if self.training and self.rank == 1:
            self.flag[1] = True
        return self.linear(x)


def _bool_buffer_worker(rank, world, name):
    torch.manual_seed(0)
    model = _Flagged(rank)
    strategy = {"sync": Sync, "fedavg": FedAvg, "async": Async}[name]()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), "cross-entropy", strategy, batch_size=8,
                      verbose=False)
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    started = []
    strategy_setup = strategy.setup
    strategy.setup = lambda *a: (result := strategy_setup(*a), started.append(model.flag.clone()))[0]
    trainer.fit((x, y), epochs=1)
    return started[0], model.flag.clone()


@pytest.mark.parametrize("name", ["sync", "fedavg", "async"])
def test_bool_buffers_start_equal_and_end_as_the_logical_or_of_the_replicas(name):
    (start0, end0), (start1, end1) = run_distributed(_bool_buffer_worker, 2, name)
    assert start0.tolist() == start1.tolist() == [False, False]  # rank 0's, broadcast at the start
    assert torch.equal(end0, end1)
    if name != "async":  # averaged strategies: OR; async adopts rank 0's at the end, like integer buffers
        assert end0.tolist() == [False, True]
