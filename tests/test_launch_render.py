"""Job scripts are pure functions of a JobSpec, pinned by golden files (tests/golden/launch/).

One golden script per scheduler x container combination, for `dptrain train` and for a user's command
(`python train.py --epochs 3`, named *-command.sh). After an intended change, regenerate
them with `DPTRAIN_REGENERATE_GOLDEN=1 make test PYTEST_ARGS=tests/test_launch_render.py` and
review the diff like code.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain import registry
from dptrain.cluster import pbs, slurm, udocker
from dptrain.cluster.spec import ContainerSpec, JobSpec, bind_paths
from dptrain.launch.commands import parse_container
from dptrain.errors import UserError
from dptrain.runtime.env import detect, port_from_job_id

GOLDEN = Path(__file__).parent / "golden" / "launch"
REGENERATE = os.environ.get("DPTRAIN_REGENERATE_GOLDEN") == "1"
# Every registered scheduler that writes a shell script: a new one fails here until its golden scripts are
# generated (and reviewed). Kubernetes writes a manifest (YAML, no --container): tests/test_kubernetes.py.
SCHEDULERS = {name: registry.load("scheduler", name) for name in registry.names("scheduler")
              if not registry.load("scheduler", name).SCRIPT_NAME.endswith(".yaml")}
CONTAINERS = {"none": None, "udocker": ContainerSpec("udocker", "dptrain"),
              "apptainer": ContainerSpec("apptainer", "/home/ada/images/dptrain.sif")}


MODES = {"train": "", "command": "-command"}  # what the ranks run -> the golden file's suffix


def example_spec(scheduler: str, container: str, mode: str = "train") -> JobSpec:
    cluster = scheduler != "local"
    what = (dict(command=("python", "train.py", "--epochs", "3"), run_dir="/home/ada/project/runs/mine")
            if mode == "command" else
            dict(train_args=("--dataset", "digits", "--strategy", "sync", "--epochs", "10"),
                 run_dir="/home/ada/project/runs/digits-sync"))
    return JobSpec(scheduler=scheduler, workdir="/home/ada/project", **what,
                   nodes=2 if cluster else 1, tasks_per_node=2, gpus_per_node=2 if cluster else 0,
                   cpus_per_task=4 if cluster else None, time="01:30:00" if cluster else None,
                   partition="gpu" if cluster else None, account="proj42" if cluster else None,
                   container=CONTAINERS[container], binds=("/scratch/ada/data",) if container != "none" else (),
                   # outside a container the ranks run the launching environment's interpreter, by its path
                   dptrain="/home/ada/venv/bin/python -m dptrain" if container == "none" else "dptrain")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("container", list(CONTAINERS))
@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_job_script_matches_its_golden_file(scheduler, container, mode):
    text = SCHEDULERS[scheduler].render(example_spec(scheduler, container, mode))
    golden = GOLDEN / f"{scheduler}-{container}{MODES[mode]}.sh"
    if REGENERATE:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}; run with DPTRAIN_REGENERATE_GOLDEN=1"
    assert text == golden.read_text()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("container", list(CONTAINERS))
@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_job_script_is_valid_bash(scheduler, container, mode):
    text = SCHEDULERS[scheduler].render(example_spec(scheduler, container, mode))
    result = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def test_rendezvous_comes_from_the_scheduler_never_from_the_user():
    assert "NodeAddr" in slurm.render(example_spec("slurm", "none"))
    assert 'head -n 1 "$PBS_NODEFILE"' in pbs.render(example_spec("pbs", "none"))
    for scheduler in ("slurm", "pbs"):
        assert "MASTER_PORT" not in SCHEDULERS[scheduler].render(example_spec(scheduler, "udocker"))


def test_gpus_ask_apptainer_for_the_nvidia_libraries_and_cpu_jobs_do_not():
    gpu = example_spec("slurm", "apptainer")
    cpu = JobSpec(**{**gpu.__dict__, "gpus_per_node": 0})
    assert " exec --nv " in slurm.render(gpu) and " exec --nv " not in slurm.render(cpu)


def test_binds_skip_paths_inside_bound_directories_but_keep_renames():
    spec = JobSpec(scheduler="local", workdir="/p", run_dir="/p/runs/x", binds=("/data", "/p/sub", "/a:/b", "/data"))
    assert bind_paths(spec) == ["/p", "/data", "/a:/b"]


@pytest.mark.parametrize("field, value, message", [
    ("nodes", 0, "--nodes 0 must be at least 1"),
    ("time", "90", "--time '90' is not HH:MM:SS"),
    ("gpus_per_node", -1, "--gpus-per-node -1 must be 0 or more"),
    ("tasks_per_node", 4, "--tasks-per-node 4 is more than --gpus-per-node 2: NCCL cannot run two ranks on one GPU"),
    ("stop_before", -5, "--stop-before -5 must be 0"),
    ("stop_signal", "KILL", "--stop-signal 'KILL' is not a signal dptrain's ranks stop on; use one of USR1, USR2, TERM"),
    ("max_requeues", -1, "--max-requeues -1 must be 0 \\(never\\) or more"),
])
def test_bad_job_settings_are_one_sentence_naming_the_value(field, value, message):
    with pytest.raises(UserError, match=message):
        JobSpec(**{"scheduler": "slurm", "workdir": "/p", "run_dir": "/p/r", "gpus_per_node": 2, "tasks_per_node": 2,
                   field: value})


FAKE_SLURM = {
    "srun": 'echo "srun $*" >> "$LOG"; exit "$SRUN_EXIT"\n',
    "scontrol": ('echo "scontrol $*" >> "$LOG"\n'
                 'case "$1 $2" in "show hostnames") echo node1;; "show node") echo "NodeName=node1 NodeAddr=10.0.0.1";; esac\n'),
}


@pytest.mark.parametrize("container", ["none", "udocker"])
@pytest.mark.parametrize("srun_exit, job_exit, requeued", [(0, 0, False), (75, 0, True), (3, 3, False)])
def test_slurm_job_requeues_itself_only_when_the_ranks_stopped_at_a_checkpoint(tmp_path, container, srun_exit,
                                                                                job_exit, requeued):
    # The script itself, run by bash against stand-ins for srun and scontrol that log their arguments.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {**FAKE_SLURM, "udocker": "exit 0\n"}.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    spec = JobSpec(**{**example_spec("slurm", container).__dict__, "workdir": str(tmp_path)})
    script = tmp_path / "job.slurm"
    script.write_text(slurm.render(spec))
    log = tmp_path / "calls.log"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LOG": str(log), "SRUN_EXIT": str(srun_exit),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]"}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == job_exit, done.stderr
    calls = log.read_text().splitlines()
    assert ("scontrol requeue 4242" in calls) == requeued, calls
    srun = next(call for call in calls if call.startswith("srun "))
    if container == "udocker":  # the container runtime ignores every stop signal; the rank inside handles them
        assert " bash -c trap \"\" USR1 USR2 TERM; exec \"$@\" rank udocker " in srun, srun
    assert "#SBATCH --signal=USR1@300" in script.read_text() and "#SBATCH --requeue" in script.read_text()


# A rank of a user's command: writes what it was given to DPTRAIN_RUN_DIR/rank-RANK.json, exits with $EXIT.
RANK_PROBE = """
import json, os, signal, sys
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DPTRAIN_RUN_DIR")
seen = {name: os.environ.get(name) for name in names}
seen["usr1_ignored"] = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
seen["argv"] = sys.argv[1:]
with open(os.path.join(os.environ["DPTRAIN_RUN_DIR"], "rank-%s.json" % os.environ["RANK"]), "w") as handle:
    json.dump(seen, handle)
