"""Requeue and stop signals outside SLURM: the local job script and the PBS job script (run by bash, with
Open MPI's real mpirun), and the local launchers' --grace; real processes, real signals.

A rank of a user's command here keeps its own checkpoint (the epochs it did); a stop signal makes it
save after the current epoch and exit with 75. Resuming means: every epoch done exactly once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain.cluster import local, pbs
from dptrain.cluster.spec import JobSpec
from dptrain.cluster.submit import follow
from dptrain.runtime.env import detect
from test_train_cli import DIGITS

EPOCHS = 6
# One rank of a user's command job. EPOCH (EPOCH_RANK): seconds per epoch; IGNORE: the rank that ignores stop signals.
RANK = """
import json, os, signal, sys, time
sys.path.insert(0, os.environ["DPTRAIN_SRC"])
from dptrain.runtime.env import detect
rank, run = os.environ["RANK"], os.environ["DPTRAIN_RUN_DIR"]
ckpt = os.path.join(run, "ckpt-%s.json" % rank)
state = json.load(open(ckpt)) if os.path.exists(ckpt) else {"epochs": [], "starts": 0, "stops": []}
state["starts"] += 1
stop = []
for number in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
    signal.signal(number, signal.SIG_IGN if os.environ.get("IGNORE") == rank else lambda n, f: stop.append(n))
state["launcher"] = detect().launcher
open(os.path.join(run, "pid-%s-%d" % (rank, state["starts"])), "w").write(str(os.getpid()))
for epoch in range(len(state["epochs"]), EPOCHS):
    time.sleep(float(os.environ.get("EPOCH_" + rank, os.environ.get("EPOCH", "0.3"))))
    state["epochs"].append(epoch)
    if stop:
        state["stops"].append(signal.Signals(stop[0]).name)
    with open(ckpt + ".tmp", "w") as handle:
        json.dump(state, handle)
    os.replace(ckpt + ".tmp", ckpt)
    if stop:
        sys.exit(75)
