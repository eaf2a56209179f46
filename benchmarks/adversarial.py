"""Adversarial matrix (issue 32, item 6): kills, freezes, forged store writes, a malicious joiner, corrupt and
foreign checkpoints, changed data, a full disk and signals, each against real `python -m dptrain train` runs.

    python benchmarks/adversarial.py                 # the full matrix (111 cases)
    python benchmarks/adversarial.py --quick         # a representative subset (17 cases)
    python benchmarks/adversarial.py --jobs 2        # cases two at a time
    python benchmarks/adversarial.py --cases kill-sync --list   # the cases whose name holds a word, not run
    python benchmarks/adversarial.py --cases hierarchical --replace-in benchmarks/results/adversarial
                                                     # those cases again, in place of their rows of an earlier run

Writes benchmarks/results/adversarial.md (the table, and a line per case) and adversarial.json (every case's
details: each invocation's argv, exit, wall time, epoch lines, the checkpoints seen before and after the resume,
the per-epoch sample accounting) (--out PREFIX to write elsewhere). The run directories go to a temporary
folder, deleted afterwards (--keep to keep them).

Everything is done from outside, as a user or an attacker would: the CLI (`python -m dptrain train ...`, the
same command again to resume), the fault points of DPTRAIN_FAULT (src/dptrain/faults.py: train-middle@RANK:EPOCH,
DPTRAIN_FAULT_ACTION=freeze; the resume runs without DPTRAIN_FAULT, so that it does not fire again), signals to the
launcher, and the run directory's documented files (docs/reference/run-directory.md): metrics.jsonl,
summary.json, model.pt, checkpoints/epoch-NNNNNN[-step-KKKKKK]/ with a SHA-256 beside each file, join.address.
Every dptrain process a case starts carries DPTRAIN_BENCH_CASE in its environment; each invocation has a hard
timeout (180 s), and what is left of it then is killed (found by that variable in /proc).

Every run uses the default embedded data set (digits, 1,437 training rows) unless said, the default MLP, few
epochs, `--timeout 45` (the wait on another worker before failing: a frozen worker without --min-workers is
found only by it) and `--no-progress`.

The cases (groups are the table's rows):

- kill / freeze (DPTRAIN_FAULT=train-middle@R:2, SIGKILL or SIGSTOP halfway through epoch 2) of rank 0, of rank
  1, of the last rank and of two ranks at once (0 and 2 of 4 workers), under allreduce, sync, async, fedavg,
  streaming and hierarchical (4 workers, --ranks-per-node 2: two emulated nodes), 3 workers (4 for two at
  once and for hierarchical), 6 epochs:
  - without --min-workers: the run fails; then the same command again (the resume);
  - with --min-workers 2: the others go on; at the first epoch line of epoch 3 or later the launcher gets
    SIGTERM (a scheduler's stop: "a checkpoint is saved ...: run the same command again"), then the same
    command again. This is the failure that must survive a resume (issue 32, item 3).
  - async with --min-workers 2, rank 1 or rank 0 killed, and no SIGTERM: the run must finish without it
    (issue 32, item 4); the same command again only if it did not (model.pt and summary.json missing).
- forged store writes: sync (full matrix: also allreduce and async), 3 workers, --min-workers 2,
  --max-workers 4, rank 1 slowed 25x, 8 epochs. Once metrics.jsonl exists, a plain torch TCPStore client
  at join.address's host:port (not using the secret) writes, at the keys as dptrain's ranks see them
  (PrefixStore 'default_pg' then '0/', and unprefixed): failed/0 = 1, a joiner (joiners counter + join/N =
  ready), a decider and members of generation 1, and a pickle whose __reduce__ would touch the marker.
- malicious joiner: sync, 3 workers, --min-workers 2, --max-workers 4 (a free place), rank 0 slowed, 8 epochs;
  `dptrain join RUN_DIR` (with the secret: join.address is the user's own) in a process where every value it
  sends (dptrain.runtime.group's encode_json, Group.gather_bytes, Group.broadcast_bytes) is replaced by a
  pickle whose __reduce__ runs `touch MARKER`. Full matrix: also a joiner without the secret (join.address
  copied without its second line).
- corrupt checkpoint: sync, 3 workers, killed in epoch 3; 64 bytes in the middle of the largest file of the
  newest checkpoint flipped; the same command again.
- foreign checkpoint: a 3-worker run's newest checkpoint (epoch 4, valid checksums) copied into a 2-worker
  run's checkpoints/ (its own newest: epoch 2); the same command again. Full matrix: also a run with the same
  settings but --seed 1 as the other run.
- changed data: `--data FILE.npz` (1,000 rows), killed in epoch 3; the file replaced by a permutation of 800 of
  its rows; the same command again.
- disk full: --out on a 2 MiB tmpfs mounted here (root only; skipped otherwise), 2 workers, an MLP with 1,024
  hidden units (each rank file about 620 kB: the disk fills at epoch 2's checkpoint); then the tmpfs grown to
  64 MiB and the same command again. The mount is undone afterwards.
- SIGTERM in the first second: SIGTERM to the launcher 0.5 s after it started; the same command again.
- SIGTERM during the final evaluation: SIGTERM to the launcher as the last epoch's line arrives (the final
  evaluation and the results follow it); the same command again if the run did not finish.

What each column counts, per group (a case is one row of adversarial.json):

- runs: cases that ran to the end of their evaluation (a case the script itself failed on is listed apart).
- hangs: cases in which an invocation's hard timeout fired, or a process of the case was still alive 10 s
  after its launcher had exited (both killed then).
- checkpoints lost: cases in which a complete checkpoint existed before the resume and either (a) the resume
  did not continue from the newest complete one (its first epoch line is not the epoch after it; a resume that
  ran no epoch counts as continuing from the last epoch when it exits 0 with summary.json; a resume that
  refuses in a case where a refusal is the right answer — foreign checkpoint, changed data — loses nothing),
  or (b) after the resume a complete checkpoint of before it is gone and no newer complete one exists.
  Complete: every file of the checkpoint's folder that has a .sha256 beside it matches it, no *.tmp is left,
  and the folder holds at least as many rank files (rank-*.pt, or *.distcp) as workers trained that epoch:
  as many as metrics.jsonl lists (the record of epoch N for epoch-N; for epoch-N-step-K, the last record
  before N; --workers where there is none), and in the kill/freeze cases at least the workers the case left
  alive (async's records, written by rank 0 as it goes, list rank 0 alone); a folder with a .metadata and no
  rank files is not counted by rank. A checkpoint the case damaged or planted is never the newest complete one.
- samples lost or duplicated: cases whose final metrics.jsonl does not read each training row exactly once per
  epoch: for every epoch recorded, the workers' samples (plus membership.rows_read_by_the_lost, and async's
  rows_made_up: rows of that epoch no worker's merge brought in, trained by the workers left at the end) must equal
  summary.json's data.train_samples (without summary.json: the data set's size learned from the other cases;
  the changed-data case only with its summary); an epoch recorded twice counts its rows again, an epoch
  missing between 1 and the last one recorded (all epochs when summary.json exists) counts its rows as lost.
  The cell gives the cases and the rows (lost + duplicated) over them.
- code executed: cases whose marker file exists (a pickle's __reduce__ ran `touch MARKER` somewhere).
- forged values accepted: forged-writes cases whose run recorded a membership change that no real failure
  explains: a metrics.jsonl membership record that leaves out a rank whose process the launcher never said
  ended ("worker rank N was killed / exited / was still running": a real failure, which async may have
  beside the forgery, is not the forger's), or leaves out nobody (a group abandoned for nothing), or admits
  a joiner, or names a member twice; an epoch recorded twice; or summary.json's workers fewer than the ranks
  whose process did not end. For the joiner without the secret: a record with membership.joined.
- silent wrong results: foreign-checkpoint, changed-data and corrupt-checkpoint cases whose resume trained on
  anyway: continued from the planted or damaged checkpoint, or (changed data) ran an epoch or exited 0 without
  refusing. A warning line while going on still counts: the goal is a refusal.

The goal is 0 in every column but runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "adversarial"
STRATEGIES = ("allreduce", "sync", "async", "fedavg", "streaming", "hierarchical")
EPOCHS = 6
WAIT = "45"  # --timeout: seconds any wait on another worker may take before failing
HARD_TIMEOUT = 180.0  # seconds an invocation may take before it counts as hung (its processes are killed)
OUTLIVE = 10.0  # seconds a process of the case may outlive its launcher before it counts as a hang
CASE_ENV = "DPTRAIN_BENCH_CASE"
EPOCH_LINE = re.compile(r"\bepoch (\d+)/(\d+)\s+train_loss")
BIG_MODEL = ["--model", "mlp", "--model-option", "hidden=[1024]"]  # rank files of about 620 kB
COLUMNS = ("runs", "hangs", "checkpoints lost", "samples lost or duplicated", "code executed",
           "forged values accepted", "silent wrong results")
GROUPS = ("kill, no --min-workers", "kill, --min-workers", "freeze, no --min-workers", "freeze, --min-workers",
          "forged store writes", "malicious joiner", "corrupt checkpoint", "foreign checkpoint", "changed data",
          "disk full", "SIGTERM in the first second", "SIGTERM during the final evaluation")

# The process a malicious joiner runs: `dptrain join RUN_DIR`, every value it sends replaced by a pickle that runs
# `touch MARKER` when unpickled. Attacker's code: it may use whatever dptrain's modules hold.
EVIL_JOINER = r'''
import os, pickle, sys
run_dir, marker = sys.argv[1], sys.argv[2]

class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {marker}; echo PWNED RANK=$RANK >> {marker}.log",))

EVIL = pickle.dumps(RunsCode())
import dptrain.runtime.group as group
patched = []
if hasattr(group, "encode_json"):
    group.encode_json = lambda value: EVIL
    patched.append("encode_json")
for name in ("gather_bytes", "broadcast_bytes", "all_gather_bytes"):
    original = getattr(group.Group, name, None)
    if original is not None:
        def evil(self, what, data, *args, _original=original, **kwargs):
            return _original(self, what, EVIL if data is not None else None, *args, **kwargs)
        setattr(group.Group, name, evil)
        patched.append(f"Group.{name}")
print("evil joiner: sends a pickle through " + ", ".join(patched), flush=True)
from dptrain.cli import main
sys.exit(main(["join", run_dir]))
'''

# A plain TCPStore client that writes what dptrain's membership reads, without the run's secret.
FORGER = r'''
import datetime, os, pickle, sys
import torch.distributed as dist
host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))

raw = dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=10))
views = [raw, dist.PrefixStore("default_pg", raw), dist.PrefixStore("0/", dist.PrefixStore("default_pg", raw))]
written = 0
for store in views:
    store.set("dptrain/membership/failed/0", "1")
    store.set("dptrain/membership/failed/1", "1")
    taken = store.add("dptrain/membership/joiners", 1)
    store.set(f"dptrain/membership/join/{3 + taken - 1}", "ready")
    store.set("dptrain/membership/1/decider", "2")
    store.set("dptrain/membership/1/members", "2;0;0")
    store.set("dptrain/membership/1/alive/2", pickle.dumps(RunsCode()))
    written += 7
print(f"forged {written} values", flush=True)
'''


# ---------------------------------------------------------------------------------------------------- processes

def case_processes(tag: str) -> list[int]:
    """Live (not zombie) processes whose environment holds DPTRAIN_BENCH_CASE=tag."""
    found = []
    needle = f"{CASE_ENV}={tag}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@dataclass
class Invocation:
    """One process of a case (a `dptrain train`, a resume, a joiner, a forger) and what became of it."""
    name: str
    argv: list[str]
    exit: Optional[int] = None
    hung: bool = False
    outlived: list[int] = field(default_factory=list)  # pids alive OUTLIVE s after the launcher exited
    wall: float = 0.0
    epochs: list[int] = field(default_factory=list)  # the epoch numbers of its epoch lines, in order
    stdout: str = ""
    stderr: str = ""
    signalled_at: Optional[float] = None  # seconds after its start that the case signalled it
    attacker: bool = False  # the attacker's own process (a forger, a joiner): its hanging is not the run's

    def record(self) -> dict:
        return {"name": self.name, "argv": self.argv, "exit": self.exit, "hung": self.hung,
                "outlived": self.outlived, "wall_seconds": round(self.wall, 2), "epoch_lines": self.epochs,
                "signalled_at": self.signalled_at, "attacker": self.attacker, "stdout_tail": self.stdout[-3000:],
                "stderr_tail": self.stderr[-3000:]}


class Running:
    """A started invocation: its lines are read as they come, `on_line(running, line)` sees each."""

    def __init__(self, case: "Case", name: str, argv: list[str], env: dict, cwd: Path,
                 on_line: Optional[Callable[["Running", str], None]] = None, attacker: bool = False) -> None:
        self.case, self.inv = case, Invocation(name, argv, attacker=attacker)
        self.on_line = on_line
        self.began = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.out_lines: list[str] = []
        self.err_lines: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out_lines), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err_lines), daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read(self, pipe, lines: list[str]) -> None:
        for line in iter(pipe.readline, ""):
            lines.append(line)
            match = EPOCH_LINE.search(line)
            if match:
                self.inv.epochs.append(int(match[1]))
            if self.on_line is not None:
                try:
                    self.on_line(self, line)
                except Exception:  # noqa: BLE001 - a watcher's mistake must not stop the reading
                    pass
        pipe.close()

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.inv.signalled_at = round(time.monotonic() - self.began, 2)
            self.proc.send_signal(signum)

    def finish(self, timeout: float = HARD_TIMEOUT) -> Invocation:
        """Wait for the process until `timeout` s after its start; then it has hung, and its group is killed (an
        attacker's process is killed without counting as a hang)."""
        left = max(1.0, timeout - (time.monotonic() - self.began))
        try:
            self.inv.exit = self.proc.wait(timeout=left)
        except subprocess.TimeoutExpired:
            self.inv.hung = not self.inv.attacker
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
            self.inv.exit = None
        self.inv.wall = time.monotonic() - self.began
        for reader in self.readers:
            reader.join(timeout=5)
        self.inv.stdout, self.inv.stderr = "".join(self.out_lines), "".join(self.err_lines)
        self.case.invocations.append(self.inv)
        return self.inv


# ---------------------------------------------------------------------------------------------- run directory

def read_records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            records.append({"unreadable": line[:200]})
    return records


def read_summary(run: Path) -> Optional[dict]:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return None


CHECKPOINT_DIR = re.compile(r"^epoch-(\d+)(?:-step-(\d+))?$")


def checkpoints(run: Path, records: list[dict], workers: int,
                live: Optional[Callable[[int], int]] = None) -> list[dict]:
    """Every checkpoint folder of `run`: its position (epoch, step), files, rank files, and whether complete.

    `live(epoch)`: the workers the case knows were alive in that epoch (it killed the others), at least as many
    rank files as that are needed too where metrics.jsonl lists fewer (async's records, written by rank 0 while
    it trains, list rank 0 alone)."""
    found = []
    root = run / "checkpoints"
    if not root.is_dir():
        return found
    for folder in sorted(root.iterdir()):
        match = CHECKPOINT_DIR.match(folder.name)
        if not match or not folder.is_dir():
            continue
        epoch, step = int(match[1]), int(match[2] or 0)
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        bad, temporary = [], [str(p.relative_to(folder)) for p in files if p.name.endswith(".tmp")]
        for path in files:
            checksum = path.with_name(path.name + ".sha256")
            if path.name.endswith(".sha256") or not checksum.is_file():
                continue
            if hashlib.sha256(path.read_bytes()).hexdigest() != checksum.read_text().strip():
                bad.append(str(path.relative_to(folder)))
        # a rank's part: rank-NNNNN.pt today; *.distcp should the layout become torch.distributed.checkpoint's
        ranks = [p.name for p in files if re.fullmatch(r"rank-\d+\.pt", p.name) or p.name.endswith(".distcp")]
        counted = bool(ranks) or not (folder / ".metadata").is_file()  # a .metadata alone: not counted by rank
        if step == 0:
            world = next((len(r.get("workers") or []) for r in records if r.get("epoch") == epoch), None)
        else:
            world = next((len(r.get("workers") or []) for r in reversed(records) if (r.get("epoch") or 0) < epoch),
                         None)
        world = max(world or workers, live(epoch) if live else 0)
        found.append({"name": folder.name, "position": [epoch, step], "files": len(files), "rank_files": ranks,
                      "checksum_failures": bad, "temporary": temporary, "world_recorded": world,
                      "complete": bool(files) and not bad and not temporary and (len(ranks) >= world or not counted)})
    return found


def newest_complete(found: list[dict], exclude: tuple = ()) -> Optional[dict]:
    complete = [c for c in found if c["complete"] and c["name"] not in exclude]
    return max(complete, key=lambda c: tuple(c["position"])) if complete else None


def continued_from(resume: Invocation, run: Path, epochs: int) -> Optional[float]:
    """The position the resume went on from: the epoch before its first epoch line; the last epoch when it ran
    none and finished; None when it neither trained nor finished."""
    if resume.epochs:
        return resume.epochs[0] - 1
    if resume.exit == 0 and read_summary(run) is not None:
        return epochs
    return None


def checkpoints_lost(before: list[dict], after: list[dict], resume: Optional[Invocation], run: Path, epochs: int,
                     exclude: tuple = (), refusal_is_right: bool = False) -> dict:
    newest = newest_complete(before, exclude)
    found = {"newest_complete_before": newest["name"] if newest else None, "continued_from": None,
             "not_continued": False, "pruned_without_newer": []}
    if resume is None or newest is None:
        return found
    position = continued_from(resume, run, epochs)
    found["continued_from"] = position
    epoch, step = newest["position"]
    needed = epoch - 1 if step else epoch  # a step checkpoint inside epoch N: the resume's first line is epoch N
    refused = resume.exit not in (0, None) and not resume.epochs
    if position is None:
        found["not_continued"] = not (refused and refusal_is_right)
    elif position < needed:
        found["not_continued"] = True
    names_after = {c["name"] for c in after}
    newest_after = newest_complete(after, exclude)
    for checkpoint in before:
        if checkpoint["complete"] and checkpoint["name"] not in exclude and checkpoint["name"] not in names_after:
            if newest_after is None or tuple(newest_after["position"]) <= tuple(checkpoint["position"]):
                found["pruned_without_newer"].append(checkpoint["name"])
    found["lost"] = found["not_continued"] or bool(found["pruned_without_newer"])
    return found


def sample_accounting(records: list[dict], summary: Optional[dict], train_rows: Optional[int],
                      epochs: int) -> dict:
    """Rows lost and duplicated over the epochs of metrics.jsonl, against the training set's size."""
    if summary is not None:
        train_rows = (summary.get("data") or {}).get("train_samples") or train_rows
    if train_rows is None:
        return {"checked": False, "why": "no training-set size known"}
    seen: dict[int, int] = {}
    lost = duplicated = 0
    wrong = []
    for record in records:
        epoch = record.get("epoch")
        if epoch is None:
            continue
        seen[epoch] = seen.get(epoch, 0) + 1
        rows = sum((worker.get("samples") or 0) for worker in record.get("workers") or [])
        rows += (record.get("membership") or {}).get("rows_read_by_the_lost", 0) or 0
        rows += record.get("rows_made_up", 0) or 0  # async: rows of this epoch trained at the end instead
        if seen[epoch] > 1:
            duplicated += rows
            wrong.append({"epoch": epoch, "recorded_again": True, "rows": rows})
        elif rows != train_rows:
            lost += max(0, train_rows - rows)
            duplicated += max(0, rows - train_rows)
            wrong.append({"epoch": epoch, "rows": rows,
                          "workers": [w.get("samples") for w in record.get("workers") or []]})
    last = epochs if summary is not None else max(seen, default=0)
    missing = [epoch for epoch in range(1, last + 1) if epoch not in seen]
    lost += train_rows * len(missing)
    return {"checked": True, "train_rows": train_rows, "epochs_recorded": [r.get("epoch") for r in records],
            "missing_epochs": missing, "rows_lost": lost, "rows_duplicated": duplicated, "wrong_epochs": wrong[:20]}


# ------------------------------------------------------------------------------------------------------ cases

@dataclass
class Case:
    """One adversarial case: a name, its group, and the function that does it (given the case and a folder)."""
    name: str
    group: str
    strategy: Optional[str]
    action: Callable[["Case", Path], dict]
    options: dict = field(default_factory=dict)
    invocations: list = field(default_factory=list)

    @property
    def tag(self) -> str:
        return f"{self.name}-{os.getpid()}"

    def env(self, tag: Optional[str] = None, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DPTRAIN_")}
        env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **{CASE_ENV: tag or self.tag}, **extra)
        return env

    def start(self, name: str, argv: list[str], cwd: Path, env: Optional[dict] = None,
              on_line: Optional[Callable] = None) -> Running:
        return Running(self, name, argv, env or self.env(), cwd, on_line)

    def attack(self, name: str, argv: list[str], cwd: Path) -> Running:
        """Start the attacker's process (tagged apart, so that it is never taken for a process of the run)."""
        return Running(self, name, argv, self.env(f"{self.tag}-attacker"), cwd, attacker=True)

    def end_attack(self, running: Optional[Running], grace: float = 20.0) -> Optional[Invocation]:
        """The attacker's process, given `grace` s after the run ended, then killed with all it started."""
        if running is None:
            return None
        inv = running.finish(timeout=time.monotonic() - running.began + grace)
        kill_all(case_processes(f"{self.tag}-attacker"))
        return inv

    def run(self, name: str, argv: list[str], cwd: Path, env: Optional[dict] = None,
            on_line: Optional[Callable] = None) -> Invocation:
        running = self.start(name, argv, cwd, env, on_line)
        inv = running.finish()
        self.reap(inv)
        return inv

    def reap(self, inv: Invocation) -> None:
        """Processes of the case still alive OUTLIVE s after its launcher exited: a hang; killed."""
        deadline = time.monotonic() + OUTLIVE
        while (left := case_processes(self.tag)) and time.monotonic() < deadline:
            time.sleep(0.5)
        if left:
            inv.outlived = left
            kill_all(left)


def train_argv(strategy: str, out: Path, workers: int, epochs: int = EPOCHS, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "dptrain", "train", "--strategy", strategy, "--workers", str(workers),
            "--epochs", str(epochs), "--lr", "0.05", "--timeout", WAIT, "--no-progress", "--out", str(out)]
    if strategy == "hierarchical":
        argv += ["--ranks-per-node", "2"]
    return argv + list(extra)


def fault_env(case: Case, root: Path, spec: str, action: str = "kill") -> dict:
    return case.env(DPTRAIN_FAULT=spec, DPTRAIN_FAULT_ONCE=str(root / "fault.fired"),
                    **({"DPTRAIN_FAULT_ACTION": "freeze"} if action == "freeze" else {}))


def evaluate(case: Case, run: Path, epochs: int, workers: int, before: list[dict],
             resume: Optional[Invocation], exclude: tuple = (), refusal_is_right: bool = False,
             live: Optional[Callable[[int], int]] = None) -> dict:
    """The columns every case shares: checkpoints lost and the sample accounting of the final run directory."""
    records = read_records(run)
    summary = read_summary(run)
    after = checkpoints(run, records, workers, live)
    lost = checkpoints_lost(before, after, resume, run, epochs, exclude, refusal_is_right)
    rows = case.options.get("train_rows", TRAIN_ROWS.get("digits", DIGITS_TRAIN_ROWS))
    return {"finished": summary is not None and (run / "model.pt").is_file(),
            "summary_workers": summary.get("workers") if summary else None,
            "checkpoints_before_resume": before, "checkpoints_after": after, "checkpoint_check": lost,
            "samples": sample_accounting(records, summary, rows, epochs)}


TRAIN_ROWS: dict[str, int] = {}  # data set -> training rows, learned from the cases' summary.json
DIGITS_TRAIN_ROWS = 1437  # until a case has learned it: digits' 1,797 rows less the 20 % held out


def learn_rows(run: Path) -> None:
    summary = read_summary(run)
    if summary and (summary.get("data") or {}).get("source") == "digits":
        TRAIN_ROWS.setdefault("digits", summary["data"]["train_samples"])


def fault_case(case: Case, root: Path) -> dict:
    """Kill or freeze `ranks` halfway through epoch 2; with --min-workers, SIGTERM at epoch 3's line; resume."""
    o = case.options
    run = root / "run"
    extra = ["--min-workers", "2"] if o["elastic"] else []
    argv = train_argv(case.strategy, run, o["workers"], EPOCHS, *extra)
    env = fault_env(case, root, f"train-middle@{o['ranks']}:2", o["action"])

    def stop_after_the_failure(running: Running, line: str) -> None:
        match = EPOCH_LINE.search(line)
        if match and int(match[1]) >= 3 and running.inv.signalled_at is None:
            running.signal(signal.SIGTERM)

    stop = o["elastic"] and o.get("stop", True)
    running = case.start("train", argv, root, env, stop_after_the_failure if stop else None)
    first = running.finish()
    case.reap(first)
    records = read_records(run)
    lost = len(o["ranks"].split(",")) if o["elastic"] else 0

    def live(epoch: int) -> int:  # the killed ranks are gone from epoch 2 on (the survivors redo it)
        return o["workers"] - (lost if epoch >= 2 else 0)

    before = checkpoints(run, records, o["workers"], live)
    resume = None
    if read_summary(run) is None:  # without the fault: of two ranks, the launcher may stop one before it fired
        resume = case.run("resume", argv, root, case.env())
    learn_rows(run)
    return {"first_finished": resume is None,
            **evaluate(case, run, EPOCHS, o["workers"], before, resume, live=live)}


ENDED = re.compile(r"dptrain: worker rank (\d+) (?:was killed|exited|was still running)")  # the launcher's lines


def ended_ranks(inv: Invocation) -> set[int]:
    """The ranks whose process the launcher saw end (or stopped as frozen): real failures, not forged ones."""
    return {int(rank) for rank in ENDED.findall(inv.stderr + inv.stdout)}


def unexplained_changes(records: list[dict], summary: Optional[dict], inv: Invocation, workers: int) -> list[str]:
    """Membership changes no real failure explains: a record whose membership leaves out a rank whose process had
    not ended, leaves out nobody (a group abandoned for nothing), admits a joiner or names a member twice; an
    epoch recorded twice; summary.json's workers short of those whose process did not end."""
    ended = ended_ranks(inv)
    found = []
    seen: set[int] = set()
    for record in records:
        epoch, change = record.get("epoch"), record.get("membership")
        if change is not None:
            left, members = set(change.get("left") or []), change.get("members") or []
            if not left or not left <= ended or change.get("joined") or len(members) != len(set(members)):
                found.append(f"epoch {epoch}: membership {json.dumps(change)} (ended by themselves: {sorted(ended)})")
        if epoch in seen and not ended:
            found.append(f"epoch {epoch} recorded again")
        seen.add(epoch)
    if summary is not None and (summary.get("workers") or 0) < workers - len(ended):
        found.append(f"summary.json workers {summary.get('workers')}, {workers - len(ended)} expected")
    return found


def attack_while_training(case: Case, root: Path, argv: list[str], ready: Callable[[Path], bool],
                          attacker: Callable[[], tuple[str, list[str]]]) -> tuple[Invocation, Optional[Invocation]]:
    """Train with `argv`; once `ready(run directory)`, start the attacker's (name, argv); both, when they ended."""
    run = Path(argv[argv.index("--out") + 1])
    running = case.start("train", argv, root)
    attack = None
    deadline = time.monotonic() + HARD_TIMEOUT
    while running.proc.poll() is None and time.monotonic() < deadline:
        if ready(run):
            attack = case.attack(*attacker(), root)
            break
        time.sleep(0.1)
    first = running.finish()
    case.reap(first)
    return first, case.end_attack(attack)


def forged_case(case: Case, root: Path) -> dict:
    run, marker = root / "run", root / "PWNED"
    argv = train_argv(case.strategy, run, 3, 8, "--min-workers", "2", "--slow-worker", "1:25",
                      *(["--max-workers", "4"] if case.strategy != "async" else []))
    address = run / "join.address"

    def forger() -> tuple[str, list[str]]:
        host, _, port = address.read_text().splitlines()[0].strip().rpartition(":")
        return "forger", [sys.executable, "-c", FORGER, host, port, str(marker)]

    first, forged = attack_while_training(
        case, root, argv, lambda run: address.is_file() and (run / "metrics.jsonl").is_file()
        and bool(address.read_text().strip()), forger)
    records = read_records(run)
    summary = read_summary(run)
    changes = unexplained_changes(records, summary, first, 3)
    learn_rows(run)
    return {"forged": forged is not None and forged.exit == 0, "forged_values_accepted": bool(changes),
            "changes_without_a_failure": changes, "ended_by_themselves": sorted(ended_ranks(first)),
            "run_exit": first.exit,
            "said_ignored": "ignored the value" in first.stderr + first.stdout,
            "code_executed": marker.exists(),
            **evaluate(case, run, 8, 3, checkpoints(run, records, 3), None)}


def joiner_case(case: Case, root: Path) -> dict:
    run, marker = root / "run", root / "PWNED"
    argv = train_argv("sync", run, 3, 8, "--min-workers", "2", "--max-workers", "4", "--slow-worker", "0:25")
    address = run / "join.address"
    with_secret = case.options["secret"]

    def joiner() -> tuple[str, list[str]]:
        if with_secret:
            return "evil joiner", [sys.executable, "-c", EVIL_JOINER, str(run), str(marker)]
        fake = root / "no-secret"  # the same run seen through a copy of its directory whose join.address has no secret
        fake.mkdir()
        shutil.copy(run / "config.yaml", fake / "config.yaml")
        (fake / "join.address").write_text(address.read_text().splitlines()[0] + "\n")
        return "joiner without the secret", [sys.executable, "-m", "dptrain", "join", str(fake)]

    lines = 2 if with_secret else 1  # join.address: host:port, then the secret (once the launcher wrote it)
    first, joined = attack_while_training(
        case, root, argv, lambda run: address.is_file() and address.read_text().count("\n") >= lines, joiner)
    records = read_records(run)
    admitted = [r.get("epoch") for r in records if (r.get("membership") or {}).get("joined")]
    changed = [r.get("epoch") for r in records if r.get("membership") or len(r.get("workers") or []) != 3]
    learn_rows(run)
    return {"joiner_started": joined is not None, "joiner_exit": joined.exit if joined else None,
            "admitted_in": admitted, "epochs_with_membership_change": changed, "run_exit": first.exit,
            "run_seconds": round(first.wall, 1),
            "generations": max(((r.get("membership") or {}).get("generation") or 0 for r in records), default=0),
            "code_executed": marker.exists(),
            "marker_log": (root / "PWNED.log").read_text() if (root / "PWNED.log").exists() else "",
            # the evidence that the attack was made: what the joiner patched, and whether the run saw a payload
            "payload_through": next((line for line in (joined.stdout if joined else "").splitlines()
                                     if line.startswith("evil joiner:")), None),
            "refusals_said": len(re.findall(r"sent \d+ bytes that are not", first.stdout + first.stderr)),
            # a joiner with the secret is the user's own: admitting it is right; one without must never enter
            "forged_values_accepted": bool(admitted) and not with_secret,
            **evaluate(case, run, 8, 3, checkpoints(run, records, 3), None)}


def killed_run(case: Case, root: Path, run: Path, workers: int, epochs: int, kill_epoch: int, *extra: str,
               name: str = "train") -> tuple[list[str], dict, Invocation]:
    argv = train_argv("sync", run, workers, epochs, *extra)
    env = case.env(DPTRAIN_FAULT=f"train-middle@1:{kill_epoch}", DPTRAIN_FAULT_ONCE=str(root / f"{run.name}.fired"))
    return argv, env, case.run(name, argv, root, env)


def corrupt_case(case: Case, root: Path) -> dict:
    run = root / "run"
    argv, env, _ = killed_run(case, root, run, 3, 5, 3)
    found = checkpoints(run, read_records(run), 3)
    newest = newest_complete(found)
    if newest is None:
        return {"error": "the killed run left no complete checkpoint", **evaluate(case, run, 5, 3, found, None)}
    target = max((p for p in (run / "checkpoints" / newest["name"]).rglob("*")
                  if p.is_file() and not p.name.endswith(".sha256")), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(b ^ 0xFF for b in data[middle:middle + 64])
    target.write_bytes(bytes(data))
    before = checkpoints(run, read_records(run), 3)
    resume = case.run("resume", argv, root, env)
    result = evaluate(case, run, 5, 3, before, resume, exclude=(newest["name"],))
    position = result["checkpoint_check"]["continued_from"]
    learn_rows(run)
    return {"corrupted": f"{newest['name']}/{target.name}",
            "silent_wrong": position is not None and position >= newest["position"][0] and not newest["position"][1],
            **result}


def foreign_case(case: Case, root: Path) -> dict:
    other, run = root / "other", root / "run"
    other_extra = ["--seed", "1"] if case.options["same_settings"] else []
    other_workers = 2 if case.options["same_settings"] else 3
    killed_run(case, root, other, other_workers, 6, 5, *other_extra, name="other run")
    argv, env, _ = killed_run(case, root, run, 2, 6, 3)
    theirs = newest_complete(checkpoints(other, read_records(other), other_workers))
    own = newest_complete(checkpoints(run, read_records(run), 2))
    if theirs is None or own is None or tuple(theirs["position"]) <= tuple(own["position"]):
        return {"error": f"no newer foreign checkpoint to plant (theirs {theirs and theirs['name']}, "
                         f"own {own and own['name']})", **evaluate(case, run, 6, 2, [], None)}
    shutil.copytree(other / "checkpoints" / theirs["name"], run / "checkpoints" / theirs["name"])
    before = checkpoints(run, read_records(run), 2)
    records_before = read_records(run)
    resume = case.run("resume", argv, root, env)
    result = evaluate(case, run, 6, 2, before, resume, exclude=(theirs["name"],), refusal_is_right=True)
    position = result["checkpoint_check"]["continued_from"]
    learn_rows(run)
    return {"planted": theirs["name"], "own_newest": own["name"], "resume_exit": resume.exit,
            "records_replaced": read_records(run)[:len(records_before)] != records_before,
            "silent_wrong": position is not None and position >= theirs["position"][0], **result}


def write_npz(path: Path, rows: Optional[int] = None, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, 1000)
    x = (rng.normal(size=(1000, 16)) + np.eye(4, 16)[y] * 3).astype("float32")
    if rows is not None:
        keep = rng.permutation(1000)[:rows]
        x, y = x[keep], y[keep]
    np.savez(path, x=x, y=y.astype("int64"))


def changed_data_case(case: Case, root: Path) -> dict:
    run, data = root / "run", root / "rows.npz"
    write_npz(data)
    argv, env, first = killed_run(case, root, run, 2, 5, 3, "--data", str(data))
    before = checkpoints(run, read_records(run), 2)
    write_npz(data, rows=800)
    resume = case.run("resume", argv, root, env)
    result = evaluate(case, run, 5, 2, before, resume, refusal_is_right=True)
    trained = bool(resume.epochs) or resume.exit == 0
    said = [line for line in resume.stderr.splitlines() if "data" in line.lower()]
    return {"silent_wrong": trained, "resume_exit": resume.exit, "lines_about_data": said[:3], **result}


def disk_full_case(case: Case, root: Path) -> dict:
    if os.geteuid() != 0:
        return {"skipped": "mounting a tmpfs needs root"}
    disk = root / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], check=True, capture_output=True)
    try:
        run = disk / "run"
        argv = train_argv("sync", run, 2, 3, *BIG_MODEL)
        first = case.run("train", argv, root)
        before = checkpoints(run, read_records(run), 2)
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True, capture_output=True)
        resume = case.run("resume", argv, root) if read_summary(run) is None else None
        result = evaluate(case, run, 3, 2, before, resume)
        learn_rows(run)
        error_lines = [line for line in first.stderr.splitlines() if "error" in line.lower()]
        return {"first_exit": first.exit, "first_error_lines": error_lines[:3],
                "traceback": "Traceback" in first.stderr, **result}
    finally:
        kill_all(case_processes(case.tag))
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def sigterm_early_case(case: Case, root: Path) -> dict:
    run = root / "run"
    argv = train_argv("sync", run, 3, 3)
    running = case.start("train", argv, root)
    time.sleep(0.5)
    running.signal(signal.SIGTERM)
    first = running.finish()
    case.reap(first)
    before = checkpoints(run, read_records(run), 3)
    resume = case.run("resume", argv, root) if read_summary(run) is None else None
    learn_rows(run)
    return {"first_exit": first.exit, "first_said": (first.stderr + first.stdout).strip().splitlines()[-3:],
            **evaluate(case, run, 3, 3, before, resume)}


