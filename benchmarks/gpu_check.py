"""`make gpu-check`: does dptrain work, and how fast, on one CUDA GPU? Writes a JSON and prints a short table.

    .venv/bin/python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check.json] [--budget 420]
    .venv/bin/python benchmarks/gpu_check.py --dry-run-cpu --out /tmp/gpu_check.json   # the same steps, tiny, on the CPU

Steps, each in a child process of its own with a time limit (a crash, a hang or a CUDA error in
one step is recorded in the JSON as that step's error, and the other steps still run):

- nccl: a one-rank NCCL process group: all_reduce, broadcast and all_gather_object on the GPU;
- strategy:allreduce|sync|async|fedavg: `dptrain train` of the cnn on digits (5 epochs), one rank, on the GPU
  (backend NCCL); checks that it finished, on the GPU, with NCCL, above MIN_ACCURACY;
- amp:bf16, amp:fp16: the same with `--amp bf16` / `--amp fp16` (fp16 trains with a GradScaler:
  the check reads the scaler's scale from the run's checkpoint);
- ranks:STRATEGY, every strategy (allreduce, sync, async, fedavg, streaming, hierarchical, auto): `dptrain train
  --workers 2` through dptrain's own launcher, DDP built and every exchange crossing ranks. NCCL where the
  machine has a GPU per rank; on a machine with one GPU both ranks share it through gloo with CUDA tensors
  (DPTRAIN_BACKEND=gloo: NCCL refuses two ranks on one device), which the JSON says as `backend`;
- shard:full, shard:hybrid, shard:offload: a sharded model (FSDP2, --shard): full on 2 ranks under allreduce,
  hybrid with --shard-size 2 on 4 ranks under sync (through gloo with CUDA tensors where one GPU serves them
  all), full with --shard-precision bf16, --shard-checkpoint and --shard-offload; shard:reshard: a checkpoint of
  --shard full on 2 ranks continued unsharded (each rank's rows read from the shard files, onto the GPU);
- shard:heal: hybrid with --shard-size 2 on 4 ranks under allreduce with --min-workers 1 --replace-workers, rank 2
  killed halfway through epoch 2: ranks 4 and 5 start as a new replica group and join, each healed shard by shard
  from its peer in the live group (the bytes that healed them against the model's); the run ends on 4 ranks;
- shard:within: hybrid with --shard-size 2 on 4 ranks cut at step 5 of epoch 1 (a checkpoint every 5 steps),
  continued with --shard full on 2: the rest of the epoch re-planned over the one group, every row read once;
- shard:async: hybrid with --shard-size 2 on 4 ranks under async: one merge service per place of a group, each
  holding its shard of the global model on the CPU (flat_state), the replies loaded into the CUDA shards.
  Like the other shard steps, on CUDA these run through NCCL where the machine has a GPU per rank, else through
  gloo with CUDA tensors (DPTRAIN_BACKEND=gloo), and the JSON's `backend` says which;
- live:kill: sync on 3 workers with --min-workers 2, rank 1 killed halfway through epoch 2: the others go on
  (the rebuilt group's collectives, the object gathers, the abandoned communicator);
- live:join: the same with --replace-workers: a new worker joins and is healed from a peer;
- resume:int8: sync with --compression int8 for 2 epochs with checkpoints, then the same command for 3: it
  resumes after epoch 2 (the error-feedback residual back on the GPU);
- amp:clip: allreduce on 2 ranks with --amp bf16 and --grad-clip 1.0;
- torchrun: `torchrun --nproc-per-node 2 -m dptrain train`: torchrun's LOCAL_RANK mapping;
- dptrain:resnet|nfnet and plain:resnet|nfnet: images/s of dptrain's training loop
  (`dptrain train` on synthetic-images, the median epoch rate after the first) against a plain
  PyTorch loop over the same data, model, batch size and optimizer on the same GPU, and the peak
  GPU memory of each (torch.cuda.max_memory_allocated).

A global time budget (--budget seconds, 420 by default, so the whole check stays under 8
minutes) bounds everything: a step that would start after it is spent is recorded as skipped,
and each step's limit is at most what is left. Without a CUDA GPU it prints one line and exits 0.
Exit code: 0 when every step ran and passed, 1 otherwise (the JSON says which and why).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"
NO_GPU = "no CUDA GPU here: skipping the GPU check"
MIN_ACCURACY = 0.5  # digits has 10 classes: chance is 0.1; a working run of a few epochs is far above 0.5
STRATEGIES = ("allreduce", "sync", "async", "fedavg")
EVERY_STRATEGY = STRATEGIES + ("streaming", "hierarchical", "auto")
AMPS = ("bf16", "fp16")
MODELS = ("resnet", "nfnet")
STEP_LIMIT = 150.0  # seconds one step may take at most
HEAL_EPOCHS = 40  # shard:heal: epochs enough for a new replica group to start and join (as live:join)
HEAL_EXTRA = 64_000  # shard:heal: bytes a heal sends besides weights, momentum and history (random states)
WITHIN_EVERY = 5  # shard:within: a checkpoint every 5 steps; an epoch of digits on 2 groups of 2 x 32 has 12

# Sizes of the steps: on the GPU, and tiny on the CPU (--dry-run-cpu).
# The strategy and AMP runs: the cnn on digits reaches about 0.94 in 5 epochs of batch 32 on one worker
# (benchmarks/README.md, section 2); the dry run's mlp about 0.8 in 2.
SIZES = {
    "gpu": {"model": "cnn", "epochs": 5, "batch": 32, "lr": 0.01, "image_samples": 8192, "image_batch": 256,
            "image_epochs": 3},
    "cpu": {"model": "mlp", "epochs": 2, "batch": 32, "lr": 0.05, "image_samples": 32, "image_batch": 16,
            "image_epochs": 2},
}


def all_steps() -> list[str]:
    """In the order they run: where the budget runs out, what crosses ranks has been checked first."""
    return (["nccl", "strategy:allreduce"] + [f"ranks:{s}" for s in EVERY_STRATEGY]
            + ["shard:full", "shard:hybrid", "shard:offload", "shard:reshard", "shard:heal", "shard:within",
               "shard:async"]
            + ["live:kill", "live:join", "memory:live", "resume:int8", "amp:clip", "torchrun"]
            + [f"amp:{a}" for a in AMPS] + [f"strategy:{s}" for s in STRATEGIES if s != "allreduce"]
            + [f"{kind}:{model}" for model in MODELS for kind in ("dptrain", "plain")])


# -- the steps, each run in a child process ----------------------------------------------------------

def _peak_memory(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    return {"peak_memory_bytes": torch.cuda.max_memory_allocated(device)}


def step_nccl(device: str, sizes: dict, workdir: Path) -> dict:
    """A one-rank process group on the GPU (NCCL; gloo on the CPU): three collectives with known answers."""
    import torch
    import torch.distributed as dist

    backend = "nccl" if device == "cuda" else "gloo"
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.arange(4, dtype=torch.float32, device=dev)
        dist.all_reduce(tensor)
        dist.broadcast(tensor, src=0)
        gathered = [None]
        dist.all_gather_object(gathered, {"rank": 0})
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ok = tensor.cpu().tolist() == [0.0, 1.0, 2.0, 3.0] and gathered == [{"rank": 0}]
        return {"ok": ok, "backend": dist.get_backend(), "values": tensor.cpu().tolist(),
                **({} if ok else {"error": "a collective returned the wrong values"})}
    finally:
        dist.destroy_process_group()


def _train(settings: dict):
    from dptrain.train.command import train_from_config

    return train_from_config({"progress": False, "workers": 1, "seed": 0, **settings})


def _check_run(summary, device: str, extra: dict) -> dict:
    expected_backend = "nccl" if device == "cuda" else "gloo"
    problems = []
    if summary.backend != expected_backend:
        problems.append(f"backend {summary.backend}, not {expected_backend}")
    if not summary.device.startswith(device):
        problems.append(f"trained on {summary.device}, not {device}")
    if summary.test_accuracy is None or summary.test_accuracy < MIN_ACCURACY:
        problems.append(f"test accuracy {summary.test_accuracy} below {MIN_ACCURACY}")
    result = {"ok": not problems, "strategy": summary.strategy, "backend": summary.backend, "device": summary.device,
              "test_accuracy": summary.test_accuracy, "wall_seconds": summary.wall_seconds,
              "samples_per_second": summary.samples_per_second, **extra}
    if problems:
        result["error"] = "; ".join(problems)
    return result


def step_strategy(name: str, device: str, sizes: dict, workdir: Path) -> dict:
    import torch

    summary = _train({"strategy": name, "device": device, "dataset": "digits", "model": sizes["model"],
                      "epochs": sizes["epochs"], "batch_size": sizes["batch"], "out": str(workdir / f"strategy-{name}")})
    return _check_run(summary, device, _peak_memory(torch.device(device, 0) if device == "cuda" else torch.device("cpu")))


def step_amp(amp: str, device: str, sizes: dict, workdir: Path) -> dict:
    import torch

    from dptrain.errors import UserError

    out = workdir / f"amp-{amp}"
    try:
        summary = _train({"strategy": "allreduce", "device": device, "dataset": "digits", "model": sizes["model"], "amp": amp,
                          "epochs": sizes["epochs"], "batch_size": sizes["batch"], "out": str(out),
                          "checkpoint_every": 1, "keep_checkpoints": 1})
    except UserError as error:
        if amp == "fp16" and device == "cpu":  # the dry run: fp16 needs a GPU, and dptrain says so
            return {"ok": "--amp fp16 needs a GPU" in str(error), "note": f"refused on the CPU as expected: {error}"}
        raise
    extra = _peak_memory(torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    # The GradScaler's state goes into each checkpoint: its scale under fp16, nothing under bf16.
    saved = sorted((out / "checkpoints").glob("epoch-*/rank-00000.pt"))
    if not saved:
        raise RuntimeError(f"no checkpoint in {out / 'checkpoints'} to read the GradScaler state from")
    state = torch.load(saved[-1], weights_only=True)["scaler"]
    extra["grad_scaler_scale"] = float(state["scale"]) if "scale" in state else None
    result = _check_run(summary, device, extra)
    if amp == "fp16" and extra.get("grad_scaler_scale") is None:
        result["ok"] = False
        result["error"] = (result.get("error", "") + "; " if "error" in result else "") + \
            "no GradScaler state in the checkpoint"
    return result


def step_dptrain_rate(model: str, device: str, sizes: dict, workdir: Path) -> dict:
    """dptrain's training loop on synthetic-images: median images/s of the epochs after the first."""
    import torch

    out = workdir / f"dptrain-{model}"
    summary = _train({"strategy": "allreduce", "device": device, "dataset": "synthetic-images", "model": model,
                      "samples": sizes["image_samples"], "image_size": 32, "epochs": sizes["image_epochs"],
                      "batch_size": sizes["image_batch"], "lr": 0.01, "checkpoint_every": 0, "out": str(out)})
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rates = [record["samples_per_second"] for record in records[1:]] or [records[-1]["samples_per_second"]]
    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    return {"ok": summary.backend == ("nccl" if device == "cuda" else "gloo"), "images_per_second": statistics.median(rates),
            "epoch_rates": [record["samples_per_second"] for record in records], "batch_size": sizes["image_batch"],
            "train_samples": sum(w["samples"] for w in records[0]["workers"]), **_peak_memory(dev)}


