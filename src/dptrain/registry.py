"""Every extension point's entries by name: where each lives ("package.module:Object") and one line of help.

Config validation, command-line choices and help, did-you-mean hints and the cost model all
derive from these tables, so adding a strategy (scheduler, container runtime, model, data set)
is its own file plus one line here. Entries are loaded only when used: this module imports
nothing heavy, so `dptrain --help` stays fast.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from dptrain.errors import unknown_name


@dataclass(frozen=True)
class Entry:
    target: str  # "package.module:Object", or "package.module" for a backend that is a whole module
    help: str  # one line, shown after the name in --help


@dataclass(frozen=True)
class StrategyEntry(Entry):
    # How the cost model times its communication (dptrain.costmodel.COMMUNICATION): a new
    # strategy that communicates like an existing one is projected without touching the model.
    communication: str
    # The strategy's options and rules without torch (dptrain.strategies.rules.StrategyRules, which the
    # strategy class inherits): what config validation and the LR policy ask. "": the class itself is light.
    rules: str = ""


STRATEGIES: dict[str, StrategyEntry] = {
    "allreduce": StrategyEntry("dptrain.strategies.allreduce:AllReduce", "gradients every step", "step-allreduce",
                               "dptrain.strategies.rules.allreduce:AllReduceRules"),
    "sync": StrategyEntry("dptrain.strategies.sync:Sync", "weights every few epochs/steps", "periodic-allreduce",
                          "dptrain.strategies.rules.sync:SyncRules"),
    "streaming": StrategyEntry("dptrain.strategies.streaming:Streaming",
                               "weights every few epochs/steps, averaged while training goes on", "overlapped-average",
                               "dptrain.strategies.rules.streaming:StreamingRules"),
    "async": StrategyEntry("dptrain.strategies.asynchronous:Async", "merges into a global model, no barrier",
                           "merge-service", "dptrain.strategies.rules.asynchronous:AsyncRules"),
    "fedavg": StrategyEntry("dptrain.strategies.fedavg:FedAvg", "federated", "periodic-allreduce",
                            "dptrain.strategies.rules.fedavg:FedAvgRules"),
    "hierarchical": StrategyEntry("dptrain.strategies.hierarchical:Hierarchical",
                                  "gradients every step inside a node, weights across nodes every few epochs/steps",
                                  "hierarchical-allreduce", "dptrain.strategies.rules.hierarchical:HierarchicalRules"),
    "auto": StrategyEntry("dptrain.strategies.auto:Auto", "measures link and model at start, then trains with the "
                          "fastest candidate", "auto", "dptrain.strategies.rules.auto:AutoRules"),
}

DEFAULT_STRATEGY = "allreduce"  # what `dptrain train` uses without --strategy


class _StrategyRules(Mapping[str, Entry]):
    """STRATEGIES seen as their rules' entries (kind "strategy rules"), read live so that a strategy
    registered later is found too."""

    def __getitem__(self, name: str) -> Entry:
        entry = STRATEGIES[name]
        return Entry(entry.rules or entry.target, entry.help)

    def __iter__(self) -> Iterator[str]:
        return iter(STRATEGIES)

    def __len__(self) -> int:
        return len(STRATEGIES)

# Each a module satisfying dptrain.cluster.base.Scheduler: its job script and its in-job environment.
SCHEDULERS: dict[str, Entry] = {
    "slurm": Entry("dptrain.cluster.slurm", "sbatch"),
    "pbs": Entry("dptrain.cluster.pbs", "qsub"),
    "local": Entry("dptrain.cluster.local", "this machine"),
    "kubernetes": Entry("dptrain.cluster.kubernetes", "kubectl apply: an Indexed Job, one pod per rank"),
}

# Launchers that are not schedulers, each a module satisfying dptrain.cluster.base.Environment: the
# variables of the ranks it starts (dptrain.runtime.env asks these and the schedulers).
LAUNCHERS: dict[str, Entry] = {
    "torchrun": Entry("dptrain.cluster.torchrun", "torchrun, or any launcher that sets RANK and WORLD_SIZE"),
    "mpirun": Entry("dptrain.cluster.mpirun", "Open MPI"),
    "pmi": Entry("dptrain.cluster.pmi", "MPICH or Intel MPI mpiexec"),
}

# Each a module satisfying dptrain.cluster.base.ContainerRuntime.
CONTAINER_RUNTIMES: dict[str, Entry] = {
    "udocker": Entry("dptrain.cluster.udocker", "rootless through PRoot, a container made by 'dptrain container setup'"),
    "apptainer": Entry("dptrain.cluster.apptainer", "Apptainer or Singularity, one .sif image file"),
    "pyxis": Entry("dptrain.cluster.pyxis", "enroot through SLURM's pyxis plugin: srun --container-image"),
    "podman": Entry("dptrain.cluster.podman", "rootless Podman, one podman run per rank"),
    "charliecloud": Entry("dptrain.cluster.charliecloud", "ch-run on an image directory or a SquashFS file"),
    "cscs-edf": Entry("dptrain.cluster.cscs_edf", "CSCS Alps' Container Engine: an EDF and srun --environment"),
}

# Builders `(input_shape, num_outputs, **options) -> nn.Module`; their keyword-only parameters are the options.
MODELS: dict[str, Entry] = {
    "mlp": Entry("dptrain.models.zoo:mlp", "fully connected classifier of flat (or flattened) samples"),
    "cnn": Entry("dptrain.models.zoo:cnn", "small convolutional classifier of (C, H, W) images"),
    "cnn1d": Entry("dptrain.models.zoo:cnn1d", "MNIST-1D's baseline CNN (three strided convolutions) of (C, L) sequences"),
    "resnet": Entry("dptrain.models.resnet:resnet", "CIFAR-style ResNet of (C, H, W) images"),
    "nfnet": Entry("dptrain.models.nfnet:nfnet", "normaliser-free ResNet of (C, H, W) images (no BatchNorm)"),
    "mlp-regression": Entry("dptrain.models.zoo:mlp_regression", "fully connected regressor with a sigmoid output"),
}

# Loaders `(settings: dptrain.data.sources.BuiltinSettings) -> Dataset`.
DATASETS: dict[str, Entry] = {
    "digits": Entry("dptrain.data.sources:digits", "scikit-learn's bundled 8x8 handwritten digits, 10 classes"),
    "mnist1d": Entry("dptrain.data.sources:mnist1d", "MNIST-1D (Greydanus 2020), 40-step sequences, 10 classes; "
                     "pip install mnist1d"),
    "synthetic-images": Entry("dptrain.data.sources:synthetic_images", "class-conditional images from the seed"),
    "synthetic-regression": Entry("dptrain.data.sources:synthetic_regression",
                                  "a nonlinear target in (0, 1) of standard-normal inputs"),
}

TABLES: dict[str, Mapping[str, Entry]] = {
    "strategy": STRATEGIES,
    "strategy rules": _StrategyRules(),
    "scheduler": SCHEDULERS,
    "launcher": LAUNCHERS,
    "container runtime": CONTAINER_RUNTIMES,
    "model": MODELS,
    "dataset": DATASETS,
}


def names(kind: str) -> tuple[str, ...]:
    """The registered names of `kind` ('strategy', 'strategy rules', 'scheduler', 'launcher', 'container runtime',
    'model', 'dataset')."""
    return tuple(TABLES[kind])


def help_text(kind: str) -> str:
    """`name (help), name (help), ...`: what --help says about the choices of `kind`."""
    return ", ".join(f"{name} ({entry.help})" for name, entry in TABLES[kind].items())


def load(kind: str, name: str) -> Any:
    """Import the object (or backend module) registered as `name`. An unknown name is one line with a hint."""
    table = TABLES[kind]
    if name not in table:
        raise unknown_name(kind, name, names(kind))
    module_name, _, attribute = table[name].target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module
