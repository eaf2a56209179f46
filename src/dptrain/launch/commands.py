"""`dptrain launch`: write a job script for SLURM, PBS or this machine (or a Kubernetes manifest), and
optionally submit and follow it.

    dptrain launch --scheduler slurm --nodes 2 --tasks-per-node 4 --gpus-per-node 4 \\
        [--container RUNTIME:IMAGE] [--submit [--wait] | --dry-run] -- <train arguments>
    dptrain launch --scheduler kubernetes --nodes 2 --gpus-per-node 1 --image IMAGE [--volume CLAIM:PATH] ...
    dptrain launch --scheduler slurm --nodes 2 [--out DIR] ... -- python train.py --epochs 3

After '--', words that start with an option are `dptrain train` arguments, validated here (and --data and a
model file checked to exist) before anything is written or submitted. Otherwise they are a command that
every rank runs, with the rendezvous variables of torchrun; its program is checked to exist, not run.
"""

from __future__ import annotations

import argparse
import os
import posixpath
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional

from dptrain import registry
from dptrain.arguments import add_config_flags, train_config
from dptrain.config import TrainConfig
from dptrain.data.kinds import check_spec
from dptrain.errors import UserError
from dptrain.user_code import check_spec_file, looks_like_spec, spec_file
from dptrain.io import timestamped
from dptrain.cluster.containers import files as container_files, say_mpi_model
from dptrain.cluster.spec import ContainerSpec, JobSpec
from dptrain.cluster.submit import follow


def container_forms() -> str:
    """How --container names each registered runtime's image: `udocker:NAME or apptainer:IMAGE.sif`."""
    runtimes = registry.names("container runtime")
    return " or ".join(f"{name}:{registry.load('container runtime', name).IMAGE}" for name in runtimes)


