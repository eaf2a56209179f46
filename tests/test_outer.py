"""Outer (server) optimizers, compressed averaging, FedProx, optimizer state and post-local SGD for sync and
fedavg: each formula against a hand computation, on real ranks joined over 127.0.0.1."""

from __future__ import annotations

import copy
import math
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from distributed import run_distributed
from dptrain.cli import main
from dptrain.runtime.distributed import init_process_group
from dptrain.runtime.env import detect
from dptrain.strategies import AllReduce, FedAvg, Sync
from dptrain.strategies.collectives import module_state
from dptrain.strategies.compression import chunk_bounds, decode, encode, payload_bytes
from dptrain.strategies.outer import OuterOptimizer
from dptrain.train.trainer import Trainer
from test_strategies import BATCH, N, _data, _model, _params, _state, _worker_batches


def _join(strategy, model, optimizer):
    return strategy.setup(model, optimizer, init_process_group(detect()))


# -- FedAdam by hand (no processes) ----------------------------------------------------------------

def test_fedadam_server_step_by_hand():
    outer = OuterOptimizer("adam", lr=0.1, betas=(0.5, 0.75), eps=0.01)
    x0 = torch.tensor([1.0, -2.0])
    param = x0.clone()
    outer.attach([param])
    param += torch.tensor([0.4, 0.0])  # the plain average moved by delta1 = (0.4, 0)
    outer.step([param])
    # m = 0.5 * 0.4 = 0.2; v = 0.25 * 0.16 = 0.04; x = 1 + 0.1 * 0.2 / (0.2 + 0.01)
    m1, v1 = torch.tensor([0.2, 0.0]), torch.tensor([0.04, 0.0])
    x1 = torch.tensor([1 + 0.1 * 0.2 / 0.21, -2.0])
    assert torch.allclose(param, x1) and torch.allclose(outer.anchor[0], x1)
    param += torch.tensor([-0.2, 0.6])  # delta2
    outer.step([param])
    m2 = 0.5 * m1 + 0.5 * torch.tensor([-0.2, 0.6])  # (0, 0.3)
    v2 = 0.75 * v1 + 0.25 * torch.tensor([0.04, 0.36])  # (0.04, 0.09)
    x2 = x1 + 0.1 * m2 / (v2.sqrt() + 0.01)
    assert torch.allclose(m2, torch.tensor([0.0, 0.3])) and torch.allclose(v2, torch.tensor([0.04, 0.09]))
    assert torch.allclose(param, x2, atol=1e-7)
    state = outer.state_dict()
    assert torch.allclose(state["m"][0], m2) and torch.allclose(state["v"][0], v2)


def test_outer_none_with_sgd_lr_1_momentum_0_is_the_plain_average():
    for kind, lr, momentum in (("none", 0.7, 0.9), ("sgd", 1.0, 0.0)):
        outer = OuterOptimizer(kind, lr=lr, momentum=momentum)
        param = torch.tensor([3.0])
        outer.attach([param])
        param += 0.5
        outer.step([param])
        assert param.item() == 3.5


# -- sync and fedavg on real ranks: direct hook calls with hand-made local "training" ---------------------

def _rounds_worker(rank, world, strategy, changes, weights):
    """Setup, then per round: add changes[round][rank] to the weight, aggregate; the global after each round."""
    torch.manual_seed(0)
    model = nn.Linear(2, 1, bias=False)
    _join(strategy, model, torch.optim.SGD(model.parameters(), lr=0.0))
    if weights is not None:
        strategy.parts = [np.arange(w) for w in weights]  # sample counts = weights
        strategy.seed = 0
    start = model.weight.detach().clone()
    history, sent = [], []
    for round_, change in enumerate(changes):
        with torch.no_grad():
            model.weight.add_(torch.tensor(change[rank]))
        before = strategy.comm_bytes
        strategy.aggregate(round_) if weights is not None else strategy.synchronise()
        history.append(model.weight.detach().clone())
        sent.append(strategy.comm_bytes - before)
    return start, history, sent


CHANGES = [[[1.0, -1.0], [2.0, 0.0]], [[2.0, 1.0], [3.0, -2.0]]]  # [round][rank] local changes


def _weighted_means(weights):
    w0, w1 = weights
    return [(w0 * torch.tensor(c[0]) + w1 * torch.tensor(c[1])) / (w0 + w1) for c in CHANGES]


