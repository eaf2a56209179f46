"""Baseline: Flower's FedAvg (the `flwr` package) on dptrain's client partitions (used only when flwr imports).

Only the data set, the seeded model and the client data come from dptrain: its Dirichlet (or
iid, contiguous) partition and each client's visiting order per round (dptrain.data.sampler's
partition_plan), so that both tools train every client on the same batches. Everything
federated is Flower's: the strategy flwr.server.strategy.FedAvg (its aggregate_fit, weighted by
the clients' sample counts), its server-side evaluate_fn on the global model after each round,
and, in the default mode, its Ray-based simulation engine running the clients.

    --mode simulation   flwr.simulation.start_simulation (Ray actors; needs `flwr[simulation]`):
                        Flower builds each client afresh every round (client_fn), so its SGD
                        momentum starts from zero in every round, as in Flower's examples.
    --mode inprocess    the same Flower objects driven in this process: client.fit through
                        Flower's Client API, FedAvg.aggregate_fit, FedAvg.evaluate; no Ray.
                        `--carry-momentum` then keeps each client's optimizer across rounds
                        (what dptrain's fedavg does), for finding out where differences come from.

    python benchmarks/baselines/flower_fedavg.py --alpha 0.1 --seed 0 --rounds 30 --out runs/flower
"""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # Flower otherwise posts usage events to its server
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import data_and_model, write_run  # noqa: E402

from dptrain.data.partition import PARTITIONERS, partition  # noqa: E402
from dptrain.data.sampler import partition_plan  # noqa: E402
from dptrain.data import sharding  # noqa: E402


def arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30, help="one local epoch per round")
    parser.add_argument("--partition", choices=PARTITIONERS, default="dirichlet")
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=32, help="per client")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mode", choices=("simulation", "inprocess"), default="simulation")
    parser.add_argument("--carry-momentum", action="store_true",
                        help="inprocess: keep each client's optimizer state across rounds")
    parser.add_argument("--cpus", type=int, default=2, help="simulation: CPUs Ray may use (one per client actor)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.carry_momentum and args.mode != "inprocess":
        parser.error("--carry-momentum needs --mode inprocess (Flower's simulation builds clients afresh each round)")
    return args


class Federation:
    """What the clients and the server need: the data, each client's partition and batches, the model."""

    def __init__(self, args):
        self.args = args
        train_set, self.x_test, self.y_test, self.model = data_and_model(args)
        self.x_train, self.y_train = train_set.tensors
        self.parts = partition(args.partition, self.y_train.numpy(), args.clients, seed=args.seed, alpha=args.alpha)
        self.plans = [partition_plan(part, cid, args.batch_size, args.seed) for cid, part in enumerate(self.parts)]

    def weights(self, model=None):
        return [v.detach().cpu().numpy().copy() for v in (model or self.model).state_dict().values()]

    def load(self, model, weights):
        model.load_state_dict({k: torch.from_numpy(np.asarray(w).copy())
                               for k, w in zip(model.state_dict().keys(), weights)}, strict=True)

    def train_round(self, cid, model, optimizer, server_round):
        """One local epoch of client `cid` in round `server_round` (from 1): dptrain's epoch server_round-1."""
        loss_fn = torch.nn.CrossEntropyLoss()
        plan = self.plans[cid]
        model.train()
        for rows in sharding.batches(plan.rows(server_round - 1), plan.steps):
            rows = torch.from_numpy(rows)
            optimizer.zero_grad()
            loss_fn(model(self.x_train[rows]), self.y_train[rows]).backward()
            optimizer.step()

    def optimizer(self, model):
        return torch.optim.SGD(model.parameters(), lr=self.args.lr, momentum=self.args.momentum)

    @torch.no_grad()
    def evaluate(self, weights):
        self.load(self.model, weights)
        self.model.eval()
        output = self.model(self.x_test)
        loss = torch.nn.functional.cross_entropy(output, self.y_test).item()
        return loss, (output.argmax(1) == self.y_test).sum().item() / len(self.y_test)


def make_client_class():
    from flwr.client import NumPyClient

    class DigitsClient(NumPyClient):
        """A Flower client training one dptrain partition; a fresh optimizer unless one is handed in."""

        def __init__(self, federation, cid, model=None, optimizer=None):
            self.federation, self.cid = federation, cid
            if model is None:
                model = build_like(federation.model)
            self.model = model
            self.optimizer = optimizer or federation.optimizer(model)

        def get_parameters(self, config):
            return self.federation.weights(self.model)

        def fit(self, parameters, config):
            self.federation.load(self.model, parameters)
            self.federation.train_round(self.cid, self.model, self.optimizer, int(config["server_round"]))
            return self.federation.weights(self.model), len(self.federation.parts[self.cid]), {}

    return DigitsClient


def build_like(model):
    import copy
    return copy.deepcopy(model)


def make_strategy(federation, history):
    from flwr.common import ndarrays_to_parameters
    from flwr.server.strategy import FedAvg

    def evaluate_fn(server_round, weights, config):
        loss, accuracy = federation.evaluate(weights)
        history.append({"epoch": server_round, "test_loss": loss, "test_accuracy": accuracy,
                        "wall_seconds": time.perf_counter() - history_start[0]})
        return loss, {"accuracy": accuracy}

    history_start = [time.perf_counter()]
    clients = federation.args.clients
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clients, min_evaluate_clients=0,
                      min_available_clients=clients, evaluate_fn=evaluate_fn,
                      on_fit_config_fn=lambda server_round: {"server_round": server_round},
                      initial_parameters=ndarrays_to_parameters(federation.weights()))
    return strategy, history_start