def parse_container(text: str) -> ContainerSpec:
    """--container RUNTIME:IMAGE as a ContainerSpec, or one line naming the forms each runtime takes."""
    runtime, sep, image = text.partition(":")
    if not sep or runtime not in registry.names("container runtime") or not image:
        raise UserError(f"--container {text!r} is not RUNTIME:IMAGE; use {container_forms()}")
    return ContainerSpec(runtime, image)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Write a job script that runs 'dptrain train', or any command, on every rank (one "
                          "container per rank with --container) into the run directory, and submit it with "
                          "--submit. After '--' put the train arguments (they start with an option), or a command "
                          "such as 'python train.py --epochs 3': every rank runs it with MASTER_ADDR, MASTER_PORT, "
                          "WORLD_SIZE, RANK and LOCAL_RANK set, so init_process_group('env://') joins the job; a "
                          "job whose ranks exit with 75 is requeued (SLURM: scontrol requeue; PBS: the script is "
                          "submitted again; local: the ranks start again; Kubernetes: the pods are recreated).")
    parser.add_argument("--scheduler", choices=registry.names("scheduler"), required=True,
                        help=registry.help_text("scheduler"))
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    parser.add_argument("--tasks-per-node", type=int, default=1, help="ranks per node, usually one per GPU (default: 1)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs to request per node (default: 0)")
    parser.add_argument("--cpus-per-task", type=int, default=None,
                        help="CPU cores per rank; sets OMP_NUM_THREADS (default: none asked for; SLURM, PBS and local "
                             "jobs set OMP_NUM_THREADS as they start to the CPUs the job was given on the node "
                             "(SLURM_CPUS_ON_NODE, else nproc) divided among its ranks, at least 1, or "
                             "SLURM_CPUS_PER_TASK when set, and say it in the job's output; Kubernetes: 1)")
    parser.add_argument("--time", help="wall-time limit HH:MM:SS or D-HH:MM:SS (default: the queue's)")
    parser.add_argument("--partition", help="SLURM partition, PBS queue or Kubernetes Kueue LocalQueue")
    parser.add_argument("--account", help="account to charge")
    parser.add_argument("--job-name", default="dptrain", help="job name (default: dptrain)")
    parser.add_argument("--mem", help="SLURM and PBS: memory per node, e.g. 16G (K, M, G, T; M when none; SLURM: 0 for "
                                      "all of it)")
    parser.add_argument("--qos", help="SLURM: quality of service")
    parser.add_argument("--constraint", help="SLURM: node features, e.g. a100")
    parser.add_argument("--exclusive", action="store_true", help="SLURM and PBS: whole nodes, shared with no other job")
    parser.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                        help="SLURM: one more #SBATCH line, written as given, e.g. --sbatch-option '--mem=0' or "
                             "'-C a100' (repeatable)")
    parser.add_argument("--pbs-option", action="append", default=[], metavar="OPTION",
                        help="PBS: one more #PBS line, written as given, e.g. --pbs-option '-l software=x' (repeatable)")
    parser.add_argument("--setup", action="append", default=[], metavar="FILE|LINES",
                        help="SLURM, PBS and local: shell lines the job script runs before the ranks start, after "
                             "'set -euo pipefail' (e.g. 'module load cuda; source venv/bin/activate'), or a FILE "
                             "holding them, copied into the script (repeatable, run in the order given)")
    parser.add_argument("--python", metavar="PATH",
                        help="the absolute path of the Python that runs dptrain on every rank (default: this one, "
                             f"{sys.executable}; in a --container: dptrain in the image)")
    parser.add_argument("--container", metavar="RUNTIME:IMAGE", help=container_forms())
    parser.add_argument("--no-mpi-check", action="store_true",
                        help="with --container and a command of your own: do not refuse an image whose MPI is not the "
                             "host's (a program that uses no MPI)")
    parser.add_argument("--image", help="Kubernetes: the container image every pod runs (with dptrain, or the "
                                            "command's program, installed)")
    parser.add_argument("--volume", action="append", default=[], metavar="CLAIM:PATH",
                        help="Kubernetes: mount PersistentVolumeClaim CLAIM at PATH in every pod (repeatable); the "
                             "run directory must be on one for checkpoints to outlive a pod")
    parser.add_argument("--bind", action="append", default=[], metavar="PATH[:DEST]",
                        help="extra path to bind into the container (repeatable); the project and run "
                             "directories and --data are bound anyway")
    parser.add_argument("--dptrain", default=None, metavar="COMMAND",
                        help="how a rank runs dptrain train, the whole command (default: PYTHON -m dptrain, "
                             "PYTHON being --python; in a container or a Kubernetes pod: the image's dptrain)")
    parser.add_argument("--stop-before", "--grace", type=int, default=300, metavar="SECONDS", dest="stop_before",
                        help="SLURM and PBS (with --time): signal the ranks this long before --time runs out; they "
                             "save a checkpoint after the current epoch and the job requeues itself to resume (0: no "
                             "signal; default: 300; --grace is the same); Kubernetes: the seconds a pod has after "
                             "SIGTERM to do so; local: the seconds the ranks have after a stop signal sent to the job "
                             "before those still running are killed")
    parser.add_argument("--stop-signal", default="USR1", metavar="SIGNAL",
                        help="SLURM and PBS: the signal sent --stop-before seconds ahead: USR1, USR2 or TERM (not under "
                             "PBS, whose mpirun ends the job on TERM); dptrain train's ranks save a checkpoint and exit "
                             "with 75 on any of them (default: USR1; Kubernetes always sends TERM)")
    parser.add_argument("--max-requeues", type=int, default=10, metavar="N",
                        help="local and PBS: how many times a job whose ranks exit with 75 (stopped to be resumed) "
                             "starts again from its checkpoint (default: 10; SLURM: the site's MaxBatchRequeue; "
                             "Kubernetes: the pods are recreated)")
    parser.add_argument("--out", metavar="DIR",
                        help="run directory for the job script and its output (default: a command's "
                             "runs/command-TIMESTAMP; for dptrain train the same as its own --out)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--submit", action="store_true",
                      help="submit the script (sbatch, qsub, kubectl apply -f; local: run it now)")
    what.add_argument("--dry-run", action="store_true", help="print the script, write and submit nothing")
    parser.add_argument("--wait", action="store_true", help="with --submit: follow the job to its end and exit with its code")
    parser.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                        help="with --wait: give up following after this many seconds (default: no limit)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, metavar="-- TRAIN_ARGS | COMMAND",
                        help="after '--': arguments of 'dptrain train' (the first starts with '-'), or a command "
                             "every rank runs, e.g. python train.py --epochs 3")


# Options whose value is itself an option (--sbatch-option --mem=0), which argparse would read as a flag.
OPTION_VALUED = ("--sbatch-option", "--pbs-option")


