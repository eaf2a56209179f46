"""Precipitation downscaling, the container workflow's science case, as a user's own training script.

Predictors: 20 coarse fields a day (5 variables at 4 pressure levels on an 8 x 16 grid, as a
reanalysis gives them); target: daily precipitation at 512 points of a finer 16 x 32 grid. The
model (DeepESD-like) runs parallel convolution branches with kernel sizes 2, 3, 5, 7 and 9 over
the predictors, and predicts for every grid point a Bernoulli-Gamma distribution: the
probability of rain, and the shape and scale of the amount. The loss is its negative
log-likelihood; Adam with the learning rate scaled by the number of workers.

The data are generated (no download): smooth random fields, a fixed "orography", rain where a
moisture index lifted over the orography is high, Gamma-distributed amounts. The same seed
gives the same data on every rank.

Three ways to run it, all data-parallel:

    python examples/downscaling.py --epochs 10                       # alone
    dptrain run --workers 2 examples/downscaling.py --epochs 10      # 2 local ranks
    dptrain launch --scheduler slurm --nodes 2 -- python examples/downscaling.py --epochs 10

and through `dptrain train` with its parts (PYTHONPATH=examples):

    dptrain train --data downscaling:make_data --model downscaling:make_model \\
        --loss downscaling:bernoulli_gamma_nll --optimizer adam --lr 1e-3 --scale-lr --strategy sync
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

COARSE = (8, 16)   # predictor grid
FINE = (16, 32)    # target grid
FIELDS = 20        # 5 variables x 4 pressure levels
POINTS = FINE[0] * FINE[1]


def _smooth_fields(rng: np.random.Generator, n: int, channels: int, shape: tuple[int, int], modes: int = 4) -> np.ndarray:
    """Random fields that vary smoothly in space: a few low Fourier modes each, plus a little noise."""
    rows, cols = np.meshgrid(np.linspace(0, 1, shape[0]), np.linspace(0, 1, shape[1]), indexing="ij")
    fields = np.zeros((n, channels, *shape), np.float32)
    for _ in range(modes):
        ky, kx = rng.integers(0, 3, size=(2, n, channels, 1, 1))
        phase = rng.uniform(0, 2 * np.pi, size=(n, channels, 1, 1))
        amplitude = rng.normal(size=(n, channels, 1, 1))
        fields += (amplitude * np.cos(2 * np.pi * (ky * rows + kx * cols) + phase)).astype(np.float32)
    return fields + 0.1 * rng.normal(size=fields.shape).astype(np.float32)


def generate(days: int = 1250, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(predictors (days, 20, 8, 16), precipitation (days, 512) in mm, 0 on dry points)."""
    rng = np.random.default_rng(seed)
    x = _smooth_fields(rng, days, FIELDS, COARSE)
    weights = rng.normal(size=FIELDS).astype(np.float32) / np.sqrt(FIELDS)
    moisture = np.tensordot(x, weights, axes=([1], [0]))  # (days, 8, 16)
    fine = torch.nn.functional.interpolate(torch.from_numpy(moisture)[:, None], size=FINE, mode="bilinear",
                                           align_corners=False)[:, 0].numpy()
    orography = _smooth_fields(rng, 1, 1, FINE, modes=6)[0, 0]  # fixed in time: where air is lifted
    index = 1.5 * fine + 0.8 * orography - 0.5
    p_rain = 1 / (1 + np.exp(-2.0 * index))
    rain = rng.random(p_rain.shape) < p_rain
    shape = 0.8 + 0.4 * np.clip(index, 0, None)
    scale = 2.0 * np.exp(0.5 * np.clip(index, -2, 2))
    amount = rng.gamma(shape, scale).astype(np.float32)
    y = np.where(rain, np.maximum(amount, 0.1), 0.0).astype(np.float32)
    return x, y.reshape(days, POINTS)


def make_data(seed: int = 0):
    """(train, test) Datasets: 1,000 days to train on, the last 250 to test (a period held out)."""
    x, y = generate(seed=seed)
    split = 1000
    return (TensorDataset(torch.from_numpy(x[:split]), torch.from_numpy(y[:split])),
            TensorDataset(torch.from_numpy(x[split:]), torch.from_numpy(y[split:])))


