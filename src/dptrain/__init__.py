"""dptrain: data-parallel PyTorch training from a laptop to an HPC cluster.

    import dptrain
    trainer = dptrain.Trainer(model, optimizer, "cross-entropy", strategy=dptrain.Sync(every=1))
    summary = trainer.fit((x_train, y_train), (x_test, y_test), epochs=10)
"""

__version__ = "0.1.0"

from dptrain.config import TrainConfig  # noqa: E402
from dptrain.data import DSTensor  # noqa: E402
from dptrain.strategies import AllReduce, Async, FedAvg, Strategy, Sync  # noqa: E402
from dptrain.train.trainer import Trainer  # noqa: E402

__all__ = ["AllReduce", "Async", "DSTensor", "FedAvg", "Strategy", "Sync", "TrainConfig", "Trainer", "__version__"]
