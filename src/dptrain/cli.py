"""The `dptrain` command: train, demo, info.

Errors the user can cause print one line `dptrain: error: ...` and exit with code 2; with
`--debug` the traceback is shown as well.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Optional, Sequence

import yaml

from dptrain import __version__
from dptrain.config import FIELDS, flag_of, resolve
from dptrain.errors import UserError, closest
from dptrain.program import report_errors, run as run_program
from dptrain.train.preemption import catch_stop_signals_early


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes as UserError (one line, exit 2)."""

    def error(self, message: str):
        raise UserError(f"{self.prog}: {message}")

    def reject_unknown(self, unknown: list[str]):
        """One line for the first unknown option, with the flag this command has that was meant."""
        first = next((word for word in unknown if word.startswith("-")), unknown[0])
        flags = [opt for action in self._actions for opt in action.option_strings if opt.startswith("--")]
        match = closest(first.split("=")[0], flags)
        hint = f"; did you mean {match}?" if match else f"; see '{self.prog} --help'"
        raise UserError(f"unknown option {first} for '{self.prog}'{hint}")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field; values stay strings/None so the config validates them once."""
    parser.add_argument("--config", metavar="FILE", help="YAML file with the same keys as the flags (flags win)")
    for name, field in FIELDS.items():
        default = field.default if field.default_factory is None else field.default_factory()
        help_text = f"{field.description} (default: {default})"
        if name == "model_options":
            parser.add_argument("--model-option", dest=name, action="append", metavar="KEY=VALUE", help=help_text)
        elif field.annotation is bool:
            parser.add_argument(flag_of(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        else:
            parser.add_argument(flag_of(name), dest=name, metavar=name.upper(), default=None, help=help_text)


def parse_model_options(items: Optional[list[str]]) -> Optional[dict[str, Any]]:
    if not items:
        return None
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--model-option {item!r} is not KEY=VALUE, e.g. --model-option depth=14")
        options[key] = yaml.safe_load(value)
    return options


# Commands that live in their own subpackage: name -> (module with add_arguments(parser) and
# main(args) -> exit code, one-line help).
COMMAND_MODULES: dict[str, tuple[str, str]] = {
    "launch": ("dptrain.launch.commands", "write a job script for SLURM, PBS or this machine, and optionally submit it"),
    "container": ("dptrain.launch.container_commands", "prepare a rootless container (udocker, Apptainer) for launch"),
    "bench": ("dptrain.bench.commands", "benchmark strategies x workers (optionally on an emulated slow network) against plain PyTorch"),
    "simulate": ("dptrain.bench.simulate", "project epoch time and scaling to 1024 workers from a measured bench"),
}


def config_from_args(args: argparse.Namespace):
    """The TrainConfig of parsed `dptrain train` arguments (file, then flags), validated once."""
    overrides = {name: getattr(args, name) for name in FIELDS}
    overrides["model_options"] = parse_model_options(args.model_options)
    return resolve(args.config, overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dptrain", description="Data-parallel PyTorch training from a laptop to an HPC cluster.",
                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"dptrain {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    train = commands.add_parser("train", help="train a model data-parallel", allow_abbrev=False,
                                description="Train a model: spawns --workers processes on this machine, or joins "
                                            "the job when started by torchrun, srun or mpirun.")
    add_config_flags(train)

    demo = commands.add_parser("demo", help="train digits under allreduce and sync and compare them", allow_abbrev=False)
    demo.add_argument("--workers", type=int, default=2, help="workers per run (default: 2)")
    demo.add_argument("--epochs", type=int, default=10, help="epochs per run (default: 10)")
    demo.add_argument("--out", default=None, help="directory for the two runs (default: runs/demo-TIMESTAMP)")

    commands.add_parser("info", help="print what the runtime detects: launcher, ranks, devices, versions",
                        allow_abbrev=False)
    for name, (module, help_text) in COMMAND_MODULES.items():
        importlib.import_module(module).add_arguments(commands.add_parser(name, help=help_text, allow_abbrev=False))
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a whole command line; an unknown option is one line naming it (with a did-you-mean)."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse reports a subcommand's unknown options at the top level; search the subcommand's flags.
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (subparsers.choices.get(args.command) or parser).reject_unknown(unknown)
    return args


def run(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.command == "train":
        from dptrain.train.run import train
        return train(config_from_args(args))
    if args.command == "demo":
        from dptrain.demo import demo
        return demo(workers=args.workers, epochs=args.epochs, out=args.out)
    if args.command == "info":
        from dptrain.info import info
        return info()
    if args.command in COMMAND_MODULES:
        return importlib.import_module(COMMAND_MODULES[args.command][0]).main(args)
    build_parser().print_help()
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug may stand anywhere and reaches spawned workers through the environment.
    if "--debug" in argv:
        os.environ["DPTRAIN_DEBUG"] = "1"
    argv = [arg for arg in argv if arg != "--debug"]
    return report_errors(lambda: run(argv))


def entry() -> None:
    """The `dptrain` program (console script and `python -m dptrain`): main(), then a safe exit."""
    if sys.argv[1:2] == ["train"]:
        catch_stop_signals_early()
    run_program(main)


if __name__ == "__main__":
    entry()