def sigterm_final_case(case: Case, root: Path) -> dict:
    run = root / "run"
    argv = train_argv(case.strategy or "sync", run, 3, 3)

    def at_the_last_epoch(running: Running, line: str) -> None:
        match = EPOCH_LINE.search(line)
        if match and match[1] == match[2]:
            running.signal(signal.SIGTERM)

    running = case.start("train", argv, root, on_line=at_the_last_epoch)
    first = running.finish()
    case.reap(first)
    before = checkpoints(run, read_records(run), 3)
    resume = case.run("resume", argv, root) if read_summary(run) is None else None
    learn_rows(run)
    return {"first_exit": first.exit, "first_finished": resume is None, **evaluate(case, run, 3, 3, before, resume)}


def all_cases() -> list[Case]:
    cases = []
    for strategy in STRATEGIES:
        workers = 4 if strategy == "hierarchical" else 3
        targets = [("rank0", "0", workers), ("rank1", "1", workers), (f"rank{workers - 1}", str(workers - 1), workers),
                   ("ranks0+2", "0,2", 4)]
        for action in ("kill", "freeze"):
            for elastic in (False, True):
                for label, ranks, count in targets:
                    name = f"{action}-{strategy}-{label}-{'min2' if elastic else 'nomin'}"
                    group = f"{action}, {'--min-workers' if elastic else 'no --min-workers'}"
                    cases.append(Case(name, group, strategy, fault_case,
                                      {"action": action, "ranks": ranks, "workers": count, "elastic": elastic}))
    # async with --min-workers to its end, no stop: it must finish (model.pt, summary.json) without the lost worker
    for label, ranks in (("rank1", "1"), ("rank0", "0")):
        cases.append(Case(f"kill-async-{label}-min2-to-the-end", "kill, --min-workers", "async", fault_case,
                          {"action": "kill", "ranks": ranks, "workers": 3, "elastic": True, "stop": False}))
    for strategy in ("sync", "allreduce", "async"):
        cases.append(Case(f"forged-{strategy}", "forged store writes", strategy, forged_case))
    cases.append(Case("joiner-evil-payload", "malicious joiner", "sync", joiner_case, {"secret": True}))
    cases.append(Case("joiner-without-secret", "malicious joiner", "sync", joiner_case, {"secret": False}))
    cases.append(Case("corrupt-checkpoint", "corrupt checkpoint", "sync", corrupt_case))
    cases.append(Case("foreign-checkpoint-3-workers", "foreign checkpoint", "sync", foreign_case,
                      {"same_settings": False}))
    cases.append(Case("foreign-checkpoint-same-settings", "foreign checkpoint", "sync", foreign_case,
                      {"same_settings": True}))
    cases.append(Case("changed-data", "changed data", "sync", changed_data_case, {"train_rows": None}))
    cases.append(Case("disk-full", "disk full", "sync", disk_full_case))
    cases.append(Case("sigterm-first-second", "SIGTERM in the first second", "sync", sigterm_early_case))
    for strategy in ("sync", "async"):
        cases.append(Case(f"sigterm-final-evaluation-{strategy}", "SIGTERM during the final evaluation", strategy,
                          sigterm_final_case))
    return cases


