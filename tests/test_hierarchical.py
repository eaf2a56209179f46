"""hierarchical on real processes: 4 ranks as 2 "nodes" x 2 on 127.0.0.1 (--ranks-per-node 2).

Inside a node DDP averages gradients every step, so a node trains like one process on the union
of its ranks' batches; across nodes the leaders average the weights every period. Checked
against a hand computation, with exact byte counts, and against allreduce (one node) and sync
(one rank per node).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from distributed import run_distributed, toy_data, toy_model
from dptrain.data import sharding
from dptrain.errors import UserError
from dptrain.runtime.distributed import init_process_group
from dptrain.runtime.env import detect
from dptrain.strategies import AllReduce, Sync
from dptrain.strategies.hierarchical import Hierarchical, assign_nodes
from dptrain.train.trainer import Trainer
from cli_runner import run_dptrain

N, BATCH, SEED, LR, MOMENTUM = 128, 16, 3, 0.1, 0.5


def _data():
    return toy_data(N)


def _model():
    return toy_model()


MODEL_BYTES = sum(p.numel() for p in _model().parameters()) * 4  # no buffers


def _state(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _train_worker(rank, world, strategy, epochs, out=None, resume=False, checkpoint_every=0):
    """Train with the Trainer; also the model after every step (every rank's own replica)."""
    x, y = _data()
    model = _model()
    trainer = Trainer(model, _optimizer(model), "cross-entropy", strategy, batch_size=BATCH, seed=SEED,
                      verbose=False, out=out and f"{out}", checkpoint_every=checkpoint_every, resume=resume)
    after_step, steps = strategy.after_step, []

    def recording(step):
        after_step(step)
        steps.append(_state(model))

    strategy.after_step = recording
    trainer.fit((x, y), epochs=epochs)
    final = strategy.finish()
    counts = (strategy.intra_node_bytes, strategy.inter_node_bytes) if isinstance(strategy, Hierarchical) else None
    return _state(final), strategy.comm_bytes, steps, counts, strategy.summary()


def _batches(rank, world, epoch):
    x, y = _data()
    steps = sharding.steps_per_epoch(N, world, BATCH)
    order = sharding.epoch_indices(N, rank, world, epoch, SEED, "global")
    return [(torch.from_numpy(x[b]), torch.from_numpy(y[b])) for b in sharding.batches(order, steps)]


# -- node membership -----------------------------------------------------------------------------

def test_nodes_come_from_the_override_the_host_names_or_the_launchers_local_size():
    assert assign_nodes(4, 2) == [[0, 1], [2, 3]]
    assert assign_nodes(6, 3, hosts=["a"] * 6) == [[0, 1, 2], [3, 4, 5]]  # the override wins
    # srun's cyclic placement: ranks of one host need not be neighbours
    assert assign_nodes(4, hosts=["a", "b", "a", "b"], local_sizes=[2] * 4) == [[0, 2], [1, 3]]
    # two torchrun agents (--nnodes 2, LOCAL_WORLD_SIZE 2) on one machine: blocks of the local size
    assert assign_nodes(4, hosts=["a"] * 4, local_sizes=[2] * 4) == [[0, 1], [2, 3]]
    # dptrain's own launcher: every rank local; no launcher at all: one node per host name
    assert assign_nodes(4, hosts=["a"] * 4, local_sizes=[4] * 4) == [[0, 1, 2, 3]]
    assert assign_nodes(3, hosts=["a", "a", "b"], local_sizes=[None] * 3) == [[0, 1], [2]]


def test_a_ranks_per_node_that_does_not_divide_the_world_is_one_sentence():
    with pytest.raises(UserError) as caught:
        assign_nodes(4, 3)
    assert str(caught.value) == ("--ranks-per-node 3 does not divide the 4 ranks into equal nodes; "
                                 "use one of 1, 2, 4")


# -- two nodes of two ----------------------------------------------------------------------------

def test_two_nodes_of_two_average_the_node_models_and_keep_each_node_equal_every_step():
    epochs = 2
    results = run_distributed(_train_worker, 4, Hierarchical(every=1, ranks_per_node=2), epochs)
    finals = [r[0] for r in results]
    steps_per_epoch = N // 4 // BATCH
    # By hand: each node trains an epoch as one process on its two ranks' batches (momentum kept
    # per node), then both node models are replaced by their average.
    models = [_model(), _model()]
    optimizers = [_optimizer(model) for model in models]
    for epoch in range(epochs):
        for k, ranks in enumerate(([0, 1], [2, 3])):
            for step, parts in enumerate(zip(*(_batches(rank, 4, epoch) for rank in ranks))):
                loss = nn.functional.cross_entropy(models[k](torch.cat([x for x, _ in parts])),
                                                   torch.cat([y for _, y in parts]))
                optimizers[k].zero_grad()
                loss.backward()
                optimizers[k].step()
                want = _state(models[k])
                for rank in ranks:  # both replicas of the node, after every step
                    got = results[rank][2][epoch * steps_per_epoch + step]
                    assert all(torch.allclose(got[key], want[key], atol=1e-6) for key in want), (rank, step)
        for mine, other in zip(results[0][2] + results[2][2], results[1][2] + results[3][2]):
            assert all(torch.equal(mine[key], other[key]) for key in mine)  # bitwise equal inside a node
        assert not torch.allclose(models[0][0].weight, models[1][0].weight)  # the nodes differ before the average
        with torch.no_grad():
            for first, second in zip(models[0].parameters(), models[1].parameters()):
                mean = (first + second) / 2
                first.copy_(mean)
                second.copy_(mean)
    expected = _state(models[0])
    for rank in range(4):
        for key in expected:
            assert torch.allclose(finals[rank][key], expected[key], atol=1e-5), key
            assert torch.equal(finals[rank][key], finals[0][key]), key

    # Bytes: intra = DDP's start-up broadcast + one gradient per step + the broadcast after each
    # average; inter (leaders only) = rank 0's model at the start + each average.
    steps = epochs * steps_per_epoch
    intra = MODEL_BYTES * (1 + steps + epochs)
    inter = MODEL_BYTES * (1 + epochs)
    for rank, (_, comm, _, (got_intra, got_inter), _) in enumerate(results):
        assert got_intra == intra
        assert got_inter == (inter if rank in (0, 2) else 0)
        assert comm == got_intra + got_inter
    summary = results[0][4]
    assert summary["nodes"] == [[0, 1], [2, 3]] and summary["averages"] == epochs
    assert summary["intra_node_bytes_per_worker"] == [intra] * 4
    assert summary["inter_node_bytes_per_worker"] == [inter, 0, inter, 0]
    assert summary["intra_node_bytes"] + summary["inter_node_bytes"] == sum(r[1] for r in results)


def test_local_sgd_every_k_steps_averages_across_nodes_at_those_steps():
    results = run_distributed(_train_worker, 4, Hierarchical(every_steps=1, ranks_per_node=2), 1)
    steps = N // 4 // BATCH
    for rank in range(4):
        assert results[rank][3] == (MODEL_BYTES * (1 + 2 * steps), MODEL_BYTES * (1 + steps) if rank % 2 == 0 else 0)
    for step in range(steps):  # averaged after every step: all four replicas equal
        assert all(torch.equal(results[rank][2][step][key], results[0][2][step][key])
                   for rank in range(4) for key in results[0][2][step])


# -- the two limits ------------------------------------------------------------------------------

def test_one_node_is_allreduce_exactly():
    # No override: one host name and no launcher's local size on the test's processes -> one node.
    for hier, flat in zip(run_distributed(_train_worker, 2, Hierarchical(), 2),
                          run_distributed(_train_worker, 2, AllReduce(), 2)):
        assert all(torch.equal(hier[0][key], flat[0][key]) for key in flat[0])
        assert hier[1] == flat[1] and hier[3] == (flat[1], 0)
        assert hier[4]["nodes"] == [[0, 1]] and hier[4]["averages"] == 0


def test_one_rank_per_node_is_sync_exactly():
    for hier, flat in zip(run_distributed(_train_worker, 2, Hierarchical(every=1, ranks_per_node=1), 2),
                          run_distributed(_train_worker, 2, Sync(every=1), 2)):
        assert all(torch.equal(hier[0][key], flat[0][key]) for key in flat[0])
        assert hier[1] == flat[1] and hier[3] == (0, flat[1])


# -- checkpoint and resume -----------------------------------------------------------------------

def _resume_worker(rank, world, root):
    whole = _train_worker(rank, world, Hierarchical(ranks_per_node=2), 2, out=f"{root}/whole")
    _train_worker(rank, world, Hierarchical(ranks_per_node=2), 1, out=f"{root}/split", checkpoint_every=1)
    resumed = _train_worker(rank, world, Hierarchical(ranks_per_node=2), 2, out=f"{root}/split", resume=True,
                            checkpoint_every=1)
    return whole, resumed


def test_a_resumed_run_ends_bitwise_equal_with_the_same_byte_counts(tmp_path):
    for whole, resumed in run_distributed(_resume_worker, 4, str(tmp_path)):
        assert all(torch.equal(whole[0][key], resumed[0][key]) for key in whole[0])
        assert whole[3] == resumed[3] and whole[1] == resumed[1]
        assert whole[4]["averages"] == resumed[4]["averages"] == 2


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--strategy", "hierarchical", "--ranks-per-node", "3"],
     "dptrain: error: --ranks-per-node 3 does not divide the 4 ranks into equal nodes; use one of 1, 2, 4\n"),
    (["--strategy", "sync", "--ranks-per-node", "2"],
     "dptrain: error: --ranks-per-node applies to strategy hierarchical, not sync\n"),
])
def test_a_bad_ranks_per_node_is_one_sentence_and_exit_code_2(tmp_path, args, message):
    result = run_dptrain(["train", "--workers", "4", "--epochs", "1", *args, "--out", str(tmp_path / "run")],
                         cwd=os.getcwd(), timeout=120)
    assert result.returncode == 2
    assert result.stderr == message
    assert not (tmp_path / "run").exists()


