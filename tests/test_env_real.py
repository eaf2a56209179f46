"""Environment detection against the real thing: what srun (and an sbatch script) really export."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster_fixtures import slurm_cluster  # noqa: F401 - pytest fixture
from dptrain.runtime.env import detect

# Each process writes its environment and what detect() made of it into DIR/PID.json (argv[1]):
# launchers interleave the lines of their ranks' output.
PROBE = ("import json, os, sys; from dptrain.runtime.env import detect; e = detect(); "
         "open(os.path.join(sys.argv[1], f'{os.getpid()}.json'), 'w').write(json.dumps({'env': dict(os.environ), "
         "'launcher': e.launcher, 'rank': e.rank, 'world': e.world_size, 'local_rank': e.local_rank, "
         "'local_world': e.local_world_size, 'nodes': list(e.nodes), 'scheduler': e.scheduler, 'port': e.master_port}))")


def records(directory: Path) -> list[dict]:
    return sorted((json.loads(path.read_text()) for path in directory.glob("*.json")), key=lambda r: r["rank"])


def test_srun_step_across_two_nodes_is_detected_as_two_ranks(slurm_cluster, tmp_path):
    result = slurm_cluster.run("srun", "--nodes=2", "--ntasks=2", sys.executable, "-c", PROBE, str(tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr + slurm_cluster.logs()
    ranks = records(tmp_path)
    assert [(r["launcher"], r["rank"], r["world"], r["local_rank"], r["local_world"]) for r in ranks] == [
        ("srun", 0, 2, 0, 1), ("srun", 1, 2, 0, 1)]
    assert all(r["nodes"] == ["node1", "node2"] and r["scheduler"] == "slurm" for r in ranks)
    assert ranks[0]["port"] == ranks[1]["port"]
    # detect() is a pure function of the environment: the recorded one gives the same answer
    assert detect(ranks[1]["env"]).rank == 1


def test_srun_with_two_tasks_on_one_node_gives_local_ranks(slurm_cluster, tmp_path):
    result = slurm_cluster.run("srun", "--nodes=1", "--ntasks=2", sys.executable, "-c", PROBE, str(tmp_path), timeout=60)
    assert result.returncode == 0, result.stderr
    ranks = records(tmp_path)
    assert [(r["rank"], r["world"], r["local_rank"], r["local_world"]) for r in ranks] == [(0, 2, 0, 2), (1, 2, 1, 2)]


def test_the_batch_script_itself_is_not_a_rank(slurm_cluster, tmp_path):
    # sbatch sets SLURM_PROCID in the batch script too; only an srun step sets SLURM_STEP_ID.
    script = tmp_path / "probe.sh"
    script.write_text(f"#!/bin/bash\n{sys.executable} -c \"{PROBE}\" {tmp_path}\n")
    result = slurm_cluster.run("sbatch", "--wait", "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/out",
                               str(script), timeout=60)
    assert result.returncode == 0, result.stderr
    (batch,) = records(tmp_path)
    assert "SLURM_PROCID" in batch["env"] and "SLURM_STEP_ID" not in batch["env"]
    assert batch["launcher"] == "single" and batch["scheduler"] == "slurm" and batch["nodes"] == ["node1", "node2"]


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="not installed on this machine: mpirun (openmpi-bin)")
def test_mpirun_ranks_are_detected_from_open_mpi_variables(tmp_path):
    from test_mpirun import MPIRUN
    result = subprocess.run([*MPIRUN, "-np", "2", sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    ranks = records(tmp_path)
    assert [(r["launcher"], r["rank"], r["world"], r["local_rank"], r["local_world"]) for r in ranks] == [
        ("mpirun", 0, 2, 0, 2), ("mpirun", 1, 2, 1, 2)]
    assert ranks[0]["port"] == ranks[1]["port"]
