"""SLURM for real: `dptrain launch --scheduler slurm --submit --wait` trains across two nodes of a
cluster started by the fixture (slurmctld and two slurmd on this machine, see cluster_fixtures)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_fixtures import slurm_cluster  # noqa: F401 - pytest fixture

pytestmark = pytest.mark.slow
DIGITS = ["--dataset", "digits", "--model", "mlp", "--epochs", "10", "--lr", "0.05", "--batch-size", "32",
          "--timeout", "60"]


def launch(cluster, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", *args],
                          cwd=cwd, env=cluster.env, capture_output=True, text=True, timeout=timeout)


def test_launch_trains_digits_from_a_user_dataset_factory_across_two_slurm_nodes(slurm_cluster, tmp_path):
    # The user's own Dataset factory (tests/digits_factory.py) reaches every rank through PYTHONPATH. No dptrain
    # on the PATH: the ranks start this interpreter by its absolute path, as launch ran in it.
    path = os.pathsep.join(part for part in slurm_cluster.env["PATH"].split(os.pathsep)
                           if Path(part) != Path(sys.executable).parent)
    env = {**slurm_cluster.env, "PYTHONPATH": str(Path(__file__).parent), "PATH": path}
    assert shutil.which("dptrain", path=path) is None
    result = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                             "--tasks-per-node", "1", "--submit", "--wait",
                             "--wait-timeout", "180", "--", "--data", "digits_factory:make", *DIGITS[2:],
                             "--strategy", "allreduce", "--out", "run"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + slurm_cluster.logs()
    job_id = next(line.split()[3].rstrip(";") for line in output.splitlines() if line.startswith("dptrain: submitted job"))
    job = slurm_cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    assert "NodeList=node[1-2]" in job and "JobState=COMPLETED" in job
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["launcher"] == "srun", summary
    assert summary["test_accuracy"] >= 0.90, summary
    assert "data: digits_factory:make" in (tmp_path / "run" / "config.yaml").read_text()
    assert (tmp_path / "run" / "job.slurm").exists() and (tmp_path / "run" / f"slurm-{job_id}.out").exists()
    assert f" rank {sys.executable} -m dptrain train " in (tmp_path / "run" / "job.slurm").read_text()


def test_launch_runs_a_user_s_own_ddp_script_on_two_slurm_nodes(slurm_cluster, tmp_path):
    # Not dptrain train: plain PyTorch (tests/user_ddp.py) whose init_process_group finds the job's world in
    # the variables the script exports; 'python' is this interpreter, first on the PATH as in a venv.
    shutil.copy(Path(__file__).parent / "user_ddp.py", tmp_path / "script.py")
    env = {**slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{slurm_cluster.env['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                             "--tasks-per-node", "1", "--out", "run", "--submit", "--wait", "--wait-timeout", "120", "--",
                             "python", "script.py", "7"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + slurm_cluster.logs()
    assert "on node[1-2]" in output and "COMPLETED with exit code 0" in output, output
    run = tmp_path / "run"
    assert (run / "sum.txt").read_text() == "21\n"  # (1 + 2) * 7
    ranks = [(run / f"rank-{rank}.txt").read_text().split() for rank in (0, 1)]  # node, local rank, world, where
    assert ranks == [["node1", "0", "2", "host"], ["node2", "0", "2", "host"]]
    assert not (run / "config.yaml").exists() and (run / "job.slurm").exists()


def test_wait_returns_the_exit_code_of_a_failing_job(slurm_cluster, tmp_path):
    # A rank that cannot start (no such program) fails the step; --wait reports the job's code.
    result = launch(slurm_cluster, "--nodes", "2", "--dptrain", str(tmp_path / "no-such-dptrain"), "--submit", "--wait",
                    "--wait-timeout", "60", "--", "--epochs", "1", "--out", "run", cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert "FAILED with exit code" in result.stdout, result.stdout + result.stderr


def test_submit_without_wait_prints_the_job_id_and_returns(slurm_cluster, tmp_path):
    result = launch(slurm_cluster, "--nodes", "1", "--dptrain", f"{sys.executable} -m dptrain", "--submit", "--",
                    "--epochs", "1", "--out", "run", cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split("submitted job ")[1].split(";")[0]
    assert job_id.isdigit()
    # leave the cluster idle for the next test
    slurm_cluster.run("scancel", job_id)



def test_the_warning_signal_checkpoints_requeues_the_job_and_it_resumes_to_the_end(slurm_cluster, tmp_path):
    # What SLURM does --stop-before seconds ahead of the time limit (or at a pre-emption warning):
    # SIGUSR1 to every rank of the step. The ranks checkpoint, exit 75, the job requeues itself,
    # the second start resumes from the checkpoint and finishes; --wait follows it to the end.
    follower = subprocess.Popen([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                                 "--dptrain", f"{sys.executable} -m dptrain", "--submit", "--wait", "--wait-timeout",
                                 "300", "--", *DIGITS, "--strategy", "sync", "--slow-worker", "0:30", "--out", "run"],
                                cwd=tmp_path, env=slurm_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    try:
        run = tmp_path / "run"
        slurm_cluster.wait_until(lambda: list(run.glob("slurm-*.out")), "job output", 60)
        job_id = next(run.glob("slurm-*.out")).stem.split("-")[1]
        slurm_cluster.preempt(job_id, run / "metrics.jsonl", after_epochs=2)
        output, _ = follower.communicate(timeout=300)
    finally:
        follower.kill()
    assert follower.returncode == 0, output + slurm_cluster.logs()
    assert f"job {job_id} COMPLETED with exit code 0" in output, output
    assert "stopped by SIGUSR1 after epoch" in output and "requeueing it to resume" in output, output
    assert f"job {job_id} went back to the queue" in output, output
    stopped_after = int(output.split("stopped by SIGUSR1 after epoch ")[1].split(";")[0])
    assert f"resuming after epoch {stopped_after}" in output, output
    epochs = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, 11)), epochs  # each epoch once: none lost, none repeated
    assert json.loads((run / "summary.json").read_text())["test_accuracy"] >= 0.90


def test_a_job_launched_with_stop_signal_usr2_checkpoints_and_requeues_on_scancel_signal_usr2(slurm_cluster, tmp_path):
    # --stop-signal USR2: the warning a site sends is SIGUSR2 (here by hand, with scancel --signal=USR2, as
    # SLURM's --signal=USR2@N would). The ranks checkpoint, exit 75 and the job requeues itself; the
    # resumed run is the USR1 test's business, so the job is cancelled once it is back in the queue.
    result = launch(slurm_cluster, "--nodes", "2", "--stop-signal", "USR2", "--dptrain", f"{sys.executable} -m dptrain",
                    "--submit", "--", *DIGITS, "--strategy", "sync", "--slow-worker", "0:10", "--out", "run",
                    cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    job_id = result.stdout.split("submitted job ")[1].split(";")[0].split()[0]
    run = tmp_path / "run"
    assert "#SBATCH --signal=USR2@300" in (run / "job.slurm").read_text()
    try:
        slurm_cluster.preempt(job_id, run / "metrics.jsonl", after_epochs=1, signal="USR2")
    finally:
        slurm_cluster.run("scancel", job_id)
    output = (run / f"slurm-{job_id}.out").read_text()
    assert "stopped by SIGUSR2 after epoch" in output and "requeueing it to resume" in output, output
    stopped_after = int(output.split("stopped by SIGUSR2 after epoch ")[1].split(";")[0])
    epochs = [json.loads(line)["epoch"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, stopped_after + 1)), epochs  # each epoch up to the checkpoint, once
    assert stopped_after < 10


def test_with_min_workers_the_node_of_rank_0_dies_and_the_job_finishes_on_the_other(slurm_cluster, tmp_path):
    # --min-workers under srun: the job script serves the ranks' store from the batch host (dptrain serve-store),
    # not rank 0, and runs srun --kill-on-bad-exit=0; rank 0 (all of node 1) killed in epoch 2 leaves rank 1
    # running: it goes on alone from the start of that epoch, writes the results, and the job completes.
    env = {**slurm_cluster.env, "DPTRAIN_FAULT": "train-middle@0:2"}
    result = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                             "--dptrain", f"{sys.executable} -m dptrain", "--submit", "--wait", "--wait-timeout",
                             "180", "--", *DIGITS, "--strategy", "sync", "--min-workers", "1", "--out", "run"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + slurm_cluster.logs()
    script = (tmp_path / "run" / "job.slurm").read_text()
    assert "--kill-on-bad-exit=0" in script and "serve-store" in script
    job_output = next((tmp_path / "run").glob("slurm-*.out")).read_text()
    assert "continuing from epoch 2 with 1 worker (rank 1 of the job; without rank 0)" in job_output, job_output
    assert "the ranks left finished the run without the ranks that failed" in job_output, job_output
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [len(record["workers"]) for record in history] == [2] + [1] * (len(history) - 1)
    assert all(sum(worker["samples"] for worker in record["workers"]) == 1437 for record in history)
    assert history[1]["membership"] == {"generation": 1, "members": [1], "left": [0], "continued_from_epoch": 2}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["workers"] == 1 and summary["launcher"] == "srun"


def test_with_replace_workers_a_new_srun_step_takes_the_place_of_a_lost_rank(slurm_cluster, tmp_path):
    # --replace-workers under srun: the store service on the batch host reads the ranks the others left out
    # and starts a new step of one task for each (srun --overlap ... dptrain join RUN_DIR); the new worker
    # takes the next rank of the job (2), enters at an epoch end healed from rank 0, and trains to the end.
    env = {**slurm_cluster.env, "DPTRAIN_FAULT": "train-middle@1:2"}
    digits = [arg for arg in DIGITS if arg not in ("--epochs", "10")]
    result = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                             "--dptrain", f"{sys.executable} -m dptrain", "--submit", "--wait", "--wait-timeout",
                             "200", "--", *digits, "--epochs", "14", "--strategy", "sync", "--min-workers", "1",
                             "--replace-workers", "--slow-worker", "0:40", "--out", "run"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    run = tmp_path / "run"
    assert result.returncode == 0, output + slurm_cluster.logs()
    script = (run / "job.slurm").read_text()
    assert "--replace 2 --replace-command 'srun --overlap --nodes=1 --ntasks=1" in script, script
    job_output = next(run.glob("slurm-*.out")).read_text()
    assert "dptrain: starting a new worker in place of rank 1 (1 more may be replaced)" in job_output, job_output
    assert f"dptrain: this worker (rank 2) trained with the others to the end of the run in {run}" in job_output
    assert "the ranks left finished the run without the ranks that failed" in job_output, job_output
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    admitted = [i for i, record in enumerate(history) if record.get("membership", {}).get("joined")]
    assert len(admitted) == 1, [record.get("membership") for record in history]
    first = admitted[0]
    assert history[first]["membership"]["members"] == [0, 2] and history[first]["membership"]["joined"] == [2]
    assert [len(record["workers"]) for record in history] == [2] + [1] * (first - 1) + [2] * (len(history) - first)
    assert all(sum(worker["samples"] for worker in record["workers"]) == 1437 for record in history)
    assert not (run / "join.address").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["launcher"] == "srun"