def test_fedavgm_momentum_over_two_rounds():
    make = FedAvg(outer="sgd", outer_lr=1.0, outer_momentum=0.9)
    (start, history, sent), (_, history1, _) = run_distributed(_rounds_worker, 2, make, CHANGES, [1, 3])
    delta1, delta2 = _weighted_means([1, 3])  # (1.75, -0.25), then (2.75, -1.25)
    buf = -delta1  # pseudo-gradient of round 1
    global1 = start - 1.0 * buf
    buf = 0.9 * buf - delta2
    global2 = global1 - 1.0 * buf
    assert torch.allclose(history[0], global1, atol=1e-6) and torch.allclose(history[1], global2, atol=1e-6)
    assert torch.allclose(global2 - start, torch.tensor([[1.75 + 2.75 + 0.9 * 1.75, -0.25 - 1.25 - 0.9 * 0.25]]))
    assert torch.equal(history[1], history1[1])
    assert sent == [8 + 2 * 4] * 2  # the total weight (float64) and two float32 weights


def test_fedadam_on_the_weighted_mean_change_over_two_rounds():
    make = FedAvg(outer="adam", outer_lr=0.05, outer_betas=(0.9, 0.99), outer_eps=1e-3)
    (start, history, _), (_, history1, _) = run_distributed(_rounds_worker, 2, make, CHANGES, [1, 3])
    x, m, v = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    for delta, reached in zip(_weighted_means([1, 3]), history):
        # each round's change is applied to the previous global (the replicas started from it)
        m = 0.9 * m + 0.1 * delta
        v = 0.99 * v + 0.01 * delta ** 2
        x = x + 0.05 * m / (v.sqrt() + 1e-3)
        assert torch.allclose(reached, x, atol=1e-6)
    assert torch.equal(history[1], history1[1])


def test_sync_adam_on_the_plain_mean_change():
    make = Sync(outer="adam", outer_lr=0.1)
    (start, history, _), _ = run_distributed(_rounds_worker, 2, make, CHANGES, None)
    delta1 = (torch.tensor(CHANGES[0][0]) + torch.tensor(CHANGES[0][1])) / 2
    m, v = 0.1 * delta1, 0.01 * delta1 ** 2
    assert torch.allclose(history[0], start + 0.1 * m / (v.sqrt() + 1e-3), atol=1e-6)


# -- FedProx -------------------------------------------------------------------------------------------

