"""Several machines without a scheduler (`--nnodes N --node-rank I --master HOST:PORT`, torchrun's meaning).

Two "machines" are two network namespaces this test creates and removes (dptrain.bench.netns: each
with its own eth0, 10.77.0.1 and 10.77.0.2, on one switch); the same `dptrain train` (or `dptrain run`)
command runs in each with its own --node-rank, and nothing crosses anything but that switch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import torch

from dptrain.bench.netns import EmulatedNetwork, namespaces_unavailable

ROOT = Path(__file__).resolve().parents[1]
DIGITS = ["--dataset", "digits", "--model", "mlp", "--strategy", "sync", "--epochs", "2", "--batch-size", "32",
          "--no-progress"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "DPTRAIN_", "SLURM_", "OMPI_", "PMI_",
                                                                     "TORCHELASTIC", "GLOO_", "NCCL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _dptrain(*args: str, cwd: Path, prefix: tuple[str, ...] = (), timeout: float = 240) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "dptrain", *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("args, says", [
    (["--nnodes", "2", "--node-rank", "2", "--master", "10.0.0.1:29400"], "node_rank 2 must be 0 to 1 with nnodes 2"),
    (["--nnodes", "2"], "nnodes 2 needs master HOST:PORT"),
    (["--nnodes", "2", "--master", "node0"], "master 'node0' must be HOST:PORT"),
    (["--nnodes", "2", "--master", "node0:70000"], "the port must be a number from 1 to 65535"),
    (["--node-rank", "1"], "node_rank applies to several machines (nnodes above 1), not nnodes 1"),
    (["--nnodes", "2", "--master", "node0:29400", "--min-workers", "1"],
     "min_workers is not available across machines without a scheduler"),
    (["--nnodes", "2", "--master", "node0:29400", "--max-restarts", "1"],
     "max_restarts is not available across machines without a scheduler"),
])
def test_bad_node_settings_are_one_line_exit_2_and_nothing_is_written(tmp_path, args, says):
    done = subprocess.run([sys.executable, "-m", "dptrain", "train", *DIGITS, "--out", "run", *args], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_node_0_refuses_a_master_address_that_is_not_its_own_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dptrain", "train", *DIGITS, "--out", "run", "--workers", "1",
                           "--nnodes", "2", "--node-rank", "0", "--master", "192.0.2.1:29400"], cwd=tmp_path,
                          env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--master 192.0.2.1:29400: node 0 cannot listen there" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture()
def two_machines():
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    with EmulatedNetwork(hosts=2, rate="1gbit", tag=uuid.uuid4().hex[:6]) as network:
        yield network


def _both(network, argv_of, cwd: Path, timeout: float = 240) -> list[str]:
    """Node 1 first (its ranks wait for node 0's rendezvous), then node 0; both outputs, once both ended."""
    procs = [_dptrain(*argv_of(rank), cwd=cwd, prefix=tuple(network.exec_prefix(rank))) for rank in (1, 0)]
    try:
        outputs = [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output
    return outputs[::-1]  # node 0's, node 1's


def test_two_machines_train_as_one_job_and_end_bitwise_equal_to_two_workers_on_one(two_machines, tmp_path):
    network = two_machines
    master = f"{network.address(0)}:29400"
    node0, node1 = _both(network, lambda rank: ["train", *DIGITS, "--workers", "1", "--nnodes", "2", "--node-rank",
                                                str(rank), "--master", master, "--out", "nodes"], tmp_path)
    assert "node 0 of 2: starting ranks 0-0 of 2; rendezvous at 10.77.0.1:29400" in node0
    # gloo talks over the interface towards node 0, not the address the host name resolves to
    assert "node 1: the ranks talk over eth0 (10.77.0.2), the interface towards 10.77.0.1" in node1
    assert "[rank0]" in node0 and "done: sync on 2 workers" in node0
    summary = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    assert summary["workers"] == 2 and summary["launcher"] == "nodes"
    epochs = [json.loads(line) for line in (tmp_path / "nodes" / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2]

    local = subprocess.run([sys.executable, "-m", "dptrain", "train", *DIGITS, "--workers", "2", "--out", "local"],
                           cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert local.returncode == 0, local.stderr
    across = torch.load(tmp_path / "nodes" / "model.pt", weights_only=True)
    alone = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    across, alone = across.get("model", across), alone.get("model", alone)
    assert across.keys() == alone.keys() and all(torch.equal(across[k], alone[k]) for k in across)


SCRIPT = textwrap.dedent("""
    import os
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    print("RANK", os.environ["RANK"], "LOCAL_RANK", os.environ["LOCAL_RANK"], "WORLD", dist.get_world_size(),
          "SUM", int(value.item()), flush=True)
    dist.destroy_process_group()
""")


def test_dptrain_run_starts_a_plain_ddp_script_across_two_machines(two_machines, tmp_path):
    network = two_machines
    (tmp_path / "script.py").write_text(SCRIPT)
    master = f"{network.address(0)}:29401"
    node0, node1 = _both(network, lambda rank: ["run", "--workers", "2", "--nnodes", "2", "--node-rank", str(rank),
                                                "--master", master, "script.py"], tmp_path)
    # ranks 0-1 on node 0 and 2-3 on node 1, local ranks 0-1 on each; 1 + 2 + 3 + 4 = 10
    assert "[rank0] RANK 0 LOCAL_RANK 0 WORLD 4 SUM 10" in node0 and "[rank1] RANK 1 LOCAL_RANK 1 WORLD 4 SUM 10" in node0
    assert "[rank2] RANK 2 LOCAL_RANK 0 WORLD 4 SUM 10" in node1 and "[rank3] RANK 3 LOCAL_RANK 1 WORLD 4 SUM 10" in node1