# -- the emulated-network benchmark's placement ---------------------------------------------------

def test_bench_ranks_per_host_places_the_nodes_and_tells_hierarchical_where_they_end():
    import argparse

    from dptrain.bench import matrix
    from dptrain.bench.commands import add_arguments, spec_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    spec = spec_from(parser.parse_args(["--workers", "1,4", "--ranks-per-host", "2",
                                        "--strategies", "allreduce,hierarchical"]))
    assert spec.ranks_per_host == 2
    assert matrix._config(spec, "hierarchical", 4, None).ranks_per_node == 2
    assert matrix._config(spec, "hierarchical", 1, None).ranks_per_node is None
    assert matrix._config(spec, "allreduce", 4, None).ranks_per_node is None
    with pytest.raises(UserError, match=r"^--ranks-per-host 2 does not divide --workers 3; use worker counts that "
                                        r"are 1 or multiples of 2$"):
        spec_from(parser.parse_args(["--workers", "1,3", "--ranks-per-host", "2"]))


# -- nodes of unequal size -----------------------------------------------------------------------

class _TwoAndOne(Hierarchical):
    """Nodes {0, 1} and {2}, as srun's "2,1" tasks per node would give on two hosts."""

    def _find_nodes(self, ctx):
        return [[0, 1], [2]]