class DownscalingNet(nn.Module):
    """Parallel convolution branches (kernels 2-9) over the predictors, then 3 numbers per grid point."""

    def __init__(self, fields: int = FIELDS, points: int = POINTS, kernels=(2, 3, 5, 7, 9), width: int = 8) -> None:
        super().__init__()
        # Padded so that every branch keeps the grid's size, odd kernels and even ones (k=2) alike.
        self.branches = nn.ModuleList(nn.Sequential(nn.ZeroPad2d(((k - 1) // 2, k // 2, (k - 1) // 2, k // 2)),
                                                    nn.Conv2d(fields, width, k)) for k in kernels)
        self.mix = nn.Conv2d(width * len(kernels), width, 3, padding=1)
        self.head = nn.Linear(width * COARSE[0] * COARSE[1], 3 * points)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.cat([torch.relu(branch(x)) for branch in self.branches], dim=1)
        return self.head(torch.relu(self.mix(features)).flatten(1))  # (batch, 3 * points): logit p, log shape, log scale


def make_model(input_shape=(FIELDS, *COARSE), num_outputs=POINTS) -> nn.Module:
    """The model factory `--model downscaling:make_model` calls (regression: one output per grid point asked)."""
    return DownscalingNet(input_shape[0], POINTS)


def bernoulli_gamma_nll(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of daily precipitation under a Bernoulli-Gamma per grid point."""
    logit, log_shape, log_scale = output.reshape(len(output), 3, -1).unbind(1)
    target = target.reshape(logit.shape).float()
    wet = target > 0
    shape, scale = log_shape.exp(), log_scale.exp()
    amount = target.clamp_min(1e-6)
    wet_ll = (torch.nn.functional.logsigmoid(logit) + (shape - 1) * amount.log() - amount / scale
              - shape * log_scale - torch.lgamma(shape))
    dry_ll = torch.nn.functional.logsigmoid(-logit)
    return -torch.where(wet, wet_ll, dry_ll).mean()


def climatology_nll(train_y: np.ndarray, test_y: np.ndarray) -> float:
    """The skill floor: each grid point's rain frequency and a Gamma fitted to its wet days (moments)."""
    wet = train_y > 0
    p = wet.mean(0).clip(1e-3, 1 - 1e-3)
    amounts = np.where(wet, train_y, np.nan)
    mean, var = np.nanmean(amounts, 0), np.nanvar(amounts, 0)
    shape, scale = mean ** 2 / var, var / mean
    output = torch.from_numpy(np.concatenate([np.log(p / (1 - p)), np.log(shape), np.log(scale)]).astype(np.float32))
    return float(bernoulli_gamma_nll(output.expand(len(test_y), -1), torch.from_numpy(test_y)))


def main() -> None:
    import dptrain

    parser = argparse.ArgumentParser(description="Precipitation downscaling with dptrain (a user's own script).")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--strategy", choices=["allreduce", "sync"], default="sync")
    parser.add_argument("--lr", type=float, default=1e-3, help="per worker; multiplied by the number of workers")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--out", default=os.environ.get("DPTRAIN_RUN_DIR"),
                        help="run directory (default: the one `dptrain launch` made for this job, if any)")
    args = parser.parse_args()

    train, test = make_data(seed=0)
    torch.manual_seed(0)
    model = make_model()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * world)
    strategy = dptrain.Sync() if args.strategy == "sync" else dptrain.AllReduce()
    trainer = dptrain.Trainer(model, optimizer, bernoulli_gamma_nll, strategy, batch_size=args.batch_size,
                              out=args.out, checkpoint_every=1 if args.out else 0, resume=bool(args.out))
    summary = trainer.fit(train, test, epochs=args.epochs)
    if int(os.environ.get("RANK", "0")) == 0:
        floor = climatology_nll(train.tensors[1].numpy(), test.tensors[1].numpy())
        print(f"downscaling: test NLL {summary.test_loss:.4f} against climatology {floor:.4f} "
              f"({'better' if summary.test_loss < floor else 'not better'}; {math.exp(floor - summary.test_loss):.2f}x "
              "the likelihood per point)")


if __name__ == "__main__":
    import dptrain

    dptrain.run(main)