QUICK = ("kill-sync-rank1-nomin", "kill-sync-rank1-min2", "kill-allreduce-rank0-min2", "kill-async-rank1-min2",
         "kill-async-rank1-min2-to-the-end",
         "kill-fedavg-ranks0+2-min2", "freeze-streaming-rank2-min2", "freeze-allreduce-rank1-nomin",
         "kill-hierarchical-rank0-nomin", "forged-sync", "joiner-evil-payload", "corrupt-checkpoint",
         "foreign-checkpoint-3-workers", "changed-data", "disk-full", "sigterm-first-second",
         "sigterm-final-evaluation-sync")


# ---------------------------------------------------------------------------------------------------- judging

def judge(case: Case, result: dict) -> dict:
    """The case's 0/1 per column (and the rows of the samples column)."""
    samples = result.get("samples") or {}
    rows = (samples.get("rows_lost", 0) + samples.get("rows_duplicated", 0)) if samples.get("checked") else 0
    return {"ran": 0 if "error" in result or "skipped" in result else 1,
            "hang": int(any((inv.hung or inv.outlived) and not inv.attacker for inv in case.invocations)),
            "checkpoints_lost": int(bool((result.get("checkpoint_check") or {}).get("lost"))),
            "samples_wrong": int(rows > 0), "rows_wrong": rows,
            "code_executed": int(bool(result.get("code_executed"))),
            "forged_accepted": int(bool(result.get("forged_values_accepted"))),
            "silent_wrong": int(bool(result.get("silent_wrong")))}


