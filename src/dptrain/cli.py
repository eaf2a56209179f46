"""The `dptrain` command: train, demo, info, and the commands of COMMAND_MODULES (run, launch, bench, plot ...).

Errors the user can cause print one line `dptrain: error: ...` and exit with code 2; with
`--debug` the traceback is shown as well.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import Optional, Sequence

from dptrain import __version__
from dptrain.arguments import Parser, add_config_flags, config_from_args
from dptrain.exits import report_errors, run as run_program
from dptrain.io import private_files
from dptrain.train.preemption import STOP_SIGNALS, catch_stop_signals_early

# Commands that live in their own module: name -> (module with add_arguments(parser) and
# main(args) -> exit code, one-line help). A command that runs another program also has
# split_argv(words) -> (its own words, the program's words): the program's words are passed on
# untouched, as args.passthrough.
COMMAND_MODULES: dict[str, tuple[str, str]] = {
    "run": ("dptrain.run_command", "run your own training script as N ranks on this machine (like torchrun)"),
    "join": ("dptrain.join_command", "add a worker to a run training on this machine (--min-workers): it heals from a live one"),
    "serve-store": ("dptrain.store_service", "serve a job's rendezvous store so that any rank may be lost (job scripts start it with --min-workers)"),
    "launch": ("dptrain.launch.commands", "write a job script for SLURM, PBS or this machine (or a Kubernetes manifest), and optionally submit it"),
    "container": ("dptrain.launch.container_commands", "prepare a rootless container (udocker, Apptainer, Podman, Charliecloud...) for launch"),
    "bench": ("dptrain.bench.commands", "benchmark strategies x workers (optionally on an emulated slow network) against plain PyTorch"),
    "simulate": ("dptrain.bench.simulate", "project epoch time and scaling to 1024 workers from a measured bench"),
    "plot": ("dptrain.plot", "draw loss and accuracy against epoch and time for runs, overlaid (optionally TensorBoard)"),
}


DESCRIPTION = "Data-parallel PyTorch training from a laptop to an HPC cluster."
WHICH_COMMAND = """which to use:
  train    a model from the zoo (or package.module:factory) on a built-in data set or your --data,
           with a strategy: dptrain trains and records the run (workers on this machine, or under
           torchrun, srun or mpirun)
  run      your own training script, unchanged (it calls torch.distributed or dptrain.Trainer),
           as N ranks on this machine
  launch   either of them on a cluster: writes a SLURM or PBS job script (--submit submits it)
  Python   import dptrain in your script: Trainer(model, optimizer, loss, strategy).fit(train, test)
           trains your model with a strategy (start the script with `dptrain run`);
           train_from_config({...}) does what `dptrain train` does
  demo     a first look: digits under two strategies, compared; info: what this machine detects"""


def build_parser(only: Optional[str] = None) -> argparse.ArgumentParser:
    """The whole command line; with `only`, the commands of COMMAND_MODULES other than that one get
    no arguments (their modules are not imported: a worker parsing `train` needs none of them)."""
    parser = Parser(prog="dptrain", description=DESCRIPTION, epilog=WHICH_COMMAND,
                    formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"dptrain {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    train = commands.add_parser("train", help="train a model data-parallel", allow_abbrev=False,
                                description="Train a model: spawns --workers processes on this machine, or joins "
                                            "the job when started by torchrun, srun or mpirun.")
    add_config_flags(train)

    demo = commands.add_parser("demo", help="train digits under allreduce and sync and compare them", allow_abbrev=False,
                               description="Train the built-in digits data set twice on this machine, under "
                                           "allreduce (gradients averaged every step) and sync (weights averaged "
                                           "every epoch), and print their accuracy, time and bytes sent side by "
                                           "side. Both runs are kept in --out.")
    demo.add_argument("--workers", type=int, default=2, help="workers per run (default: 2)")
    demo.add_argument("--epochs", type=int, default=10, help="epochs per run (default: 10)")
    demo.add_argument("--out", default=None, help="directory for the two runs (default: runs/demo-TIMESTAMP)")

    info = commands.add_parser("info", help="print what the runtime detects: launcher, ranks, devices, versions",
                               allow_abbrev=False,
                               description="Print what dptrain detects here: the launcher or scheduler (torchrun, "
                                           "SLURM, PBS, mpirun or none), this process's rank and world size, the "
                                           "devices and the versions of Python, PyTorch and dptrain. The first thing "
                                           "to run when a job misbehaves; it starts no worker. With RUN_DIR, also "
                                           "that run's state: running or not, epochs recorded, its live workers and "
                                           "each change of them.")
    info.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="a run directory (--out) to report on too")
    for name, (module, help_text) in COMMAND_MODULES.items():
        command = commands.add_parser(name, help=help_text, allow_abbrev=False)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(command)
    return parser


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], Optional[list[str]]]:
    """(the words dptrain parses, the words its command passes on untouched, or None when it passes none on)."""
    at = next((i for i, word in enumerate(argv) if not word.startswith("-")), None)
    if at is None or argv[at] not in COMMAND_MODULES:
        return list(argv), None
    split = getattr(importlib.import_module(COMMAND_MODULES[argv[at]][0]), "split_argv", None)
    if split is None:
        return list(argv), None
    ours, theirs = split(argv[at + 1:])
    return [*argv[:at + 1], *ours], theirs


def parse_args(argv: Sequence[str], passthrough: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse a whole command line; an unknown option is one line naming it (with a did-you-mean).

    `passthrough`: the words split off argv already (split_passthrough); else they are split here.
    """
    if passthrough is None:
        argv, passthrough = split_passthrough(argv)
    # The top level has no option that takes a value, so the first word that is not an option is the command.
    parser = build_parser(only=next((arg for arg in argv if not arg.startswith("-")), None))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse reports a subcommand's unknown options at the top level; search the subcommand's flags.
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (subparsers.choices.get(args.command) or parser).reject_unknown(unknown)
    if passthrough is not None:
        args.passthrough = passthrough
    return args