def split_argv(words: list[str]) -> tuple[list[str], None]:
    """The words with `--sbatch-option VALUE` joined into `--sbatch-option=VALUE` before the first '--', so that
    a VALUE starting with '-' is taken as the value it is (a '--' right after is no value: the train arguments
    start there); nothing is passed on untouched. A `dptrain train` option before the '--' is one line
    saying where it goes."""
    joined: list[str] = []
    at = 0
    while at < len(words):
        if words[at] == "--":
            break
        if words[at] in OPTION_VALUED and at + 1 < len(words) and words[at + 1] != "--":
            joined.append(f"{words[at]}={words[at + 1]}")
            at += 2
            continue
        joined.append(words[at])
        at += 1
    reject_train_options(joined, list(words[at:]))
    return joined + list(words[at:]), None


def _flags(add: Callable[[argparse.ArgumentParser], None]) -> dict[str, bool]:
    """{--flag: whether it takes a value} of the options `add` puts on a parser."""
    parser = argparse.ArgumentParser(add_help=False)
    add(parser)
    return {flag: action.nargs != 0 for action in parser._actions for flag in action.option_strings}


def reject_train_options(ours: list[str], after: list[str]) -> None:
    """One line when a `dptrain train` option that launch does not have comes before the '--' (`ours`; `after`
    is the '--' and what follows): forgetting the '--' would otherwise read as an unknown option of launch.
    The line shows the command with those options moved after the '--'."""
    launch = _flags(add_arguments)
    train = _flags(add_config_flags)
    kept, moved, at, first = [], [], 0, None
    while at < len(ours):
        name = ours[at].split("=")[0]
        if name in train and name not in launch:  # --partition, --out, --grace are launch's own too
            first = first or name
            takes_value = train[name] and "=" not in ours[at] and at + 1 < len(ours)
            moved += ours[at:at + 1 + takes_value]
            at += 1 + takes_value
        else:
            kept.append(ours[at])
            at += 1
    if first is None:
        return
    rest = after[1:] if after[:1] == ["--"] else after
    raise UserError(f"{first} is an option of 'dptrain train', not of 'dptrain launch'; put the train arguments "
                    f"after '--': {shlex.join(['dptrain', 'launch', *kept, '--', *moved, *rest])}")


def without_out(train_args: list[str]) -> list[str]:
    """The train arguments less --out (the script passes the resolved run directory instead)."""
    kept, skip = [], False
    for arg in train_args:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            kept.append(arg)
    return kept


def split_words(words: list[str]) -> tuple[list[str], list[str]]:
    """(train arguments, command) of the words after '--': train arguments when the first starts with '-'
    (or there are none), else a command."""
    if words[:1] == ["--"]:
        words = words[1:]
    if words and not words[0].startswith("-"):
        return [], list(words)
    return list(words), []


PYTHON = re.compile(r"python[\d.]*")


def python_script(command: list[str]) -> Optional[str]:
    """The script of `python [OPTIONS] SCRIPT.py ...`, or None (not Python, or -m/-c)."""
    if not PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    for word in command[1:]:
        if word.startswith(("-m", "-c")) or word == "-":
            return None
        if not word.startswith("-"):
            return word if word.endswith(".py") else None
    return None


def check_command(command: list[str], workdir: Path) -> None:
    """One line when the command's program is neither on the PATH nor a file, or `python SCRIPT.py` names a
    script that is not there. Nothing is run."""
    program = command[0]
    if "/" in program:
        path = workdir / program
        if not path.is_file():
            raise UserError(f"command '{program}' does not exist (in {workdir})")
        if not os.access(path, os.X_OK):
            raise UserError(f"command '{program}' is not executable; run {shlex.join(['chmod', '+x', program])}, "
                            f"or put its interpreter first (e.g. {shlex.join(['bash', program])})")
    elif shutil.which(program) is None:
        if (workdir / program).is_file():
            raise UserError(f"command '{program}' is not on the PATH; to run the file in {workdir}, write ./{program}")
        raise UserError(f"command '{program}' is not on the PATH nor a file; the words after '--' are a command "
                        "unless the first starts with '-', and then they are dptrain train's")
    script = python_script(command)
    if script is not None and not (workdir / script).is_file():
        raise UserError(f"the command's script '{script}' does not exist (in {workdir})")


def check_files(config: TrainConfig, workdir: Path) -> None:
    """--data can be loaded (its kind says, dptrain.data.kinds) and a model factory's Python file exists:
    one line before anything is written."""
    check_spec(config.data, workdir)
    check_spec_file(config.model, "--model")


