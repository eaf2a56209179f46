"""The local launcher and the one spawner under it: rank-prefixed output or per-rank logs, torchrun-style
worker environments, forwarded signals, a time limit, and one line naming a failed worker."""

import io
import os
import re
import signal
import sys
import threading
import time

import pytest

from dptrain.runtime.env import detect, free_port
from dptrain.runtime.launcher import launch_local
from dptrain.runtime.prestart import prestart, release
from dptrain.runtime.spawn import STORE_FD, _pump, describe_exit, spawn_ranks, store_listener, worker_env


class ChunkedStream(io.BytesIO):
    """A worker's pipe: each read1 returns the next chunk as written, however lines fall across chunks."""

    def __init__(self, chunks):
        super().__init__(b"".join(chunks))
        self.sizes = [len(chunk) for chunk in chunks]

    def read1(self, size=-1):
        return super().read1(self.sizes.pop(0) if self.sizes else 0)


class Sink:
    """Our stdout: records what reaches it and whether it was flushed after the last write."""

    def __init__(self):
        self.data = bytearray()
        self.flushed = True
        self.lock = threading.Lock()

    def write(self, data):
        with self.lock:
            self.data += data
            self.flushed = False
        return len(data)

    def flush(self):
        self.flushed = True


def pumped(chunks, prefix=b"[rank1] "):
    sink = Sink()
    _pump(ChunkedStream(chunks), prefix, sink)
    return sink


def test_pump_prefixes_every_line_across_chunks_split_mid_line():
    sink = pumped([b"epo", b"ch 1\nepoch", b" 2\n\nlast line without newline"])
    assert bytes(sink.data) == b"[rank1] epoch 1\n[rank1] epoch 2\n[rank1] \n[rank1] last line without newline"
    assert sink.flushed


def test_pump_prefixes_every_carriage_return_redraw_of_a_progress_bar():
    sink = pumped([b"\r 10%", b"|#  |\r 50%|##", b" |\r100%|###|\n", b"done\n"])
    assert bytes(sink.data) == (b"[rank1] \r[rank1]  10%|#  |\r[rank1]  50%|## |\r[rank1] 100%|###|\n"
                                b"[rank1] done\n")
    assert sink.flushed


def test_pump_of_an_empty_stream_writes_nothing():
    assert bytes(pumped([]).data) == b""


def test_pump_reads_streams_without_read1():
    class PlainStream:
        def __init__(self, chunks):
            self.chunks = list(chunks)

        def read(self, size):
            return self.chunks.pop(0) if self.chunks else b""

    sink = Sink()
    _pump(PlainStream([b"a\nb", b"c\n"]), b"> ", sink)
    assert bytes(sink.data) == b"> a\n> bc\n"


class ScriptedStream:
    """A pipe whose i-th read1 first sets `before[i]` (if any), then waits for `after[i]` (if any)."""

    def __init__(self, chunks, before, after):
        self.script = list(zip(chunks + [b""], before, after))

    def read1(self, size):
        chunk, before, after = self.script.pop(0) if self.script else (b"", None, None)
        if before is not None:
            before.set()
        if after is not None:
            assert after.wait(10)
        return chunk