sys.exit(int(os.environ["EXIT"]))
"""
# Stand-ins for srun and mpirun that run their command once per rank, 4 ranks on 2 nodes, with the
# launcher's own rank variables; they log their arguments and exit with the highest exit code.
FAKE_LAUNCHERS = {
    "srun": ('echo "srun $*" >> "$LOG"\n'
             'while [ "${1#--}" != "$1" ]; do shift; done\n'
             'status=0\n'
             'for rank in 0 1 2 3; do SLURM_PROCID=$rank SLURM_LOCALID=$((rank % 2)) "$@" || status=$?; done\n'
             'exit $status\n'),
    "mpirun": ('echo "mpirun $*" >> "$LOG"\n'
               'while [ "${1#-}" != "$1" ]; do shift 2; done\n'
               'status=0\n'
               'for rank in 0 1 2 3; do OMPI_COMM_WORLD_RANK=$rank OMPI_COMM_WORLD_LOCAL_RANK=$((rank % 2)) "$@" '
               '|| status=$?; done\n'
               'exit $status\n'),
}


def run_command_job(tmp_path: Path, scheduler: str, exit_code: int, **env: str):
    """Render a 2-node x 2-task job of RANK_PROBE for `scheduler`, run it with bash against the stand-ins:
    (the job's exit code, the ranks' records by rank, the logged calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {**FAKE_SLURM, **FAKE_LAUNCHERS}.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    spec = JobSpec(scheduler=scheduler, workdir=str(tmp_path), run_dir=str(run_dir),
                   command=(sys.executable, "-c", RANK_PROBE, "--epochs", "3"), nodes=2, tasks_per_node=2)
    script = tmp_path / "job.sh"
    script.write_text(SCHEDULERS[scheduler].render(spec))
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("node1\nnode1\nnode2\nnode2\n")
    log = tmp_path / "calls.log"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "LOG": str(log),
                               "EXIT": str(exit_code), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]",
                               "PBS_JOBID": "77.pbs-server", "PBS_NODEFILE": str(nodefile), **env})
    ranks = {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in run_dir.glob("rank-*.json")}
    return done, ranks, log.read_text().splitlines()


@pytest.mark.parametrize("scheduler, master_addr, job_id", [("slurm", "10.0.0.1", "4242"),
                                                            ("pbs", "node1", "77.pbs-server")])
def test_a_command_s_ranks_get_torchrun_s_variables_from_the_scheduler(tmp_path, scheduler, master_addr, job_id):
    done, ranks, calls = run_command_job(tmp_path, scheduler, 0, PYTHONPATH="/home/ada/lib")
    assert done.returncode == 0, done.stderr
    assert sorted(ranks) == [0, 1, 2, 3], done.stderr
    for rank, seen in ranks.items():
        assert seen == {"RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": master_addr, "MASTER_PORT": str(port_from_job_id(job_id)),
                        "DPTRAIN_RUN_DIR": str(tmp_path / "run"), "usr1_ignored": scheduler == "slurm",
                        "argv": ["--epochs", "3"]}
        # dptrain's own ranks, given that environment, would agree on every number
        env = detect({name: value for name, value in seen.items() if isinstance(value, str)})
        assert (env.rank, env.world_size, env.local_rank, env.master_port) == (rank, 4, rank % 2,
                                                                               port_from_job_id(job_id))
    if scheduler == "pbs":  # other nodes get what the first has, and the search paths that are set
        mpirun = next(call for call in calls if call.startswith("mpirun "))
        for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "DPTRAIN_RUN_DIR", "PATH",
                     "PYTHONPATH"):
            assert f" -x {name} " in mpirun, mpirun
        assert "VIRTUAL_ENV" not in mpirun and "LD_LIBRARY_PATH" not in mpirun, mpirun


@pytest.mark.parametrize("exit_code, job_exit, requeued", [(75, 0, True), (3, 3, False)])
def test_a_slurm_command_job_is_requeued_only_when_its_ranks_exit_with_75(tmp_path, exit_code, job_exit, requeued):
    done, ranks, calls = run_command_job(tmp_path, "slurm", exit_code)
    assert done.returncode == job_exit, done.stderr
    assert len(ranks) == 4
    assert ("scontrol requeue 4242" in calls) == requeued, calls
    assert ("requeueing it" in done.stdout) == requeued, done.stdout


def test_stop_before_zero_sends_no_signal_but_still_requeues_a_stopped_job():
    text = slurm.render(JobSpec(**{**example_spec("slurm", "udocker").__dict__, "stop_before": 0}))
    assert "--signal" not in text
    # A stop signal may still come (scancel --signal, srun's TERM when a rank exits 75 first): the runtime ignores it.
    assert 'trap "" USR1 USR2 TERM; exec' in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text


@pytest.mark.parametrize("mode", list(MODES))
def test_the_stop_signal_is_the_users_choice_and_the_one_the_containers_and_commands_ignore(mode):
    for container in ("none", "udocker"):
        text = slurm.render(JobSpec(**{**example_spec("slurm", container, mode).__dict__, "stop_signal": "USR2"}))
        assert "#SBATCH --signal=USR2@300" in text
        if mode == "command":  # the user's program starts with the warning ignored, no other signal
            assert "USR1" not in text and 'trap "" USR2; exec' in text
        else:  # dptrain train handles every stop signal once started; until then, and its runtime, ignore them
            assert 'trap "" USR1 USR2 TERM; exec' in text


def test_local_scheduler_refuses_several_nodes():
    with pytest.raises(UserError, match="--nodes 1, not 2"):
        JobSpec(scheduler="local", workdir="/p", run_dir="/p/r", nodes=2)