def step_plain_rate(model_name: str, device: str, sizes: dict, workdir: Path) -> dict:
    """A plain PyTorch loop: the same data, model, batch size and optimizer; images/s of the epochs after the first."""
    import torch

    from dptrain.data import load_dataset
    from dptrain.models import build_model

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    data = load_dataset("synthetic-images", seed=0, samples=sizes["image_samples"], image_size=32)
    train = data.train_set()
    x, y = train.__getitems__(list(range(len(train))))
    torch.manual_seed(0)
    model = build_model(model_name, data.input_shape, data.num_outputs).to(dev)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    batch = sizes["image_batch"]
    rates = []
    model.train()
    for epoch in range(sizes["image_epochs"]):
        order = torch.randperm(len(y))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        for first in range(0, len(y), batch):
            rows = order[first:first + batch]
            inputs, targets = x[rows].to(dev, non_blocking=True), y[rows].long().to(dev, non_blocking=True)
            loss = loss_fn(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        rates.append(len(y) / (time.perf_counter() - start))
    return {"ok": True, "images_per_second": statistics.median(rates[1:] or rates), "epoch_rates": rates,
            "batch_size": batch, "train_samples": len(y), **_peak_memory(dev)}


def _several_ranks_env(device: str, ranks: int) -> dict:
    """The environment for `ranks` ranks on this machine: gloo with CUDA tensors where there are fewer GPUs."""
    import torch

    env = dict(os.environ)
    if device == "cuda" and torch.cuda.device_count() < ranks:
        env["DPTRAIN_BACKEND"] = "gloo"
    return env


def _cli(argv: list, workdir: Path, env: dict, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)


def _ranks_result(done: subprocess.CompletedProcess, out: Path, device: str, env: dict, ranks: int,
                  expect: Optional[str] = None) -> dict:
    """What a several-rank run left: exit code, summary.json's backend, device, workers and accuracy."""
    problems = []
    if done.returncode != 0:
        problems.append(f"exit code {done.returncode}: {(done.stderr.strip().splitlines() or [''])[-1]}")
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    backend = "gloo" if device == "cpu" or env.get("DPTRAIN_BACKEND") == "gloo" else "nccl"
    if summary and summary.get("backend") != backend:
        problems.append(f"backend {summary.get('backend')}, not {backend}")
    if summary and not str(summary.get("device", "")).startswith(device):
        problems.append(f"trained on {summary.get('device')}, not {device}")
    if summary and summary.get("workers") != ranks:
        problems.append(f"{summary.get('workers')} workers at the end, not {ranks}")
    if summary and (summary.get("test_accuracy") or 0) < MIN_ACCURACY:
        problems.append(f"test accuracy {summary.get('test_accuracy')} below {MIN_ACCURACY}")
    if expect is not None and expect not in done.stdout + done.stderr:
        problems.append(f"no line saying {expect!r}")
    if not summary and not problems:
        problems.append("no summary.json")
    result = {"ok": not problems, "backend": summary.get("backend"), "device": summary.get("device"),
              "workers": summary.get("workers"), "test_accuracy": summary.get("test_accuracy")}
    if problems:
        result["error"] = "; ".join(problems)
    return result


def _train_argv(strategy: str, sizes: dict, out: Path, device: str, workers: int, *extra: str) -> list:
    return [sys.executable, "-m", "dptrain", "train", "--strategy", strategy, "--dataset", "digits", "--model",
            sizes["model"], "--epochs", str(sizes["epochs"]), "--batch-size", str(sizes["batch"]), "--lr",
            str(sizes["lr"]), "--device",
            device, "--workers", str(workers), "--no-progress", "--out", str(out), *extra]


def step_ranks(strategy: str, device: str, sizes: dict, workdir: Path) -> dict:
    env, out = _several_ranks_env(device, 2), workdir / f"ranks-{strategy}"
    extra = ["--ranks-per-node", "1"] if strategy == "hierarchical" else []
    return _ranks_result(_cli(_train_argv(strategy, sizes, out, device, 2, *extra), workdir, env), out, device, env, 2)


def step_shard(kind: str, device: str, sizes: dict, workdir: Path) -> dict:
    """A sharded model (FSDP2 on the run's own group, its mesh on the rank's device): `--shard full` on 2 ranks
    under allreduce; `--shard hybrid --shard-size 2` on 4 under sync (2 replica groups averaging their shards);
    offload: full on 2 ranks with bf16 parameters, activation checkpointing and the shards offloaded to the CPU;
    reshard: full on 2 ranks for one epoch, then the run continued unsharded from its checkpoint."""
    ranks = 4 if kind in ("hybrid", "async") else 2
    env, out = _several_ranks_env(device, ranks), workdir / f"shard-{kind}"
    if kind == "reshard":
        first = _cli(_train_argv("allreduce", {**sizes, "epochs": 1}, out, device, ranks, "--shard", "full"), workdir,
                     env, timeout=140)
        if first.returncode != 0:
            return _ranks_result(first, out, device, env, ranks)
        return _ranks_result(_cli(_train_argv("allreduce", sizes, out, device, ranks), workdir, env, timeout=140), out,
                             device, env, ranks, expect="resharded from replica groups of 2 ranks onto unsharded workers")
    extra = ["--shard", "hybrid", "--shard-size", "2"] if kind in ("hybrid", "async") else ["--shard", "full"]
    if kind == "offload":  # (the CPU has nothing to offload to: the dry run leaves --shard-offload out)
        extra += ["--shard-precision", "bf16", "--shard-checkpoint"] + (["--shard-offload"] if device == "cuda" else [])
    strategy = {"hybrid": "sync", "async": "async"}.get(kind, "allreduce")
    if kind == "async":  # 2 groups of a batch of 2 x 32 without a barrier: more epochs to pass the accuracy bar
        sizes = {**sizes, "epochs": 3 * sizes["epochs"]}
    done = _cli(_train_argv(strategy, sizes, out, device, ranks, *extra), workdir, env, timeout=140)
    return _ranks_result(done, out, device, env, ranks)


def _records(out: Path) -> list:
    """metrics.jsonl: one record an epoch (none where the run wrote no file)."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _failed(result: dict, problem: str) -> dict:
    """`result` failed for `problem` too."""
    result.update(ok=False, error="; ".join(filter(None, [result.get("error"), problem])))
    return result


def step_shard_heal(device: str, sizes: dict, workdir: Path) -> dict:
    """Live membership of replica groups: `--shard hybrid --shard-size 2` on 4 ranks under allreduce (HSDP) with
    --min-workers 1 --replace-workers, rank 2 killed halfway through epoch 2. Its group leaves (rank 3 with it); the
    launcher starts ranks 4 and 5 as a new replica group, which joins at an epoch end, each rank healed from its
    peer in the live group (ranks 0 and 1) shard by shard over the groups across; the run ends on 4 ranks. (Not
    sync: 2 groups under sync need --min-workers 2, and one left has nobody to average with.) The JSON has the
    bytes that healed them (metrics.jsonl's membership record) beside the model's: the model and SGD's momentum
    once each, summed over the 2 groups across, with the senders' random states and plain values, so 2 x the
    model's bytes and at most HEAL_EXTRA more, beside the history the 2 senders hand over (tests/
    test_sharded_replace.py checks the same on the CPU): a rank that sent a whole model, not its shards, fails it."""
    env, out = _several_ranks_env(device, 4), workdir / "shard-heal"
    env.update(DPTRAIN_FAULT="train-middle@2:2", DPTRAIN_FAULT_ONCE=str(workdir / "fired"))
    extra = ["--shard", "hybrid", "--shard-size", "2", "--min-workers", "1", "--replace-workers"]
    sizes = {**sizes, "epochs": HEAL_EPOCHS}  # the new group needs seconds to start, and joins at an epoch end
    done = _cli(_train_argv("allreduce", sizes, out, device, 4, *extra), workdir, env, timeout=140)
    result = _ranks_result(done, out, device, env, 4,
                           expect="starting worker ranks 4, 5 as a new replica group in place of rank 2's")
    records = _records(out)
    first = next((i for i, record in enumerate(records) if record.get("membership", {}).get("joined")), None)
    if first is None:
        return _failed(result, "no epoch record says a replica group joined")
    change = records[first]["membership"]
    history = sum(len(json.dumps(record)) for record in records[:first])  # each sender's, as JSON: about its size
    result.update(joined=change["joined"], joined_after_epoch=change["continued_from_epoch"] - 1,
                  healed_bytes=change.get("healed_bytes"), history_bytes=history)
    if (out / "model.pt").is_file():
        import torch

        model = torch.load(out / "model.pt", weights_only=True)
        result["model_bytes"] = sum(tensor.numel() * tensor.element_size() for tensor in model.values())
    if change["joined"] != [4, 5]:
        return _failed(result, f"ranks {change['joined']} joined, not 4 and 5")
    healed, model_bytes, most = result["healed_bytes"], result.get("model_bytes"), HEAL_EXTRA + 2 * history
    if healed is None or model_bytes is None or not 2 * model_bytes <= healed < 2 * model_bytes + most:
        return _failed(result, f"{healed} bytes healed the new group, not 2 x the model's {model_bytes} (its "
                               f"weights and momentum) plus at most {most}")
    return result


def step_shard_within(device: str, sizes: dict, workdir: Path) -> dict:
    """Resharding within an epoch: `--shard hybrid --shard-size 2` on 4 ranks under allreduce with a checkpoint every
    WITHIN_EVERY steps for one epoch, cut after the first of them (the later checkpoints, model.pt, summary.json and
    metrics.jsonl removed, as if killed there), then continued with `--shard full` on 2 ranks: the rest of epoch 1
    (every row the 4 had not read) is re-planned over the one replica group, so epoch 1's record counts every
    training row once."""
    env, out = _several_ranks_env(device, 4), workdir / "shard-within"
    every = ["--checkpoint-every-steps", str(WITHIN_EVERY), "--keep-checkpoints", "50"]
    first = _cli(_train_argv("allreduce", {**sizes, "epochs": 1}, out, device, 4, "--shard", "hybrid", "--shard-size",
                             "2", *every), workdir, env, timeout=140)
    if first.returncode != 0:
        return _ranks_result(first, out, device, env, 4)
    checkpoints, cut = out / "checkpoints", f"epoch-000000-step-{WITHIN_EVERY:06d}"
    if not (checkpoints / cut).is_dir():
        return {"ok": False, "error": f"no checkpoint {cut} to cut the run at, only "
                                      f"{sorted(path.name for path in checkpoints.iterdir())}"}
    for later in [path for path in checkpoints.iterdir() if path.name > cut]:
        shutil.rmtree(later)
    for name in ("model.pt", "summary.json", "metrics.jsonl"):
        (out / name).unlink()
    env = _several_ranks_env(device, 2)
    done = _cli(_train_argv("allreduce", sizes, out, device, 2, "--shard", "full", *every), workdir, env, timeout=140)
    result = _ranks_result(done, out, device, env, 2,
                           expect="the rest of epoch 1 re-planned over 1 replica group of 2 ranks")
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    train_rows = summary.get("data", {}).get("train_samples")
    rows = [sum(worker["samples"] for worker in record["workers"]) for record in _records(out)]
    result.update(cut_at=cut, train_rows=train_rows, rows_per_epoch=rows)
    if not rows or rows[0] != train_rows:
        return _failed(result, f"epoch 1 read {rows[0] if rows else 'no'} rows, not the {train_rows} training rows")
    return result


def step_live(kind: str, device: str, sizes: dict, workdir: Path) -> dict:
    env, out = _several_ranks_env(device, 3), workdir / f"live-{kind}"
    env.update(DPTRAIN_FAULT="train-middle@1:2", DPTRAIN_FAULT_ONCE=str(workdir / "fired"))
    extra = ["--min-workers", "2"] + (["--replace-workers"] if kind == "join" else [])
    sizes = {**sizes, "epochs": 40 if kind == "join" else max(sizes["epochs"], 3)}  # a joiner needs seconds to start
    done = _cli(_train_argv("sync", sizes, out, device, 3, *extra), workdir, env, timeout=140)
    return _ranks_result(done, out, device, env, 3 if kind == "join" else 2, expect="without rank 1")


def step_resume_int8(device: str, sizes: dict, workdir: Path) -> dict:
    """Rank 1 killed in epoch 3; the restarted world (--max-restarts 1) resumes from epoch 2's checkpoint."""
    env, out = _several_ranks_env(device, 2), workdir / "resume-int8"
    env.update(DPTRAIN_FAULT="train-middle@1:3", DPTRAIN_FAULT_ONCE=str(workdir / "fired"))
    argv = _train_argv("sync", {**sizes, "epochs": 3}, out, device, 2, "--compression", "int8", "--max-restarts", "1")
    return _ranks_result(_cli(argv, workdir, env, timeout=140), out, device, env, 2, expect="resuming after epoch 2")


def step_amp_clip(device: str, sizes: dict, workdir: Path) -> dict:
    env, out = _several_ranks_env(device, 2), workdir / "amp-clip"
    return _ranks_result(_cli(_train_argv("allreduce", sizes, out, device, 2, "--amp", "bf16", "--grad-clip", "1.0"),
                              workdir, env), out, device, env, 2)


def step_torchrun(device: str, sizes: dict, workdir: Path) -> dict:
    env, out = _several_ranks_env(device, 2), workdir / "torchrun"
    argv = _train_argv("allreduce", sizes, out, device, 2)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
            *argv[2:argv.index("--workers")], *argv[argv.index("--workers") + 2:]]
    result = _ranks_result(_cli(argv, workdir, env), out, device, env, 2)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {}
    if summary and summary.get("launcher") != "torchrun":
        result.update(ok=False, error=f"launcher {summary.get('launcher')}, not torchrun")
    return result


