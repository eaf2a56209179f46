"""`dptrain plot`: what is drawn equals what the run directories hold; bad input is one line, exit 2, nothing written.

Two real 1-worker runs (trained in-process, a few seconds) check the whole path on files
`dptrain train` wrote; hand-written metrics.jsonl files in the recorded format cover the
cases a short real run does not produce (skipped evaluations, regression, a crash mid-line).
"""

from __future__ import annotations

import json
import signal
import struct
import sys
from pathlib import Path

import pytest
import yaml

from dptrain import plot
from dptrain.cli import main


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header; fails on anything that is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def expected_pixels(rows: int) -> tuple[int, int]:
    width, height = plot.figure_size(rows)
    return round(width * plot.DPI), round(height * plot.DPI)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def record(epoch: int, train_loss: float, test_loss=None, test_accuracy=None, evaluated=True, wall=None) -> dict:
    """One epoch record in the format train/recorder.py writes."""
    return {"epoch": epoch, "test_loss": test_loss if evaluated else None,
            "test_accuracy": test_accuracy if evaluated else None, "evaluated": evaluated,
            "wall_seconds": 0.5 * epoch if wall is None else wall, "lr": 0.05, "train_loss": train_loss,
            "samples_per_second": 1000.0, "comm_bytes": 100 * epoch, "epoch_seconds": 0.5,
            "workers": [{"rank": 0, "samples": 500, "train_loss": train_loss, "train_seconds": 0.5, "comm_bytes": 100}]}


def write_run(directory: Path, records: list[dict], strategy="sync", workers=2, summary=True) -> Path:
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / "config.yaml").write_text(yaml.safe_dump({"strategy": strategy, "workers": workers}))
    if summary:
        (directory / "summary.json").write_text(json.dumps({"strategy": strategy, "workers": workers}))
    return directory


CLASSIFICATION = [record(1, 2.0, 1.5, 0.5), record(2, 1.0, 0.9, 0.7), record(3, 0.5, 0.6, 0.8)]


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory) -> dict[str, Path]:
    """Two finished 1-worker, 2-epoch digits runs written by `dptrain train`: allreduce and sync."""
    root = tmp_path_factory.mktemp("runs")
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    runs = {}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(root)
            patch.setenv("DPTRAIN_DEBUG", "0")
            for strategy in ("allreduce", "sync"):
                assert main(["train", "--dataset", "digits", "--model", "mlp", "--strategy", strategy, "--workers", "1",
                             "--epochs", "2", "--out", strategy, "--no-progress"]) == 0
                runs[strategy] = root / strategy
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    return runs


def file_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------- real runs

def test_two_real_runs_make_one_png_of_the_documented_size(real_runs, tmp_path, capsys):
    out = tmp_path / "curves.png"
    code, stdout, stderr = run_cli(["plot", str(real_runs["allreduce"]), str(real_runs["sync"]), "--out", str(out)],
                                   capsys)
    assert code == 0, stderr
    assert stdout == f"wrote {out}\n"
    assert png_size(out) == expected_pixels(2) == (1000, 800)
    from PIL import Image
    with Image.open(out) as image:
        image.verify()


def test_the_lines_are_the_numbers_in_metrics_jsonl_against_epoch_and_wall_time(real_runs):
    runs = plot.read_runs([str(real_runs["allreduce"]), str(real_runs["sync"])])
    assert [run.label for run in runs] == ["allreduce ×1", "sync ×1"]
    figure, curves = plot.build_figure(runs)
    for strategy in ("allreduce", "sync"):
        records = file_records(real_runs[strategy])
        mine = {(c.metric, c.x_axis): c for c in curves if c.run == f"{strategy} ×1"}
        assert set(mine) == {(metric, x) for metric in ("train_loss", "test_loss", "test_accuracy")
                             for x in ("epoch", "wall_seconds")}
        for (metric, x_axis), curve in mine.items():
            assert curve.x == [r[x_axis] for r in records]
            assert curve.y == [r[metric] for r in records]
        assert mine["train_loss", "epoch"].x == [1, 2]
    # What the figure holds is what the curves say, and the legend names the strategies.
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
             for axes in figure.axes for line in axes.get_lines()}
    assert drawn == {curve.label: (curve.x, curve.y) for curve in curves}
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["allreduce ×1", "sync ×1", "train", "test"]
    assert [axes.get_xlabel() for axes in figure.axes[2:]] == ["epoch", "wall time since the start (s)"]


