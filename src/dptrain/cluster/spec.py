"""What a job is (JobSpec) and the shell text every scheduler shares: header, rank command, binds.

Everything here is a pure function of a JobSpec, so job scripts are tested as text.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import textwrap
from dataclasses import dataclass, field
from typing import Optional

from dptrain import registry
from dptrain.errors import UserError

TIME_PATTERN = re.compile(r"(\d+-)?\d{1,3}:\d{2}:\d{2}")
MEMORY_PATTERN = re.compile(r"\d+[KMGT]?")  # SLURM's --mem; PBS's mem= is written from it (pbs.memory)
# One option of a directive line: sbatch's long (--mem=0) or short (-C a100) form; PBS's are short (-l mem=1gb).
DIRECTIVE_PATTERN = {"slurm": re.compile(r"--?[A-Za-z]"), "pbs": re.compile(r"-[A-Za-z]")}
SITE_EXAMPLES = {"--mem": "16G", "--qos": "normal", "--constraint": "a100"}


# The signals a scheduler may send ahead of the end (dptrain.runtime.spawn.FORWARDED_SIGNALS, by name).
STOP_SIGNALS = ("USR1", "USR2", "TERM")

@dataclass(frozen=True)
class ContainerSpec:
    """A container each rank runs in: the runtime's name (registry.CONTAINER_RUNTIMES) and its image."""

    runtime: str
    image: str


