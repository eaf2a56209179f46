"""benchmarks/shard_throughput.py: its flags, the commands it runs, and the ratios and tables it reports, without
training anything."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import shard_throughput as bench  # noqa: E402 - the benchmark script, imported as a module

from dptrain.arguments import train_config  # noqa: E402


def test_the_flags_have_short_defaults_and_refuse_what_cannot_be_measured():
    args = bench.parse_args(["out.json"])
    assert (args.repeats, args.epochs, args.hidden, args.dataset, args.batch_size) == (3, 6, (512, 512), "digits", 32)
    assert bench.parse_args(["--hidden", "64,32,16"]).hidden == (64, 32, 16)
    for bad in (["--epochs", "1"], ["--repeats", "0"], ["--hidden", "wide"], ["--hidden", "0,8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def _flags(command: list[str]) -> dict[str, str]:
    return {flag: value for flag, value in zip(command, command[1:] + [""]) if flag.startswith("--")}


def test_dptrain_runs_are_dptrain_train_commands_with_the_variant_s_sharding(tmp_path):
    args = bench.parse_args([])
    variants = {variant.name: variant for variant in bench.VARIANTS}
    for name, shard, size, strategy, workers in (("dptrain full", "full", None, "allreduce", 2),
                                                 ("dptrain hybrid", "hybrid", 2, "allreduce", 4),
                                                 ("dptrain hybrid sync", "hybrid", 2, "sync", 4),
                                                 ("dptrain DDP", "none", None, "allreduce", 2)):
        command = bench.dptrain_command(variants[name], args, 1, tmp_path)
        assert command[1:4] == ["-m", "dptrain", "train"]
        config = train_config(command[4:])  # validated as dptrain train validates it (refusals of --shard too)
        assert (config.shard, config.shard_size, config.strategy, config.seed) == (shard, size, strategy, 1)
        assert (config.workers, config.model_options, config.epochs, config.checkpoint_every) == (workers, {
            "hidden": [512, 512]}, 6, 0)


def test_plain_runs_are_torchrun_on_loopback_with_the_same_settings(tmp_path):
    args = bench.parse_args(["--hidden", "64,64", "--epochs", "3"])
    variants = {variant.name: variant for variant in bench.VARIANTS}
    full = _flags(bench.plain_command(variants["plain FSDP2 full"], args, 2, tmp_path / "p.json", 29500))
    hybrid = _flags(bench.plain_command(variants["plain FSDP2 hybrid"], args, 2, tmp_path / "p.json", 29500))
    assert full["--master-addr"] == "127.0.0.1" and full["--nproc-per-node"] == "2" and full["--shard-size"] == "2"
    assert hybrid["--nproc-per-node"] == "4" and hybrid["--shard-size"] == "2"
    assert (full["--hidden"], full["--epochs"], full["--seed"], full["--lr"]) == ("64,64", "3", "2", "0.02")


def test_each_repeat_runs_every_variant_once_starting_one_further_on():
    orders = [bench.rotated(bench.VARIANTS, repeat) for repeat in range(3)]
    assert all(sorted(v.name for v in order) == sorted(v.name for v in bench.VARIANTS) for order in orders)
    assert [order[0] for order in orders] == list(bench.VARIANTS[:3])


def test_a_run_s_throughput_leaves_its_first_epoch_out():
    assert bench.steady_rate([100.0, 300.0, 200.0, 400.0]) == 300.0
    assert bench.steady_rate([50.0]) == 50.0


def _run(variant: str, repeat: int, rate: float, accuracy: float = 0.9, ranks: int = 2) -> dict:
    return {"variant": variant, "repeat": repeat, "ranks": ranks, "steady_samples_per_second": rate,
            "test_accuracy": accuracy}


def test_the_ratio_is_of_the_medians_beside_each_repeat_s_own_and_failed_runs_are_left_out():
    runs = [_run("dptrain full", 0, 970.0), _run("plain FSDP2 full", 0, 1000.0),
            _run("dptrain full", 1, 900.0), _run("plain FSDP2 full", 1, 1100.0),
            _run("dptrain full", 2, 1000.0), {"variant": "plain FSDP2 full", "repeat": 2, "ranks": 2,
                                              "failed": "timed out"},
            _run("dptrain hybrid", 0, 500.0, 0.8, 4), _run("plain FSDP2 hybrid", 0, 400.0, 0.7, 4),
            _run("dptrain hybrid sync", 0, 700.0, 0.85, 4)]
    summary = bench.summarise_throughput(runs)
    full = summary["ratios"]["dptrain full / plain FSDP2 full"]
    assert full["ratio"] == pytest.approx(970.0 / 1050.0) and full["verdict"] == "not shown"
    assert full["per_repeat"] == pytest.approx([0.97, 900.0 / 1100.0])
    assert summary["variants"]["plain FSDP2 full"]["failed"] == 1
    hybrid = summary["ratios"]["dptrain hybrid / plain FSDP2 hybrid"]
    assert hybrid["ratio"] == pytest.approx(1.25) and hybrid["verdict"] == "met"
    table = bench.tables(summary, [])
    assert "| dptrain full / plain FSDP2 full | 0.92 | 0.97, 0.82 | >= 0.97 | not shown |" in table
    assert "| dptrain hybrid sync | 0.8500 | 0.8500 |" in table and "| dptrain hybrid | 0.8000 | 0.8000 |" in table


def test_the_goal_is_met_only_when_every_repeat_meets_it():
    assert bench.verdict([0.98, 1.2], 0.97) == "met"
    assert bench.verdict([0.9, 0.96], 0.97) == "not met"
    assert bench.verdict([0.8, 1.39], 0.97) == "not shown"
    assert bench.verdict([], 0.97) == "not measured" and bench.verdict([0.2], None) == ""


def test_memory_is_the_largest_rank_s_against_ddp_s():
    def rank(variant, size, held, rss):
        return {"variant": variant, "S": size, "params": held, "grads": held, "optimizer": held, "peak_rss": rss}

    rows = [rank("dptrain DDP", 1, 400, 1000), rank("dptrain DDP", 1, 400, 1100),
            rank("dptrain full", 2, 200, 900), rank("dptrain full", 2, 210, 1000),
            {"variant": "dptrain hybrid", "failed": "exit code 1"}]
    memory = bench.summarise_memory(rows)
    assert [row["variant"] for row in memory] == ["dptrain DDP", "dptrain full", "dptrain hybrid"]
    assert memory[1]["held"] == 630 and memory[1]["vs_ddp"] == pytest.approx([630 / 1200, 1000 / 1100])
    assert memory[2] == {"variant": "dptrain hybrid", "failed": True}
    table = bench.tables({"variants": {}, "ratios": {}}, memory)
    assert "| dptrain full | 2 |" in table and "| 0.53 |" in table and "| dptrain hybrid | | | | | failed |" in table


def test_a_run_past_its_time_is_ended_and_said_so():
    started = time.perf_counter()
    assert bench.run_bounded(["sleep", "30"], timeout=0.5).startswith("timed out after 0 s")
    assert time.perf_counter() - started < 10
    assert bench.run_bounded([sys.executable, "-c", "raise SystemExit(3)"], timeout=30).startswith("exit code 3")
    assert bench.run_bounded([sys.executable, "-c", "pass"], timeout=30) is None
