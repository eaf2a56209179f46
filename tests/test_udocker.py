"""udocker for real: `dptrain container setup` offline, and training with one container per rank,
under the local launcher and across two SLURM nodes.

The container is a tiny root filesystem built by the fixture (busybox, /etc); this machine's
Python, venv and shared libraries are bound into it, so no image download is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_fixtures import slurm_cluster, udocker_container  # noqa: F401 - pytest fixtures

pytestmark = pytest.mark.slow
# sync: one average per epoch, so few collectives pass through proot's system-call tracing.
DIGITS = ["--dataset", "digits", "--model", "mlp", "--epochs", "10", "--lr", "0.05", "--batch-size", "32",
          "--strategy", "sync", "--timeout", "120"]


def launch(container, *args: str, cwd: Path, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    """`dptrain launch ARGS --container udocker:NAME ... --submit --wait -- DIGITS --out run`."""
    binds = [word for path in container.binds for word in ("--bind", path)]
    return subprocess.run([sys.executable, "-m", "dptrain", "launch", *args, "--container", f"udocker:{container.name}",
                           *binds, "--dptrain", container.dptrain, "--submit", "--wait", "--wait-timeout",
                           str(timeout - 30), "--", *DIGITS, "--out", "run"],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_setup_leaves_udocker_offline_with_the_wrapped_system_proot(udocker_container):
    config = (udocker_container.directory / "udocker.conf").read_text()
    assert "autoinstall =\n" in config
    wrapper = next(line.split("=", 1)[1].strip() for line in config.splitlines() if line.startswith("use_proot_executable"))
    assert os.access(wrapper, os.X_OK) and "exec " in Path(wrapper).read_text()


def test_container_check_runs_dptrain_inside(udocker_container):
    binds = [word for path in udocker_container.binds for word in ("--bind", path)]
    result = subprocess.run([sys.executable, "-m", "dptrain", "container", "check", "--name", udocker_container.name,
                             "--dptrain", udocker_container.dptrain, *binds], env=udocker_container.env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok   runs" in result.stdout and "dptrain 0." in result.stdout


def test_info_inside_the_container_names_udocker(udocker_container):
    volumes = [word for path in udocker_container.binds for word in ("-v", path)]
    udocker = [str(Path(sys.executable).parent / "udocker"), f"--config={udocker_container.directory}/udocker.conf"]
    if os.geteuid() == 0:
        udocker.append("--allow-root")
    probe = "from dptrain.info import runtime_report; print(runtime_report()['container'])"
    result = subprocess.run([*udocker, "run", "--nobanner", "--hostenv", *volumes, udocker_container.name, sys.executable, "-c", probe],
                            env=udocker_container.env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "udocker"


def test_local_launch_trains_with_one_container_per_rank(udocker_container, tmp_path):
    result = launch(udocker_container, "--scheduler", "local", "--tasks-per-node", "2", cwd=tmp_path,
                    env=udocker_container.env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "COMPLETED with exit code 0" in output
    run = summary(tmp_path / "run")
    assert run["workers"] == 2 and run["test_accuracy"] >= 0.90, run


def test_slurm_job_trains_across_two_nodes_in_udocker_containers(slurm_cluster, udocker_container, tmp_path):
    env = {**udocker_container.env, "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    result = launch(udocker_container, "--scheduler", "slurm", "--nodes", "2", "--tasks-per-node", "1", cwd=tmp_path,
                    env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + slurm_cluster.logs()
    assert "on node[1-2]" in output and "COMPLETED with exit code 0" in output
    run = summary(tmp_path / "run")
    assert run["workers"] == 2 and run["launcher"] == "srun" and run["test_accuracy"] >= 0.90, run