def test_two_ranks_printing_at_once_never_share_a_line():
    # Rank 0 prints "abc\n" as two writes ("abc", "\n"), as print() does under PYTHONUNBUFFERED;
    # rank 1 prints a whole line after rank 0's pump has taken "abc" and before "\n" arrives.
    rank0_took_partial, rank1_finished = threading.Event(), threading.Event()
    rank0 = ScriptedStream([b"abc", b"\n"], before=[None, rank0_took_partial, None], after=[None, rank1_finished, None])
    rank1 = ScriptedStream([b"xyz\n"], before=[None, rank1_finished], after=[rank0_took_partial, None])
    sink = Sink()
    threads = [threading.Thread(target=_pump, args=(stream, prefix, sink))
               for stream, prefix in ((rank0, b"[rank0] "), (rank1, b"[rank1] "))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(bytes(sink.data).decode().splitlines()) == ["[rank0] abc", "[rank1] xyz"]


@pytest.mark.parametrize("code, text", [
    (-9, "was killed by SIGKILL"), (-15, "was killed by SIGTERM"), (-2, "was killed by SIGINT"),
    (-11, "was killed by SIGSEGV"), (-200, "was killed by signal 200"),
    (0, "exited with code 0"), (1, "exited with code 1"), (2, "exited with code 2"), (137, "exited with code 137"),
])
def test_describe_exit_names_signals_and_codes(code, text):
    assert describe_exit(code) == text


@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2), (3, 4)])
def test_worker_env_is_torchrun_style_and_detect_reads_the_same_rank_back(rank, world):
    base = {"PATH": "/usr/bin", "RANK": "7", "WORLD_SIZE": "9", "MASTER_ADDR": "elsewhere", "OMP_NUM_THREADS": "64"}
    env = worker_env(rank, world, 29123, 3, base)
    assert base["RANK"] == "7"  # the launcher's own environment is left alone
    assert env["PATH"] == "/usr/bin"
    assert {key: env[key] for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                      "MASTER_PORT", "DPTRAIN_LAUNCHER", "OMP_NUM_THREADS")} == {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29123", "DPTRAIN_LAUNCHER": "local", "OMP_NUM_THREADS": "3"}
    seen = detect(env)
    assert (seen.launcher, seen.rank, seen.world_size, seen.local_rank, seen.local_world_size) == (
        "local", rank, world, rank, world)
    assert (seen.master_addr, seen.master_port, seen.launched) == ("127.0.0.1", 29123, True)


@pytest.mark.slow
def test_launch_local_runs_every_rank_and_prefixes_its_output(capfd):
    assert launch_local(2, ["info"]) == 0
    out, _ = capfd.readouterr()
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines and all(re.match(r"\[rank[01]\] ", line) for line in lines)
    for rank in (0, 1):
        mine = "\n".join(line for line in lines if line.startswith(f"[rank{rank}] "))
        assert re.search(rf"\brank\b\W+{rank}\b", mine)
        assert re.search(r"\bworld_size\b\W+2\b", mine)
        assert re.search(r"\blauncher\b\W+local\b", mine)


@pytest.mark.slow
def test_launch_local_returns_the_failed_worker_code_and_names_its_rank(capfd):
    assert launch_local(2, ["train", "--config", "/nonexistent.yaml"]) == 2
    _, err = capfd.readouterr()
    failed = re.search(r"^dptrain: worker rank ([01]) exited with code 2; stopping the other workers$", err, re.M)
    assert failed, err
    # Both ranks make the same mistake: its line is shown once, from whichever rank printed it first (not
    # necessarily the one whose exit came first).
    assert len(re.findall(r"^\[rank[01]\] dptrain: error: .*/nonexistent\.yaml", err, re.M)) == 1, err


@pytest.mark.slow
def test_prestarted_workers_run_what_they_are_released_with_and_exit_unheard_without_it(capfd):
    # Released: the ranks run `dptrain ARGV` with the environment sent, as spawned ones would.
    ranks = prestart(2)
    try:
        release(ranks, ["info"], {"MASTER_PORT": "29130"})
        ended = ranks.wait(timeout=120)
    finally:
        ranks.close()
    assert ended.code == 0
    out, err = capfd.readouterr()
    for rank in (0, 1):
        mine = "\n".join(line for line in out.splitlines() if line.startswith(f"[rank{rank}] "))
        assert re.search(rf"\brank\b\W+{rank}\b", mine) and re.search(r"\blauncher\b\W+local\b", mine), out
    # Their launcher gone (stdin closed without a line): each exits at once, code 0, saying nothing.
    ranks = prestart(2)
    try:
        for proc in ranks.procs:
            proc.stdin.close()
        ended = ranks.wait(timeout=120)
    finally:
        ranks.close()
    assert (ended.code, ended.timed_out) == (0, False)
    assert capfd.readouterr() == ("", "")
    # Bad input: the launcher closes them unreleased, which kills them at once, with nothing said.
    started = time.monotonic()
    ranks = prestart(2)
    ranks.close()
    assert time.monotonic() - started < 10 and all(proc.returncode is not None for proc in ranks.procs)
    assert capfd.readouterr() == ("", "")


def python(code: str) -> list[str]:
    """A rank's command: Python running `code`, which sees its RANK in os.environ."""
    return [sys.executable, "-c", "import os, sys, time, signal\n" + code]


def test_spawn_ranks_writes_each_ranks_output_to_its_log_with_its_prefix_and_environment(tmp_path):
    ended = spawn_ranks(python("print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'], "
                               "os.environ['TAG'], os.environ['OMP_NUM_THREADS'], 'DPTRAIN_TTY' in os.environ)"),
                        3, port=29111, threads=2, log_dir=tmp_path, prefix=lambda rank: ["env", f"TAG=host{rank}"])
    assert (ended.code, ended.failed_rank, ended.timed_out, ended.preempted) == (0, None, False, False)
    assert ended.seconds > 0
    for rank in range(3):
        assert (tmp_path / f"rank{rank}.log").read_text() == f"rank {rank} of 3 host{rank} 2 False\n"


def test_rank_0_is_handed_the_socket_listening_on_master_port_and_no_other_rank_has_it(tmp_path):
    # Each rank says whether it has the socket and whether it listens on MASTER_PORT; the launcher keeps no copy.
    code = ("import socket\nfd = os.environ.get('" + STORE_FD + "')\n"
            "if fd:\n    s = socket.socket(fileno=int(fd))\n"
            "    print('handed', s.getsockname()[1] == int(os.environ['MASTER_PORT']), "
            "s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))\n"
            "else:\n    print('none')")
    listener = store_listener()
    ended = spawn_ranks(python(code), 2, port=listener.getsockname()[1], log_dir=tmp_path, listener=listener)
    assert ended.code == 0 and listener.fileno() == -1
    assert [(tmp_path / f"rank{rank}.log").read_text() for rank in range(2)] == ["handed True 1\n", "none\n"]


def test_spawn_ranks_names_the_first_failed_rank_and_stops_the_others(tmp_path):
    started = time.monotonic()
    ended = spawn_ranks(python("if os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)"), 3, port=29112,
                        log_dir=tmp_path)
    assert (ended.failed_rank, ended.failed_code, ended.code) == (1, 3, 3)
    assert time.monotonic() - started < 30  # the sleeping ranks were killed, not waited for


def test_spawn_ranks_stops_every_rank_after_the_timeout(tmp_path):
    started = time.monotonic()
    ended = spawn_ranks(python("print('started', flush=True)\ntime.sleep(60)"), 2, port=29113, log_dir=tmp_path,
                        timeout=1.0)
    assert (ended.timed_out, ended.failed_rank, ended.code) == (True, None, 1)
    assert time.monotonic() - started < 30
    assert all((tmp_path / f"rank{rank}.log").read_text() == "started\n" for rank in range(2))


@pytest.mark.parametrize("warning", ["SIGUSR1", "SIGUSR2", "SIGTERM"])
def test_spawn_ranks_forwards_a_schedulers_warning_to_every_rank(tmp_path, warning):
    # Each rank exits with 75 (stopped at a checkpoint) on the warning, after saying it is ready for it.
    code = (f"signal.signal(signal.{warning}, lambda *_: sys.exit(75))\n"
            "open(os.environ['READY'] + os.environ['RANK'], 'w').close()\n"
            "time.sleep(60)")

    def warn_when_ready():
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"ready{rank}").exists() for rank in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.Signals[warning])

    previous = signal.getsignal(signal.Signals[warning])
    threading.Thread(target=warn_when_ready, daemon=True).start()
    ended = spawn_ranks(python(code), 2, port=29114, log_dir=tmp_path, extra_env={"READY": str(tmp_path / "ready")})
    assert (ended.preempted, ended.failed_rank, ended.code) == (True, None, 75)
    assert signal.getsignal(signal.Signals[warning]) is previous  # our own handler is back


