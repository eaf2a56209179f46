"""benchmarks/robustness.py (issue 20): the 12 problems' factories, the fixed tuning/held-out split, the runs'
flags, the report's paired differences and tables, and one tiny real run through the harness."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import robustness  # noqa: E402 - the benchmark script, imported as a module
import robustness_problems as problems  # noqa: E402

from dptrain.arguments import train_config  # noqa: E402


@pytest.mark.parametrize("name", list(problems.PROBLEMS))
def test_every_problem_gives_consistent_datasets_and_a_model_that_fits_them(name):
    spec = problems.PROBLEMS[name]
    factory = getattr(problems, spec.data)
    assert "seed" not in inspect.signature(factory).parameters  # the same data for every run seed
    train, test = factory()
    assert isinstance(train, Dataset) and isinstance(test, Dataset)
    assert 2 <= len(test) <= 1000 and len(train) > len(test)
    x, y = train[0]
    for dataset in (train, test):
        for index in (0, len(dataset) // 2, len(dataset) - 1):
            xi, yi = dataset[index]
            assert xi.shape == x.shape and xi.dtype == x.dtype and yi.shape == y.shape and yi.dtype == y.dtype
    if spec.task == "classify":
        assert y.dtype == torch.int64 and y.ndim == 0
        labels = torch.stack([train[i][1] for i in range(len(train))])
        outputs = int(labels.max()) + 1
        assert int(labels.min()) == 0 and len(labels.unique()) == outputs  # every class present
    else:
        assert y.dtype == torch.float32
        outputs = 1
        assert 0.8 < problems.target_variance(name) < 1.2  # standardised targets
    again = factory()[1][len(test) - 1]
    assert torch.equal(again[0], test[len(test) - 1][0])  # deterministic
    model = getattr(problems, spec.model)(input_shape=tuple(x.shape), num_outputs=outputs)
    batch = torch.stack([train[i][0] for i in range(4)])
    model.eval()
    with torch.no_grad():
        assert model(batch).shape == (4, outputs)


def test_the_split_is_fixed_disjoint_and_covers_the_12_problems():
    assert problems.TUNING == ["blobs-mlp", "digits-lenet", "shapes-cnn-bn", "seq-gru", "regress-unnormalised",
                               "imbalanced-adamw"]
    assert problems.HELD_OUT == ["textures-resnet", "moons-large", "waves-conv1d", "tokens-transformer",
                                 "pixels-unnormalised-cnn", "regress-sines-long"]
    assert not set(problems.TUNING) & set(problems.HELD_OUT)
    assert sorted(problems.TUNING + problems.HELD_OUT) == sorted(problems.PROBLEMS) and len(problems.PROBLEMS) == 12


def _flags(argv: list[str]) -> dict[str, str]:
    return {flag: value for flag, value in zip(argv, argv[1:] + [""]) if flag.startswith("--")}


def test_runs_carry_the_configuration_the_rule_and_the_problem_flags_and_parse_as_dptrain_train(tmp_path):
    jobs = robustness.select_jobs(problems.TUNING, list(robustness.CONFIGS), [2, 4, 8],
                                  ["none", "linear-warm", "auto"], [0, 1], ["0.02"])
    # per seed and problem: 1 one-worker + (3 sync + 2 async + 2 fedavg) x 3 rules (+ 1 lr study without --lr)
    assert len(jobs) == 2 * (6 * (1 + 7 * 3) + 5)
    groups = robustness.group_jobs(jobs)
    assert list(groups)[:2] == [("allreduce", 1), ("sync", 2)] and list(groups)[-1] == ("sync", 8)
    for job in jobs:
        argv = job.argv(tmp_path)
        config = train_config(argv)  # exactly as `dptrain train` reads them
        assert config.strategy == job.strategy and config.seed == job.seed and config.epochs == job.epochs
        assert robustness.parse_run_dir(job.run_dir(tmp_path), tmp_path) == job
    by_key = {(j.problem, j.config, j.workers, j.rule, j.seed): j for j in jobs}
    warm = _flags(by_key[("digits-lenet", "sync", 4, "linear-warm", 0)].argv(tmp_path))
    assert (warm["--lr-scaling"], warm["--warmup-epochs"], warm["--workers"]) == ("linear", "0.8", "4")
    fedavg = _flags(by_key[("seq-gru", "fedavg", 2, "none", 1)].argv(tmp_path))
    assert (fedavg["--partition"], fedavg["--lr-scaling"], fedavg["--optimizer"]) == ("iid", "none", "adam")
    one = _flags(by_key[("blobs-mlp", "one-worker", 1, "any", 0)].argv(tmp_path))
    assert one["--lr-scaling"] == "none" and "--lr" not in one and one["--strategy"] == "allreduce"
    study = _flags(by_key[("blobs-mlp", "one-worker-lr0.02", 1, "any", 0)].argv(tmp_path))
    assert study["--lr"] == "0.02"
    assert not any(j.config.startswith("one-worker-lr") for j in jobs if j.problem == "regress-unnormalised")


def _fake_run(runs: Path, problem: str, config: str, workers: int, rule: str, seed: int, score) -> None:
    """A finished run directory as dptrain writes it (score in points), or a diverged one (score None)."""
    job = robustness.Job(problem, config, workers, rule, seed, problems.PROBLEMS[problem].epochs)
    out = job.run_dir(runs)
    out.mkdir(parents=True)
    (out / "config.yaml").write_text("lr: 0.05\n")
    if score is None:
        (out / "failed.json").write_text(json.dumps({"type": "Diverged", "error": "rank 1: training diverged",
                                                     "final": True}))
        return
    if problems.PROBLEMS[problem].task == "classify":
        summary = {"test_accuracy": score / 100, "test_loss": 0.3, "wall_seconds": 1.0}
    else:  # R² = 1 - loss / var
        summary = {"test_accuracy": None, "test_loss": (1 - score / 100) * problems.target_variance(problem),
                   "wall_seconds": 1.0}
    (out / "summary.json").write_text(json.dumps(summary))
    (out / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train_loss": 0.5, "lr": 0.1, "evaluated": True,
                                                   **summary}) + "\n")


def test_the_report_pairs_seeds_against_one_worker_and_none_and_counts_the_goals(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    for seed, score in enumerate([90.0, 92.0, 94.0]):
        _fake_run(runs, "blobs-mlp", "one-worker", 1, "any", seed, score)
    for seed, score in enumerate([89.0, 90.0, 95.0]):  # paired: -1, -2, +1 -> mean -0.67
        _fake_run(runs, "blobs-mlp", "sync", 2, "none", seed, score)
    for seed, score in enumerate([91.0, 92.0, None]):  # seed 2 diverged: paired over seeds 0, 1 only
        _fake_run(runs, "blobs-mlp", "sync", 2, "linear-warm", seed, score)
    _fake_run(runs, "blobs-mlp", "sync", 4, "none", 0, 80.0)  # -10 at W=4: misses the goal of -2
    _fake_run(runs, "blobs-mlp", "sync", 4, "linear-warm", 0, 89.0)  # -1: meets it
    _fake_run(runs, "regress-unnormalised", "one-worker", 1, "any", 0, 70.0)
    _fake_run(runs, "regress-unnormalised", "async", 2, "none", 0, 69.0)
    robustness.report(runs, out, quiet=True)

    saved = json.loads((out / "results.json").read_text())
    assert len(saved["runs"]) == 13 and saved["tuning"] == problems.TUNING
    regress = next(r for r in saved["runs"] if r["problem"] == "regress-unnormalised" and r["config"] == "async")
    assert regress["score"] == pytest.approx(69.0) and regress["half"] == "tuning"
    assert regress["train_loss"] == 0.5 and regress["lr_applied"] == 0.1
    assert regress["curve"][0][1] == pytest.approx(69.0)

    cells = robustness.scores_by_seed(saved["runs"])
    reference = cells[("blobs-mlp", 3, "one-worker", 1, "any")]
    d = robustness.paired(cells[("blobs-mlp", 3, "sync", 2, "none")], reference)
    assert d["n"] == 3 and d["mean"] == pytest.approx(-2 / 3) and d["std"] == pytest.approx(1.5275, abs=1e-3)
    d = robustness.paired(cells[("blobs-mlp", 3, "sync", 2, "linear-warm")], cells[("blobs-mlp", 3, "sync", 2, "none")])
    assert d["n"] == 2 and d["diffs"] == pytest.approx([2.0, 2.0])

    goals = {(r["config"], r["workers"]): r for r in robustness.goal_cells(cells, [("blobs-mlp", 3)], "none")}
    assert goals[("sync", 2)]["met"] and not goals[("sync", 4)]["met"]
    warm = {(r["config"], r["workers"]): r for r in robustness.goal_cells(cells, [("blobs-mlp", 3)], "linear-warm")}
    assert not warm[("sync", 2)]["met"] and warm[("sync", 2)]["failed"] == 1  # a diverged run misses the goal
    assert warm[("sync", 4)]["met"]

    text = (out / "tuning.md").read_text()
    assert "| none | 2 / 3 |" in text and "| linear-warm | 1 / 2 |" in text
    # score, Δ 1 worker under none; score, Δ 1 worker, Δ none under linear-warm (over seeds 0 and 1)
    assert ("| sync | 2 | 91.3 ± 3.2 | -0.7 ± 1.5 | 91.5 ± 0.7 (n=2) [1 diverged] | +0.5 ± 0.7 | +2.0 ± 0.0 |"
            in text)
    assert "| one-worker | 1 | 92.0 ± 2.0 |" in text
    assert "diverged (blobs-mlp, sync W=2)" in text
    assert not (out / "held-out.md").exists()


def test_one_tiny_real_run_through_the_harness(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    code = robustness.main(["run", "--only", "blobs-mlp", "--configs", "one-worker,sync", "--workers", "2",
                            "--rules", "none", "--seeds", "0", "--epochs", "1", "--runs", str(runs), "--out", str(out)])
    assert code == 0
    saved = json.loads((out / "results.json").read_text())
    assert {(r["config"], r["workers"]) for r in saved["runs"]} == {("one-worker", 1), ("sync", 2)}
    for record in saved["runs"]:
        job = robustness.Job("blobs-mlp", record["config"], record["workers"], record["rule"], 0, 1)
        summary = json.loads((job.run_dir(runs) / "summary.json").read_text())
        assert summary["workers"] == record["workers"] and summary["epochs"] == 1
        assert record["score"] == pytest.approx(100 * summary["test_accuracy"])
    assert "### blobs-mlp, 1 epochs (not its own 3)" in (out / "tuning.md").read_text()
    groups = [json.loads(line) for line in (runs / "groups.jsonl").read_text().splitlines()]
    assert [(g["group"], g["finished"], g["failed"]) for g in groups] == [("allreduce-w1", 1, []), ("sync-w2", 1, [])]
    # Run again: everything is finished, nothing is trained.
    assert robustness.main(["run", "--only", "blobs-mlp", "--configs", "one-worker,sync", "--workers", "2",
                            "--rules", "none", "--seeds", "0", "--epochs", "1", "--runs", str(runs),
                            "--out", str(out)]) == 0
    assert len((runs / "groups.jsonl").read_text().splitlines()) == 2
