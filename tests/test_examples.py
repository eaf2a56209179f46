"""The science examples: precipitation downscaling (examples/downscaling.py) with its own loss, and
`--loss package.module:function` on the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import downscaling  # noqa: E402 - the example, imported as a user's module
from cluster_fixtures import assert_run_written, slurm_cluster, udocker_container  # noqa: E402,F401 - pytest fixtures
from cli_runner import run_dptrain

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")]))}
PARTS = ["--data", "downscaling:make_data", "--model", "downscaling:make_model",
         "--loss", "downscaling:bernoulli_gamma_nll", "--optimizer", "adam", "--lr", "1e-3", "--scale-lr"]


def _dptrain(tmp_path, *args, timeout=300):
    return run_dptrain(args, cwd=tmp_path, env=ENV, timeout=timeout)


def test_the_bernoulli_gamma_nll_is_torch_distributions_log_likelihood():
    torch.manual_seed(0)
    output = torch.randn(4, 3 * 5)
    target = torch.where(torch.rand(4, 5) < 0.5, torch.zeros(4, 5), torch.rand(4, 5) * 10 + 0.1)
    logit, log_shape, log_scale = output.reshape(4, 3, 5).unbind(1)
    wet = target > 0
    rain = torch.distributions.Bernoulli(logits=logit).log_prob(wet.float())
    amount = torch.distributions.Gamma(log_shape.exp(), 1 / log_scale.exp()).log_prob(target.clamp_min(1e-6))
    expected = -torch.where(wet, rain + amount, rain).mean()
    assert torch.allclose(downscaling.bernoulli_gamma_nll(output, target), expected, atol=1e-5)


def test_downscaling_trains_through_the_cli_with_its_own_loss_on_two_workers_and_beats_climatology(tmp_path):
    done = _dptrain(tmp_path, "train", *PARTS, "--strategy", "sync", "--workers", "2", "--epochs", "3",
                    "--no-progress", "--out", "run")
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    train, test = downscaling.make_data()
    floor = downscaling.climatology_nll(train.tensors[1].numpy(), test.tensors[1].numpy())
    assert summary["workers"] == 2 and summary["test_accuracy"] is None
    assert summary["test_loss"] < floor, (summary["test_loss"], floor)
    assert "loss: downscaling:bernoulli_gamma_nll" in (tmp_path / "run" / "config.yaml").read_text()


@pytest.mark.slow
def test_downscaling_as_the_user_s_own_script_through_launch_on_two_slurm_nodes(slurm_cluster, tmp_path):
    env = {**slurm_cluster.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{slurm_cluster.env['PATH']}"}
    result = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                             "--tasks-per-node", "1", "--out", "run", "--submit", "--wait", "--wait-timeout", "200", "--",
                             "python", str(EXAMPLES / "downscaling.py"), "--epochs", "3"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + slurm_cluster.logs()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # The job script exports the rendezvous (RANK, WORLD_SIZE, MASTER_ADDR...): the script joins that world,
    # and records the launcher that started its ranks (srun), not the variables' generic name.
    assert summary["workers"] == 2 and summary["launcher"] == "srun" and summary["strategy"] == "sync"
    train, test = downscaling.make_data()
    assert summary["test_loss"] < downscaling.climatology_nll(train.tensors[1].numpy(), test.tensors[1].numpy())
    log = next((tmp_path / "run").glob("slurm-*.out")).read_text()
    assert "downscaling: test NLL" in log and "(better;" in log


@pytest.mark.slow
def test_downscaling_in_one_udocker_container_per_rank_on_two_slurm_nodes(slurm_cluster, udocker_container, tmp_path):
    env = {**udocker_container.env, "SLURM_CONF": slurm_cluster.env["SLURM_CONF"]}
    binds = [word for path in udocker_container.binds for word in ("--bind", path)]
    result = subprocess.run([sys.executable, "-m", "dptrain", "launch", "--scheduler", "slurm", "--nodes", "2",
                             "--tasks-per-node", "1", "--container", f"udocker:{udocker_container.name}", *binds,
                             "--out", "run", "--submit", "--wait", "--wait-timeout", "200", "--", sys.executable,
                             str(EXAMPLES / "downscaling.py"), "--epochs", "1"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + slurm_cluster.logs()
    summary = assert_run_written(tmp_path / "run", workers=2, epochs=1, config=False)
    assert summary["launcher"] == "srun" and summary["test_loss"] < 3


BAD_LOSSES = '''
import torch

def per_sample(output, target):
    return ((output - target) ** 2).mean(dim=1)

def broken(output, target):
    raise ValueError("shapes disagree")
'''


@pytest.mark.parametrize("loss, message", [
    ("badloss:per_sample", "--loss badloss:per_sample returned a tensor of shape (2,); it must return one number "
                           "(a 0-d tensor), e.g. the mean over the batch"),
    ("badloss:broken", "--loss badloss:broken failed on the model's output for two samples: ValueError: shapes "
                       "disagree"),
    ("badloss:nothing", "module 'badloss' has no attribute 'nothing' for --loss badloss:nothing; its public "
                        "callables are: broken, per_sample"),
    ("hinge", "--loss must be one of auto, cross-entropy, mse or package.module:function (got 'hinge')"),
])
def test_a_loss_function_that_cannot_work_is_one_line_before_any_worker_starts(tmp_path, loss, message):
    (tmp_path / "badloss.py").write_text(BAD_LOSSES)
    env = {**ENV, "PYTHONPATH": str(tmp_path)}
    done = run_dptrain(["train", "--dataset", "synthetic-regression", "--model", "mlp-regression", "--loss", loss,
                        "--out", "run"], cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == f"dptrain: error: {message}"
    assert not (tmp_path / "run").exists()