def test_a_rank_still_running_long_after_another_finished_is_named_and_stopped(tmp_path, capfd):
    # rank 0 finishes at once; rank 1 freezes (as a SIGSTOPped rank would) and must not hang the launcher
    script = tmp_path / "linger.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '1':\n    time.sleep(600)\n")
    started = time.monotonic()
    ended = spawn_ranks([sys.executable, str(script)], 2, port=free_port(), log_dir=tmp_path, linger=2)
    assert time.monotonic() - started < 30
    assert ended.stuck_ranks == (1,) and ended.first_done == 0 and ended.code == 1


def test_a_joiner_takes_the_local_slot_of_the_rank_it_replaces_not_its_new_rank(monkeypatch):
    """Under NCCL LOCAL_RANK is the rank's GPU: a joiner started as rank 4 of a 4-GPU machine in place of rank 1
    would otherwise land on cuda:4 (or, modulo the GPUs, on rank 0's cuda:0); a second joiner replacing the
    first takes the same slot."""
    import dptrain.runtime.membership as membership
    from dptrain.runtime.spawn import Ranks

    ranks = Ranks(4)
    ranks.store, ranks.spawned = object(), (4, 29123, 1, {"PATH": "/usr/bin"}, "127.0.0.1", "local", None)
    started, next_rank = [], iter([4, 5])
    monkeypatch.setattr(membership, "take_rank", lambda store: next(next_rank))
    monkeypatch.setattr(Ranks, "job_store", lambda self: None)
    monkeypatch.setattr(Ranks, "start", lambda self, rank, argv, env, log_dir=None: started.append(
        (rank, env["RANK"], env["LOCAL_RANK"])))
    assert ranks.start_joiner(["train"], replacing=1) == 4
    assert ranks.start_joiner(["train"], replacing=4) == 5
    assert started == [(4, "4", "1"), (5, "5", "1")]


def test_more_local_ranks_than_gpus_is_one_line_not_two_ranks_on_one_gpu(monkeypatch):
    import torch

    from dptrain.errors import UserError
    from dptrain.runtime.distributed import choose_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert choose_device("auto", 3) == torch.device("cuda", 3)
    with pytest.raises(UserError, match=r"^local rank 4 has no GPU of its own: 4 visible on this node \(cuda:0-3\), "
                                        r"and NCCL cannot run two ranks on one GPU"):
        choose_device("auto", 4)
    assert choose_device("cpu", 4) == torch.device("cpu")


def test_dptrain_backend_gloo_lets_ranks_share_a_gpu_and_a_wrong_value_is_one_line(monkeypatch):
    import torch

    from dptrain.errors import UserError
    from dptrain.runtime.distributed import backend_for, choose_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert backend_for(torch.device("cuda", 0)) == "nccl" and backend_for(torch.device("cpu")) == "gloo"
    monkeypatch.setenv("DPTRAIN_BACKEND", "gloo")
    assert choose_device("auto", 1) == torch.device("cuda", 0) and backend_for(torch.device("cuda", 0)) == "gloo"
    monkeypatch.setenv("DPTRAIN_BACKEND", "mpi")
    with pytest.raises(UserError, match=r"^DPTRAIN_BACKEND='mpi' is not a backend dptrain runs on; give gloo or nccl"):
        backend_for(torch.device("cuda", 0))
