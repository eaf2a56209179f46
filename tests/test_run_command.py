"""`dptrain run`: a user's own script as N ranks on 127.0.0.1, as torchrun --nproc-per-node N would start it.

Real processes throughout: a plain DDP script and a dptrain.Trainer script join the 2-rank
world; a failed rank is named and its code returned; a failed world restarts with
DPTRAIN_RESTART; `-m MODULE` works; the script's words are never taken as ours; bad input and
Ctrl-C are one line each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dptrain import cli
from dptrain.run_command import split_argv
from launcher_signals import signal_when_started

# Variables that would tell the launcher, or its ranks, that they are already part of a job.
LAUNCHED = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
                      r"DPTRAIN_.*|TORCHELASTIC_.*|OMPI_.*|PMI_.*|MPI_LOCAL.*|SLURM_.*|PBS_.*)$")


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A clean directory to run in, with no launcher's variables around (and one thread per rank)."""
    for name in [name for name in os.environ if LAUNCHED.match(name)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write(path, code: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(code))
    return path


def dptrain_run(*argv: str) -> int:
    return cli.main(["run", *argv])


DDP_SCRIPT = """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank = dist.get_rank()
    total = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    dist.all_reduce(total)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    ddp = DistributedDataParallel(model)
    ddp(torch.tensor([[rank + 1.0]])).sum().backward()  # gradient x: 1 on rank 0, 2 on rank 1; DDP averages
    seen = {name: os.environ[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    seen.update(argv=sys.argv[1:], grad=model.weight.grad.item(), total=total.tolist())
    with open(f"rank{rank}.json", "w") as handle:
        json.dump(seen, handle)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # not Python's finalization, which torch 2.13's gloo aborts now and then (see the README)
"""


@pytest.mark.slow
def test_a_plain_ddp_script_joins_a_two_rank_world_on_127_0_0_1(here, capfd):
    write(here / "ddp.py", DDP_SCRIPT)
    assert dptrain_run("--workers", "2", "ddp.py", "--workers", "5", "--debug") == 0
    ranks = [json.loads((here / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [seen["total"] for seen in ranks] == [[3.0, 30.0]] * 2  # the exact sum, on every rank
    assert [seen["grad"] for seen in ranks] == [1.5, 1.5]
    assert [(seen["RANK"], seen["LOCAL_RANK"], seen["WORLD_SIZE"]) for seen in ranks] == [("0", "0", "2"),
                                                                                          ("1", "1", "2")]
    assert {(seen["MASTER_ADDR"], seen["MASTER_PORT"]) for seen in ranks} == {("127.0.0.1", ranks[0]["MASTER_PORT"])}
    assert all(seen["argv"] == ["--workers", "5", "--debug"] for seen in ranks)  # the script's, untouched
    out, err = capfd.readouterr()
    assert "dptrain:" not in out + err  # quiet when all is well


TRAINER_SCRIPT = """
    import sys
    import torch
    import dptrain

    def main(out):
        data = dptrain.load_dataset("digits")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        trainer = dptrain.Trainer(model, optimizer, "cross-entropy", dptrain.AllReduce(), batch_size=64, out=out,
                                  progress=False)
        trainer.fit((data.x_train, data.y_train), (data.x_test, data.y_test), epochs=1)

    if __name__ == "__main__":
        dptrain.run(main, sys.argv[1])
"""


@pytest.mark.slow
def test_a_script_using_the_trainer_joins_the_world_and_records_the_launcher(here, capfd):
    write(here / "train.py", TRAINER_SCRIPT)
    assert dptrain_run("train.py", "run") == 0
    summary = json.loads((here / "run" / "summary.json").read_text())
    assert (summary["workers"], summary["launcher"], summary["epochs"]) == (2, "dptrain-run", 1)
    out, _ = capfd.readouterr()
    assert len(re.findall(r"^\[rank0\] dptrain: done: allreduce on 2 workers", out, re.M)) == 1, out
    assert "[rank1] dptrain: done" not in out


FAILING_SCRIPT = """
    import os, sys, time
    attempt = int(os.environ["DPTRAIN_RESTART"])
    with open(f"attempt{attempt}-rank{os.environ['RANK']}", "w") as handle:
        handle.write(" ".join(os.environ[name] for name in ("MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
                                                            "TORCHELASTIC_MAX_RESTARTS")))
    print("attempt", attempt, flush=True)
    if os.environ["RANK"] == "1" and attempt < int(sys.argv[1]):
        sys.exit(int(sys.argv[2]))
    time.sleep(float(sys.argv[3]))
"""


def test_the_first_failed_rank_is_named_the_others_stopped_and_its_code_returned(here, capfd):
    write(here / "fail.py", FAILING_SCRIPT)
    started = time.monotonic()
    assert dptrain_run("fail.py", "1", "3", "60") == 3  # rank 1 exits with 3 at once; rank 0 would sleep 60 s
    assert time.monotonic() - started < 20
    _, err = capfd.readouterr()
    assert err.splitlines() == ["dptrain: rank 1 of `python fail.py` exited with code 3; stopping the other ranks"]


def test_max_restarts_starts_the_world_again_with_dptrain_restart_on_a_fresh_port(here, capfd):
    write(here / "fail.py", FAILING_SCRIPT)
    assert dptrain_run("--max-restarts", "2", "fail.py", "1", "3", "0") == 0  # fails on the first attempt only
    _, err = capfd.readouterr()
    assert err.splitlines() == ["dptrain: rank 1 of `python fail.py` exited with code 3; stopping the other ranks",
                                "dptrain: restarting the 2 ranks of `python fail.py` (restart 1 of 2)"]
    first, second = ((here / f"attempt{attempt}-rank1").read_text().split() for attempt in (0, 1))
    assert first[1:] == ["0", "2"] and second[1:] == ["1", "2"]  # TORCHELASTIC_RESTART_COUNT, _MAX_RESTARTS
    assert first[0] != second[0]  # MASTER_PORT
    assert (here / "attempt1-rank0").read_text().split()[0] == second[0]
    assert not (here / "attempt2-rank0").exists()


def test_bad_input_in_the_script_is_not_restarted(here, capfd):
    write(here / "fail.py", FAILING_SCRIPT)
    assert dptrain_run("--max-restarts", "3", "fail.py", "9", "2", "0") == 2
    _, err = capfd.readouterr()
    assert "restarting" not in err and not (here / "attempt1-rank0").exists()


def test_a_mistake_every_rank_makes_alike_is_said_once(here, capfd):
    # The Trainer's arguments are checked before the ranks form a group: each rank finds the same mistake.
    write(here / "mistake.py", """
        import torch
        from dptrain import Trainer
        model = torch.nn.Linear(4, 2)
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy="sync")
    """)
    assert dptrain_run("--workers", "3", "mistake.py") == 2
    _, err = capfd.readouterr()
    errors = [line for line in err.splitlines() if "dptrain: error: " in line]
    assert len(errors) == 1 and re.fullmatch(r"\[rank[012]\] dptrain: error: strategy 'sync' is a name, not a "
                                             r"Strategy: pass dptrain.Sync\(\) .*", errors[0]), err


def test_different_error_lines_of_two_ranks_are_both_shown():
    from dptrain.runtime.spawn import SaidOnce, _prefixed
    said = SaidOnce()
    first = _prefixed(b"dptrain: error: rank 0 cannot read a.npy\nprogress\n", b"[rank0] ", said)
    second = _prefixed(b"dptrain: error: rank 0 cannot read a.npy\ndptrain: error: rank 1 cannot read b.npy\n"
                       b"progress\n", b"[rank1] ", said)
    assert first == b"[rank0] dptrain: error: rank 0 cannot read a.npy\n[rank0] progress\n"
    assert second == b"[rank1] dptrain: error: rank 1 cannot read b.npy\n[rank1] progress\n"


def test_a_rank_still_running_timeout_seconds_after_another_ended_is_named(here, capfd):
    write(here / "hang.py", "import os, time\nif os.environ['RANK'] == '1':\n    time.sleep(60)\n")
    started = time.monotonic()
    assert dptrain_run("--timeout", "1", "hang.py") == 1
    assert time.monotonic() - started < 20
    _, err = capfd.readouterr()
    assert err.splitlines() == ["dptrain: rank 1 of `python hang.py` had not ended 1 s after rank 0 did "
                                "(frozen or stuck); stopping it"]


def test_a_module_runs_with_dash_m_and_keeps_its_arguments(here, capfd):
    write(here / "pkg" / "__init__.py", "")
    write(here / "pkg" / "hello.py", "import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n")
    assert dptrain_run("--workers", "3", "-m", "pkg.hello", "-m", "x", "--workers", "1") == 0
    out, err = capfd.readouterr()
    assert sorted(out.splitlines()) == [f"[rank{rank}] rank {rank} ['-m', 'x', '--workers', '1']" for rank in range(3)]
    assert err == ""


@pytest.mark.parametrize("argv, message", [
    ([], r"no script to run; give SCRIPT \[ARGS...\] or -m MODULE \[ARGS...\], e\.g\. dptrain run .*"),
    (["--workers", "0", "ok.py"], r"--workers must be at least 1 \(got 0\)"),
    (["nothere.py", "--lr", "1"], r"script 'nothere\.py' does not exist; give the path of a Python file, or -m MODULE"),
    (["pkg.train"], r"script 'pkg\.train' does not exist; to run the module pkg\.train, use -m pkg\.train"),
    (["ok"], r"script 'ok' does not exist; did you mean ok\.py\?"),
    (["-m", "nosuch.train"], r"-m nosuch\.train: no module named 'nosuch' in this directory or on the Python path"),
    (["-m", "ok.py"], r"-m ok\.py is not a module name \(like package\.train\); to run the file, give it without -m: "
                      r"dptrain run ok\.py"),
    (["--worker", "2", "ok.py"], r"unknown option --worker for 'dptrain run'; did you mean --workers\?"),
])
def test_bad_input_is_one_line_and_exit_code_2(here, capfd, argv, message):
    write(here / "ok.py", "open('ran', 'w').close()\n")
    assert dptrain_run(*argv) == 2
    out, err = capfd.readouterr()
    assert out == "" and re.fullmatch(rf"dptrain: error: {message}\n", err), err
    assert not (here / "ran").exists()


def test_started_as_one_rank_of_a_launched_job_it_refuses_to_start_a_world_of_its_own(here, capfd, monkeypatch):
    write(here / "ok.py", "open('ran', 'w').close()\n")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert dptrain_run("ok.py") == 2
    _, err = capfd.readouterr()
    assert err == ("dptrain: error: dptrain run starts the ranks itself, but was started as rank 1 of 4 (launcher "
                   "srun); start `python ok.py` under that launcher directly, or dptrain run outside it\n")
    assert not (here / "ran").exists()


def test_only_the_words_before_the_script_are_ours():
    assert split_argv(["--workers", "3", "t.py", "--workers", "1"]) == (["--workers", "3"], ["t.py", "--workers", "1"])
    assert split_argv(["--timeout=5", "--", "--odd.py", "-m"]) == (["--timeout=5"], ["--odd.py", "-m"])
    assert split_argv(["-m", "pkg.mod", "--debug"]) == (["-m", "pkg.mod"], ["--debug"])
    assert split_argv(["-mpkg.mod", "x"]) == (["-m", "pkg.mod"], ["x"])
    assert split_argv(["--debug", "t.py", "--debug"]) == (["--debug"], ["t.py", "--debug"])


def test_ctrl_c_stops_every_rank_in_one_line_with_code_130_and_no_restart(here):
    # Through dptrain.run, a rank says nothing of a Ctrl-C that its launcher reports (a plain script's
    # KeyboardInterrupt traceback may come first, when it is echoed before the launcher sees the Ctrl-C).
    write(here / "sleep.py", """
        import time
        import dptrain

        def main():
            print("up", flush=True)
            time.sleep(60)

        dptrain.run(main)
    """)
    launcher = subprocess.Popen([sys.executable, "-m", "dptrain", "run", "--max-restarts", "2", "sleep.py"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for _ in range(2):  # both ranks are up
            assert launcher.stdout.readline().endswith("up\n")
        os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the launcher and its ranks
        _, err = launcher.communicate(timeout=20)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130
    assert err == "dptrain: interrupted; stopped the 2 ranks of `python sleep.py`\n"


def test_a_stop_signal_while_the_ranks_start_reaches_every_rank_started(here):
    write(here / "sleep.py", """
        import time

        time.sleep(30)
    """)
    ended = signal_when_started(["run", "--workers", "3", "sleep.py"], here)
    assert ended["left"] == [], ended  # none still sleeping once the launcher is gone
    assert ended["code"] == 1 and "was killed by SIGTERM" in ended["stderr"], ended  # as for a later SIGTERM