def test_a_container_spec_names_the_valid_forms():
    assert parse_container("apptainer:/x/y.sif") == ContainerSpec("apptainer", "/x/y.sif")
    with pytest.raises(UserError, match="udocker:NAME or apptainer:IMAGE.sif"):
        parse_container("docker:ubuntu")


def test_slurm_status_parsing():
    running = slurm.parse_status("JobId=7 JobName=x JobState=RUNNING Reason=None ExitCode=0:0 RunTime=00:00:03")
    assert (running.state, running.finished) == ("RUNNING", False)
    failed = slurm.parse_status("JobId=7 JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0")
    assert (failed.finished, failed.exit_code) == (True, 3)
    cancelled = slurm.parse_status("JobId=7 JobState=CANCELLED ExitCode=0:15")
    assert cancelled.exit_code == 128 + 15
    timeout = slurm.parse_status("JobId=7 JobState=TIMEOUT ExitCode=0:0")
    assert timeout.finished and timeout.exit_code == 1
    assert slurm.parse_job_id("1234;cluster\n") == "1234"


def test_pbs_status_parsing():
    finished = pbs.parse_status("Job Id: 12.server\n    job_state = F\n    Exit_status = 2\n")
    assert (finished.state, finished.finished, finished.exit_code) == ("F", True, 2)
    killed = pbs.parse_status("Job Id: 12.server\n    job_state = F\n    Exit_status = 265\n")
    assert killed.exit_code == 128 + 9
    queued = pbs.parse_status("Job Id: 12.server\n    job_state = Q\n")
    assert not queued.finished
    torque = pbs.parse_status("Job Id: 12.server\n    job_state = C\n    exit_status = 0\n")
    assert torque.finished and torque.exit_code == 0
    assert pbs.parse_job_id("12.server\n") == "12.server"


def test_udocker_config_switches_autoinstall_off_with_an_empty_value():
    text = udocker.config_text("/opt/proot")
    assert "autoinstall =\n" in text and "False" not in text
    assert "use_proot_executable = /opt/proot" in text


def test_proot_wrapper_drops_the_kernel_release_option(tmp_path):
    wrapper = tmp_path / "proot"
    wrapper.write_text(udocker.proot_wrapper("/bin/echo"))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    result = subprocess.run([str(wrapper), "-r", "/root fs", "-k", "6.1.0", "--kernel-release=5", "-w", "/", "true"],
                            capture_output=True, text=True, timeout=10)
    assert result.stdout.split() == ["-r", "/root", "fs", "-w", "/", "true"]


def dptrain(*args, cwd):
    # 'python' on the PATH is this interpreter, as in an activated venv
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "dptrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    result = dptrain("launch", "--scheduler", "slurm", "--nodes", "2", "--dry-run", "--", "--epochs", "3",
                     "--out", "runs/x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("#!/bin/bash") and f"--out {tmp_path}/runs/x" in result.stdout
    assert not (tmp_path / "runs").exists()


def test_launch_writes_the_script_into_the_run_directory(tmp_path):
    result = dptrain("launch", "--scheduler", "pbs", "--", "--out", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "job.pbs").read_text().startswith("#!/bin/bash")


@pytest.mark.parametrize("options, script_name", [(["slurm"], "job.slurm"), (["pbs"], "job.pbs"),
                                                 (["local"], "job.sh"), (["kubernetes", "--image", "img"], "job.yaml")])