def do_case(case: Case, base: Path, keep: bool) -> dict:
    root = base / case.name
    root.mkdir(parents=True)
    began = time.monotonic()
    try:
        result = case.action(case, root)
    except Exception:  # noqa: BLE001 - a benchmark mistake is reported with the case, the others go on
        result = {"error": traceback.format_exc()[-3000:]}
    finally:
        kill_all(case_processes(case.tag) + case_processes(f"{case.tag}-attacker"))
    # the marker of any case (a pickle may run in a process of the run without the case looking for it)
    result.setdefault("code_executed", (root / "PWNED").exists())
    verdict = judge(case, result)
    record = {"case": case.name, "group": case.group, "strategy": case.strategy, "options": case.options,
              "seconds": round(time.monotonic() - began, 1), "verdict": verdict, "result": result,
              "invocations": [inv.record() for inv in case.invocations]}
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
    return record


def problems(verdict: dict) -> str:
    said = [name.replace("_", " ") for name in ("hang", "checkpoints_lost", "code_executed", "forged_accepted",
                                                "silent_wrong") if verdict[name]]
    if verdict["samples_wrong"]:
        said.append(f"{verdict['rows_wrong']} rows lost/duplicated")
    return ", ".join(said) or "none"


def table(records: list[dict]) -> list[str]:
    lines = ["| case group | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for group in GROUPS:
        rows = [r for r in records if r["group"] == group]
        if not rows:
            continue
        v = [r["verdict"] for r in rows]
        total = lambda key: sum(x[key] for x in v)  # noqa: E731
        samples = total("samples_wrong")
        cells = [f"{total('ran')} of {len(rows)}", total("hang"), total("checkpoints_lost"),
                 f"{samples} ({total('rows_wrong'):,} rows)" if samples else "0", total("code_executed"),
                 total("forged_accepted"), total("silent_wrong")]
        lines.append(f"| {group} | " + " | ".join(str(c) for c in cells) + " |")
    return lines


def git_head() -> str:
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return head.stdout.strip() or "?"


def report(records: list[dict], mode: str, seconds: float, jobs: int) -> str:
    commits = sorted({r.get("commit", "?") for r in records})
    lines = [f"# Adversarial matrix ({mode}, {len(records)} cases, {seconds / 60:.1f} min, --jobs {jobs})", "",
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit{'s' if len(commits) > 1 else ''} "
             f"{', '.join(commits)} (each case's below), {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} "
             "at the end. Each column counts cases (benchmarks/adversarial.py's docstring says what each measures); "
             "goal: 0 in every column but runs.", "", *table(records), "", "## Cases", "",
             "| case | commit | seconds | exits | problems |", "|---|---|---:|---|---|"]
    for r in records:
        exits = ", ".join(f"{i['name']} {'hung' if i['hung'] else i['exit']}" for i in r["invocations"])
        error = " (benchmark error: see the JSON)" if "error" in r["result"] else ""
        skipped = f" (skipped: {r['result']['skipped']})" if "skipped" in r["result"] else ""
        lines.append(f"| {r['case']} | {r.get('commit', '?')} | {r['seconds']} | {exits} | "
                     f"{problems(r['verdict'])}{error}{skipped} |")
    return "\n".join(lines) + "\n"


def replace_in(earlier: Path, records: list[dict], mode: str, seconds: float) -> tuple[list[dict], str, float]:
    """An earlier run's cases (PREFIX.json; their commit from its record, or its .md's header) with those run now
    in place of theirs."""
    before = json.loads(earlier.with_suffix(".json").read_text())
    found = re.search(r"commit (\w+)", earlier.with_suffix(".md").read_text()) if earlier.with_suffix(".md").exists() else None
    commit = found[1] if found else "?"
    fresh = {r["case"]: r for r in records}
    merged = [fresh.pop(r["case"], {"commit": commit, **r}) for r in before["cases"]] + list(fresh.values())
    return merged, f"{before['mode']}, {len(records)} of them run again", before["seconds"] + seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"the {len(QUICK)} representative cases only")
    parser.add_argument("--cases", nargs="*", default=[], help="only the cases whose name holds one of these words")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at the same time (default 1)")
    parser.add_argument("--out", type=Path, default=OUT, help="PREFIX of PREFIX.md and PREFIX.json")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed at the end)")
    parser.add_argument("--list", action="store_true", help="list the chosen cases and stop")
    parser.add_argument("--replace-in", type=Path, metavar="PREFIX",
                        help="an earlier run's PREFIX.json: the chosen cases replace their rows of it, its others are "
                             "kept (each row names the commit it ran at); written to --out")
    args = parser.parse_args()
    cases = all_cases()
    if args.quick:
        cases = [c for c in cases if c.name in QUICK]
    if args.cases:
        cases = [c for c in cases if any(word in c.name for word in args.cases)]
    if args.list:
        for case in cases:
            print(f"{case.name:40s} {case.group}")
        return 0
    mode = "quick" if args.quick else ("selected" if args.cases else "full")
    base = Path(tempfile.mkdtemp(prefix="dptrain-adversarial-"))
    print(f"{len(cases)} cases ({mode}), {args.jobs} at a time, run directories in {base}", flush=True)
    began = time.monotonic()
    records: list[dict] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = {pool.submit(do_case, case, base, args.keep): case for case in cases}
        for future in concurrent.futures.as_completed(futures):
            record = future.result()
            records.append(record)
            exits = " then ".join("hung" if i["hung"] else str(i["exit"]) for i in record["invocations"])
            print(f"[{len(records)}/{len(cases)}] {record['case']}: {record['seconds']} s, exits {exits or '-'}; "
                  f"problems: {problems(record['verdict'])}"
                  + (" (benchmark error)" if "error" in record["result"] else ""), flush=True)
    order = {case.name: i for i, case in enumerate(cases)}
    records.sort(key=lambda r: order[r["case"]])
    seconds = time.monotonic() - began
    head = git_head()
    for record in records:
        record["commit"] = head
    if args.replace_in:
        records, mode, seconds = replace_in(args.replace_in, records, mode, seconds)
    text = report(records, mode, seconds, args.jobs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"mode": mode, "seconds": round(seconds, 1),
                                                         "jobs": args.jobs, "cases": records}, indent=1) + "\n")
    print("\n" + "\n".join(table(records)))
    print(f"\n{len(records)} cases in {seconds / 60:.1f} min; written {args.out.with_suffix('.md')} and .json"
          + (f"; run directories kept in {base}" if args.keep else ""))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