""".replace("EPOCHS", str(EPOCHS))
SRC = str(Path(__file__).resolve().parents[1] / "src")


def checkpoints(run: Path) -> dict[int, dict]:
    return {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in run.glob("ckpt-*.json")}


def wait_for(paths, proc: subprocess.Popen, timeout: float = 60) -> list[int]:
    """The pids the ranks wrote to `paths`, once all are there (while the job runs)."""
    deadline = time.monotonic() + timeout
    while not all(path.exists() and path.read_text() for path in paths):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)
    return [int(path.read_text()) for path in paths]


def local_command_job(tmp_path: Path, grace: int = 30, **env: str) -> tuple[subprocess.Popen, Path]:
    """The local job script of a 2-rank command job of RANK, started by bash."""
    (tmp_path / "rank.py").write_text(RANK)
    run = tmp_path / "run"
    run.mkdir()
    spec = JobSpec(scheduler="local", workdir=str(tmp_path), run_dir=str(run), command=(sys.executable, "rank.py"),
                   tasks_per_node=2, stop_before=grace)
    (tmp_path / "job.sh").write_text(local.render(spec))
    # As from a user's shell: a suite started in the background without job control (`cmd &` in a script, nohup)
    # inherits SIGINT ignored, and a shell cannot trap a signal ignored when it starts.
    proc = subprocess.Popen(["bash", "job.sh"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "DPTRAIN_SRC": SRC, **env},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, run


def test_a_local_command_job_whose_ranks_stop_unasked_starts_again_and_resumes(tmp_path):
    proc, run = local_command_job(tmp_path)
    for pid in wait_for([run / "pid-0-1", run / "pid-1-1"], proc):
        os.kill(pid, signal.SIGUSR1)  # as a node's own warning would reach the ranks, not the job script
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.count("(exit code 75); starting them again from the run directory's checkpoint (requeue 1 of 10)") == 1
    for rank, state in checkpoints(run).items():  # the checkpoint's epoch continued: each epoch done once
        assert state["epochs"] == list(range(EPOCHS)) and state["starts"] == 2, (rank, state)
        assert state["stops"] == ["SIGUSR1"] and state["launcher"] == "env", (rank, state)


@pytest.mark.parametrize("stop", ["USR1", "USR2", "TERM"])
def test_a_stop_signal_sent_to_a_local_command_job_reaches_every_rank_and_ends_the_job(tmp_path, stop):
    proc, run = local_command_job(tmp_path)
    wait_for([run / "pid-0-1", run / "pid-1-1"], proc)
    proc.send_signal(signal.Signals["SIG" + stop])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert "requeue" not in out  # asked to stop: not started again
    states = checkpoints(run)
    assert sorted(states) == [0, 1]
    for state in states.values():
        assert state["stops"] == ["SIG" + stop] and state["starts"] == 1 and len(state["epochs"]) < EPOCHS


def test_ctrl_c_sent_to_a_local_command_job_reaches_every_rank(tmp_path):
    proc, run = local_command_job(tmp_path)
    pids = wait_for([run / "pid-0-1", run / "pid-1-1"], proc)
    proc.send_signal(signal.SIGINT)  # ranks started in the background would ignore it, but for the script
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("KeyboardInterrupt") == 2, err
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()


def test_ranks_still_running_grace_seconds_after_the_stop_signal_are_killed_and_named(tmp_path):
    proc, run = local_command_job(tmp_path, grace=3, IGNORE="1", EPOCH_1="30")
    wait_for([run / "pid-0-1", run / "pid-1-1"], proc)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err  # rank 0 saved its state to be resumed
    assert err.splitlines() == ["dptrain: rank 1 had not exited 3 s (--grace) after SIGUSR1; killing it"]
    states = checkpoints(run)
    assert states[0]["stops"] == ["SIGUSR1"]
    assert 1 not in states  # killed in its first epoch


def test_dptrain_run_kills_and_names_a_rank_still_running_grace_seconds_after_the_stop_signal(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "dptrain", "run", "--workers", "2", "--grace", "3", "rank.py"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DPTRAIN_SRC": SRC, "DPTRAIN_RUN_DIR": str(run), "IGNORE": "1",
                                 "EPOCH_1": "30"})
    wait_for([run / "pid-0-1", run / "pid-1-1"], proc)
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 75, err
    assert err.splitlines()[-1] == "dptrain: rank 1 of `python rank.py` had not exited 3 s (--grace) after SIGUSR2; killing it"
    states = checkpoints(run)
    assert states[0]["stops"] == ["SIGUSR2"] and states[0]["launcher"] == "dptrain-run"


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc/*/stat)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
def test_a_local_train_job_whose_workers_stop_unasked_starts_again_and_continues_after_their_checkpoint(tmp_path):
    spec = JobSpec(scheduler="local", workdir=str(tmp_path), run_dir=str(tmp_path / "run"), tasks_per_node=2,
                   train_args=(*DIGITS[:DIGITS.index("--epochs")], "--epochs", "3", "--strategy", "sync"),
                   dptrain=f"{sys.executable} -m dptrain")
    (tmp_path / "job.sh").write_text(local.render(spec))
    proc = subprocess.Popen(["bash", "job.sh"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    workers: list[int] = []
    while len(workers) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        workers = [worker for launcher in children(proc.pid) for worker in children(launcher)]
        time.sleep(0.02)
    for pid in workers:  # to the workers, not to the job: they stop after epoch 1, and the job starts again
        os.kill(pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert out.count("starting them again from the run directory's checkpoint (requeue 1 of 10)") == 1, out
    assert "[rank0] dptrain: resuming after epoch 1" in out + err, out + err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [record["epoch"] for record in records] == [1, 2, 3]  # each epoch once: the checkpoint's continued
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["epochs"] == 3


# ---- PBS: the job script with the host's real Open MPI mpirun; qsub is a stand-in (no PBS server installs
# from Debian's or PyPI's packages) that records how the script submits itself again.

FAKE_QSUB = 'echo "qsub $* DPTRAIN_REQUEUES=$DPTRAIN_REQUEUES" >> "$LOG"; echo 78.pbs-server\n'
# Open MPI as root, on the loopback interface, more ranks than cores.
OMPI = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_btl_tcp_if_include": "lo"}


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="not installed on this machine: mpirun (openmpi-bin)")
def test_a_pbs_job_warns_its_ranks_through_mpirun_before_the_walltime_and_resubmits_itself_to_resume(tmp_path):
    (tmp_path / "rank.py").write_text(RANK)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qsub").write_text("#!/bin/bash\n" + FAKE_QSUB)
    (bin_dir / "qsub").chmod(0o755)
    run = tmp_path / "run"
    run.mkdir()
    # Walltime 12 s, warning 6 s before it: SIGUSR2 comes 6 s in, while the ranks are in their 9 s of epochs.
    spec = JobSpec(scheduler="pbs", workdir=str(tmp_path), run_dir=str(run), command=(sys.executable, "rank.py"),
                   tasks_per_node=2, time="00:00:12", stop_before=6, stop_signal="USR2")
    script = run / pbs.SCRIPT_NAME
    script.write_text(pbs.render(spec))
    (tmp_path / "nodefile").write_text("localhost\nlocalhost\n")
    env = {**os.environ, **OMPI, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(tmp_path / "calls.log"),
           "PBS_NODEFILE": str(tmp_path / "nodefile"), "DPTRAIN_SRC": SRC, "EPOCH": "1.5"}
    env.pop("DPTRAIN_REQUEUES", None)
    first = subprocess.run(["bash", str(script)], env={**env, "PBS_JOBID": "77.pbs-server"}, capture_output=True,
                           text=True, timeout=120)
    output = (run / pbs.OUTPUT_NAME).read_text()
    assert first.returncode == 0, output
    assert "dptrain: job 77.pbs-server is 6 s from its walltime; sending SIGUSR2 to the ranks" in output
    assert ("dptrain: job 77.pbs-server stopped to be resumed (exit code 75); requeued as job 78.pbs-server "
            "(requeue 1 of 10)") in output
    assert (tmp_path / "calls.log").read_text().splitlines() == [
        f"qsub -W depend=afterany:77.pbs-server {script} DPTRAIN_REQUEUES=1"]
    assert pbs.requeued_as(run, "77.pbs-server") == "78.pbs-server"
    stopped = checkpoints(run)
    assert sorted(stopped) == [0, 1]
    for state in stopped.values():  # mpirun passed the warning on to every rank, which recorded mpirun
        assert state["stops"] == ["SIGUSR2"] and len(state["epochs"]) < EPOCHS and state["launcher"] == "mpirun"
    # The resubmitted job (qsub -V hands it DPTRAIN_REQUEUES) resumes from the checkpoints, into the same output.
    second = subprocess.run(["bash", str(script)], env={**env, "PBS_JOBID": "78.pbs-server", "DPTRAIN_REQUEUES": "1",
                                                        "EPOCH": "0.05"}, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, (run / pbs.OUTPUT_NAME).read_text()
    for rank, state in checkpoints(run).items():
        assert state["epochs"] == list(range(EPOCHS)) and state["starts"] == 2, (rank, state)
    output = (run / pbs.OUTPUT_NAME).read_text()
    assert output.index("dptrain: job 77.pbs-server on") < output.index("dptrain: job 78.pbs-server on")
    assert pbs.requeued_as(run, "78.pbs-server") is None


def test_pbs_refuses_term_as_the_stop_signal_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "pbs", "--stop-signal", "TERM",
                           "--dry-run", "--", "--dataset", "digits"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["dptrain: error: --stop-signal TERM: under PBS, Open MPI's mpirun ends the "
                                        "job on TERM rather than passing it on; use USR1 or USR2"]


@pytest.mark.parametrize("launcher, variables", [
    ("srun", {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
              "SLURM_JOB_ID": "4242"}),
    ("mpirun", {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}),
])
def test_a_command_rank_given_rank_by_its_job_script_records_the_launcher_underneath(launcher, variables):
    # What the SLURM and PBS scripts export for a command (RANK from the launcher's own variable).
    env = detect({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                  "MASTER_ADDR": "node1", "MASTER_PORT": "29400", **variables})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == (launcher, 3, 4, 1)


def test_launch_wait_follows_a_pbs_job_into_the_job_it_requeued_itself_as(tmp_path, monkeypatch, capsys):
    # A stand-in qstat: every job has finished; 77 resubmitted itself as 78 (as its script records it).
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qstat").write_text('#!/bin/bash\necho "Job Id: $4"; echo "    job_state = F"; echo "    Exit_status = 0"\n')
    (bin_dir / "qstat").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    (tmp_path / "pbs-requeued-77.server").write_text("78.server\n")
    (tmp_path / pbs.OUTPUT_NAME).write_text("first job\n")
    status = follow(pbs, "77.server", tmp_path / pbs.OUTPUT_NAME, timeout=30)
    assert status.finished and status.exit_code == 0 and status.requeued_as == "78.server"
    assert capsys.readouterr().out.splitlines() == [
        "first job", "dptrain: job 77.server was requeued as job 78.server; following it until it finishes"]