def test_one_run_is_drawn_into_its_own_directory_by_default(real_runs, capsys):
    run_dir = real_runs["sync"]
    try:
        code, stdout, _ = run_cli(["plot", str(run_dir)], capsys)
        assert code == 0 and stdout == f"wrote {run_dir / 'curves.png'}\n"
        assert png_size(run_dir / "curves.png") == expected_pixels(2)
    finally:
        (run_dir / "curves.png").unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------- written runs

def test_several_runs_go_to_curves_png_in_the_current_directory(tmp_path, monkeypatch, capsys):
    write_run(tmp_path / "a", CLASSIFICATION)
    write_run(tmp_path / "b", CLASSIFICATION, strategy="allreduce")
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = run_cli(["plot", "a", "b"], capsys)
    assert code == 0 and stdout == "wrote curves.png\n"
    assert png_size(tmp_path / "curves.png") == expected_pixels(2)
    assert not (tmp_path / "a" / "curves.png").exists()


def test_epochs_that_were_not_evaluated_have_no_test_points(tmp_path):
    records = [record(1, 2.0, 1.5, 0.5), record(2, 1.0, evaluated=False), record(3, 0.5, 0.6, 0.8)]
    write_run(tmp_path / "run", records)
    _, curves = plot.build_figure(plot.read_runs([str(tmp_path / "run")]))
    by = {(c.metric, c.x_axis): c for c in curves}
    assert by["train_loss", "epoch"].x == [1, 2, 3]
    assert by["test_loss", "epoch"].x == [1, 3] and by["test_loss", "epoch"].y == [1.5, 0.6]
    assert by["test_accuracy", "wall_seconds"].x == [0.5, 1.5] and by["test_accuracy", "wall_seconds"].y == [0.5, 0.8]


def test_a_regression_run_draws_its_losses_in_one_row(tmp_path, capsys):
    write_run(tmp_path / "reg", [record(1, 0.09, 0.03), record(2, 0.02, 0.014)], strategy="allreduce", workers=1)
    figure, curves = plot.build_figure(plot.read_runs([str(tmp_path / "reg")]))
    assert {c.metric for c in curves} == {"train_loss", "test_loss"}
    assert len(figure.axes) == 2 and {axes.get_ylabel() for axes in figure.axes} == {"loss"}
    code, _, _ = run_cli(["plot", str(tmp_path / "reg")], capsys)
    assert code == 0 and png_size(tmp_path / "reg" / "curves.png") == expected_pixels(1)


def test_a_regression_run_beside_a_classifier_keeps_the_accuracy_row(tmp_path):
    write_run(tmp_path / "reg", [record(1, 0.09, 0.03)], strategy="allreduce")
    write_run(tmp_path / "cls", CLASSIFICATION)
    figure, curves = plot.build_figure(plot.read_runs([str(tmp_path / "reg"), str(tmp_path / "cls")]))
    assert len(figure.axes) == 4
    assert {c.run for c in curves if c.metric == "test_accuracy"} == {"sync ×2"}


def test_identical_labels_are_told_apart_by_the_run_directory(tmp_path):
    for name in ("x/a", "y/a"):
        write_run(tmp_path / name, CLASSIFICATION)
    write_run(tmp_path / "z", CLASSIFICATION, strategy="allreduce")
    names = [str(tmp_path / "x/a"), str(tmp_path / "y/a"), str(tmp_path / "z")]
    assert [run.label for run in plot.read_runs(names)] == [f"sync ×2 ({names[0]})", f"sync ×2 ({names[1]})",
                                                             "allreduce ×2"]


def test_a_run_without_summary_yet_is_named_from_its_config(tmp_path):
    write_run(tmp_path / "running", CLASSIFICATION[:1], strategy="fedavg", workers=4, summary=False)
    assert plot.read_runs([str(tmp_path / "running")])[0].label == "fedavg ×4"


