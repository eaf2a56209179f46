"""Fault injection: kill or freeze a random worker at a random moment, or kill it while it saves; the run
must name what happened, restart and finish as well as an uninterrupted run.

    make test PYTEST_ARGS="tests/test_fault_injection.py --fault-runs 20 --fault-report faults.jsonl"

Each run trains digits with 2 workers under a strategy drawn at random, `--max-restarts 3` and
`--timeout 10`, while one of three faults strikes a randomly chosen rank (rank 0 hosts the
rendezvous store and, under async, the merge service):

- kill: SIGKILL after a random number of epochs (0: during start-up or the first epoch, before
  any checkpoint) plus a random fraction of an epoch;
- save: SIGKILL at a random point of a random epoch's checkpoint save (dptrain.faults);
- freeze: SIGSTOP after a random number of epochs; the other rank must name the frozen one
  within the timeout and exit, so the launcher can restart the world.

`--fault-runs N` runs N of each kind. Recorded per run: completed, restarts, epochs lost (trained
but thrown away because they came after the last checkpoint), seconds until a frozen rank was
named, final test accuracy; it must be within 1 point of an uninterrupted run of the same
strategy (under async, whose merge order varies from run to run and whose checkpoints are
approximate, at most ASYNC_TOLERANCE below it: 5 standard deviations of the measured spread).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dptrain.faults import POINTS
from test_train_cli import DIGITS
from cli_runner import ForkedDptrain

pytestmark = [pytest.mark.slow]
EPOCHS = 8
TIMEOUT = 10
STRATEGIES = ("allreduce", "sync", "async", "fedavg")
KINDS = ("kill", "save", "freeze")
# Async's accuracy varies from run to run, with or without a fault: its merge order follows the timing, and its
# checkpoints are approximate (benchmarks/README.md, section 7). Measured on a loaded 2-core machine (load 7-12;
# digits, 8 epochs, 2 workers): 8 uninterrupted runs 0.919-0.950, 6 runs with a fault (kill, save, and 4 of the
# CI draw: rank 0 frozen after 5 epochs) 0.931-0.956; each with a standard deviation of 0.010, so the difference
# of a faulted run and its one reference run has one of 0.014. A faulted run may fall 5 of those below it.
ASYNC_SPREAD = 0.014
ASYNC_TOLERANCE = 5 * ASYNC_SPREAD


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def _rank_of(pid: int) -> int | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _strike_later(launcher: subprocess.Popen, rank: int, after_epochs: int, extra_delay: float, metrics: Path,
                  how: signal.Signals, struck: dict) -> None:
    """Send `how` to worker `rank` once rank 0 has recorded `after_epochs` epochs, plus a random moment."""
    deadline = time.monotonic() + 120
    while launcher.poll() is None and time.monotonic() < deadline:
        done = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        if done >= after_epochs and len(_children(launcher.pid)) == 2:
            time.sleep(extra_delay)
            for pid in _children(launcher.pid):
                if _rank_of(pid) == rank:
                    os.kill(pid, how)
                    struck.update(pid=pid, after_epochs=done, at=time.monotonic())
                    return
        time.sleep(0.01)


def _train(cwd: Path, out: str, strategy: str, extra=(), env=None) -> subprocess.Popen:
    return ForkedDptrain(["train", *DIGITS, "--epochs", str(EPOCHS), "--strategy", strategy, "--timeout",
                          str(TIMEOUT), "--out", out, *extra], cwd=cwd, env={**os.environ, **(env or {})})


def _timed_lines(stream, lines: list) -> None:
    for line in stream:
        lines.append((time.monotonic(), line))


@pytest.fixture(scope="module")
def reference_accuracy(tmp_path_factory):
    cwd, accuracy = tmp_path_factory.mktemp("reference"), {}

    def of(strategy: str) -> float:
        if strategy not in accuracy:
            proc = _train(cwd, strategy, strategy)
            _, stderr = proc.communicate(timeout=240)
            assert proc.returncode == 0, stderr
            accuracy[strategy] = json.loads((cwd / strategy / "summary.json").read_text())["test_accuracy"]
        return accuracy[strategy]
    return of


def _one_run(tmp_path: Path, index: int, kind: str, rng: random.Random, reference_accuracy) -> dict:
    strategy, rank = rng.choice(STRATEGIES), rng.randrange(2)
    out, env, struck = f"run{index}", {}, {}
    metrics = tmp_path / out / "metrics.jsonl"
    result = {"run": index, "kind": kind, "strategy": strategy, "victim_rank": rank}
    if kind == "save":
        point, epoch = rng.choice(POINTS), rng.randrange(1, EPOCHS)
        env = {"DPTRAIN_FAULT": f"{point}@{rank}:{epoch}", "DPTRAIN_FAULT_ONCE": str(tmp_path / f"fired{index}")}
        result.update(point=point, save_epoch=epoch)
    launcher = _train(tmp_path, out, strategy, ["--max-restarts", "3"], env)
    if kind != "save":
        after_epochs = rng.randrange(EPOCHS - 1) if kind == "kill" else rng.randrange(1, EPOCHS - 1)
        delay = rng.uniform(0.5, 3.0) if after_epochs == 0 else rng.uniform(0.0, 0.1)  # an epoch takes ~0.1 s
        how = signal.SIGKILL if kind == "kill" else signal.SIGSTOP
        threading.Thread(target=_strike_later, args=(launcher, rank, after_epochs, delay, metrics, how, struck),
                         daemon=True).start()
        result.update(after_epochs=after_epochs, extra_delay_s=round(delay, 2))
    err_lines: list = []
    reader = threading.Thread(target=_timed_lines, args=(launcher.stderr, err_lines), daemon=True)
    reader.start()
    stdout = launcher.stdout.read()
    launcher.wait(timeout=400)
    reader.join(timeout=10)
    stderr = "".join(line for _, line in err_lines)
    struck_now = bool(struck) or (kind == "save" and (tmp_path / f"fired{index}").exists())
    epochs_printed = len(re.findall(r"^\[rank0\] epoch \d+/", stdout, re.M))
    summary_path = tmp_path / out / "summary.json"
    accuracy = json.loads(summary_path.read_text())["test_accuracy"] if summary_path.exists() else None
    result.update(struck=struck_now, completed=launcher.returncode == 0,
                  restarts=stderr.count("restarting the 2 workers"), epochs_lost=epochs_printed - EPOCHS,
                  test_accuracy=accuracy, reference_accuracy=reference_accuracy(strategy))
    if kind == "freeze" and struck:
        # a peer's error line, or the launcher's when the rank froze after the last collective
        named = [t for t, line in err_lines if ("error:" in line or "had not ended" in line)
                 and re.search(rf"rank {rank}\b(?!:)", line)]
        result["named_after_s"] = round(named[0] - struck["at"], 1) if named else None
    return result | {"_stderr": stderr}


@pytest.mark.timeout(7200)  # --fault-runs 20 takes a while; each run has its own limit
def test_faulty_workers_are_named_restarted_and_the_run_finishes_as_well(tmp_path, request, reference_accuracy):
    runs = request.config.getoption("--fault-runs")
    report_path = request.config.getoption("--fault-report")
    rng = random.Random(int(os.environ.get("DPTRAIN_FAULT_SEED", "0")))
    results = []
    for index, kind in enumerate(kind for _ in range(runs) for kind in KINDS):
        result = _one_run(tmp_path, index, kind, rng, reference_accuracy)
        stderr = result.pop("_stderr")
        results.append(result)
        print(json.dumps(result))
        if result["restarts"] > 1:  # a restart that itself failed: keep its story in the log
            print(stderr[-3000:])
        assert result["completed"], stderr[-3000:]
        if result["strategy"] == "async":  # one-sided: finishing above a reference that varies is no failure
            assert result["reference_accuracy"] - result["test_accuracy"] <= ASYNC_TOLERANCE, result
        else:
            assert abs(result["test_accuracy"] - result["reference_accuracy"]) <= 0.01, result
        if result["struck"]:  # the worker may have finished before its time came
            assert result["restarts"] >= 1, stderr[-3000:]
            if kind == "freeze":
                assert result["named_after_s"] is not None and result["named_after_s"] <= TIMEOUT + 20, \
                    stderr[-3000:]
            else:
                assert f"worker rank {result['victim_rank']} was killed by SIGKILL" in stderr, stderr[-3000:]
    if report_path:
        Path(report_path).write_text("".join(json.dumps(r) + "\n" for r in results))