def step_memory_live(device: str, sizes: dict, workdir: Path) -> dict:
    """Peak memory on the model's device of one rank training a 25M-parameter MLP with Adam, with live
    membership (--min-workers 1, a commit every 2 steps: a state kept at each epoch start and commit) and
    without: the states are kept in host memory (dptrain.train.host_copy), so the difference should be at
    most 0.1 x the model state (parameters, gradients and Adam's two moments: 16 bytes per parameter)."""
    import torch

    from dptrain.strategies import AllReduce
    from dptrain.train.trainer import Trainer

    dev = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
    width = 2048 if device == "cuda" else 64
    peaks = {}
    for live in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[layer for _ in range(6) for layer in (torch.nn.Linear(width, width),
                                                                            torch.nn.ReLU())],
                                    torch.nn.Linear(width, 10))
        parameters = sum(p.numel() for p in model.parameters())
        x, y = torch.randn(512, width), torch.randint(0, 10, (512,))
        options = {"min_workers": 1, "commit_every_steps": 2} if live else {}
        trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=1e-4), strategy=AllReduce(), batch_size=64,
                          device=device, verbose=False, progress=False, **options)
        if device == "cuda":
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        trainer.fit((x, y), epochs=2)
        peaks[live] = torch.cuda.max_memory_allocated(dev) if device == "cuda" else None
        del trainer, model
        if device == "cuda":
            torch.cuda.empty_cache()
    model_state = 16 * parameters
    result = {"parameters": parameters, "model_state_bytes": model_state,
              "peak_memory_bytes": peaks[True], "peak_memory_without_live_bytes": peaks[False]}
    if device != "cuda":
        return {"ok": True, "note": "peak memory is measured on a GPU only", **result}
    overhead = peaks[True] - peaks[False]
    result.update(live_overhead_bytes=overhead, live_overhead_of_model_state=round(overhead / model_state, 4),
                  ok=overhead <= 0.1 * model_state)
    if not result["ok"]:
        result["error"] = f"live membership took {overhead / 2 ** 20:,.0f} MiB more on the GPU, above 0.1 x the " \
                          f"model state ({model_state / 2 ** 20:,.0f} MiB)"
    return result