def test_the_submit_command_it_prints_pasted_into_bash_names_the_script(tmp_path, options, script_name):
    out = "it's my run"  # a quote and a space
    result = dptrain("launch", "--scheduler", *options, "--", "--out", out, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "submit it" in line)
    command = line.rsplit(" with: ", 1)[1]
    # The scheduler's program, replaced by one that prints each argument it gets on a line of its own.
    fake = tmp_path / "bin"
    fake.mkdir()
    program = command.split()[0]
    (fake / program).write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    (fake / program).chmod(0o755)

    pasted = subprocess.run(["/bin/bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=30,
                            env={**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"})

    assert pasted.returncode == 0, pasted.stderr
    named = Path(pasted.stdout.splitlines()[-1])
    assert named == tmp_path / out / script_name and named.is_file()


def test_words_after_dashes_that_start_with_a_word_are_a_command_for_every_rank(tmp_path):
    (tmp_path / "train.py").write_text("")
    result = dptrain("launch", "--scheduler", "slurm", "--nodes", "2", "--dry-run", "--out", "mine", "--", "python",
                     "train.py", "--epochs", "3", "--debug", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "# Every rank runs: python train.py --epochs 3 --debug\n" in result.stdout  # --debug is the command's
    assert f"DPTRAIN_RUN_DIR={tmp_path}/mine" in result.stdout and " --out " not in result.stdout
    srun = next(line for line in result.stdout.splitlines() if line.startswith("srun "))
    assert srun.endswith("' rank python train.py --epochs 3 --debug || status=$?"), srun
    assert not (tmp_path / "mine").exists()


def test_a_command_job_launched_again_keeps_its_script_unless_it_is_the_same(tmp_path):
    (tmp_path / "train.py").write_text("")
    first = dptrain("launch", "--scheduler", "pbs", "--out", "run", "--", "python", "train.py", "--lr", "1", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    script = (tmp_path / "run" / "job.pbs").read_text()
    again = dptrain("launch", "--scheduler", "pbs", "--out", "run", "--", "python", "train.py", "--lr", "1", cwd=tmp_path)
    assert again.returncode == 0, again.stderr  # the same job again (a resubmission) is fine
    other = dptrain("launch", "--scheduler", "pbs", "--out", "run", "--", "python", "train.py", "--lr", "2", cwd=tmp_path)
    assert other.returncode == 2
    assert other.stderr.splitlines() == [f"dptrain: error: '{tmp_path}/run/job.pbs' already holds a different job "
                                         "script; give --out a new directory (or delete that script to replace it)"]
    assert (tmp_path / "run" / "job.pbs").read_text() == script


@pytest.mark.parametrize("words, message", [
    (["pyhton", "train.py"], "command 'pyhton' is not on the PATH nor a file; the words after '--' are a command "
                             "unless the first starts with '-', and then they are dptrain train's"),
    (["python", "tain.py"], "the command's script 'tain.py' does not exist (in {cwd})"),
    (["train.sh"], "command 'train.sh' is not on the PATH; to run the file in {cwd}, write ./train.sh"),
    (["./train.sh"], "command './train.sh' is not executable; run chmod +x ./train.sh, or put its interpreter "
                     "first (e.g. bash ./train.sh)"),
    (["./it's.sh"], "command './it's.sh' is not executable; run chmod +x './it'\"'\"'s.sh', or put its "
                    "interpreter first (e.g. bash './it'\"'\"'s.sh')"),
    (["./nope.sh"], "command './nope.sh' does not exist (in {cwd})"),
])
def test_a_command_that_cannot_start_is_one_line_and_nothing_is_written(tmp_path, words, message):
    (tmp_path / "train.py").write_text("")
    (tmp_path / "train.sh").write_text("echo hi\n")
    (tmp_path / "it's.sh").write_text("echo hi\n")
    result = dptrain("launch", "--scheduler", "pbs", "--out", "run", "--", *words, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["dptrain: error: " + message.format(cwd=tmp_path)]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_local_launch_runs_a_user_s_ddp_script_on_every_rank(tmp_path):
    shutil.copy(Path(__file__).parent / "user_ddp.py", tmp_path / "script.py")
    result = dptrain("launch", "--scheduler", "local", "--tasks-per-node", "2", "--out", "run", "--submit", "--wait",
                     "--wait-timeout", "100", "--", "python", "script.py", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run = tmp_path / "run"
    assert (run / "sum.txt").read_text() == "15\n"  # (1 + 2) * 5
    ranks = [(run / f"rank-{rank}.txt").read_text().split()[1:] for rank in (0, 1)]  # local rank, world, where
    assert ranks == [["0", "2", "host"], ["1", "2", "host"]]
    assert sorted(path.name for path in run.iterdir()) == [".dptrain-run", "job.out", "job.sh", "rank-0.txt",
                                                           "rank-1.txt", "sum.txt"]  # no config.yaml


def test_bad_train_arguments_fail_before_anything_is_written(tmp_path):
    result = dptrain("launch", "--scheduler", "slurm", "--", "--epoch", "3", "--out", "run", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "dptrain: error: unknown option --epoch for 'dptrain train'; did you mean --epochs?"
    assert not (tmp_path / "run").exists()


def test_train_arguments_before_the_double_dash_say_to_put_them_after_it(tmp_path):
    result = dptrain("launch", "--scheduler", "slurm", "--nodes", "2", "--epochs", "3", "--strategy", "sync",
                     "--out", "run", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "dptrain: error: --epochs is an option of 'dptrain train', not of 'dptrain launch'; put the train arguments "
        "after '--': dptrain launch --scheduler slurm --nodes 2 --out run -- --epochs 3 --strategy sync")
    assert not (tmp_path / "run").exists()


def test_only_options_launch_lacks_are_moved_after_the_double_dash():
    from dptrain.cli import parse_args

    # --partition is launch's (a SLURM partition) as well as train's (fedavg's); before '--' it is launch's.
    args = parse_args(["launch", "--scheduler", "slurm", "--partition", "gpu", "--", "--epochs", "1"])
    assert (args.partition, args.train_args) == ("gpu", ["--", "--epochs", "1"])
    with pytest.raises(UserError) as error:
        parse_args(["launch", "--scheduler", "local", "--no-progress", "--sbatch-option", "--mem=0", "--lr=0.1",
                    "--", "--epochs", "1"])
    assert str(error.value).endswith(": dptrain launch --scheduler local --sbatch-option=--mem=0 -- --no-progress "
                                     "--lr=0.1 --epochs 1")


def _build_lines(text):
    """The docker build and apptainer build command lines of a header or of the printed output."""
    return [line.strip("# ").strip() for line in text.splitlines() if " build " in line and "dptrain" in line
            and line.strip("# ").startswith(("docker build", "apptainer build"))]


def test_container_recipe_writes_a_dockerfile_its_ignore_file_and_an_apptainer_definition(tmp_path):
    # Run outside any source tree: the build context is the checkout this dptrain runs from.
    result = dptrain("container", "recipe", "--out", "image", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    checkout = Path(__file__).resolve().parents[1]
    dockerfile = (tmp_path / "image" / "Dockerfile").read_text()
    definition = (tmp_path / "image" / "dptrain.def").read_text()
    assert "COPY src /opt/dptrain/src" in dockerfile and "pip install /opt/dptrain" in dockerfile
    assert "COPY . " not in dockerfile and "the dptrain source tree" in dockerfile
    assert "    src /opt/dptrain/src" in definition and "Bootstrap: docker" in definition
    # The Dockerfile lies outside the context's root: its ignore file has BuildKit's name, beside it.
    assert sorted(path.name for path in (tmp_path / "image").iterdir()) == ["Dockerfile", "Dockerfile.dockerignore",
                                                                            "dptrain.def"]
    ignore = (tmp_path / "image" / "Dockerfile.dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*"):] == ["*", "!pyproject.toml", "!README.md", "!src", "**/__pycache__", "**/*.pyc",
                                          "**/*.egg-info"]
    assert ".venv" in ignore[1] and "runs/" in ignore[1]
    # What the header says and what is printed agree, and name the real paths.
    printed = result.stdout.splitlines()
    assert f"  cd {checkout}" in printed
    assert _build_lines(result.stdout) == _build_lines(dockerfile) + _build_lines(definition) == [
        f"docker build -t dptrain -f {tmp_path}/image/Dockerfile . && docker save dptrain -o dptrain.tar",
        f"apptainer build dptrain.sif {tmp_path}/image/dptrain.def"]


def test_container_recipe_pins_the_torch_installed_here_and_shows_where_a_user_s_packages_go(tmp_path):
    import importlib.metadata

    result = dptrain("container", "recipe", "--out", "image", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    pinned = f"torch=={importlib.metadata.version('torch').split('+')[0]}"
    dockerfile = (tmp_path / "image" / "Dockerfile").read_text()
    definition = (tmp_path / "image" / "dptrain.def").read_text()
    assert f'RUN python -m pip install "{pinned}" && python -m pip install /opt/dptrain' in dockerfile
    assert f'    python -m pip install "{pinned}"\n' in definition
    # The place for the user's own packages: after dptrain's install, before the image's working directory.
    assert dockerfile.index("# Your own packages") > dockerfile.index("pip install /opt/dptrain")
    assert "# RUN python -m pip install scikit-learn==" in dockerfile
    assert definition.index("    # Your own packages") > definition.index("pip install /opt/dptrain")
    assert definition.index("    # Your own packages") < definition.index("%environment")


def test_container_recipe_installs_torch_from_the_index_given(tmp_path):
    # PyTorch's CUDA builds come from its own index (a site may have a mirror): both recipes install from it
    url = "https://download.pytorch.org/whl/cu124"
    result = dptrain("container", "recipe", "--out", "image", "--torch", "torch==2.5.1", "--torch-index-url", url,
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    dockerfile = (tmp_path / "image" / "Dockerfile").read_text()
    definition = (tmp_path / "image" / "dptrain.def").read_text()
    assert f'RUN python -m pip install "torch==2.5.1" --index-url "{url}" && python -m pip install /opt/dptrain' in dockerfile
    assert f'    python -m pip install "torch==2.5.1" --index-url "{url}"\n    python -m pip install /opt/dptrain\n' in definition
    # without it, PyPI (no --index-url at all)
    assert dptrain("container", "recipe", "--out", "plain", cwd=tmp_path).returncode == 0
    assert "--index-url" not in (tmp_path / "plain" / "Dockerfile").read_text()


@pytest.mark.parametrize("url", ["download.pytorch.org/whl/cu124", "https://x/y z", 'https://x/"; rm -rf ~ "'])
def test_a_torch_index_that_is_not_a_url_is_refused_in_one_line(tmp_path, url):
    result = dptrain("container", "recipe", "--out", "image", "--torch-index-url", url, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"dptrain: error: --torch-index-url {url!r} is not a pip index URL; give one such as "
        "https://download.pytorch.org/whl/cu124 (http, https or file; no spaces, quotes, $ or `)"]
    assert not (tmp_path / "image").exists()


def test_the_torch_pin_drops_the_local_suffix_and_is_plain_torch_without_one_installed(monkeypatch):
    import importlib.metadata
    from dptrain.launch.container_commands import installed_torch

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cu128")
    assert installed_torch() == "torch==2.13.0"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert installed_torch() == "torch"


@pytest.fixture
def source_tree(tmp_path, monkeypatch):
    """A directory that looks like a dptrain checkout, as the working directory."""
    tree = tmp_path / "dptrain-src"
    (tree / "src" / "dptrain").mkdir(parents=True)
    (tree / "src" / "dptrain" / "__init__.py").write_text("")
    (tree / "pyproject.toml").write_text('[project]\nname = "dptrain"\n')
    monkeypatch.chdir(tree)
    return tree


def test_container_recipe_in_the_source_tree_writes_the_context_s_dockerignore(source_tree, capsys):
    from dptrain.launch.container_commands import recipe

    assert recipe(Path("."), base="python:3.11-slim", torch="torch", wheel=None, force=False) == 0
    printed = capsys.readouterr().out
    assert "cd " not in printed  # already in the build context
    assert (source_tree / ".dockerignore").read_text().splitlines()[3:5] == ["*", "!pyproject.toml"]
    assert not (source_tree / "Dockerfile.dockerignore").exists()
    dockerfile = (source_tree / "Dockerfile").read_text()
    assert _build_lines(printed) == _build_lines(dockerfile) + _build_lines((source_tree / "dptrain.def").read_text())
    assert _build_lines(printed)[0].startswith("docker build -t dptrain -f Dockerfile . &&")
    assert recipe(Path("image"), base="b", torch="torch", wheel=None, force=False) == 0
    assert _build_lines(capsys.readouterr().out) == [
        "docker build -t dptrain -f image/Dockerfile . && docker save dptrain -o dptrain.tar",
        "apptainer build dptrain.sif image/dptrain.def"]
    assert (source_tree / "image" / "Dockerfile.dockerignore").is_file()
    with pytest.raises(UserError, match="add --force to replace Dockerfile, .dockerignore, dptrain.def$"):
        recipe(Path("."), base="b", torch="torch", wheel=None, force=False)


def test_container_recipe_never_overwrites_a_file_without_force(tmp_path):
    (tmp_path / "image").mkdir()
    (tmp_path / "image" / ".dockerignore").write_text("mine\n")
    (tmp_path / "image" / "Dockerfile").write_text("FROM mine\n")
    result = dptrain("container", "recipe", "--out", "image", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("dptrain: error: image/Dockerfile is already there; dptrain container recipe "
                                     "overwrites nothing: choose another --out, or add --force to replace it")
    assert (tmp_path / "image" / "Dockerfile").read_text() == "FROM mine\n"
    assert not (tmp_path / "image" / "dptrain.def").exists()  # nothing written at all
    forced = dptrain("container", "recipe", "--out", "image", "--force", cwd=tmp_path)
    assert forced.returncode == 0, forced.stderr
    assert (tmp_path / "image" / "Dockerfile").read_text().startswith("# An image holding dptrain")
    assert (tmp_path / "image" / ".dockerignore").read_text() == "mine\n"  # not the recipe's: left alone


def test_container_recipe_from_a_wheel_needs_no_source_tree(tmp_path, monkeypatch, capsys):
    import dptrain as package
    from dptrain.launch.container_commands import recipe

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(package, "__file__", str(tmp_path / "site-packages" / "dptrain" / "__init__.py"))
    with pytest.raises(UserError, match="there is none here: dptrain runs as an installed package.*--wheel PATH"):
        recipe(Path("image"), base="b", torch="torch", wheel=None, force=False)
    assert not (tmp_path / "image").exists()
    (tmp_path / "dist").mkdir()
    wheel = tmp_path / "dist" / "dptrain-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"PK wheel")
    with pytest.raises(UserError, match="is not a dptrain wheel"):
        recipe(Path("image"), base="b", torch="torch", wheel=tmp_path / "dist" / "other.whl", force=False)
    assert recipe(Path("image"), base="b", torch="torch==2.3", wheel=Path("dist") / wheel.name, force=False) == 0
    image = tmp_path / "image"
    assert (image / wheel.name).read_bytes() == b"PK wheel"
    dockerfile = (image / "Dockerfile").read_text()
    assert f"COPY {wheel.name} /opt/dptrain/" in dockerfile and "COPY src" not in dockerfile
    assert f'pip install "torch==2.3" && python -m pip install /opt/dptrain/{wheel.name}' in dockerfile
    assert (image / ".dockerignore").read_text().splitlines()[3:] == ["*", f"!{wheel.name}", "**/__pycache__",
                                                                     "**/*.pyc", "**/*.egg-info"]
    definition = (image / "dptrain.def").read_text()
    assert f"    {wheel.name} /opt/dptrain/{wheel.name}" in definition
    printed = capsys.readouterr().out
    assert f"  cd {image}" in printed.splitlines()
    assert _build_lines(printed) == _build_lines(dockerfile) + _build_lines(definition) == [
        "docker build -t dptrain -f Dockerfile . && docker save dptrain -o dptrain.tar",
        "apptainer build dptrain.sif dptrain.def"]
    with pytest.raises(UserError, match="add --force to replace Dockerfile, .dockerignore, dptrain.def, dptrain-0"):
        recipe(Path("image"), base="b", torch="torch", wheel=wheel, force=False)


def test_wait_follows_a_requeued_job_to_its_end_and_says_so(tmp_path, monkeypatch, capsys):
    from dptrain.cluster import submit

    states = iter(["PENDING", "RUNNING", "REQUEUED", "PENDING", "RUNNING", "COMPLETED"])
    output = tmp_path / "slurm-7.out"

    class Scheduler:
        @staticmethod
        def poll(job_id):
            state = next(states)
            with open(output, "a") as handle:
                handle.write(f"line while {state}\n")
            return slurm.parse_status(f"JobId={job_id} JobState={state} ExitCode=0:0")

    monkeypatch.setattr(submit, "POLL_SECONDS", 0.0)
    monkeypatch.setattr(submit.time, "sleep", lambda seconds: None)
    status = submit.follow(Scheduler, "7", output, timeout=60)
    assert status.state == "COMPLETED" and status.exit_code == 0
    printed = capsys.readouterr().out
    assert printed.count("went back to the queue") == 1 and "(REQUEUED)" in printed
    assert printed.count("line while") == 6  # the whole output, across both starts


@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_job_scripts_quiet_torchs_cpp_log_unless_the_user_chose_a_level(scheduler):
    # Ranks started by srun, mpirun or torchrun import torch before dptrain runs: the script sets the level.
    text = SCHEDULERS[scheduler].render(example_spec(scheduler, "none", "command"))
    exports = [line for line in text.splitlines() if line.startswith("export TORCH_CPP_LOG_LEVEL=")]
    assert len(exports) == 1
    for given, seen in ((None, "ERROR"), ("INFO", "INFO")):
        env = {"PATH": os.environ["PATH"], **({"TORCH_CPP_LOG_LEVEL": given} if given else {})}
        shown = subprocess.run(["bash", "-c", exports[0] + '; echo "$TORCH_CPP_LOG_LEVEL"'], env=env,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        assert shown == seen


def _lines_between(text: str, first: str, last: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next(i for i, line in enumerate(lines) if i >= start and line.startswith(last))
    return lines[start:end + 1]


def test_site_directives_are_written_as_slurm_lines_after_dptrain_s_own():
    spec = JobSpec(**{**example_spec("slurm", "none").__dict__, "mem": "0", "qos": "high", "constraint": "a100&ib",
                      "exclusive": True, "sbatch_options": ("--mail-type=END", "--gres=gpu:a100:2")})
    text = slurm.render(spec)
    assert _lines_between(text, "#SBATCH --account", "set -euo pipefail") == [
        "#SBATCH --account=proj42", "#SBATCH --mem=0", "#SBATCH --qos=high", "#SBATCH '--constraint=a100&ib'",
        "#SBATCH --exclusive", "#SBATCH --output=/home/ada/project/runs/digits-sync/slurm-%j.out",
        "#SBATCH --open-mode=append", "#SBATCH --requeue", "#SBATCH --signal=USR1@300",
        "#SBATCH --mail-type=END", "#SBATCH --gres=gpu:a100:2", "set -euo pipefail"]


def test_site_directives_are_written_as_pbs_lines_where_pbs_has_them():
    spec = JobSpec(**{**example_spec("pbs", "none").__dict__, "mem": "16G", "exclusive": True,
                      "pbs_options": ("-l software=matlab", "-m abe")})
    lines = pbs.render(spec).splitlines()
    assert "#PBS -l select=2:ncpus=8:mpiprocs=2:ngpus=2:mem=16gb" in lines
    assert "#PBS -l place=scatter:excl" in lines
    assert lines[lines.index("set -euo pipefail") - 2:lines.index("set -euo pipefail")] == [
        "#PBS -l software=matlab", "#PBS -m abe"]
    assert pbs.memory("4000") == "4000mb" and pbs.memory("2T") == "2tb"


@pytest.mark.parametrize("scheduler", ["slurm", "pbs", "local"])
def test_setup_lines_run_after_set_e_and_before_the_ranks_start(tmp_path, scheduler):
    (tmp_path / "env.sh").write_text("module load cuda/12\nsource /opt/venv/bin/activate\n")
    file_given = dptrain("launch", "--scheduler", scheduler, "--setup", "env.sh", "--dry-run", "--", "--out", "run",
                         cwd=tmp_path)
    assert file_given.returncode == 0, file_given.stderr
    lines = file_given.stdout.splitlines()
    at = lines.index(f"# Set-up from {tmp_path}/env.sh (--setup):")
    assert lines[at - 1].startswith("set +u  # ")  # (conda's activate reads unset variables)
    assert lines[at + 1:at + 4] == ["module load cuda/12", "source /opt/venv/bin/activate", "set -u"]
    assert lines.index("set -euo pipefail") < at
    start = next(i for i, line in enumerate(lines) if line.startswith(("srun ", "mpirun ", "start_ranks() {")))
    assert at < start
    typed = dptrain("launch", "--scheduler", scheduler, "--setup", "module load cuda; nvidia-smi -L", "--dry-run",
                    "--", "--out", "run", cwd=tmp_path)
    lines = typed.stdout.splitlines()
    assert lines[lines.index("# Set-up as given (--setup):") + 1] == "module load cuda; nvidia-smi -L"


@pytest.mark.parametrize("scheduler", ["slurm", "pbs", "local"])
def test_the_threads_line_is_said_after_a_setup_that_may_set_them(tmp_path, scheduler):
    said = 'echo "dptrain: $OMP_NUM_THREADS CPU threads per rank (OMP_NUM_THREADS; --cpus-per-task N asks for N)"'
    result = dptrain("launch", "--scheduler", scheduler, "--setup", "export OMP_NUM_THREADS=3", "--dry-run", "--",
                     "--out", "run", cwd=tmp_path)
    lines = result.stdout.splitlines()
    assert lines.count(said) == 1
    assert lines.index("export OMP_NUM_THREADS=$(( threads > 1 ? threads : 1 ))") < lines.index(
        "export OMP_NUM_THREADS=3") < lines.index(said)
    with_cpus = dptrain("launch", "--scheduler", scheduler, "--cpus-per-task", "2", "--dry-run", "--", "--out", "run",
                        cwd=tmp_path)
    assert "export OMP_NUM_THREADS=2" in with_cpus.stdout.splitlines() and said not in with_cpus.stdout


def test_setup_is_repeatable_and_runs_in_the_order_given(tmp_path):
    # Each --setup is a file (copied in: a requeued job runs what was submitted) or typed lines; a file
    # whose name has a space is still the file.
    (tmp_path / "site env.sh").write_text("module purge\nmodule load cuda/12\n")
    (tmp_path / "venv.sh").write_text("source /opt/venv/bin/activate")
    result = dptrain("launch", "--scheduler", "slurm", "--setup", "site env.sh", "--setup", "ulimit -n 4096",
                     "--setup", "venv.sh", "--dry-run", "--", "--out", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert _lines_between(result.stdout, "set +u", "set -u") == [
        "set +u  # environment scripts (module, conda activate) may read variables that are not set",
        f"# Set-up from {tmp_path}/site env.sh (--setup):", "module purge", "module load cuda/12",
        "# Set-up as given (--setup):", "ulimit -n 4096",
        f"# Set-up from {tmp_path}/venv.sh (--setup):", "source /opt/venv/bin/activate",
        "set -u"]
    # run by bash, each block in turn, with unset variables allowed in them only
    (tmp_path / "venv.sh").write_text('echo "two $UNSET_BY_ANYONE"')
    script = dptrain("launch", "--scheduler", "slurm", "--setup", "echo one; echo once", "--setup", "venv.sh",
                     "--dry-run", "--", "--out", "run", cwd=tmp_path).stdout
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(_lines_between(script, "set +u", "set -u"))
                           + '\necho "$UNSET_BY_ANYONE"'], capture_output=True, text=True, timeout=10)
    assert done.returncode != 0 and "UNSET_BY_ANYONE: unbound variable" in done.stderr
    assert done.stdout.splitlines() == ["one", "once", "two "]


def test_an_sbatch_option_is_taken_as_typed_even_though_it_starts_with_dashes(tmp_path):
    result = dptrain("launch", "--scheduler", "slurm", "--sbatch-option", "--mem=0", "--sbatch-option=--exclusive",
                     "--sbatch-option", "-C a100", "--dry-run", "--", "--out", "run", "--epochs", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --mem=0\n#SBATCH --exclusive\n#SBATCH -C a100\nset -euo pipefail\n" in result.stdout
    assert f"--epochs 2 --out {tmp_path}/run" in result.stdout  # the words after -- are still train's


@pytest.mark.parametrize("words, message", [
    (["--sbatch-option", "mem=0"], "--sbatch-option 'mem=0' is not one sbatch option; give one option on one line "
                                   "starting with '-', e.g. --sbatch-option '--mem=0'"),
    (["--sbatch-option", "--mem=0\n--qos=x"], "--sbatch-option '--mem=0\\n--qos=x' is not one sbatch option; give "
                                              "one option on one line starting with '-', e.g. --sbatch-option '--mem=0'"),
    (["--sbatch-option", "---"], "--sbatch-option '---' is not one sbatch option; give one option on one line "
                                 "starting with '-', e.g. --sbatch-option '--mem=0'"),
    (["--sbatch-option"], "--sbatch-option needs a value (see 'dptrain launch --help')"),
    (["--setup", "env.sh", "--setup", "mod"], "--setup 'mod' is not a file (in {cwd}); give a file of set-up lines, "
                                              "or the lines themselves, e.g. --setup 'module load cuda'"),
    (["--setup", "empty.sh"], "--setup 'empty.sh' is empty; give a file of set-up lines, or leave --setup out"),
    (["--pbs-option", "-l mem=1gb"], "--pbs-option '-l mem=1gb' is for --scheduler pbs, not slurm"),
    (["--setup", "nope.sh"], "--setup 'nope.sh' is not a file (in {cwd}); give a file of set-up lines, or the lines "
                             "themselves, e.g. --setup 'module load cuda'"),
    (["--qos", "high prio"], "--qos 'high prio' must be one word without spaces, e.g. normal"),
    (["--mem", "16GB"], "--mem '16GB' is not an amount of memory per node: a number with K, M, G or T (M when none), "
                        "e.g. 16G, or 0 for all of a node's memory"),
    (["--python", "venv/bin/python"], "--python 'venv/bin/python' is not an absolute path; give the interpreter's "
                                      "whole path, e.g. /opt/venv/bin/python"),
    (["--python", "/usr/bin/python3", "--dptrain", "dptrain"], "--python /usr/bin/python3 and --dptrain 'dptrain' "
                                                               "both say how ranks run dptrain; give one"),
    (["--scheduler", "pbs", "--qos", "high"], "--qos is SLURM's and PBS has no equivalent (a PBS queue is "
                                              "--partition); give the site's own with --pbs-option '-l ...'"),
    (["--scheduler", "pbs", "--constraint", "a100"], "--constraint is SLURM's and PBS has no equivalent (node features "
                                                     "are site resources); give the site's own with --pbs-option '-l ...'"),
    (["--scheduler", "pbs", "--mem", "0"], "--mem 0 (all of a node's memory) is SLURM's; under PBS give an amount, "
                                           "e.g. --mem 64G"),
    (["--scheduler", "pbs", "--pbs-option", "l mem=1gb"], "--pbs-option 'l mem=1gb' is not one PBS option; give one "
                                                          "option on one line starting with '-', e.g. --pbs-option "
                                                          "'-l mem=16gb'"),
    (["--scheduler", "local", "--exclusive"], "--exclusive is a SLURM and PBS directive; --scheduler local has none"),
    (["--scheduler", "kubernetes", "--image", "i", "--setup", "a b"],
     "--setup runs lines in a job script; a Kubernetes pod runs its --image as it is: put the set-up into the image"),
])
def test_a_bad_site_option_is_one_line_and_nothing_is_written(tmp_path, words, message):
    (tmp_path / "env.sh").write_text("module load cuda\n")
    (tmp_path / "empty.sh").write_text("\n")
    scheduler = [] if words[0] == "--scheduler" else ["--scheduler", "slurm"]
    result = dptrain("launch", *scheduler, *words, "--", "--out", "run", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["dptrain: error: " + message.format(cwd=tmp_path)]
    assert not (tmp_path / "run").exists()


def test_a_bad_option_leaves_a_job_script_already_written_as_it_was(tmp_path):
    first = dptrain("launch", "--scheduler", "slurm", "--mem", "16G", "--", "--out", "run", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    written = (tmp_path / "run" / "job.slurm").read_text()
    for words in (["--mem", "16 G"], ["--sbatch-option", "mem=0"], ["--setup", "missing.sh"], ["--mem", "32G"]):
        again = dptrain("launch", "--scheduler", "slurm", *words, "--", "--out", "run", cwd=tmp_path)
        assert again.returncode == 2 and len(again.stderr.splitlines()) == 1, again.stderr
        assert (tmp_path / "run" / "job.slurm").read_text() == written


def _threads(text: str, tmp_path: Path, cpus: int, **env: str) -> str:
    """OMP_NUM_THREADS as the script's own lines set it, run by bash on a node whose nproc says `cpus`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nproc").write_text(f"#!/bin/bash\necho {cpus}\n")
    (bin_dir / "nproc").chmod(0o755)
    lines = _lines_between(text, "export OMP_NUM_THREADS" if "threads=" not in text else "threads=",
                           "export OMP_NUM_THREADS")
    done = subprocess.run(["bash", "-c", "set -euo pipefail\n" + "\n".join(lines) + '\necho "$OMP_NUM_THREADS"'],
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_without_cpus_per_task_the_threads_are_what_the_node_offers(tmp_path):
    spec = JobSpec(**{**example_spec("slurm", "none").__dict__, "cpus_per_task": None})
    text = slurm.render(spec)
    assert "--cpus-per-task=" not in text  # neither asked of SLURM nor pinned on srun
    assert _lines_between(text, "# CPU threads per rank", "export OMP_NUM_THREADS") == [
        "# CPU threads per rank (no --cpus-per-task): SLURM_CPUS_PER_TASK if set, else the CPUs the job was",
        "# given on this node (SLURM_CPUS_ON_NODE, else nproc) shared among the ranks on it, at least 1. A",
        "# site's default is often one CPU per rank: for more, give --cpus-per-task N, or --exclusive.",
        "threads=${SLURM_CPUS_PER_TASK:-$(( ${SLURM_CPUS_ON_NODE:-$(nproc)} / ${SLURM_NTASKS_PER_NODE:-2} ))}",
        "export OMP_NUM_THREADS=$(( threads > 1 ? threads : 1 ))"]
    # the job's output says how many, so that one thread per rank is never silent
    assert ('echo "dptrain: $OMP_NUM_THREADS CPU threads per rank (OMP_NUM_THREADS; --cpus-per-task N asks for N)"'
            in text.splitlines())
    assert _threads(text, tmp_path, 32, SLURM_NTASKS_PER_NODE="4") == "8"
    # what SLURM gave the job on the node, not all the node's CPUs, which nproc sees where nothing confines it
    assert _threads(text, tmp_path, 64, SLURM_NTASKS_PER_NODE="4", SLURM_CPUS_ON_NODE="16") == "4"
    assert _threads(text, tmp_path, 32, SLURM_NTASKS_PER_NODE="4", SLURM_CPUS_PER_TASK="6",
                    SLURM_CPUS_ON_NODE="16") == "6"
    assert _threads(text, tmp_path, 3, SLURM_NTASKS_PER_NODE="4") == "1"  # at least 1
    assert _threads(text, tmp_path, 8) == "4"  # no SLURM_NTASKS_PER_NODE: --tasks-per-node (2)
    pbs_text = pbs.render(JobSpec(**{**example_spec("pbs", "none").__dict__, "cpus_per_task": None}))
    assert "#PBS -l select=2:ncpus=2:mpiprocs=2:ngpus=2" in pbs_text.splitlines()
    assert "threads=$(( $(nproc) / 2 ))" in pbs_text.splitlines()
    assert _threads(pbs_text, tmp_path, 48) == "24"
    given = slurm.render(example_spec("slurm", "none"))  # --cpus-per-task 4: asked for and pinned
    assert "#SBATCH --cpus-per-task=4" in given and " --cpus-per-task=4 " in given
    assert _threads(given, tmp_path, 32, SLURM_CPUS_PER_TASK="9") == "4"


@pytest.mark.parametrize("scheduler", ["slurm", "pbs", "local"])
def test_ranks_start_dptrain_by_the_launching_interpreter_s_absolute_path(tmp_path, scheduler):
    result = dptrain("launch", "--scheduler", scheduler, "--dry-run", "--", "--out", "run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rank = next(line for line in result.stdout.splitlines() if " -m dptrain train " in line)
    assert f" {sys.executable} -m dptrain train " in f" {rank.strip()}", rank
    assert os.path.isabs(sys.executable) and os.access(sys.executable, os.X_OK)
    chosen = dptrain("launch", "--scheduler", scheduler, "--python", "/opt/site/venv/bin/python", "--dry-run", "--",
                     "--out", "run", cwd=tmp_path)
    assert "/opt/site/venv/bin/python -m dptrain train " in chosen.stdout
    # In a container the laptop's interpreter does not exist: the image's dptrain runs.
    boxed = dptrain("launch", "--scheduler", scheduler, "--container", "udocker:img", "--dry-run", "--", "--out",
                    "run", cwd=tmp_path)
    assert boxed.returncode == 0, boxed.stderr
    assert sys.executable not in boxed.stdout and " img dptrain train " in boxed.stdout


def test_wait_names_a_requeue_that_started_again_between_two_polls(tmp_path, monkeypatch, capsys):
    # SLURM can requeue a job and start it again within one poll: only its Restarts count tells.
    from dptrain.cluster import submit

    states = iter([("RUNNING", 0), ("RUNNING", 0), ("RUNNING", 1), ("RUNNING", 1), ("COMPLETED", 1)])
    output = tmp_path / "slurm-8.out"

    class Scheduler:
        @staticmethod
        def poll(job_id):
            state, restarts = next(states)
            return slurm.parse_status(f"JobId={job_id} JobState={state} Restarts={restarts} ExitCode=0:0")

    monkeypatch.setattr(submit, "POLL_SECONDS", 0.0)
    monkeypatch.setattr(submit.time, "sleep", lambda seconds: None)
    status = submit.follow(Scheduler, "8", output, timeout=60)
    assert status.state == "COMPLETED" and status.restarts == 1
    printed = capsys.readouterr().out
    assert printed.count("went back to the queue") == 1 and "(restart 1, RUNNING again)" in printed


def test_kubernetes_with_an_absolute_out_writes_the_manifest_here_and_nothing_at_the_pods_path(tmp_path):
    # --out /.../k8s is the pods' run directory (on a --volume): this machine need not have it, nor make it.
    pods_path = tmp_path / "not-here" / "srv" / "runs" / "k8s"
    result = dptrain("launch", "--scheduler", "kubernetes", "--image", "img", "--volume", f"runs:{pods_path.parent}",
                     "--", "--dataset", "digits", "--out", str(pods_path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    manifest = tmp_path / "runs" / "k8s" / "job.yaml"
    assert result.stdout.splitlines()[:2] == [
        f"dptrain: wrote {manifest}",
        f"dptrain: the pods write the run into {pods_path} (--out); this machine keeps only the manifest, in "
        f"{manifest.parent}"]
    assert not (tmp_path / "not-here").exists()
    assert f"- {pods_path}\n" in manifest.read_text()  # the pods' --out, as given
    relative = dptrain("launch", "--scheduler", "kubernetes", "--image", "img", "--", "--dataset", "digits", "--out",
                       "runs/rel", cwd=tmp_path)
    assert relative.stdout.splitlines()[0] == f"dptrain: wrote {tmp_path}/runs/rel/job.yaml"
    assert "keeps only the manifest" not in relative.stdout