def _proximal_worker(rank, world, mu, lr):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    strategy = FedAvg(proximal_mu=mu)
    _join(strategy, model, optimizer)
    global_ = [p.detach().clone() for p in model.parameters()]
    x = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    steps = []
    for _ in range(2):  # the first step starts at the global model (no pull yet), the second away from it
        before = [p.detach().clone() for p in model.parameters()]
        loss = (model(x) ** 2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
        strategy.after_backward(model)
        optimizer.step()
        optimizer.zero_grad()
        steps.append((before, [g.detach() for g in grads], [p.detach().clone() for p in model.parameters()]))
    return global_, steps


def test_fedprox_step_adds_mu_times_the_distance_to_the_global_model():
    mu, lr = 0.5, 0.1
    for global_, steps in run_distributed(_proximal_worker, 2, mu, lr):
        for before, grads, after in steps:
            for w, g, wg, new in zip(before, grads, global_, after):
                assert torch.allclose(new, w - lr * (g + mu * (w - wg)), atol=1e-7)
        moved = steps[1][0]
        assert not torch.allclose(moved[0], global_[0])  # the second step did feel the pull


# -- client optimizer state in fedavg --------------------------------------------------------------------

def _optimizer_rounds_worker(rank, world, mode):
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    strategy = FedAvg(optimizer_state=mode)
    _join(strategy, model, optimizer)
    strategy.parts, strategy.seed = [np.arange(1), np.arange(3)], 0
    x = torch.tensor([1.0, 2.0, -1.0]) * (rank + 1)  # loss w.x: the gradient is x, whatever w
    start = model.weight.detach().clone()
    weights, buffers = [], []
    for round_ in range(2):
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        strategy.aggregate(round_)
        weights.append(model.weight.detach().clone())
        state = optimizer.state.get(model.weight, {})
        buffers.append(state["momentum_buffer"].clone() if "momentum_buffer" in state else None)
    return start, weights, buffers, strategy.comm_bytes


@pytest.mark.parametrize("mode", ["keep", "reset", "average"])
def test_fedavg_client_optimizer_state_keep_reset_average(mode):
    (start, weights, buffers0, bytes0), (_, weights1, buffers1, _) = run_distributed(_optimizer_rounds_worker, 2, mode)
    x = [torch.tensor([1.0, 2.0, -1.0]), torch.tensor([2.0, 4.0, -2.0])]
    xbar = (1 * x[0] + 3 * x[1]) / 4  # sample-weighted
    global1 = start - 0.1 * xbar  # round 1: one plain step from zero momentum on every client
    assert torch.allclose(weights[0], global1, atol=1e-6)
    if mode == "reset":  # round 2 starts afresh: again a plain step
        expected2 = global1 - 0.1 * xbar
        assert buffers0 == [None, None] and buffers1 == [None, None]
    elif mode == "keep":  # momentum carries over: buf = 0.9 x + x on each client
        expected2 = global1 - 0.1 * 1.9 * xbar
        assert torch.allclose(buffers0[1], 1.9 * x[0]) and torch.allclose(buffers1[1], 1.9 * x[1])
    else:  # the buffers are averaged by sample count: xbar after round 1, 0.9 xbar + xbar after round 2
        expected2 = global1 - 0.1 * 1.9 * xbar
        assert torch.allclose(buffers0[0], xbar) and torch.equal(buffers0[0], buffers1[0])
        assert torch.allclose(buffers0[1], 1.9 * xbar) and torch.equal(buffers0[1], buffers1[1])
    assert torch.allclose(weights[1], expected2, atol=1e-6) and torch.equal(weights[1], weights1[1])
    model_bytes = 8 + 3 * 4  # total weight + three float32 weights
    extra = 2 * (8 + 3 * 4) if mode == "average" else 0
    assert bytes0 == 3 * 4 + 2 * model_bytes + extra  # broadcast, two averages (and two buffer averages)


# -- compressed averaging with error feedback ---------------------------------------------------------

class BNNet(nn.Module):
    """375 floats: 315 + 30 parameters, 30 running statistics; one int64 counter."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(20, 15)
        self.norm = nn.BatchNorm1d(15)

    def forward(self, x):
        return self.norm(self.linear(x))


FLOATS = 20 * 15 + 15 + 15 + 15 + 15 + 15


def _compressed_worker(rank, world, kind, fedavg):
    torch.manual_seed(0)
    model = BNNet()
    strategy = FedAvg(compression=kind) if fedavg else Sync(compression=kind)
    _join(strategy, model, torch.optim.SGD(model.parameters(), lr=0.0))
    if fedavg:
        strategy.parts, strategy.seed = [np.arange(1 + 2 * r) for r in range(world)], 0
    generator = torch.Generator().manual_seed(10 + rank)
    anchor = torch.cat([t.detach().reshape(-1).clone() for t in module_state(model)[0]])
    changes, globals_, sent = [], [], []
    for round_ in range(2):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.01 * (rank + 1))
            model.train()
            model(torch.randn(8, 20, generator=generator))  # BatchNorm statistics move too
        local = torch.cat([t.detach().reshape(-1).clone() for t in module_state(model)[0]])
        changes.append(local - (anchor if round_ == 0 else globals_[-1]))
        before = strategy.comm_bytes
        strategy.aggregate(round_) if fedavg else strategy.synchronise()
        sent.append(strategy.comm_bytes - before)
        globals_.append(torch.cat([t.detach().reshape(-1).clone() for t in module_state(model)[0]]))
    return anchor, changes, globals_, sent, model.norm.num_batches_tracked.item()


def _two_step_mean(kind, corrected, weights, servers):
    """The compressed mean by its four steps (dptrain.strategies.compression): each rank's chunk of every
    payload, its weighted mean, + that rank's server residual (`servers`, updated), encoded, decoded."""
    result = []
    for rank, (start, end) in enumerate(chunk_bounds(kind, corrected[0].numel(), len(corrected))):
        mean = torch.zeros(end - start)
        for weight, values in zip(weights, corrected):
            mean.add_(decode(kind, encode(kind, values[start:end]), end - start), alpha=weight)
        value = mean.div_(sum(weights)) + servers[rank]
        result.append(decode(kind, encode(kind, value), end - start))
        servers[rank] = value - result[-1]
    return torch.cat(result)


def _handed_over(kind, n, world, rank):
    """Bytes a rank hands to the two-step mean: the chunks for the others, its padded mean chunk."""
    sizes = [payload_bytes(kind, end - start) for start, end in chunk_bounds(kind, n, world)]
    return payload_bytes(kind, n) - sizes[rank] + max(sizes)


@pytest.mark.parametrize("fedavg", [False, True], ids=["sync", "fedavg"])
def test_int8_average_is_anchor_plus_the_two_step_mean_with_error_feedback(fedavg):
    world = 3
    results = run_distributed(_compressed_worker, world, "int8", fedavg, timeout=180)
    weights = [1 + 2 * r for r in range(world)] if fedavg else [1] * world
    anchor = results[0][0]
    residuals = [torch.zeros(FLOATS) for _ in range(world)]
    servers = [0.0] * world
    expected = anchor
    for round_ in range(2):
        corrected = []
        for rank in range(world):
            corrected.append(results[rank][1][round_] + residuals[rank])
            residuals[rank] = corrected[-1] - decode("int8", encode("int8", corrected[-1]), FLOATS)
        expected = expected + _two_step_mean("int8", corrected, weights, servers)
        for rank in range(world):
            assert torch.allclose(results[rank][2][round_], expected, atol=1e-6), (round_, rank)
            assert torch.equal(results[rank][2][round_], results[0][2][round_])
    for rank in range(world):
        per_average = _handed_over("int8", FLOATS, world, rank) + (8 if fedavg else 0) + 8  # (the weight), the max
        assert results[rank][3] == [per_average] * 2
    assert all(r[4] == 2 for r in results)  # integer buffers take the max


def test_fp16_sync_average_bytes_and_mean():
    results = run_distributed(_compressed_worker, 2, "fp16", False)
    anchor = results[0][0]
    mean = _two_step_mean("fp16", [r[1][0] for r in results], [1, 1], [0.0, 0.0])
    assert torch.allclose(results[0][2][0], anchor + mean, atol=1e-6)
    for rank in range(2):
        assert results[rank][3] == [_handed_over("fp16", FLOATS, 2, rank) + 8] * 2  # 750 + 0 or 2 bytes of padding


def _sitting_out_worker(rank, world):
    """A client with weight 0 keeps its residual; the mean is the participants' alone."""
    torch.manual_seed(0)
    model = nn.Linear(300, 1, bias=False)
    strategy = FedAvg(compression="int8", clients_per_round=0.5)
    _join(strategy, model, torch.optim.SGD(model.parameters(), lr=0.0))
    strategy.parts, strategy.seed = [np.arange(2), np.arange(2)], 0
    participants = strategy.clients_in_round(0)
    strategy.averager.feedback.residual = torch.full((300,), 0.001 * (rank + 1))
    start = model.weight.detach().reshape(-1).clone()
    if rank in participants:
        with torch.no_grad():
            model.weight.add_(0.1)
    strategy.aggregate(0)
    return participants, start, model.weight.detach().reshape(-1).clone(), strategy.averager.feedback.residual


def test_a_client_sitting_a_round_out_sends_zeros_and_keeps_its_residual():
    results = run_distributed(_sitting_out_worker, 2)
    (participant,) = results[0][0]
    absent = 1 - participant
    corrected = torch.full((300,), 0.1) + 0.001 * (participant + 1)
    expected = results[0][1] + decode("int8", encode("int8", corrected), 300)
    for _, _, reached, _ in results:
        assert torch.allclose(reached, expected, atol=1e-7)
    assert torch.equal(results[absent][3], torch.full((300,), 0.001 * (absent + 1)))


# -- post-local SGD ----------------------------------------------------------------------------------

def _bn_model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


def _fit_worker(rank, world, strategy, epochs, make_model):
    x, y = _data()
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    Trainer(model, optimizer, "cross-entropy", strategy, batch_size=BATCH, seed=3, verbose=False).fit((x, y), epochs=epochs)
    return _state(strategy.finish()), strategy.comm_bytes


def test_post_local_sgd_equals_allreduce_for_its_allreduce_epochs():
    (reference, reference_bytes), _ = run_distributed(_fit_worker, 2, AllReduce(), 1, _bn_model)
    (state0, bytes0), (state1, _) = run_distributed(_fit_worker, 2, Sync(allreduce_epochs=1), 1, _bn_model)
    for key, value in reference.items():
        assert torch.allclose(state0[key].float(), value.float(), atol=1e-6), key
        assert torch.equal(state0[key], state1[key]), key  # rank 0's buffers are everyone's at the switch
    params = _params(_bn_model())
    buffer_bytes = 2 * 8 * 4 + 8  # running mean and var, num_batches_tracked
    steps = N // 2 // BATCH
    assert reference_bytes == params * 4 + buffer_bytes + steps * (params * 4 + buffer_bytes)
    assert bytes0 == reference_bytes + buffer_bytes  # and the buffers broadcast at the switch


def test_post_local_sgd_then_local_epochs_and_an_average():
    (state0, bytes0), (state1, _) = run_distributed(_fit_worker, 2, Sync(allreduce_epochs=1), 2, _model)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    loss_fn = nn.CrossEntropyLoss()
    for (x0, y0), (x1, y1) in zip(_worker_batches(0, 2, 0), _worker_batches(1, 2, 0)):  # epoch 1: all-reduce
        optimizer.zero_grad()
        loss_fn(model(torch.cat([x0, x1])), torch.cat([y0, y1])).backward()
        optimizer.step()
    replicas = []
    for rank in range(2):  # epoch 2: each worker alone from the common model and momentum, then the average
        local = _model()
        local.load_state_dict(model.state_dict())
        local_optimizer = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.5)
        local_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # load_state_dict shares tensors
        for x, y in _worker_batches(rank, 2, 1):
            local_optimizer.zero_grad()
            loss_fn(local(x), y).backward()
            local_optimizer.step()
        replicas.append(_state(local))
    for key in replicas[0]:
        assert torch.allclose(state0[key], (replicas[0][key] + replicas[1][key]) / 2, atol=1e-5), key
        assert torch.equal(state0[key], state1[key])
    params = _params(_model())
    assert bytes0 == params * 4 * (1 + N // 2 // BATCH + 1)  # broadcast, a gradient per step, one average


# -- resume continues exactly -------------------------------------------------------------------------

def _resume_worker(rank, world, make, root):
    x, y = _data()

    def fit(out, epochs, resume):
        model = _bn_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        strategy = make[0](**make[1])
        Trainer(model, optimizer, "cross-entropy", strategy, batch_size=BATCH, seed=3, verbose=False, out=out,
                checkpoint_every=1, keep_checkpoints=5, resume=resume).fit((x, y), epochs=epochs)
        return _state(strategy.finish())

    whole = fit(f"{root}/whole", 3, False)
    fit(f"{root}/parts", 2, False)
    resumed = fit(f"{root}/parts", 3, True)
    return whole, resumed


RESUMED = {
    "sync-adam-int8": (Sync, dict(outer="adam", outer_lr=0.01, compression="int8")),
    "sync-postlocal-nesterov": (Sync, dict(allreduce_epochs=1, outer="nesterov", every_steps=3)),
    "fedavg-sgd-int8-prox-reset": (FedAvg, dict(outer="sgd", outer_lr=1.0, compression="int8", proximal_mu=0.1,
                                                optimizer_state="reset", partition="dirichlet")),
}


@pytest.mark.parametrize("name", RESUMED)
def test_resume_continues_exactly_with_outer_state_and_residuals(name, tmp_path):
    for whole, resumed in run_distributed(_resume_worker, 2, RESUMED[name], str(tmp_path), timeout=240):
        for key in whole:
            assert torch.equal(whole[key], resumed[key]), key
    shutil.rmtree(tmp_path)


# -- bad values on the command line --------------------------------------------------------------------

@pytest.mark.parametrize("args,names", [
    (["--strategy", "fedavg", "--proximal-mu", "-0.1"], ["--proximal-mu must be at least 0", "-0.1"]),
    (["--strategy", "sync", "--outer", "lamb"], ["--outer must be one of none, sgd, nesterov, adam", "'lamb'"]),
    (["--strategy", "sync", "--outer", "adam", "--outer-betas", "0.9,1.2"], ["--outer-betas", "'0.9,1.2'"]),
    (["--strategy", "fedavg", "--outer-betas", "0.9"], ["--outer-betas", "two numbers"]),
    (["--strategy", "allreduce", "--compression", "int8"], ["compression int8 applies to strategies sync, fedavg and async"]),
    (["--strategy", "sync", "--compression", "int4"], ["--compression must be one of none, fp16, bf16, int8", "'int4'"]),
    (["--strategy", "allreduce", "--outer", "adam"], ["--outer applies to strategies sync and fedavg, not allreduce"]),
    (["--strategy", "fedavg", "--allreduce-epochs", "2"], ["--allreduce-epochs applies to strategy sync, not fedavg"]),
    (["--strategy", "sync", "--proximal-mu", "0.1"], ["--proximal-mu applies to strategy fedavg, not sync"]),
    (["--strategy", "fedavg", "--optimizer-state", "average", "--clients-per-round", "0.5"],
     ["optimizer_state average with fedavg needs every client in every round"]),
])
def test_bad_outer_compression_and_fedprox_values_exit_2_with_one_line(args, names, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DPTRAIN_DEBUG", "0")
    code = main(["train", "--dataset", "digits", "--workers", "1", "--epochs", "1", "--out", "out", *args])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dptrain: error: "), lines
    for name in names:
        assert name in lines[0], lines[0]
    assert not (tmp_path / "out").exists()