def run_step(name: str, device: str, sizes: dict, workdir: Path) -> dict:
    kind, _, arg = name.partition(":")
    if name == "memory:live":
        return step_memory_live(device, sizes, workdir)
    if kind == "ranks":
        return step_ranks(arg, device, sizes, workdir)
    if kind == "live":
        return step_live(arg, device, sizes, workdir)
    if name == "shard:heal":
        return step_shard_heal(device, sizes, workdir)
    if name == "shard:within":
        return step_shard_within(device, sizes, workdir)
    if kind == "shard":
        return step_shard(arg, device, sizes, workdir)
    if name == "resume:int8":
        return step_resume_int8(device, sizes, workdir)
    if name == "amp:clip":
        return step_amp_clip(device, sizes, workdir)
    if kind == "torchrun":
        return step_torchrun(device, sizes, workdir)
    if kind == "nccl":
        return step_nccl(device, sizes, workdir)
    if kind == "strategy":
        return step_strategy(arg, device, sizes, workdir)
    if kind == "amp":
        return step_amp(arg, device, sizes, workdir)
    if kind == "dptrain":
        return step_dptrain_rate(arg, device, sizes, workdir)
    if kind == "plain":
        return step_plain_rate(arg, device, sizes, workdir)
    raise ValueError(f"unknown step {name!r}")