def is_file(path: Path) -> bool:
    """Whether `path` is a file; False for what cannot name one (a name too long, a NUL in it)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def read_setup(values: list[str], workdir: Path) -> tuple[tuple[str, str], ...]:
    """(where they came from, lines) of each --setup, in order: a value that names a file here is that file's
    lines, read now and written into the script (a requeued job runs what was submitted, and the nodes need
    not see the file); any other value with a space is the lines themselves."""
    blocks = []
    for text in values:
        path = (workdir / text).resolve()
        if not is_file(path):
            if not text.strip() or not any(character.isspace() for character in text.strip()):
                raise UserError(f"--setup {text!r} is not a file (in {workdir}); give a file of set-up lines, or the "
                                "lines themselves, e.g. --setup 'module load cuda'")
            blocks.append(("as given", text))
            continue
        try:
            lines = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"--setup {text!r} cannot be read as text ({error.__class__.__name__})") from None
        if not lines.strip():
            raise UserError(f"--setup {text!r} is empty; give a file of set-up lines, or leave --setup out")
        blocks.append((f"from {path}", lines))
    return tuple(blocks)


def dptrain_command(args: argparse.Namespace, container: Optional[ContainerSpec]) -> str:
    """How a rank runs dptrain: --dptrain as given, else an absolute interpreter with -m dptrain (--python, or
    this one; no PATH needed on the nodes), else in a container (or a Kubernetes pod) the image's dptrain."""
    if args.python is not None:
        if args.dptrain is not None:
            raise UserError(f"--python {args.python} and --dptrain '{args.dptrain}' both say how ranks run dptrain; "
                            "give one")
        if not os.path.isabs(args.python):
            raise UserError(f"--python {args.python!r} is not an absolute path; give the interpreter's whole path, "
                            "e.g. /opt/venv/bin/python")
    if args.dptrain is not None:
        return args.dptrain
    if args.python is None and (container is not None or args.scheduler == "kubernetes"):
        return "dptrain"
    return f"{shlex.quote(args.python or sys.executable)} -m dptrain"


def pod_files(config: Optional[TrainConfig], command: list[str]) -> list[tuple[str, str]]:
    """(flag, path as given) of each file a Kubernetes pod reads: --data (or its factory's file), --model's file,
    a command's script."""
    if config is None:
        script = python_script(command)
        return [("the command's script", script)] if script else []
    data = config.data and (spec_file(config.data) if looks_like_spec(config.data) else config.data)
    return [(flag, path) for flag, path in (("--data", data), ("--model", spec_file(config.model))) if path]


def manifest_dir(out: str, job_name: str) -> str:
    """Where a Kubernetes manifest is written on this machine: --out as given when relative (the pods take it
    from the image's working directory); for an absolute --out, a path in the pods (on a --volume, or in the
    image) that need not exist here, runs/NAME, NAME being its last part (else the job's name)."""
    if not posixpath.isabs(out):
        return out
    return posixpath.join("runs", posixpath.basename(posixpath.normpath(out)) or job_name)


def build_spec(args: argparse.Namespace, workdir: Path) -> JobSpec:
    train_args, command = split_words(list(args.train_args))
    ranks = args.nodes * args.tasks_per_node
    if not train_args and not command:  # nothing to run: a default digits job is never what was meant
        raise UserError("nothing to run after '--'; give dptrain train's arguments (e.g. -- --dataset digits "
                        "--epochs 3) or a command (e.g. -- python train.py)")
    container = parse_container(args.container) if args.container else None
    binds = list(args.bind)
    config = None
    if command:
        for flag, value in (("--dptrain", args.dptrain), ("--python", args.python)):
            if value is not None:
                raise UserError(f"{flag} '{value}' says how ranks run dptrain train, but this job runs the "
                                f"command '{command[0]}' itself; leave {flag} out")
        if container is None and args.image is None:  # inside a container the program is the image's
            check_command(command, workdir)
        out = args.out or timestamped("runs", "command")
    else:
        if args.out is not None:
            if without_out(train_args) != train_args:
                raise UserError("--out is given twice, before and after '--'; give the run directory once")
            train_args += ["--out", args.out]
        # The job's ranks are its --workers (a scheduler's launcher starts them, dptrain train spawns nothing):
        # --min-workers is checked against them, here and on the ranks, who are told so where it is given.
        world = (["--workers", str(ranks)]
                 if args.nodes >= 1 and args.tasks_per_node >= 1 and not any(
                     word == "--workers" or word.startswith("--workers=") for word in train_args) else [])
        config = train_config(train_args + world)
        if config.min_workers is not None:
            train_args += world
        if args.scheduler != "kubernetes":  # a pod sees the image and its volumes, not this machine
            check_files(config, workdir)
        from dptrain.train.rundir import default_run_dir

        out = config.out or default_run_dir(config.strategy)
        if container:
            binds += [str((workdir / path).resolve().parent) for path in (config.data, spec_file(config.model))
                      if path]
    in_pods = args.scheduler == "kubernetes"
    run_dir = (workdir / (manifest_dir(out, args.job_name) if in_pods else out)).resolve()
    setup = read_setup(args.setup, workdir)
    return JobSpec(scheduler=args.scheduler, workdir=str(workdir), run_dir=str(run_dir),
                   train_args=tuple(without_out(train_args)), command=tuple(command), nodes=args.nodes,
                   tasks_per_node=args.tasks_per_node, gpus_per_node=args.gpus_per_node,
                   cpus_per_task=args.cpus_per_task, time=args.time, partition=args.partition, account=args.account,
                   job_name=args.job_name, container=container, binds=tuple(binds),
                   dptrain=dptrain_command(args, container) if not command else "dptrain",
                   stop_before=args.stop_before, stop_signal=args.stop_signal, max_requeues=args.max_requeues,
                   image=args.image,
                   volumes=tuple(args.volume), elastic=config is not None and config.min_workers is not None,
                   replacements=ranks if config is not None and config.replace_workers else 0,
                   mem=args.mem, qos=args.qos, constraint=args.constraint, exclusive=args.exclusive,
                   sbatch_options=tuple(args.sbatch_option), pbs_options=tuple(args.pbs_option), setup=setup,
                   pod_run_dir=os.path.normpath(out) if in_pods else "",
                   pod_files=tuple(pod_files(config, command)) if in_pods else ())