def dispatch(argv: Sequence[str], passthrough: Optional[list[str]] = None) -> int:
    args = parse_args(argv, passthrough)
    if args.command == "train":
        return _train(config_from_args(args))
    if args.command == "demo":
        from dptrain.demo import demo
        return demo(workers=args.workers, epochs=args.epochs, out=args.out)
    if args.command == "info":
        from dptrain.info import info
        return info(args.run_dir)
    if args.command in COMMAND_MODULES:
        return importlib.import_module(COMMAND_MODULES[args.command][0]).main(args)
    build_parser().print_help()
    return 2


def _train(config) -> int:
    """`dptrain train`: local workers are started before this process imports torch and validates the
    run, so that their start-up (mostly importing torch) overlaps its own (dptrain.runtime.prestart)."""
    from dptrain.runtime.env import detect

    prestarted = None
    if config.workers > 1 and config.nnodes == 1 and not detect().launched:
        from dptrain.exits import skip_finalization
        from dptrain.runtime.prestart import prestart
        prestarted = prestart(config.workers, serve_store=config.min_workers is not None)
        skip_finalization()  # this launcher ends when its workers have: nothing needs tearing down
    try:
        from dptrain.train.command import train
        return train(config, prestarted)
    finally:
        if prestarted is not None:
            prestarted.close()


def wait_for_launcher() -> None:
    """In a pre-started worker (dptrain.runtime.prestart): import what a rank needs, then take sys.argv
    from the launcher's line; exit at once, saying nothing, when there is none (the launcher refused
    the input, was interrupted or died).

    The launcher started this process with SIGINT and the stop signals (TERM, USR1, USR2) blocked, so that none of
    them ends it while the interpreter itself starts: now a stop signal that came meanwhile is
    remembered, to be honoured at the first epoch end, and Ctrl-C (which reaches the whole
    process group) is left to the launcher until the release: it reports it and stops this process.
    """
    from dptrain.runtime.prestart import receive

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    catch_stop_signals_early()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, *STOP_SIGNALS})
    try:  # what every `dptrain train` rank imports anyway; a failure happens again where it would
        import dptrain.train.command  # noqa: F401 - torch, torch.distributed, the trainer
        import torch._dynamo  # noqa: F401 - torch.optim imports it when the first optimizer is made (~1 s)
    except Exception:  # noqa: BLE001
        pass
    argv = receive()
    if argv is None:
        os._exit(0)
    signal.signal(signal.SIGINT, previous)
    sys.argv[1:] = argv


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv, passthrough = split_passthrough(list(sys.argv[1:] if argv is None else argv))
    # --debug may stand anywhere among dptrain's words (not a script's under `dptrain run`, nor in a
    # command that `dptrain launch` runs, after '--') and reaches spawned workers through the environment.
    end = len(argv)
    if "--" in argv:
        cut = argv.index("--")
        end = cut if argv[cut + 1:cut + 2] and not argv[cut + 1].startswith("-") else end
    if "--debug" in argv[:end]:
        os.environ["DPTRAIN_DEBUG"] = "1"
    argv = [arg for arg in argv[:end] if arg != "--debug"] + argv[end:]
    return report_errors(lambda: (private_files(), dispatch(argv, passthrough))[1])


def entry() -> None:
    """The `dptrain` program (console script and `python -m dptrain`): main(), then a safe exit."""
    if sys.argv[1:2] == ["train"]:
        catch_stop_signals_early()
    run_program(main)


if __name__ == "__main__":
    entry()