@dataclass(frozen=True)
class JobSpec:
    """One job: where it runs, how many ranks, and what each rank runs: `dptrain train` with `train_args`,
    or, when `command` is given, that command (a user's program, e.g. `python train.py`)."""

    scheduler: str
    workdir: str
    run_dir: str
    train_args: tuple[str, ...] = ()
    command: tuple[str, ...] = ()  # a user's command that every rank runs instead of dptrain train
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: Optional[int] = None  # None: what the node offers, divided among its ranks (see threads())
    time: Optional[str] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    job_name: str = "dptrain"
    container: Optional[ContainerSpec] = None
    image: Optional[str] = None  # Kubernetes: the pods' container image
    volumes: tuple[str, ...] = ()  # Kubernetes: CLAIM:PATH, a PersistentVolumeClaim every pod mounts at PATH
    binds: tuple[str, ...] = field(default_factory=tuple)
    dptrain: str = "dptrain"
    stop_before: int = 300  # seconds before the time limit that the ranks are told to checkpoint and stop
    stop_signal: str = "USR1"  # which signal tells them (one of STOP_SIGNALS)
    max_requeues: int = 10  # local and PBS: how often a job whose ranks exit with 75 starts again
    elastic: bool = False  # dptrain train --min-workers: the ranks left go on when one fails (SLURM: srun keeps them)
    replacements: int = 0  # --replace-workers: new workers started at most, each in place of a lost one
    mem: Optional[str] = None  # --mem: memory per node, SLURM's form (16G, 4000M, 0 for all of it)
    qos: Optional[str] = None  # --qos: SLURM's quality of service
    constraint: Optional[str] = None  # --constraint: SLURM's node features
    exclusive: bool = False  # --exclusive: whole nodes, no other job beside
    sbatch_options: tuple[str, ...] = ()  # --sbatch-option: each one #SBATCH line, verbatim
    pbs_options: tuple[str, ...] = ()  # --pbs-option: each one #PBS line, verbatim
    # --setup, in the order given: (where the lines came from, e.g. "from FILE", said in a comment above them;
    # the shell lines, run verbatim before the ranks start)
    setup: tuple[tuple[str, str], ...] = ()
    # Kubernetes: the run directory as the pods see it (--out as given: relative to the image's working
    # directory, or absolute, e.g. on a --volume), and the (flag, path) of each file the pods read, as given
    pod_run_dir: str = ""
    pod_files: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.scheduler not in registry.names("scheduler"):
            raise UserError(f"--scheduler {self.scheduler!r} is not known; "
                            f"use one of {', '.join(registry.names('scheduler'))}")
        if self.replacements and self.scheduler not in ("slurm", "pbs", "local"):
            raise UserError(f"--replace-workers under --scheduler {self.scheduler}: only SLURM, PBS and local jobs "
                            "start new workers in place of lost ones; drop it")
        for name in ("nodes", "tasks_per_node", "cpus_per_task"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.stop_before < 0:
            raise UserError(f"--stop-before {self.stop_before} must be 0 (no warning) or a number of seconds")
        if self.max_requeues < 0:
            raise UserError(f"--max-requeues {self.max_requeues} must be 0 (never) or more")
        if self.stop_signal not in STOP_SIGNALS:
            raise UserError(f"--stop-signal {self.stop_signal!r} is not a signal dptrain's ranks stop on; "
                            f"use one of {', '.join(STOP_SIGNALS)}")
        if self.scheduler == "pbs" and self.stop_signal == "TERM":
            raise UserError("--stop-signal TERM: under PBS, Open MPI's mpirun ends the job on TERM rather than "
                            "passing it on; use USR1 or USR2")
        if self.gpus_per_node < 0:
            raise UserError(f"--gpus-per-node {self.gpus_per_node} must be 0 or more")
        if 0 < self.gpus_per_node < self.tasks_per_node:
            raise UserError(f"--tasks-per-node {self.tasks_per_node} is more than --gpus-per-node "
                            f"{self.gpus_per_node}: NCCL cannot run two ranks on one GPU; give --tasks-per-node "
                            f"{self.gpus_per_node} (one rank per GPU) or more GPUs per node")
        if self.time is not None and not TIME_PATTERN.fullmatch(self.time):
            raise UserError(f"--time {self.time!r} is not HH:MM:SS (or D-HH:MM:SS), e.g. 02:00:00")
        if self.scheduler == "local" and self.nodes != 1:
            raise UserError(f"--scheduler local runs on this machine only; use --nodes 1, not {self.nodes}")
        if (self.image or self.volumes) and self.scheduler != "kubernetes":
            flag = f"--image {self.image}" if self.image else f"--volume {self.volumes[0]}"
            raise UserError(f"{flag} is for --scheduler kubernetes; under {self.scheduler} the ranks run on the "
                            "host, or in --container RUNTIME:IMAGE")
        self._check_site_options()
        if not posixpath.isabs(self.workdir) or not posixpath.isabs(self.run_dir):
            raise ValueError("workdir and run_dir must be absolute")
        if self.command and self.train_args:
            raise ValueError("a job runs either dptrain train with train_args or a command, not both")

    def _check_site_options(self) -> None:
        """One line for a site option the scheduler has no directive for, or a directive that is not one."""
        for flag, lines, own, example in (("--sbatch-option", self.sbatch_options, "slurm", "'--mem=0'"),
                                          ("--pbs-option", self.pbs_options, "pbs", "'-l mem=16gb'")):
            for line in lines:
                if self.scheduler != own:
                    raise UserError(f"{flag} {line!r} is for --scheduler {own}, not {self.scheduler}")
                if not DIRECTIVE_PATTERN[own].match(line) or "\n" in line or "\r" in line:
                    raise UserError(f"{flag} {line!r} is not one {'sbatch' if own == 'slurm' else 'PBS'} option; give "
                                    f"one option on one line starting with '-', e.g. {flag} {example}")
        for flag, value in (("--mem", self.mem), ("--qos", self.qos), ("--constraint", self.constraint)):
            if value is not None and (not value or any(character.isspace() for character in value)):
                raise UserError(f"{flag} {value!r} must be one word without spaces, e.g. {SITE_EXAMPLES[flag]}")
        if self.mem is not None and not MEMORY_PATTERN.fullmatch(self.mem):
            raise UserError(f"--mem {self.mem!r} is not an amount of memory per node: a number with K, M, G or T "
                            "(M when none), e.g. 16G, or 0 for all of a node's memory")
        given = [flag for flag, value in (("--mem", self.mem), ("--qos", self.qos), ("--constraint", self.constraint),
                                          ("--exclusive", self.exclusive or None)) if value is not None]
        # --mem is also a Kubernetes pod's memory request and limit (kubernetes.memory); the others are not.
        directives = [flag for flag in given if not (flag == "--mem" and self.scheduler == "kubernetes")]
        if directives and self.scheduler not in ("slurm", "pbs"):
            raise UserError(f"{directives[0]} is a SLURM and PBS directive; --scheduler {self.scheduler} has none")
        if self.scheduler in ("pbs", "kubernetes") and self.mem is not None and int(self.mem.rstrip("KMGT")) == 0:
            where = "PBS" if self.scheduler == "pbs" else "Kubernetes"
            raise UserError(f"--mem 0 (all of a node's memory) is SLURM's; under {where} give an amount, e.g. --mem 64G")
        if self.setup and self.scheduler == "kubernetes":
            raise UserError("--setup runs lines in a job script; a Kubernetes pod runs its --image as it is: put "
                            "the set-up into the image")
        if self.scheduler == "pbs":
            for flag, why in (("--qos", "a PBS queue is --partition"), ("--constraint", "node features are site resources")):
                if flag in given:
                    raise UserError(f"{flag} is SLURM's and PBS has no equivalent ({why}); give the site's own with "
                                    "--pbs-option '-l ...'")

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


def header(spec: JobSpec, what: str, own_lines: str = "") -> list[str]:
    """The first lines of every script: what it is, how it was made, and (`own_lines`) which flags add a
    site's own lines to it, so that nobody needs to edit it."""
    ranks = f"{spec.world_size} rank{'s' if spec.world_size > 1 else ''}"
    layout = f"{spec.nodes} node{'s' if spec.nodes > 1 else ''} x {spec.tasks_per_node} task{'s' if spec.tasks_per_node > 1 else ''}"
    inside = f", each in {spec.container.runtime} container {spec.container.image}" if spec.container else ""
    # (a line break inside an argument, e.g. of python -c, is shown as \n: it would end the comment)
    runs = [f"# Every rank runs: {quote(list(spec.command))}".replace("\n", "\\n")] if spec.command else []
    return ["#!/bin/bash", f"# {what}: {ranks} ({layout}){inside}.", *runs,
            "# Written by dptrain launch; rerun it rather than editing this file"
            + (f" ({own_lines})." if own_lines else ".")]


def process_environment(spec: JobSpec, *, cpus_variable: str = "", node_cpus_variable: str = "",
                        tasks_variable: str = "") -> list[str]:
    """Script lines every rank's process environment starts from: its CPU threads, and torch's C++ log
    level at ERROR unless the user chose one (torch reads it once, at import, before dptrain runs in a
    rank started by srun, mpirun or torchrun; dptrain's own local workers set it themselves).

    The threads are --cpus-per-task when given. Otherwise they are found as the job starts: the
    scheduler's own count of CPUs per task (`cpus_variable`, e.g. SLURM_CPUS_PER_TASK, set when an
    --sbatch-option gives one) if set, else the CPUs the job was given on this node
    (`node_cpus_variable`, e.g. SLURM_CPUS_ON_NODE, right also where the job is not confined to its
    CPUs and nproc counts the whole node; else nproc) divided among the ranks on it (`tasks_variable`
    if set, else --tasks-per-node), at least 1. Never a fixed 1: a CPU job on whole nodes (--exclusive)
    uses their cores. The job's output says how many."""
    log_level = 'export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"'
    if spec.cpus_per_task is not None:
        return [f"export OMP_NUM_THREADS={spec.cpus_per_task}", log_level]
    tasks = f"${{{tasks_variable}:-{spec.tasks_per_node}}}" if tasks_variable else str(spec.tasks_per_node)
    node = f"${{{node_cpus_variable}:-$(nproc)}}" if node_cpus_variable else "$(nproc)"
    offered = f"$(( {node} / {tasks} ))"
    first = f"{cpus_variable} if set, else " if cpus_variable else ""
    given = f"{node_cpus_variable}, else nproc" if node_cpus_variable else "nproc"
    comment = (f"CPU threads per rank (no --cpus-per-task): {first}the CPUs the job was given on this node "
               f"({given}) shared among the ranks on it, at least 1.")
    if spec.scheduler != "local":  # a batch scheduler's default share, not the node's cores
        comment += " A site's default is often one CPU per rank: for more, give --cpus-per-task N, or --exclusive."
    return [*textwrap.wrap(comment, 100, initial_indent="# ", subsequent_indent="# "),
            f"threads={f'${{{cpus_variable}:-{offered}}}' if cpus_variable else offered}",
            "export OMP_NUM_THREADS=$(( threads > 1 ? threads : 1 ))",
            log_level]


def setup_lines(spec: JobSpec) -> list[str]:
    """The user's --setup lines (module load, activating an environment ...), verbatim and in the order
    given, each block under a comment saying where it came from; run once on the first node before the
    ranks start. Then, without --cpus-per-task, the line that says the ranks' threads: after the set-up,
    which may export OMP_NUM_THREADS itself."""
    said = ([] if spec.cpus_per_task is not None else
            ['echo "dptrain: $OMP_NUM_THREADS CPU threads per rank (OMP_NUM_THREADS; --cpus-per-task N asks for N)"'])
    if not spec.setup:
        return said
    lines = ["", "set +u  # environment scripts (module, conda activate) may read variables that are not set"]
    for where, text in spec.setup:
        lines += [f"# Set-up {where} (--setup):", *text.rstrip("\n").split("\n")]
    return [*lines, "set -u", *said]


def train_command(spec: JobSpec, run_dir: str = "") -> list[str]:
    """The words one rank runs: `dptrain train ARGS --out RUN_DIR` (`run_dir`, else the spec's), or the
    spec's command."""
    if spec.command:
        return list(spec.command)
    return [*shlex.split(spec.dptrain), "train", *spec.train_args, "--out", run_dir or spec.run_dir]


def command_environment(spec: JobSpec, port: str) -> list[str]:
    """Script lines that give a command job's ranks what torchrun gives its own (beside MASTER_ADDR, exported
    already): MASTER_PORT (the shell arithmetic `port`), WORLD_SIZE, LOCAL_WORLD_SIZE and DPTRAIN_RUN_DIR.
    RANK and LOCAL_RANK differ per rank: `rank_environment` sets them. None for a dptrain train job."""
    if not spec.command:
        return []
    return ["",
            "# The command meets its world as under torchrun: init_process_group(\"env://\") reads MASTER_ADDR,",
            "# MASTER_PORT, WORLD_SIZE and RANK (each rank's own, set as it starts; LOCAL_RANK too).",
            f"export MASTER_PORT={port} WORLD_SIZE={spec.world_size} LOCAL_WORLD_SIZE={spec.tasks_per_node} "
            f"DPTRAIN_RUN_DIR={quote([spec.run_dir])}"]


def serve_store(spec: JobSpec, port: str, replace_step: str = "") -> list[str]:
    """Script lines that serve the ranks' store from the batch host (`dptrain serve-store`, at MASTER_ADDR and
    the shell arithmetic `port`), so that any rank may be lost, rank 0 too: for a dptrain train job with
    --min-workers outside a container. With `replace_step` (a command line that starts one worker, `dptrain
    join RUN_DIR` in a new job step) it starts one in place of each rank lost, up to spec.replacements."""
    if not spec.elastic or spec.command or spec.container is not None:
        return []
    run_dir = quote([spec.run_dir])
    replace = (f" --replace {spec.replacements} --replace-command {quote([replace_step])}"
               if spec.replacements and replace_step else "")
    return ["",
            "# --min-workers: the ranks' store is served here, not by rank 0, so that any rank may be lost;",
            "# RUN_DIR/join.address says where while it runs (dptrain join RUN_DIR from any node of the job)"
            + (", and it starts a new worker in place of each rank lost (--replace-workers)." if replace else "."),
            f"export MASTER_PORT={port} DPTRAIN_STORE_SERVED=1",
            "# The run's secret signs what the store service and the ranks write there (never in this file: made",
            "# as the job starts, inherited by the store service and the ranks; RUN_DIR/join.address holds it, 0600).",
            "umask 077",
            'DPTRAIN_RUN_SECRET="$(od -An -N32 -tx1 /dev/urandom | tr -d \' \\n\')"',
            "export DPTRAIN_RUN_SECRET",
            f'{spec.dptrain} serve-store --host "$MASTER_ADDR" --port "$MASTER_PORT" --world {spec.world_size} '
            f"--run-dir {run_dir}{replace} &",
            "store_pid=$!",
            'trap \'kill "$store_pid" 2>/dev/null || true\' EXIT']


def rank_environment(rank: str, local_rank: str, *, ignore: str = "") -> str:
    """A prefix for a rank's command that exports RANK and LOCAL_RANK from the launcher's own variables
    (e.g. $SLURM_PROCID), and with `ignore` starts it with that signal ignored."""
    trap = f'trap "" {ignore}; ' if ignore else ""
    return f"bash -c 'export RANK={rank} LOCAL_RANK={local_rank}; {trap}exec \"$@\"' rank "


def ignoring(signal: str) -> str:
    """A prefix for a rank's command that starts it with `signal` ignored (a handler it installs replaces that)."""
    return f"bash -c 'trap \"\" {signal}; exec \"$@\"' rank "


def bind_paths(spec: JobSpec) -> list[str]:
    """Directories a container must see: the project, the run directory, and the user's --bind paths.

    A path inside one already bound is left out; the user's own `SRC:DST` binds are kept as given.
    """
    binds: list[str] = []
    for path in (spec.workdir, spec.run_dir, *spec.binds):
        source = path.split(":", 1)[0]
        if ":" not in path and any(source == b or source.startswith(b.rstrip("/") + "/") for b in binds if ":" not in b):
            continue
        if path not in binds:
            binds.append(path)
    return binds


def quote(words: list[str]) -> str:
    return " ".join(shlex.quote(word) for word in words)
