"""After a membership change every line names the rank that was lost, whichever it was (issue: rank 0 once said
'rank 3 left the job after a failure' when rank 2 was the one lost). Each rank of three is killed in turn halfway
through epoch 2 under sync with --min-workers 2; every line that names a lost, failed or missing rank names it,
and metrics.jsonl records it as the one that left."""

from __future__ import annotations

import json
import re

import pytest

from test_train_cli import dptrain

# The phrases dptrain uses for a rank that is gone, each followed by that rank's number.
GONE = re.compile(r"(?:worker rank|without rank|ranks? (?=\d+ (?:was|were|left|is|are) )|waits on ranks?) (\d+)")


@pytest.mark.parametrize("lost", [0, 1, 2])
def test_every_line_after_a_loss_names_the_rank_that_was_lost(tmp_path, lost):
    result = dptrain("train", "--dataset", "digits", "--strategy", "sync", "--workers", "3", "--min-workers", "2",
                     "--epochs", "3", "--no-progress", "--out", str(tmp_path / "run"), cwd=tmp_path,
                     env={"DPTRAIN_FAULT": f"train-middle@{lost}:2"})
    assert result.returncode == 0, result.stdout + result.stderr
    said = result.stdout + result.stderr
    assert f"dptrain: worker rank {lost} was killed by SIGKILL; the others go on without it" in result.stderr
    stay = [rank for rank in range(3) if rank != lost]
    assert f"with 2 workers (ranks {stay[0]}, {stay[1]} of the job; without rank {lost})" in said
    named = {int(rank) for rank in GONE.findall(said)}
    assert named == {lost}, [line for line in said.splitlines() if GONE.search(line)]
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    changes = [record["membership"] for record in history if "membership" in record]
    assert [change["left"] for change in changes] == [[lost]] and changes[0]["members"] == stay
