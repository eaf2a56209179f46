"""The Python API a user writes against: Trainer takes user settings only, fit returns a Summary,
the run directory is made by whoever writes into it, dptrain.run ends a script cleanly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dptrain
from dptrain.runtime.env import free_port
from dptrain.train.recorder import Summary

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import dptrain

    def main(out, strategy):
        data = dptrain.load_dataset("digits")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        trainer = dptrain.Trainer(model, optimizer, "cross-entropy", getattr(dptrain, strategy)(), batch_size=32,
                                  out=out, verbose=False)
        summary = trainer.fit((data.x_train, data.y_train), (data.x_test, data.y_test), epochs=2)
        print("SUMMARY", type(summary).__name__, summary.workers, summary.test_accuracy)

    if __name__ == "__main__":
        dptrain.run(main, sys.argv[1], sys.argv[2])
""")


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                        "SLURM_", "OMPI_", "PMI_", "TORCHELASTIC"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def test_a_script_writes_into_a_run_directory_that_did_not_exist_and_ends_through_dptrain_run(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    out = tmp_path / "deeper" / "run-api"
    done = subprocess.run([sys.executable, "script.py", str(out), "Sync"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    kind, workers, accuracy = done.stdout.split("SUMMARY")[1].split()
    assert kind == "Summary" and workers == "1"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_accuracy"] == pytest.approx(float(accuracy))
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert set(torch.load(out / "model.pt", weights_only=True)) == {"1.weight", "1.bias"}


def test_the_same_script_under_torchrun_trains_as_two_ranks(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "script.py", "run", "AllReduce"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["workers"] == 2


def test_dptrain_run_reports_a_user_error_in_one_line_with_exit_code_2(tmp_path):
    (tmp_path / "bad.py").write_text(textwrap.dedent("""
        import dptrain
        from dptrain.errors import UserError

        def main():
            raise UserError("--lr -1 must be positive")

        dptrain.run(main)
    """))
    done = subprocess.run([sys.executable, "bad.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "dptrain: error: --lr -1 must be positive"


def test_the_trainer_needs_an_optimizer_and_joins_no_process_group_before_fit():
    model = torch.nn.Linear(4, 2)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        dptrain.Trainer(model, None)
    fresh = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import torch, torch.distributed as dist, dptrain
        model = torch.nn.Linear(4, 2)
        dptrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        print(dist.is_initialized())
    """)], env=_env(), capture_output=True, text=True, timeout=60)
    assert fresh.stdout.strip() == "False", fresh.stderr


def test_summary_round_trips_through_its_dict_with_strategy_results_flattened():
    summary = Summary("async", {"name": "async"}, 2, 3, 0.9, 0.3, 1.5, 100.0, 64, [32, 32], 10, "gloo", "cpu",
                      "local", 0, strategy_results={"merges": [3, 3]})
    record = summary.to_dict()
    assert record["merges"] == [3, 3] and "strategy_results" not in record
    assert list(record)[:3] == ["strategy", "strategy_options", "workers"]
    assert Summary.from_dict(record) == summary


def test_train_from_config_spawns_the_workers_and_returns_their_summary(tmp_path):
    summary = dptrain.train_from_config({"workers": 2, "epochs": 1, "strategy": "sync", "out": str(tmp_path / "r"),
                                         "progress": False})
    assert isinstance(summary, Summary) and summary.workers == 2 and summary.launcher == "local"
    assert summary.to_dict() == json.loads((tmp_path / "r" / "summary.json").read_text())


def test_every_registered_strategy_is_exported_as_its_registered_class():
    from dptrain import registry

    for name, entry in registry.STRATEGIES.items():
        module, _, attribute = entry.target.partition(":")
        assert attribute in dptrain.__all__, f"strategy {name} ({attribute}) is not exported by dptrain"
        assert getattr(dptrain, attribute) is registry.load("strategy", name)
        assert issubclass(getattr(dptrain, attribute), dptrain.Strategy)
