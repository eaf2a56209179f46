"""Benchmark pieces: cost-model arithmetic, result aggregation, plots, namespaces set up and removed, a tiny real matrix.

Speeds are never asserted: the machine is shared, and the benchmarks exist to measure them.
"""

from __future__ import annotations

import os
import argparse
import csv
import json
import shutil
import subprocess
import sys

import pytest

from dptrain import costmodel
from dptrain.bench import plots
from dptrain.bench.netns import EmulatedNetwork, measure_link, namespaces_unavailable, parse_rate, tbf_arguments
from dptrain.bench.commands import SHOWN, replot
from dptrain.bench.results import (add_scaling, format_summary, mean_and_ci, run_row, summarise, time_to_target,
                                   write_results)
from dptrain.bench.throughput import rate_summary
from dptrain.errors import UserError
from cli_runner import run_dptrain

CAL = costmodel.Calibration(seconds_per_sample=1e-3, model_bytes=1_000_000, bandwidth=1e6, latency=1e-3,
                            samples=1000, batch_size=10)


# -- cost model ---------------------------------------------------------------------------------

def test_ring_allreduce_is_two_n_minus_one_over_n_times_bytes_over_bandwidth_plus_latency_terms():
    assert costmodel.ring_allreduce_seconds(1, 1e6, 1e6, 1e-3) == 0.0
    assert costmodel.ring_allreduce_seconds(2, 1e6, 1e6, 1e-3) == pytest.approx(1.0 + 0.002, rel=1e-12)
    assert costmodel.ring_allreduce_seconds(4, 8e6, 2e6, 5e-4) == pytest.approx(2 * 3 / 4 * 4 + 6 * 5e-4, rel=1e-12)
    assert costmodel.ring_allreduce_seconds(1024, 1e6, 1e6, 0.0) == pytest.approx(2 * 1023 / 1024, rel=1e-12)


def test_allreduce_epoch_pays_one_ring_per_step_sync_one_per_epoch():
    alone = costmodel.epoch_seconds("allreduce", 1, CAL)
    assert alone == {"compute": 1.0, "communication": 0.0, "total": 1.0}
    ring = 1.0 + 0.002  # N=2: M/B + 2 alpha
    allreduce = costmodel.epoch_seconds("allreduce", 2, CAL)
    assert allreduce["compute"] == pytest.approx(0.5)
    assert allreduce["communication"] == pytest.approx(50 * ring)  # 500 samples / batch 10 = 50 steps
    assert costmodel.epoch_seconds("sync", 2, CAL)["communication"] == pytest.approx(ring)
    assert costmodel.epoch_seconds("sync", 2, CAL, every=2)["communication"] == pytest.approx(ring / 2)
    assert costmodel.epoch_seconds("fedavg", 2, CAL) == costmodel.epoch_seconds("sync", 2, CAL)


def test_async_epoch_is_bounded_by_the_one_merge_service():
    message = 1e-3 + 1.0
    two = costmodel.epoch_seconds("async", 2, CAL)
    assert two["total"] == pytest.approx(0.5 + 2 * message)  # own round trip; service handles one merge
    many = costmodel.epoch_seconds("async", 64, CAL)
    assert many["total"] == pytest.approx(63 * 2 * message)  # the service's queue dominates