def _unequal_worker(rank, world):
    from dptrain.runtime.distributed import init_process_group
    from dptrain.runtime.env import detect

    model = nn.Linear(3, 2)
    strategy = _TwoAndOne()
    strategy.setup(model, _optimizer(model), init_process_group(detect()))
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(1.0 if rank < 2 else 4.0)  # node 0's replicas equal, node 1 different
    strategy.synchronise()
    return [p.detach().clone() for p in model.parameters()], strategy.intra_node_bytes, strategy.inter_node_bytes


def test_nodes_of_unequal_size_average_by_their_ranks():
    results = run_distributed(_unequal_worker, 3)
    model_bytes = (3 * 2 + 2) * 4
    for rank, (params, intra, inter) in enumerate(results):
        assert all(torch.allclose(p, torch.full_like(p, 2.0)) for p in params)  # (2 x 1 + 1 x 4) / 3
        assert all(torch.equal(p, q) for p, q in zip(params, results[0][0]))
        # start-up: rank 0's model to the leaders, DDP's broadcast in node 0; the average: the
        # weighted all-reduce (and its total weight, one float64) among the leaders, the broadcast in node 0
        assert intra == (2 * model_bytes if rank < 2 else 0)
        assert inter == ((2 * model_bytes + 8) if rank in (0, 2) else 0)


# -- nodes from the launcher's environment -------------------------------------------------------

def _torchrun_like_worker(rank, world):
    import os

    # What two torchrun agents (--nnodes 2 --nproc-per-node 2) on one machine give each rank.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29400")  # the group is joined already
    return _train_worker(rank, world, Hierarchical(), 1)


def test_nodes_from_the_launchers_local_world_size_equal_the_override():
    from_env = run_distributed(_torchrun_like_worker, 4)
    overridden = run_distributed(_train_worker, 4, Hierarchical(ranks_per_node=2), 1)
    assert from_env[0][4]["nodes"] == [[0, 1], [2, 3]]
    for env_result, override_result in zip(from_env, overridden):
        assert all(torch.equal(env_result[0][key], override_result[0][key]) for key in env_result[0])
        assert env_result[3] == override_result[3]


def _regrouped_worker(rank, world):
    """Hierarchical on 2 nodes of 2, then a membership change that keeps all four (a new generation of the
    group): the node and leader groups of the generation before are closed, the new ones work."""
    ctx = init_process_group(detect())
    model = _model()
    strategy = Hierarchical(ranks_per_node=2)
    strategy.setup(model, _optimizer(model), ctx)
    old = [strategy._node_group, strategy._leader_group]
    ctx.group = ctx.group.rebuild(list(range(world)), 1)
    strategy.rebind(ctx)
    new = [strategy._node_group, strategy._leader_group]
    value = torch.tensor([float(rank)])
    strategy.node_group.all_reduce(value)
    return [g.closed if g is not None else None for g in old], [g.closed if g is not None else None for g in new], \
        value.item()


def test_a_membership_change_closes_the_node_and_leader_groups_it_replaces():
    results = run_distributed(_regrouped_worker, 4)
    for rank, (old, new, node_sum) in enumerate(results):
        leader = rank in (0, 2)
        assert old == [True, True if leader else None], (rank, old)  # a non-leader has no leaders' group
        assert new == [False, False if leader else None], (rank, new)
        assert node_sum == (0 + 1 if rank < 2 else 2 + 3)
