"""`dptrain launch`: write a job script for SLURM, PBS or this machine, and optionally submit and follow it.

    dptrain launch --scheduler slurm --nodes 2 --tasks-per-node 4 --gpus-per-node 4 \\
        [--container udocker:NAME | apptainer:IMAGE.sif] [--submit [--wait] | --dry-run] -- <train arguments>

The train arguments are validated here, before anything is written or submitted.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from dptrain import registry
from dptrain.arguments import train_config
from dptrain.errors import UserError
from dptrain.launch.spec import ContainerSpec, JobSpec, container_forms
from dptrain.launch.submit import follow


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Write a job script that runs 'dptrain train' on every rank (one container per rank with "
                          "--container) into the run directory, and submit it with --submit. Put the train "
                          "arguments after '--'.")
    parser.add_argument("--scheduler", choices=registry.names("scheduler"), required=True,
                        help=registry.help_text("scheduler"))
    parser.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
    parser.add_argument("--tasks-per-node", type=int, default=1, help="ranks per node, usually one per GPU (default: 1)")
    parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs to request per node (default: 0)")
    parser.add_argument("--cpus-per-task", type=int, default=1, help="CPU cores per rank; sets OMP_NUM_THREADS (default: 1)")
    parser.add_argument("--time", help="wall-time limit HH:MM:SS or D-HH:MM:SS (default: the queue's)")
    parser.add_argument("--partition", help="SLURM partition or PBS queue")
    parser.add_argument("--account", help="account to charge")
    parser.add_argument("--job-name", default="dptrain", help="job name (default: dptrain)")
    parser.add_argument("--container", metavar="RUNTIME:IMAGE", help=container_forms())
    parser.add_argument("--bind", action="append", default=[], metavar="PATH[:DEST]",
                        help="extra path to bind into the container (repeatable); the project and run "
                             "directories and --data are bound anyway")
    parser.add_argument("--dptrain", default="dptrain", metavar="COMMAND",
                        help="how a rank runs dptrain (default: dptrain from the PATH; e.g. '/opt/venv/bin/python -m dptrain')")
    parser.add_argument("--stop-before", type=int, default=300, metavar="SECONDS",
                        help="SLURM: signal the ranks this long before --time runs out; they save a checkpoint "
                             "after the current epoch and the job requeues itself to resume (0: no signal; "
                             "default: 300)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--submit", action="store_true", help="submit the script (sbatch, qsub; local: run it now)")
    what.add_argument("--dry-run", action="store_true", help="print the script, write and submit nothing")
    parser.add_argument("--wait", action="store_true", help="with --submit: follow the job to its end and exit with its code")
    parser.add_argument("--wait-timeout", type=float, default=None, metavar="SECONDS",
                        help="with --wait: give up following after this many seconds (default: no limit)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="arguments of 'dptrain train', after '--'")


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


def build_spec(args: argparse.Namespace, workdir: Path) -> JobSpec:
    train_args = list(args.train_args)
    if train_args[:1] == ["--"]:
        train_args = train_args[1:]
    config = train_config(train_args)
    from dptrain.train.rundir import default_run_dir

    run_dir = (workdir / (config.out or default_run_dir(config.strategy))).resolve()
    container = ContainerSpec.parse(args.container) if args.container else None
    binds = list(args.bind)
    if container and config.data:
        binds.append(str((workdir / config.data).resolve().parent))
    return JobSpec(scheduler=args.scheduler, workdir=str(workdir), run_dir=str(run_dir),
                   train_args=tuple(without_out(train_args)), nodes=args.nodes, tasks_per_node=args.tasks_per_node,
                   gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, time=args.time,
                   partition=args.partition, account=args.account, job_name=args.job_name, container=container,
                   binds=tuple(binds), dptrain=args.dptrain, stop_before=args.stop_before)


def main(args: argparse.Namespace) -> int:
    if args.wait and not args.submit:
        raise UserError("--wait follows a submitted job; add --submit")
    spec = build_spec(args, Path(os.getcwd()).resolve())
    scheduler = registry.load("scheduler", spec.scheduler)
    text = scheduler.render(spec)
    if args.dry_run:
        sys.stdout.write(text)
        return 0

    from dptrain.train.rundir import claim_run_dir

    run_dir = claim_run_dir(spec.run_dir)
    script = run_dir / scheduler.SCRIPT_NAME
    script.write_text(text)
    script.chmod(0o755)
    print(f"dptrain: wrote {script}", flush=True)
    if not args.submit:
        print(f"dptrain: submit it with '{scheduler.SUBMIT_COMMAND} {script}' or run this command again with --submit")
        return 0
    job_id = scheduler.submit(script)
    output = scheduler.output_path(run_dir, job_id)
    print(f"dptrain: submitted job {job_id}; output {output}", flush=True)
    if not args.wait:
        return 0
    status = follow(scheduler, job_id, output, timeout=args.wait_timeout)
    print(f"dptrain: job {job_id} {status.state} with exit code {status.exit_code}", flush=True)
    return status.exit_code
