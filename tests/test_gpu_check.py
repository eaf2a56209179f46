"""benchmarks/gpu_check.py (`make gpu-check`): on this CPU machine it says so in one line; its --dry-run-cpu
runs every step on the CPU with tiny sizes, so the script that will run on a GPU has run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
STEPS = ["nccl", "strategy:allreduce", "ranks:allreduce", "ranks:sync", "ranks:async", "ranks:fedavg", "ranks:streaming",
         "ranks:hierarchical", "ranks:auto", "shard:full", "shard:hybrid", "shard:offload", "shard:reshard", "shard:heal",
         "shard:within", "shard:async", "live:kill", "live:join", "memory:live", "resume:int8", "amp:clip", "torchrun",
         "amp:bf16", "amp:fp16", "strategy:sync", "strategy:async", "strategy:fedavg",
         "dptrain:resnet", "plain:resnet", "dptrain:nfnet", "plain:nfnet"]


def gpu_check(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the check would run")
def test_without_cuda_it_prints_one_line_and_exits_0_writing_nothing(tmp_path):
    result = gpu_check("--out", str(tmp_path / "check.json"), cwd=tmp_path)
    assert result.returncode == 0
    assert result.stdout == "no CUDA GPU here: skipping the GPU check\n"
    assert not (tmp_path / "check.json").exists()


def test_a_spent_budget_skips_every_step_and_fails(tmp_path):
    out = tmp_path / "check.json"
    result = gpu_check("--dry-run-cpu", "--budget", "0", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 1
    report = json.loads(out.read_text())
    assert list(report["steps"]) == STEPS
    assert all(step == {"ok": False, "skipped": "the time budget of 0 s is spent"} for step in report["steps"].values())
    assert report["ok"] is False


@pytest.mark.slow
def test_a_failing_step_is_recorded_and_the_others_still_run(tmp_path):
    out = tmp_path / "check.json"
    result = gpu_check("--dry-run-cpu", "--steps", "plain:nosuchmodel,nccl", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 1
    steps = json.loads(out.read_text())["steps"]
    assert steps["plain:nosuchmodel"]["ok"] is False
    assert steps["plain:nosuchmodel"]["error"].startswith("UserError: unknown model 'nosuchmodel'")
    assert steps["nccl"]["ok"] is True and steps["nccl"]["backend"] == "gloo"
    assert steps["nccl"]["values"] == [0.0, 1.0, 2.0, 3.0]
    assert "plain:nosuchmodel: UserError: unknown model 'nosuchmodel'" in result.stdout


# One of each kind of step (the other strategies' steps are the same code with another name; the whole
# list runs with `python benchmarks/gpu_check.py --dry-run-cpu`, about a minute on idle cores).
DRY_RUN_STEPS = ["nccl", "strategy:sync", "live:kill", "memory:live", "amp:bf16", "amp:fp16", "dptrain:nfnet",
                 "plain:nfnet"]


@pytest.mark.slow
@pytest.mark.timeout(900)  # seven processes that each import torch: half a minute idle, minutes on busy cores
def test_dry_run_on_the_cpu_runs_one_step_of_each_kind(tmp_path):
    out = tmp_path / "check.json"
    result = gpu_check("--dry-run-cpu", "--budget", "850", "--steps", ",".join(DRY_RUN_STEPS), "--out", str(out),
                       cwd=tmp_path)
    report = json.loads(out.read_text())
    assert result.returncode == 0, json.dumps(report["steps"], indent=1)
    assert report["ok"] is True and report["dry_run_cpu"] is True and list(report["steps"]) == DRY_RUN_STEPS
    steps = report["steps"]
    for strategy in ("sync",):
        run = steps[f"strategy:{strategy}"]
        assert run["strategy"] == strategy and run["backend"] == "gloo" and run["device"] == "cpu"
        assert run["test_accuracy"] >= 0.5
    assert steps["amp:bf16"]["test_accuracy"] >= 0.5
    assert (steps["live:kill"]["workers"], steps["live:kill"]["backend"]) == (2, "gloo")  # 3, rank 1 killed
    assert steps["amp:bf16"]["grad_scaler_scale"] is None  # read from the checkpoint: no GradScaler under bf16
    assert steps["amp:fp16"]["note"].startswith("refused on the CPU as expected: --amp fp16 needs a GPU")
    for model in ("nfnet",):
        ours, plain = steps[f"dptrain:{model}"], steps[f"plain:{model}"]
        assert ours["train_samples"] == plain["train_samples"] and ours["batch_size"] == plain["batch_size"] == 16
        assert ours["images_per_second"] > 0 and plain["images_per_second"] > 0
        assert report["dptrain_vs_plain"][model] == pytest.approx(ours["images_per_second"] / plain["images_per_second"])
    table = result.stdout.splitlines()
    assert any(line.startswith("nfnet: dptrain at ") for line in table)
    assert table[-1].startswith("gpu-check: all steps passed;")
