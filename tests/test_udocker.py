"""udocker for real: `dptrain container setup` offline, and training with one container per rank,
under the local launcher and across two SLURM nodes.

The container is a tiny root filesystem built by the fixture (busybox, /etc); this machine's
Python, venv and shared libraries are bound into it, so no image download is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dptrain.cluster import udocker

from cluster_fixtures import assert_run_written, slurm_cluster, udocker_container  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow
# sync: one average per epoch, so few collectives pass through proot's system-call tracing.
DIGITS = ["--dataset", "digits", "--model", "mlp", "--epochs", "10", "--lr", "0.05", "--batch-size", "32",
          "--strategy", "sync", "--timeout", "120"]


def launch_command(container, *args: str, wait_timeout: float, slow: str = "",
                   data: tuple[str, ...] = ("--dataset", "digits")) -> list[str]:
    """`dptrain launch ARGS --container udocker:NAME ... --submit --wait -- DIGITS --out run`."""
    binds = [word for path in container.binds for word in ("--bind", path)]
    return [sys.executable, "-m", "dptrain", "launch", *args, "--container", f"udocker:{container.name}", *binds,
            "--dptrain", container.dptrain, "--submit", "--wait", "--wait-timeout", str(wait_timeout), "--", *data,
            *DIGITS[2:], *(["--slow-worker", slow] if slow else []), "--out", "run"]


def launch(container, *args: str, cwd: Path, env: dict, timeout: float = 300, **options) -> subprocess.CompletedProcess:
    return subprocess.run(launch_command(container, *args, wait_timeout=timeout - 30, **options), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_setup_leaves_udocker_offline_with_the_wrapped_system_proot(udocker_container):
    config = (udocker_container.directory / "udocker.conf").read_text()
    assert "autoinstall =\n" in config
    wrapper = next(line.split("=", 1)[1].strip() for line in config.splitlines() if line.startswith("use_proot_executable"))
    assert os.access(wrapper, os.X_OK) and "exec " in Path(wrapper).read_text()


def execmode(container, name: str) -> str:
    """The execution mode udocker keeps for container NAME (beside its root filesystem)."""
    root = subprocess.run([*udocker_argv(container), "inspect", "-p", name], env=container.env, capture_output=True,
                          text=True, timeout=60, check=True).stdout.split()[-1]
    return (Path(root).parent / "execmode").read_text().strip()


def test_setup_sets_the_fastest_execution_mode_that_runs_here(udocker_container):
    assert execmode(udocker_container, udocker_container.name) == udocker.AUTO_MODES[0] == "P1"


def test_an_execution_mode_that_cannot_run_here_is_one_line_and_auto_falls_back_past_it(udocker_container, capsys):
    # F1 (Fakechroot) needs udocker's own libfakechroot, which an offline udocker never downloads.
    tarball = udocker_container.directory.parent / "rootfs.tar.gz"
    done = subprocess.run([sys.executable, "-m", "dptrain", "container", "setup", "--image", str(tarball), "--name",
                           "fallback", "--execmode", "F1"], env=udocker_container.env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert done.stderr.startswith("dptrain: error: --execmode F1 cannot run container fallback here: 'true' inside it "
                                  "exited 1: Error: libfakechroot not found") and len(done.stderr.splitlines()) == 1
    assert done.stderr.rstrip().endswith("; --execmode auto tries P1, P2 in turn")
    assert udocker.choose_mode(udocker_container.directory, "fallback", ("F1", "P2")) == "P2"
    line = capsys.readouterr().out.strip()
    assert line.startswith("dptrain: udocker execution mode F1 cannot run here ('true' inside it exited 1: Error: "
                           "libfakechroot not found") and line.endswith("; trying P2"), line
    assert execmode(udocker_container, "fallback") == "P2"
    result = subprocess.run([*udocker_argv(udocker_container), "run", "--nobanner", "fallback", "true"],
                            env=udocker_container.env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_container_check_runs_dptrain_inside(udocker_container):
    binds = [word for path in udocker_container.binds for word in ("--bind", path)]
    result = subprocess.run([sys.executable, "-m", "dptrain", "container", "check", "--name", udocker_container.name,
                             "--dptrain", udocker_container.dptrain, *binds], env=udocker_container.env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok   runs" in result.stdout and "dptrain 0." in result.stdout


def udocker_argv(container) -> list[str]:
    argv = [str(Path(sys.executable).parent / "udocker"), f"--config={container.directory}/udocker.conf"]
    return argv + ["--allow-root"] if os.geteuid() == 0 else argv


def udocker_run(container, *volumes: str) -> list[str]:
    """`udocker run` of the fixture's container, with its binds and `volumes` bound."""
    binds = [word for path in (*container.binds, *volumes) for word in ("-v", path)]
    return [*udocker_argv(container), "run", "--nobanner", "--hostenv", *binds, container.name]