def child(args: argparse.Namespace) -> int:
    """Run one step; its result is the last line of stdout, as JSON."""
    started = time.perf_counter()
    try:
        from dptrain.runtime.distributed import set_cpu_threads

        set_cpu_threads()
        result = run_step(args.step, args.device, SIZES[args.sizes], Path(args.workdir))
    except BaseException as error:  # noqa: BLE001 - whatever failed is this step's result
        result = {"ok": False, "error": f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"}
    result["seconds"] = time.perf_counter() - started
    print("GPU_CHECK_RESULT " + json.dumps(result), flush=True)
    return 0


# -- the parent: budget, children, JSON, table -------------------------------------------------------

def run_child(name: str, device: str, sizes: str, workdir: Path, limit: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--device", device, "--sizes", sizes,
               "--workdir", str(workdir)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, env=env, cwd=workdir)
    except subprocess.TimeoutExpired as timeout:
        tail = (timeout.stderr or b"")
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"ok": False, "error": f"no result within its limit of {limit:.0f} s", "seconds": limit,
                "stderr_tail": tail[-2000:]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("GPU_CHECK_RESULT ")]
    if not lines:
        return {"ok": False, "error": f"the step's process exited with code {done.returncode} without a result",
                "seconds": time.perf_counter() - started, "stderr_tail": done.stderr[-2000:]}
    result = json.loads(lines[-1].removeprefix("GPU_CHECK_RESULT "))
    if not result.get("ok"):
        result["stderr_tail"] = done.stderr[-2000:]
    return result