def test_a_partial_last_line_from_a_crash_is_skipped(tmp_path):
    run_dir = write_run(tmp_path / "run", CLASSIFICATION[:2])
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps(CLASSIFICATION[2])[:40])
    assert [r["epoch"] for r in plot.read_runs([str(run_dir)])[0].records] == [1, 2]


def test_an_existing_image_is_replaced_only_with_force(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", CLASSIFICATION)
    out = tmp_path / "mine.png"
    out.write_bytes(b"keep me")
    code, stdout, stderr = run_cli(["plot", str(run_dir), "--out", str(out)], capsys)
    assert code == 2 and stdout == ""
    assert stderr == f"dptrain: error: '{out}' already exists; give --force to replace it, or choose another --out\n"
    assert out.read_bytes() == b"keep me"
    code, _, _ = run_cli(["plot", str(run_dir), "--out", str(out), "--force"], capsys)
    assert code == 0 and png_size(out) == expected_pixels(2)


@pytest.mark.parametrize("suffix", [".svg", ".pdf"])
def test_vector_formats_are_written_too(tmp_path, capsys, suffix):
    run_dir = write_run(tmp_path / "run", CLASSIFICATION)
    code, _, _ = run_cli(["plot", str(run_dir), "--out", str(tmp_path / f"c{suffix}")], capsys)
    assert code == 0
    head = (tmp_path / f"c{suffix}").read_bytes()[:200]
    assert (b"<svg" in head or b"<?xml" in head) if suffix == ".svg" else head.startswith(b"%PDF")


# ---------------------------------------------------------------------------------------- bad input

def _not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    return ["plot", str(tmp_path / "empty")], f"'{tmp_path / 'empty'}' is not a dptrain run directory: no metrics.jsonl"


def _missing(tmp_path):
    return ["plot", str(tmp_path / "nope")], (f"run directory '{tmp_path / 'nope'}' does not exist; "
                                                 "give run directories (the --out of `dptrain train`)")


def _a_file(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    return (["plot", str(tmp_path / "file.txt")],
            f"'{tmp_path / 'file.txt'}' is not a directory; give run directories (the --out of `dptrain train`)")


def _no_epochs(tmp_path):
    write_run(tmp_path / "new", [])
    return ["plot", str(tmp_path / "new")], f"run '{tmp_path / 'new'}' has no epochs yet: its metrics.jsonl holds no records"


def _bad_suffix(tmp_path):
    write_run(tmp_path / "run", CLASSIFICATION)
    return (["plot", str(tmp_path / "run"), "--out", str(tmp_path / "curves.txt")],
            f"--out '{tmp_path / 'curves.txt'}' is not an image file name; end it in one of .png, .svg, .pdf, .jpg, .jpeg")


def _bad_middle_line(tmp_path):
    run_dir = write_run(tmp_path / "run", CLASSIFICATION)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    lines[1] = "{broken"
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return (["plot", str(run_dir)],
            f"line 2 of '{run_dir / 'metrics.jsonl'}' is not JSON; is '{run_dir}' a dptrain run directory?")


def _twice(tmp_path):
    write_run(tmp_path / "run", CLASSIFICATION)
    return (["plot", str(tmp_path / "run"), str(tmp_path / "run") + "/"],
            f"run '{tmp_path / 'run'}/' is given twice (also as '{tmp_path / 'run'}')")


def _no_run(tmp_path):
    return ["plot"], "RUN is required (see 'dptrain plot --help')"


@pytest.mark.parametrize("case", [_not_a_run, _missing, _a_file, _no_epochs, _bad_suffix, _bad_middle_line, _twice,
                                  _no_run])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys, case):
    argv, message = case(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = run_cli(argv, capsys)
    assert code == 2
    assert stdout == "" and stderr == f"dptrain: error: {message}\n"
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# ---------------------------------------------------------------------------------------- TensorBoard

def test_without_tensorboard_installed_one_line_and_nothing_written(tmp_path, monkeypatch, capsys):
    run_dir = write_run(tmp_path / "run", CLASSIFICATION)
    # None in sys.modules makes `import tensorboard` fail as it does where the package is missing.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    code, stdout, stderr = run_cli(["plot", str(run_dir), "--tensorboard", str(tmp_path / "tb")], capsys)
    assert code == 2 and stdout == ""
    assert stderr == "dptrain: error: --tensorboard needs the tensorboard package: pip install tensorboard\n"
    assert not (tmp_path / "tb").exists() and not (run_dir / "curves.png").exists()


class FakeWriter:
    """Records what dptrain hands to torch's SummaryWriter (same signature: log_dir, add_scalar, close)."""

    made: list["FakeWriter"] = []

    def __init__(self, log_dir: str):
        self.log_dir, self.scalars, self.closed = log_dir, [], False
        FakeWriter.made.append(self)

    def add_scalar(self, tag, scalar_value, global_step=None, walltime=None):
        self.scalars.append((tag, scalar_value, global_step, walltime))

    def close(self):
        self.closed = True


def test_tensorboard_gets_each_runs_scalars_by_epoch_with_wall_time(tmp_path, monkeypatch, capsys):
    records = [record(1, 2.0, 1.5, 0.5), record(2, 1.0, evaluated=False), record(3, 0.5, 0.6, 0.8)]
    write_run(tmp_path / "a", records)
    write_run(tmp_path / "b", CLASSIFICATION, strategy="allreduce")
    FakeWriter.made = []
    monkeypatch.setattr(plot, "summary_writer_class", lambda: FakeWriter)
    code, stdout, _ = run_cli(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "c.png"),
                               "--tensorboard", str(tmp_path / "tb")], capsys)
    assert code == 0
    assert stdout.splitlines()[1].startswith(f"wrote TensorBoard events of 2 runs to {tmp_path / 'tb'}")
    a, b = FakeWriter.made
    assert (a.log_dir, b.log_dir) == (str(tmp_path / "tb" / "a"), str(tmp_path / "tb" / "b"))
    assert a.closed and b.closed
    by_tag = {}
    for tag, value, step, wall in a.scalars:
        by_tag.setdefault(tag, []).append((step, value, wall))
    assert set(by_tag) == {"train_loss", "test_loss", "test_accuracy", "lr", "comm_bytes"}
    assert [(s, v) for s, v, _ in by_tag["train_loss"]] == [(1, 2.0), (2, 1.0), (3, 0.5)]
    assert [(s, v) for s, v, _ in by_tag["test_loss"]] == [(1, 1.5), (3, 0.6)]  # epoch 2 was not evaluated
    assert [(s, v) for s, v, _ in by_tag["comm_bytes"]] == [(1, 100.0), (2, 200.0), (3, 300.0)]
    walls = [w for _, _, w in by_tag["train_loss"]]
    assert [round(w - walls[0], 6) for w in walls] == [0.0, 0.5, 1.0]  # wall_seconds apart
    assert abs(walls[-1] - (tmp_path / "a" / "metrics.jsonl").stat().st_mtime) < 1e-6


def test_tensorboard_directories_of_runs_with_the_same_name_do_not_collide(tmp_path):
    for name in ("x/run", "y/run"):
        write_run(tmp_path / name, CLASSIFICATION)
    runs = plot.read_runs([str(tmp_path / "x/run"), str(tmp_path / "y/run")])
    assert plot.tensorboard_dirs(runs, tmp_path / "tb", force=False) == [tmp_path / "tb/run", tmp_path / "tb/run-2"]


def test_real_tensorboard_event_files_read_back(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_run(tmp_path / "a", CLASSIFICATION)
    code, _, stderr = run_cli(["plot", str(tmp_path / "a"), "--tensorboard", str(tmp_path / "tb")], capsys)
    assert code == 0, stderr
    events = EventAccumulator(str(tmp_path / "tb" / "a"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("test_accuracy")] == [(1, 0.5), (2, 0.7), (3, 0.8)]
    code, _, stderr = run_cli(["plot", str(tmp_path / "a"), "--tensorboard", str(tmp_path / "tb"), "--force"], capsys)
    assert code == 0 and len(list((tmp_path / "tb" / "a").glob("events.out.tfevents.*"))) == 1
