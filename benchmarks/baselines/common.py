"""What the baseline scripts share: their flags, the data as tensors, and the run files `dptrain bench` reads."""

import argparse
import json
import os
import time

import torch

from dptrain.data import load_dataset
from dptrain.models import build_model


def exit_without_finalizing(code=0):
    """Leave without interpreter finalization, as `dptrain` itself does (dptrain.runtime.distributed.exit_process).

    With torch 2.13 on gloo, a finished two-rank DDP script aborts at exit about one run in thirty:
    a gloo worker thread still releasing the last collective's tensors needs the GIL while the
    interpreter is finalizing, and the C++ runtime calls std::terminate. Not a dptrain matter,
    but it would fail a benchmark run whose results were already written.
    """
    import sys
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def arguments(description):
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dataset", default="digits")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    return args


def data_and_model(args):
    """(train TensorDataset, x_test, y_test, model): dptrain's data set and its seeded model, nothing else of dptrain."""
    data = load_dataset(args.dataset, seed=args.seed, samples=args.samples, image_size=args.image_size)
    x_train, y_train = _tensors(data.x_train, data.y_train)
    x_test, y_test = _tensors(data.x_test, data.y_test)
    torch.manual_seed(args.seed)
    model = build_model(args.model, data.input_shape, data.num_outputs)
    return torch.utils.data.TensorDataset(x_train, y_train), x_test, y_test, model


def _tensors(x, y):
    return torch.from_numpy(x.to_numpy()).float(), torch.from_numpy(y.to_numpy()).long()


def fit(model, optimizer, loader, epochs, test_accuracy, sampler=None):
    """The textbook loop every baseline runs: SGD steps over the loader, then `test_accuracy()`
    (in eval mode, without gradients) once per epoch; returns (records, wall seconds, samples trained here)."""
    loss_fn = torch.nn.CrossEntropyLoss()
    records, samples = [], 0
    started = time.perf_counter()
    for epoch in range(epochs):
        epoch_start = time.perf_counter()
        if sampler is not None:
            sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            samples += len(x)
        epoch_seconds = time.perf_counter() - epoch_start
        model.eval()
        with torch.no_grad():
            accuracy = test_accuracy()
        records.append({"epoch": epoch + 1, "test_accuracy": accuracy, "epoch_seconds": epoch_seconds,
                        "wall_seconds": time.perf_counter() - started})
    return records, time.perf_counter() - started, samples


def shard_counts(model, x_test, y_test, rank, world):
    """[correct, count] on this rank's slice of the test set, in float64, to be summed across ranks."""
    mine = slice(rank, None, world)
    correct = (model(x_test[mine]).argmax(1) == y_test[mine]).sum().item()
    return torch.tensor([correct, len(y_test[mine])], dtype=torch.float64)


def write_run(out, strategy, workers, records, wall, samples, model, comm_bytes=None):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.jsonl"), "w") as handle:
        handle.writelines(json.dumps(record) + "\n" for record in records)
    summary = {"strategy": strategy, "workers": workers, "epochs": len(records),
               "test_accuracy": records[-1]["test_accuracy"], "wall_seconds": wall,
               "samples_per_second": samples / wall, "comm_bytes": comm_bytes,
               "model_parameters": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(out, "summary.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
