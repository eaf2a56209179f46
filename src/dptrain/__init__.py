"""dptrain: data-parallel PyTorch training from a laptop to an HPC cluster.

    import dptrain

    def main():
        trainer = dptrain.Trainer(model, optimizer, "cross-entropy", dptrain.Sync(every=1))
        summary = trainer.fit((x_train, y_train), (x_test, y_test), epochs=10)

    if __name__ == "__main__":
        dptrain.run(main)

A user's mistake (dptrain.errors.UserError) ends such a script in one line and exit code 2, with `dptrain.run`
and without it (the hook dptrain.errors.install_excepthook puts in sys.excepthook, on this import).
"""

import importlib

from dptrain.errors import install_excepthook

__version__ = "0.1.0"

install_excepthook()

# Imported on first use, so that `dptrain --help` or `dptrain launch` do not pay for torch.
_EXPORTS = {
    "Trainer": "dptrain.train.trainer", "Summary": "dptrain.train.recorder",
    # every registered strategy (dptrain.registry.STRATEGIES), from its own module, and their base class
    "AllReduce": "dptrain.strategies.allreduce", "Sync": "dptrain.strategies.sync",
    "Streaming": "dptrain.strategies.streaming", "Async": "dptrain.strategies.asynchronous",
    "FedAvg": "dptrain.strategies.fedavg", "Hierarchical": "dptrain.strategies.hierarchical",
    "Auto": "dptrain.strategies.auto", "Strategy": "dptrain.strategies.base",
    "DSTensor": "dptrain.data", "load_dataset": "dptrain.data",
    "TrainConfig": "dptrain.config", "train_from_config": "dptrain.train.command",
    "run": "dptrain.exits", "exit_process": "dptrain.runtime.distributed",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dptrain' has no attribute {name!r}")