def test_info_inside_the_container_names_udocker(udocker_container):
    probe = "from dptrain.info import runtime_report; print(runtime_report()['container'])"
    result = subprocess.run([*udocker_run(udocker_container), sys.executable, "-c", probe],
                            env=udocker_container.env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "udocker"


def wait_for_file(path: Path, what: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"{what} ended before {path.name}: " + process.communicate()[0]
        assert time.monotonic() < deadline, f"{what} wrote no {path.name} within {timeout:g} s"
        time.sleep(0.1)


def test_a_container_that_ends_first_leaves_the_bind_paths_of_one_still_running_on_the_same_image(
        udocker_container, tmp_path):
    # The SLURM downscaling test's lost summary.json and model.pt: two ranks on one udocker container, the
    # first to start ends first, the other then writes into its bound run directory. PRoot used to make the
    # bind's missing parents (here under /tmp) in the shared image and delete them when the first one exited.
    shared = tmp_path / "deep" / "run"
    shared.mkdir(parents=True)
    # Each waits for its go file; exit 8 where the bound directory itself has gone.
    wait_go = "for i in $(seq 600); do [ -e {go} ] && exit 0; [ -d {shared} ] || exit 8; sleep 0.1; done; exit 9"

    def container(name: str, after: str) -> subprocess.Popen:
        script = f"echo > {shared}/{name}-up && ({wait_go.format(go=shared / (name + '-go'), shared=shared)}) && {after}"
        return subprocess.Popen([*udocker_run(udocker_container, str(shared)), "/bin/sh", "-c", script],
                                env=udocker_container.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    first = container("first", "true")
    try:
        wait_for_file(shared / "first-up", "the first container", first)
        second = container("second", f"mkdir {shared}/checkpoints && echo done > {shared}/checkpoints/written")
        try:
            wait_for_file(shared / "second-up", "the second container", second)
            (shared / "first-go").touch()
            assert first.wait(timeout=60) == 0, first.communicate()[0]
            (shared / "second-go").touch()
            output, _ = second.communicate(timeout=60)
        finally:
            second.kill()
    finally:
        first.kill()
    assert second.returncode == 0, f"exit {second.returncode} (8: {shared} vanished inside it)\n{output}"
    assert (shared / "checkpoints" / "written").read_text() == "done\n"
    image = Path(subprocess.run([*udocker_argv(udocker_container), "inspect", "-p", udocker_container.name],
                                env=udocker_container.env, capture_output=True, text=True, timeout=60,
                                check=True).stdout.split()[-1])
    assert image.is_dir() and not (image / tmp_path.relative_to("/")).exists()  # nothing made in the image


def test_local_launch_trains_a_user_dataset_factory_with_one_container_per_rank(udocker_container, tmp_path):
    # tests/ lies inside the bound repository, so PYTHONPATH finds the factory inside the containers too.
    env = {**udocker_container.env, "PYTHONPATH": str(Path(__file__).parent)}
    result = launch(udocker_container, "--scheduler", "local", "--tasks-per-node", "2", cwd=tmp_path, env=env,
                    data=("--data", "digits_factory:make"))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "COMPLETED with exit code 0" in output
    run = assert_run_written(tmp_path / "run", workers=2, epochs=10)
    assert run["test_accuracy"] >= 0.90, run
    assert "data: digits_factory:make" in (tmp_path / "run" / "config.yaml").read_text()


def test_slurm_job_runs_a_user_s_ddp_script_in_one_udocker_container_per_rank(slurm_cluster, udocker_container,
                                                                            tmp_path):
    # A command, not dptrain train: the ranks' variables pass into the containers with --hostenv.
    shutil.copy(Path(__file__).parent / "user_ddp.py", tmp_path / "script.py")
    env = {**udocker_container.env, "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    binds = [word for path in udocker_container.binds for word in ("--bind", path)]
    result = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                             "--tasks-per-node", "1", "--container", f"udocker:{udocker_container.name}", *binds,
                             "--out", "run", "--submit", "--wait", "--wait-timeout", "150", "--", sys.executable,
                             "script.py", "7"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + slurm_cluster.logs()
    run = tmp_path / "run"
    assert (run / "sum.txt").read_text() == "21\n"  # (1 + 2) * 7
    ranks = [(run / f"rank-{rank}.txt").read_text().split() for rank in (0, 1)]  # node, local rank, world, where
    assert ranks == [["node1", "0", "2", "udocker"], ["node2", "0", "2", "udocker"]]


def test_slurm_job_in_udocker_containers_trains_across_two_nodes_and_survives_the_time_limit_warning(
        slurm_cluster, udocker_container, tmp_path):
    # SIGUSR1 reaches every process of the step: udocker and proot ignore it (the job script's
    # trap), the rank inside checkpoints and exits 75, the job requeues itself and resumes.
    env = {**udocker_container.env, "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    follower = subprocess.Popen(launch_command(udocker_container, "--scheduler", "slurm", "--nodes", "2",
                                               "--tasks-per-node", "1", wait_timeout=400, slow="0:8"),
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run_dir = tmp_path / "run"
        slurm_cluster.wait_until(lambda: list(run_dir.glob("slurm-*.out")), "job output", 60)
        job_id = next(run_dir.glob("slurm-*.out")).stem.split("-")[1]
        slurm_cluster.preempt(job_id, run_dir / "metrics.jsonl", after_epochs=2, timeout=240)
        output, _ = follower.communicate(timeout=420)
    finally:
        follower.kill()
    assert follower.returncode == 0, output + slurm_cluster.logs()
    assert "on node[1-2]" in output and f"job {job_id} COMPLETED with exit code 0" in output, output
    assert "stopped by SIGUSR1 after epoch" in output and "resuming after epoch" in output, output
    epochs = [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert epochs == list(range(1, 11)), epochs
    run = summary(run_dir)
    assert run["workers"] == 2 and run["launcher"] == "srun" and run["test_accuracy"] >= 0.90, run