def main(args: argparse.Namespace) -> int:
    if args.wait and not args.submit:
        raise UserError("--wait follows a submitted job; add --submit")
    spec = build_spec(args, Path(os.getcwd()).resolve())
    scheduler = registry.load("scheduler", spec.scheduler)
    text = scheduler.render(spec)
    # (a scheduler whose ranks do not see this machine says where it expects the files they read)
    for where in scheduler.expected_files(spec) if hasattr(scheduler, "expected_files") else ():
        print(f"dptrain: the pods expect {where}", file=sys.stderr if args.dry_run else sys.stdout)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    if not args.no_mpi_check:
        say_mpi_model(spec)
    program = scheduler.SUBMIT_COMMAND.split()[0]
    if args.submit and shutil.which(program) is None:
        raise UserError(f"{program} is not on the PATH; --submit needs it to submit the job: run this where {program} "
                        "works, or leave --submit out to only write the job script")

    from dptrain.train.rundir import claim_run_dir

    run_dir = claim_run_dir(spec.run_dir)
    script = run_dir / scheduler.SCRIPT_NAME
    if script.is_file() and script.read_text() != text:
        raise UserError(f"'{script}' already holds a different job script; give --out a new directory "
                        "(or delete that script to replace it)")
    beside = {run_dir / name: content for name, content in container_files(spec).items()}
    for path, content in beside.items():  # (checked before anything is written)
        if path.is_file() and path.read_text() != content:
            raise UserError(f"'{path}' already holds a different {spec.container.runtime} file; give --out a new "
                            "directory (or delete that file to replace it)")
    for path, content in beside.items():
        path.write_text(content)
        print(f"dptrain: wrote {path}", flush=True)
    script.write_text(text)
    script.chmod(0o755)
    print(f"dptrain: wrote {script}", flush=True)
    if spec.pod_run_dir and posixpath.isabs(spec.pod_run_dir):
        print(f"dptrain: the pods write the run into {spec.pod_run_dir} (--out); this machine keeps only the "
              f"manifest, in {run_dir}", flush=True)
    if not args.submit:
        # Last on the line and quoted for a shell: a path with a space or a quote pastes as it is.
        submit = shlex.join([*shlex.split(scheduler.SUBMIT_COMMAND), str(script)])
        print(f"dptrain: submit it by running this command again with --submit, or with: {submit}")
        return 0
    job_id = scheduler.submit(script)
    output = scheduler.output_path(run_dir, job_id)
    # (a scheduler whose jobs write no output file into the run directory says where it goes instead)
    where = scheduler.describe_output(job_id) if hasattr(scheduler, "describe_output") else output
    print(f"dptrain: submitted job {job_id}; output {where}", flush=True)
    if not args.wait:
        return 0
    status = follow(scheduler, job_id, output, timeout=args.wait_timeout)
    print(f"dptrain: job {status.requeued_as or job_id} {status.state} with exit code {status.exit_code}", flush=True)
    return status.exit_code
