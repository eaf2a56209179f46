"""Open MPI's mpirun and torchrun start `dptrain train` ranks that find each other and train."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from dptrain.runtime.env import free_port

pytestmark = pytest.mark.slow
# As root Open MPI wants to be told; --oversubscribe: 2 ranks may exceed the cores it counts.
# Its own traffic stays on the loopback interface.
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--mca", "oob_tcp_if_include", "lo",
          "--mca", "btl_tcp_if_include", "lo", "--mca", "btl", "self,tcp"]
DIGITS = ["--dataset", "digits", "--model", "mlp", "--epochs", "10", "--lr", "0.05", "--batch-size", "32",
          "--timeout", "60"]
# The same digits from a user's own Dataset factory (tests/digits_factory.py), found through PYTHONPATH.
FACTORY = ["--data", "digits_factory:make", *DIGITS[2:]]
FACTORY_ENV = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}


def summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="not installed on this machine: mpirun (openmpi-bin)")
def test_mpirun_np_2_trains_digits_from_a_user_dataset_factory(tmp_path):
    result = subprocess.run([*MPIRUN, "-np", "2", "-x", "PYTHONPATH", sys.executable, "-m", "dptrain", "train",
                             *FACTORY, "--strategy", "allreduce", "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=240, env=FACTORY_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    run = summary(tmp_path / "run")
    assert run["launcher"] == "mpirun" and run["workers"] == 2 and run["test_accuracy"] >= 0.90, run
    assert "data: digits_factory:make" in (tmp_path / "run" / "config.yaml").read_text()


def test_torchrun_module_entry_point_trains_digits_from_a_user_dataset_factory(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                "--master-port", str(free_port())]
    result = subprocess.run([*torchrun, "-m", "dptrain", "train", *FACTORY, "--strategy", "sync",
                             "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=240, env=FACTORY_ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    run = summary(tmp_path / "run")
    assert run["launcher"] == "torchrun" and run["workers"] == 2 and run["test_accuracy"] >= 0.90, run
    assert "data: digits_factory:make" in (tmp_path / "run" / "config.yaml").read_text()


# PBS's variables for a job on this machine alone (PBS_NODEFILE: one line per MPI slot), and Open MPI's
# settings of MPIRUN above as environment variables, for a job script's own mpirun.
def pbs_environment(tmp_path, slots: int) -> dict:
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("localhost\n" * slots)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PBS_JOBID": "4242.pbs-server", "PBS_NODEFILE": str(nodefile),
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_oob_tcp_if_include": "lo",
            "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_btl": "self,tcp", "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def pbs_job(tmp_path, *train_args: str, fault: str) -> tuple[subprocess.CompletedProcess, str]:
    """`dptrain launch --scheduler pbs` writes the job script of 3 ranks on one node, which runs here as PBS
    would run it (no qsub: the script itself, with PBS's variables): (how it ended, its output)."""
    digits = DIGITS if "--epochs" not in train_args else [arg for arg in DIGITS if arg not in ("--epochs", "10")]
    written = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "pbs", "--nodes", "1",
                              "--tasks-per-node", "3", "--dptrain", f"{sys.executable} -m dptrain", "--", *digits,
                              *train_args, "--out", "run"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert written.returncode == 0, written.stderr
    result = subprocess.run(["bash", str(tmp_path / "run" / "job.pbs")], cwd=tmp_path, capture_output=True, text=True,
                            timeout=240, env={**pbs_environment(tmp_path, 3), "DPTRAIN_FAULT": fault})
    return result, (tmp_path / "run" / "pbs.out").read_text()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="not installed on this machine: mpirun (openmpi-bin)")
def test_a_pbs_job_with_min_workers_goes_on_under_mpirun_without_a_killed_rank(tmp_path):
    # The script serves the ranks' store itself and runs mpirun --enable-recovery: rank 1 killed in epoch 2
    # leaves ranks 0 and 2 running, which go on from the start of that epoch and finish the run; the job ends
    # with 0 (mpirun would say 0 whatever happened: the ranks' own exit codes decide).
    result, output = pbs_job(tmp_path, "--strategy", "sync", "--min-workers", "2", fault="train-middle@1:2")
    assert result.returncode == 0, output
    script = (tmp_path / "run" / "job.pbs").read_text()
    assert "--enable-recovery" in script and "serve-store" in script
    assert "continuing from epoch 2 with 2 workers (ranks 0, 2 of the job; without rank 1)" in output, output
    assert "the ranks left finished the run without the ranks that failed (exit codes 0 137 0)" in output, output
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [len(record["workers"]) for record in history] == [3] + [2] * (len(history) - 1)
    assert all(sum(worker["samples"] for worker in record["workers"]) == 1437 for record in history)
    assert history[1]["membership"] == {"generation": 1, "members": [0, 2], "left": [1], "continued_from_epoch": 2}
    assert summary(tmp_path / "run")["launcher"] == "mpirun"
    assert not list((tmp_path / "run").glob(".exits-*"))  # the ranks' exit codes are read, then removed


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="not installed on this machine: mpirun (openmpi-bin)")
def test_a_pbs_job_with_replace_workers_starts_a_new_worker_in_place_of_a_killed_rank(tmp_path):
    # The store service on the first node starts `dptrain join RUN_DIR` there in place of rank 1: it takes the
    # next rank of the job (3), enters at an epoch end healed from rank 0, and trains to the end.
    result, output = pbs_job(tmp_path, "--strategy", "sync", "--min-workers", "2", "--replace-workers", "--epochs",
                             "14", "--slow-worker", "0:40", fault="train-middle@1:2")
    assert result.returncode == 0, output
    assert "dptrain: starting a new worker in place of rank 1 (2 more may be replaced)" in output, output
    assert f"dptrain: this worker (rank 3) trained with the others to the end of the run in {tmp_path / 'run'}" \
        in output, output
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    admitted = [i for i, record in enumerate(history) if record.get("membership", {}).get("joined")]
    assert len(admitted) == 1, [record.get("membership") for record in history]
    first = admitted[0]
    assert history[first]["membership"]["members"] == [0, 2, 3]
    assert [len(record["workers"]) for record in history] == [3] + [2] * (first - 1) + [3] * (len(history) - first)
    assert all(sum(worker["samples"] for worker in record["workers"]) == 1437 for record in history)
    assert summary(tmp_path / "run")["workers"] == 3


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="not installed on this machine: mpirun (openmpi-bin)")
def test_a_pbs_job_that_cannot_go_on_fails_although_mpirun_with_recovery_says_0(tmp_path):
    # --min-workers 3 of 3: without rank 1 the others stop; the job ends with their failure, not mpirun's 0.
    result, output = pbs_job(tmp_path, "--strategy", "sync", "--min-workers", "3", fault="train-middle@1:2")
    assert result.returncode not in (0, 75), output
    assert "fewer than --min-workers 3" in output, output
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="not installed on this machine: mpirun (openmpi-bin)")
def test_min_workers_under_a_plain_mpirun_is_one_line(tmp_path):
    result = subprocess.run([*MPIRUN, "-np", "2", sys.executable, "-m", "dptrain", "train", *DIGITS, "--min-workers",
                             "1", "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("dptrain")]
    assert lines == ["dptrain: error: --min-workers under mpirun needs mpirun --enable-recovery (else it stops every "
                     "rank when one fails) and the ranks' store served by dptrain serve-store "
                     "(DPTRAIN_STORE_SERVED=1), as the job script of dptrain launch --scheduler pbs does; or drop "
                     "--min-workers"], result.stderr