def environment(device: str) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": device,
            "python": sys.version.split()[0]}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, gpus_visible=torch.cuda.device_count())
        try:
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as error:  # noqa: BLE001 - recorded, not fatal
            info["nccl"] = f"unknown ({type(error).__name__})"
    return info


def table(report: dict) -> str:
    rows = [("step", "status", "accuracy", "images/s", "peak MB", "seconds")]
    for name, result in report["steps"].items():
        status = "skipped" if result.get("skipped") else ("ok" if result.get("ok") else "FAILED")
        accuracy = f"{result['test_accuracy']:.3f}" if isinstance(result.get("test_accuracy"), float) else ""
        rate = f"{result['images_per_second']:,.0f}" if result.get("images_per_second") else ""
        peak = f"{result['peak_memory_bytes'] / 2 ** 20:,.0f}" if result.get("peak_memory_bytes") else ""
        seconds = f"{result['seconds']:.1f}" if isinstance(result.get("seconds"), (int, float)) else ""
        rows.append((name, status, accuracy, rate, peak, seconds))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    for model, ratio in report.get("dptrain_vs_plain", {}).items():
        lines.append(f"{model}: dptrain at {ratio:.2f}x the images/s of the plain loop")
    for name, result in report["steps"].items():
        if not result.get("ok") and not result.get("skipped"):
            lines.append(f"{name}: {result.get('error', 'failed')}")
        elif result.get("skipped"):
            lines.append(f"{name}: skipped: {result['skipped']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DEFAULT_OUT), help=f"where the JSON goes (default {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all steps together (default 420)")
    parser.add_argument("--dry-run-cpu", action="store_true", help="run every step on the CPU with tiny sizes (a test)")
    parser.add_argument("--steps", default=None, help="comma-separated subset of the steps (default: all)")
    parser.add_argument("--step", help=argparse.SUPPRESS)  # a child: run this one step
    parser.add_argument("--device", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        return child(args)

    begun = time.perf_counter()
    import torch

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    device, sizes = ("cpu", "cpu") if args.dry_run_cpu else ("cuda", "gpu")
    steps = all_steps() if args.steps is None else [s.strip() for s in args.steps.split(",") if s.strip()]
    report: dict = {"dry_run_cpu": args.dry_run_cpu, "budget_seconds": args.budget, "sizes": SIZES[sizes],
                    "min_accuracy": MIN_ACCURACY, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "steps": {}}
    try:
        report["environment"] = environment(device)
    except Exception as error:  # noqa: BLE001 - recorded; the steps still run
        report["environment"] = {"error": f"{type(error).__name__}: {error}"}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
        for name in steps:
            left = args.budget - (time.perf_counter() - begun)
            if left < 5:
                report["steps"][name] = {"ok": False, "skipped": f"the time budget of {args.budget:g} s is spent"}
                continue
            step_dir = Path(workdir) / name.replace(":", "-")
            step_dir.mkdir()
            report["steps"][name] = run_child(name, device, sizes, step_dir, min(STEP_LIMIT, left))
            print(f"gpu-check: {name}: {'ok' if report['steps'][name].get('ok') else 'FAILED'}", flush=True)
    ratios = {}
    for model in MODELS:
        ours, plain = report["steps"].get(f"dptrain:{model}", {}), report["steps"].get(f"plain:{model}", {})
        if ours.get("images_per_second") and plain.get("images_per_second"):
            ratios[model] = ours["images_per_second"] / plain["images_per_second"]
    report["dptrain_vs_plain"] = ratios
    report["wall_seconds"] = time.perf_counter() - begun
    ran = [result for result in report["steps"].values() if not result.get("skipped")]
    report["ok"] = len(ran) == len(report["steps"]) > 0 and all(result.get("ok") for result in ran)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"gpu-check: {'all steps passed' if report['ok'] else 'some steps failed or none ran'}; "
          f"{report['wall_seconds']:.0f} s; {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