def test_projection_speedup_and_efficiency_follow_from_epoch_times():
    rows = costmodel.project(["sync"], [1, 2, 4], CAL)
    assert [row["workers"] for row in rows] == [1, 2, 4]
    four = rows[2]
    expected = 1.0 / (0.25 + 2 * 3 / 4 * 1.0 + 6 * 1e-3)
    assert four["speedup"] == pytest.approx(expected)
    assert four["efficiency"] == pytest.approx(expected / 4)
    assert costmodel.powers_of_two(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def test_calibration_takes_compute_from_sync_and_link_from_the_probe():
    runs = [{"kind": "dptrain", "strategy": "sync", "workers": 2, "epoch_seconds": 0.5 + 1.002, "model_parameters": 250_000,
             "train_samples": 1000, "batch_size": 10},
            {"kind": "dptrain", "strategy": "allreduce", "workers": 2, "epoch_seconds": 60.0, "model_parameters": 250_000,
             "train_samples": 1000, "batch_size": 10}]
    cal = costmodel.calibrate(runs, {"bandwidth_bytes_per_second": 1e6, "round_trip_seconds": 2e-3})
    assert cal.model_bytes == 1_000_000 and cal.latency == pytest.approx(1e-3)
    assert cal.seconds_per_sample == pytest.approx(1e-3)
    validation = {row["strategy"]: row for row in costmodel.validate(runs, cal)}
    assert validation["sync"]["error"] == pytest.approx(0.0, abs=1e-12)
    assert validation["allreduce"]["predicted_epoch_seconds"] == pytest.approx(0.5 + 50 * 1.002)
    with pytest.raises(ValueError, match="bandwidth"):
        costmodel.calibrate(runs, {"name": "loopback"})


# -- results ------------------------------------------------------------------------------------

def _run(strategy, workers, wall, repeat=0, accuracies=(0.5, 0.9), kind="dptrain"):
    summary = {"strategy": strategy, "workers": workers, "epochs": len(accuracies), "test_accuracy": accuracies[-1],
               "wall_seconds": wall, "samples_per_second": 1000.0 / wall, "comm_bytes": 10 * workers,
               "model_parameters": 7}
    metrics = [{"epoch": i + 1, "test_accuracy": a, "wall_seconds": wall * (i + 1) / len(accuracies),
                "epoch_seconds": wall / len(accuracies)} for i, a in enumerate(accuracies)]
    return run_row(summary, metrics, kind=kind, repeat=repeat, network="loopback", target=0.8, process_seconds=wall + 3,
                   train_samples=1000, batch_size=10)


def test_time_to_target_is_the_first_epoch_at_or_above_it():
    metrics = [{"test_accuracy": None, "wall_seconds": 1}, {"test_accuracy": 0.7, "wall_seconds": 2},
               {"test_accuracy": 0.8, "wall_seconds": 3}, {"test_accuracy": 0.9, "wall_seconds": 4}]
    assert time_to_target(metrics, 0.8) == 3
    assert time_to_target(metrics, 0.95) is None
    assert time_to_target(metrics, None) is None


def test_scaling_against_one_worker_and_means_over_repeats():
    rows = [_run("sync", 1, 10.0), _run("sync", 2, 4.0), _run("sync", 2, 6.0, repeat=1),
            _run("plain-loop", 1, 8.0, kind="baseline"), _run("plain-ddp", 2, 5.0, kind="baseline")]
    add_scaling(rows)
    assert rows[1]["speedup"] == pytest.approx(2.5) and rows[1]["efficiency"] == pytest.approx(1.25)
    assert rows[4]["speedup"] == pytest.approx(8.0 / 5.0)  # no 1-worker plain-ddp: against the plain loop
    table = {(row["strategy"], row["workers"]): row for row in summarise(rows)}
    two = table[("sync", 2)]
    assert two["runs"] == 2 and two["wall_seconds"] == pytest.approx(5.0)
    assert two["wall_seconds_ci"] == pytest.approx(1.96 * 2 ** 0.5)
    assert two["time_to_target_seconds"] == pytest.approx(5.0) and two["reached_target"] == "2/2"
    assert two["speedup"] == pytest.approx((2.5 + 10 / 6) / 2)
    assert mean_and_ci([3.0]) == (3.0, None)


def test_throughput_is_the_per_worker_mean_with_a_196_std_band():
    mean, spread = rate_summary([[10.0, 20.0, 30.0], [30.0, 20.0, 10.0]])
    assert mean == pytest.approx(20.0) and spread == pytest.approx(0.0)
    mean, spread = rate_summary([[10.0, 30.0]])
    assert mean == pytest.approx(20.0) and spread == pytest.approx(1.96 * 200 ** 0.5)


def test_plots_are_written(tmp_path):
    rows = add_scaling([_run("sync", 1, 10.0), _run("sync", 2, 6.0), _run("allreduce", 1, 10.0), _run("allreduce", 2, 9.0)])
    table = summarise(rows)
    written = [plots.plot_scaling(table, tmp_path / "s.png"), plots.plot_accuracy_vs_time(rows, tmp_path / "a.png", 0.8),
               plots.plot_bytes(table, tmp_path / "b.png"),
               plots.plot_projection(costmodel.project(["allreduce", "sync"], [1, 2, 4], CAL), tmp_path / "p.png"),
               plots.plot_throughput([{"model": "resnet", "workers": 1, "images_per_second_per_worker": 5.0, "ci": 1.0}],
                                     tmp_path / "t.png")]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 1000 < path.stat().st_size < 200_000


def _busy_machine_rows():
    """The issue's case: a 1-worker run slowed by a busy machine (61.32 s against 1 s on two workers),
    and a sync configuration whose two repeats are 1 s and 9 s apart."""
    return add_scaling([_run("allreduce", 1, 61.32), _run("allreduce", 2, 1.0),
                        _run("sync", 1, 10.0), _run("sync", 2, 1.0), _run("sync", 2, 9.0, repeat=1)])


def test_an_efficiency_above_one_and_a_spread_wider_than_the_mean_are_flagged_unreliable():
    table = {(row["strategy"], row["workers"]): row for row in summarise(_busy_machine_rows())}
    assert table[("allreduce", 2)]["efficiency"] == pytest.approx(30.66)
    assert len(table[("allreduce", 2)]["unreliable"]) == 1
    assert table[("allreduce", 2)]["unreliable"][0].startswith("efficiency 30.66 above 1 (speedup 61.32 on 2 workers)")
    assert table[("allreduce", 1)]["unreliable"] == [] and table[("sync", 1)]["unreliable"] == []
    spread = " ".join(table[("sync", 2)]["unreliable"])
    assert "wall time spread ±11.1 s" in spread and "wider than its mean 5 s" in spread
    printed = format_summary(list(table.values()), SHOWN)
    lines = printed.splitlines()
    assert lines[0].endswith("| efficiency | note |")
    marked = [line for line in lines if line.startswith("| ") and line.endswith("| ! |")]
    assert [line.split(" | ")[:2] for line in marked] == [["| allreduce", "2"], ["| sync", "2"]]
    assert "! unreliable: allreduce, 2 workers: efficiency 30.66 above 1" in printed
    assert "! unreliable: sync, 2 workers: " in printed and "efficiency above 1.05" in printed


def test_sane_results_carry_no_flag():
    rows = add_scaling([_run("sync", 1, 10.0), _run("sync", 1, 10.5, repeat=1), _run("sync", 2, 6.0),
                        _run("sync", 2, 6.4, repeat=1), _run("allreduce", 1, 10.0), _run("allreduce", 2, 9.0)])
    table = summarise(rows)
    assert all(row["unreliable"] == [] for row in table)
    assert max(row["efficiency"] for row in table) < 1.01
    printed = format_summary(table, SHOWN)
    assert "!" not in printed and len(printed.splitlines()) == 2 + len(table)


def test_the_plots_draw_the_one_worker_runs_and_mark_the_unreliable_ones():
    rows = _busy_machine_rows() + add_scaling([_run("plain-loop", 1, 12.0, kind="baseline")])
    table = summarise(rows)
    curves = {(curve["strategy"], curve["workers"]): curve for curve in plots.accuracy_series(rows, table)}
    assert set(curves) == {("allreduce", 1), ("allreduce", 2), ("sync", 1), ("sync", 2), ("plain-loop", 1)}
    assert curves[("allreduce", 1)]["accuracy"] == [0.5, 0.9] and curves[("allreduce", 1)]["seconds"][-1] == 61.32
    assert [key for key, curve in curves.items() if curve["unreliable"]] == [("allreduce", 2), ("sync", 2)]
    assert curves[("sync", 2)]["label"] == "sync, 2 w (unreliable)"
    assert plots.accuracy_series(rows) == list(curves.values())  # judged from the runs when no summary is given
    lines = {line["label"]: line for line in plots.scaling_series(table)}
    assert lines["allreduce"]["workers"] == [1, 2] and lines["allreduce"]["unreliable"] == [False, True]
    assert lines["allreduce"]["efficiency"][1] == pytest.approx(30.66)


def test_replot_judges_recorded_results_again_and_redraws_them(tmp_path, capsys):
    rows = _busy_machine_rows()
    table = summarise(rows)
    for row in table:
        del row["unreliable"]  # as written before rows were judged
    write_results(tmp_path, rows, table, {"target_accuracy": 0.8, "headlines": {}, "notes": [], "throughput": []})
    assert replot(tmp_path) == 0
    judged = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert [bool(row["unreliable"]) for row in judged] == [False, True, False, True]
    printed = capsys.readouterr().out
    assert "! unreliable: allreduce, 2 workers: efficiency 30.66" in printed
    for name in ("scaling.png", "accuracy_vs_time.png", "bytes.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UserError, match="holds no results.json"):
        replot(tmp_path / "nothing")


# -- emulated networks ---------------------------------------------------------------------------

def test_rates_parse_and_bad_ones_are_named():
    assert parse_rate("100mbit") == 1e8 and parse_rate("1.5gbit") == 1.5e9
    with pytest.raises(UserError, match="'100mb'"):
        parse_rate("100mb")
    assert tbf_arguments(1e8)[:3] == ["tbf", "rate", "100000000bit"]


def _namespaces_or_skip():
    reason = namespaces_unavailable()
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)


def test_namespaces_are_created_rate_limited_and_removed(tmp_path):
    _namespaces_or_skip()
    net = EmulatedNetwork(2, "50mbit", tag=f"t{tmp_path.name[-6:]}")
    try:
        with net:
            assert net.exists()
            qdisc = subprocess.run(["tc", "-n", net.names[0], "qdisc", "show", "dev", "eth0"],
                                   capture_output=True, text=True, check=True).stdout
            assert "tbf" in qdisc and "50Mbit" in qdisc
            link = measure_link(net, payload=500_000)
            assert link["bandwidth_bytes_per_second"] > 0 and link["round_trip_seconds"] > 0
            raise KeyError("failure inside the network")
    except KeyError:
        pass
    assert not net.exists()  # removed although the body failed
    visible = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert "10.77.0." not in visible  # nothing leaked into this namespace


def test_a_clear_error_when_namespaces_are_refused(monkeypatch):
    monkeypatch.setattr("dptrain.bench.netns.os.geteuid", lambda: 1000)
    if shutil.which("ip") and shutil.which("tc"):
        with pytest.raises(UserError, match="needs root"):
            EmulatedNetwork(2, "100mbit").__enter__()


# -- a real (tiny) matrix ------------------------------------------------------------------------

@pytest.mark.slow
def test_a_tiny_matrix_writes_results_and_plots(tmp_path):
    out = tmp_path / "bench"
    # One dptrain run and the two plain PyTorch baselines (a 1-process loop and 2-rank DDP).
    command = ["bench", "--strategies", "sync", "--workers", "2", "--epochs", "2", "--threads", "1",
               "--target-accuracy", "0.5", "--option", "samples=256", "--dataset", "synthetic-images",
               "--option", "image_size=8", "--model", "mlp", "--out", str(out)]
    done = run_dptrain(command, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-2000:]
    with open(out / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert {(row["strategy"], row["workers"]) for row in rows} == {("sync", "2"), ("plain-loop", "1"), ("plain-ddp", "2")}
    results = json.loads((out / "results.json").read_text())
    sync2 = next(run for run in results["runs"] if run["strategy"] == "sync" and run["workers"] == 2)
    assert sync2["epochs"] == 2 and len(sync2["curve"]) == 2 and sync2["comm_bytes"] > 0
    assert sync2["speedup"] is not None and 0 <= sync2["final_accuracy"] <= 1  # speedup against the plain loop
    assert {row["strategy"] for row in results["summary"]} == {"sync", "plain-loop", "plain-ddp"}
    assert all(isinstance(row["unreliable"], list) for row in results["summary"])
    assert "| efficiency | note |" in done.stdout
    for name in ("scaling.png", "accuracy_vs_time.png", "bytes.png"):
        assert (out / name).stat().st_size > 1000
    simulated = subprocess.run([sys.executable, "-m", "dptrain", "simulate", "--from", str(out), "--bandwidth", "1gbit",
                                "--max-workers", "8"], capture_output=True, text=True, timeout=120)
    assert simulated.returncode == 0, simulated.stderr[-2000:]
    projection = json.loads((out / "projection.json").read_text())
    assert [row["workers"] for row in projection["projection"] if row["strategy"] == "allreduce"] == [1, 2, 4, 8]


def test_bench_rejects_bad_settings_in_one_line():
    from dptrain.bench.commands import add_arguments, spec_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UserError, match="valid strategies"):
        spec_from(parser.parse_args(["--strategies", "allreduce,ring"]))
    with pytest.raises(UserError, match="did you mean"):
        spec_from(parser.parse_args(["--option", "sampels=3"]))
    with pytest.raises(UserError, match="whole numbers"):
        spec_from(parser.parse_args(["--workers", "1,two"]))


def test_baselines_refuse_settings_they_cannot_follow_but_not_dptrain_only_ones():
    from dptrain.bench.commands import add_arguments, spec_from
    from dptrain.bench.matrix import check

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(UserError, match="baseline scripts cannot reproduce optimizer"):
        check(spec_from(parser.parse_args(["--workers", "1", "--option", "optimizer=adam"])))
    # Checkpoints change nothing that is trained: the baselines simply write none.
    check(spec_from(parser.parse_args(["--workers", "1", "--option", "checkpoint_every=0"])))
    check(spec_from(parser.parse_args(["--workers", "1", "--option", "optimizer=adam", "--no-baselines"])))
