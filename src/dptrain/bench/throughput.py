"""Synthetic throughput benchmark, as in Horovod's: random data, warm-up steps, timed iterations, images/s per worker.

Each rank trains `model` with dptrain's allreduce strategy (DDP) on one fixed random batch:
`warmup` untimed steps, then `iterations` timed iterations of `batches` steps each. A rank's
rate in an iteration is batch_size x batches / seconds; the per-worker rate of an iteration is
the mean over ranks, reported as mean ± 1.96·std over iterations (the paper's convention).

    python -m dptrain.bench.throughput --model resnet --out rate.json   # as every rank of a job
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from dptrain.bench.processes import run_ranks
from dptrain.runtime.env import free_port


def rate_summary(rates: list[list[float]]) -> tuple[float, float]:
    """(mean, 1.96·std) over iterations of the per-worker rate; rates[rank][iteration] in images/s."""
    per_iteration = [statistics.mean(column) for column in zip(*rates)]
    spread = 1.96 * statistics.stdev(per_iteration) if len(per_iteration) > 1 else 0.0
    return statistics.mean(per_iteration), spread


def measure(model_name: str, batch_size: int, image_size: int, warmup: int, iterations: int, batches: int) -> dict:
    """Run as one rank (or alone); rank 0 returns the result, the others an empty dict."""
    import torch

    from dptrain.models import build_model
    from dptrain.runtime.distributed import destroy_process_group, init_process_group, set_cpu_threads
    from dptrain.runtime.env import detect
    from dptrain.strategies.allreduce import AllReduce

    set_cpu_threads()
    ctx = init_process_group(detect(), device="auto")
    try:
        torch.manual_seed(0)
        model = build_model(model_name, (3, image_size, image_size), 10).to(ctx.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        trained = AllReduce().setup(model, optimizer, ctx)
        x = torch.randn(batch_size, 3, image_size, image_size, device=ctx.device)
        y = torch.randint(0, 10, (batch_size,), device=ctx.device)
        loss_fn = torch.nn.CrossEntropyLoss()

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss_fn(trained(x), y).backward()
            optimizer.step()

        for _ in range(warmup):
            step()
        rates = []
        for _ in range(iterations):
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            begun = time.perf_counter()
            for _ in range(batches):
                step()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            rates.append(batch_size * batches / (time.perf_counter() - begun))
        everyone = ctx.group.gather_objects("throughput: gathering the rates", rates)
        if not ctx.is_main:
            return {}
        mean, spread = rate_summary(everyone)
        return {"model": model_name, "workers": ctx.world_size, "batch_size": batch_size, "image_size": image_size,
                "warmup": warmup, "iterations": iterations, "batches_per_iteration": batches,
                "device": str(ctx.device), "images_per_second_per_worker": mean, "ci": spread,
                "images_per_second": mean * ctx.world_size, "rates": everyone}
    finally:
        destroy_process_group()


def run_throughput(models: list[str], workers: list[int], out: Path, *, batch_size: int, image_size: int,
                   warmup: int, iterations: int, batches: int, timeout: float = 1800.0, progress=None) -> list[dict]:
    """The synthetic benchmark for every (model, worker count); one row each (also OUT/throughput/NAME/result.json)."""
    rows = []
    for model in models:
        for n in workers:
            run_dir = out / "throughput" / f"{model}-w{n}"
            run_dir.mkdir(parents=True)
            command = [sys.executable, "-m", "dptrain.bench.throughput", "--model", model, "--batch-size", str(batch_size),
                       "--image-size", str(image_size), "--warmup", str(warmup), "--iterations", str(iterations),
                       "--batches", str(batches), "--out", str(run_dir / "result.json")]
            run_ranks(command, n, run_dir, port=free_port(), timeout=timeout)
            rows.append(json.loads((run_dir / "result.json").read_text()))
            if progress is not None:
                progress.update(1)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dptrain.bench.throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = measure(args.model, args.batch_size, args.image_size, args.warmup, args.iterations, args.batches)
    if result:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from dptrain.runtime.distributed import exit_process
    exit_process(main())
