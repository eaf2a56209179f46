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