def run_simulation(federation):
    import flwr
    from flwr.server import ServerConfig

    args = federation.args
    history = []
    strategy, start = make_strategy(federation, history)
    DigitsClient = make_client_class()

    def client_fn(context):
        # Runs in a Ray actor: the federation (data, partitions, model) travels pickled with this function.
        torch.set_num_threads(1)
        return DigitsClient(federation, int(context.node_config["partition-id"])).to_client()

    source = str(Path(__file__).resolve().parents[2] / "src")
    env = {"OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([source, str(Path(__file__).resolve().parent),
                                          os.environ.get("PYTHONPATH", "")])}
    start[0] = time.perf_counter()
    result = flwr.simulation.start_simulation(
        client_fn=client_fn, num_clients=args.clients, config=ServerConfig(num_rounds=args.rounds),
        strategy=strategy, client_resources={"num_cpus": 1, "num_gpus": 0.0},
        ray_init_args={"num_cpus": args.cpus, "include_dashboard": False, "ignore_reinit_error": True,
                       "runtime_env": {"env_vars": env}, "logging_level": "error", "log_to_driver": False})
    wall = time.perf_counter() - start[0]
    accuracy = dict(result.metrics_centralized.get("accuracy", []))
    for record in history:  # Flower's History agrees with what evaluate_fn saw
        assert abs(accuracy[record["epoch"]] - record["test_accuracy"]) < 1e-12
    return history, wall


def run_inprocess(federation):
    from flwr.common import Code, FitIns, FitRes, Status, parameters_to_ndarrays

    args = federation.args
    history = []
    strategy, start = make_strategy(federation, history)
    DigitsClient = make_client_class()
    kept = {}  # cid -> (model, optimizer), only with --carry-momentum
    parameters = strategy.initialize_parameters(client_manager=None)
    strategy.evaluate(0, parameters)
    start[0] = time.perf_counter()
    for server_round in range(1, args.rounds + 1):
        results = []
        for cid in range(args.clients):
            if args.carry_momentum:
                if cid not in kept:
                    model = build_like(federation.model)
                    kept[cid] = (model, federation.optimizer(model))
                client = DigitsClient(federation, cid, *kept[cid])
            else:
                client = DigitsClient(federation, cid)
            reply = client.to_client().fit(FitIns(parameters, {"server_round": server_round}))
            assert reply.status.code == Code.OK
            results.append((None, FitRes(Status(Code.OK, ""), reply.parameters, reply.num_examples, {})))
        parameters, _ = strategy.aggregate_fit(server_round, results, [])
        strategy.evaluate(server_round, parameters)
    federation.load(federation.model, parameters_to_ndarrays(parameters))
    return history, time.perf_counter() - start[0]


def main(argv=None):
    args = arguments(argv)
    torch.set_num_threads(1)
    federation = Federation(args)
    history, wall = (run_simulation if args.mode == "simulation" else run_inprocess)(federation)
    records = [r for r in history if r["epoch"] >= 1]
    samples = sum(len(p) for p in federation.parts) * args.rounds
    strategy = f"flower-fedavg-{args.mode}" + ("-carry-momentum" if args.carry_momentum else "")
    write_run(args.out, strategy, args.clients, records, wall, samples, federation.model)
    torch.save(federation.model.state_dict(), os.path.join(args.out, "model.pt"))  # the last global model
    return records


if __name__ == "__main__":
    main()
