"""`dptrain run [--workers N] [--max-restarts R] [--timeout S] SCRIPT [ARGS...]` (or `-m MODULE [ARGS...]`).

A user's own training script as N ranks on this machine, as `torchrun --nproc-per-node N
SCRIPT` would start it, but quieter. Each rank runs `python SCRIPT ARGS` with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free
MASTER_PORT) through the one spawner (dptrain.runtime.spawn), so a plain DDP script
(`init_process_group("gloo")`) and a script using dptrain.Trainer both join that world.

Output comes back prefixed with the rank. The first rank to fail is named in one line, the
others are stopped, and its exit code is ours; ranks still running `--timeout` seconds after
another one ended well are named and stopped. With `--max-restarts R` a failed world is started
again (all ranks, on a fresh port) up to R times, with DPTRAIN_RESTART (and torchrun's
TORCHELASTIC_RESTART_COUNT) set to the restart's number, so the script can resume from its own
checkpoints; bad input (2), a stop on request (75) and Ctrl-C (130) are never restarted.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Sequence

from dptrain.errors import Interrupted, UserError
from dptrain.runtime.env import detect, free_port
from dptrain.runtime.launcher import NOT_RESTARTED, say_how_ranks_ended
from dptrain.runtime.spawn import spawn_ranks

# The ranks' DPTRAIN_LAUNCHER, which a Trainer records in summary.json (see runtime/env.py's OWN_LAUNCHERS).
LAUNCHER = "dptrain-run"
USAGE = ("dptrain run [-h] [--workers N] [--max-restarts R] [--timeout S] [--grace S] "
         "[--nnodes N --node-rank I --master HOST:PORT] (SCRIPT | -m MODULE) [ARGS ...]")
EXAMPLE = "dptrain run --workers 2 train.py --epochs 10"
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = USAGE
    parser.description = ("Run your own training script as N ranks on this machine, as torchrun --nproc-per-node N "
                          "would: each gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, so a plain "
                          "DDP script and one using dptrain.Trainer join the same world.")
    parser.epilog = ("Everything after SCRIPT (or -m MODULE) is the script's own: passed on as it is, options "
                     "included. A '--' before SCRIPT is allowed, not needed.")
    parser.add_argument("--workers", type=int, default=2, metavar="N", help="ranks to start (default: 2)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="R",
                        help="when a rank fails, start all ranks again up to R times, with DPTRAIN_RESTART=1, 2, ... "
                             "so the script can resume from its checkpoints (default: 0)")
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="once one rank has ended well, seconds the others may take before they are named as "
                             "frozen and stopped (default: 300)")
    parser.add_argument("--grace", type=float, default=None, metavar="S",
                        help="after passing a stop signal (TERM, USR1, USR2) on to the ranks, seconds they have to "
                             "exit; those still running then are named and killed (default: no limit)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="machines that run the script together without a scheduler (torchrun's --nnodes): run "
                             "the same command on each with its own --node-rank; --workers ranks on each (default: 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="I",
                        help="with --nnodes: this machine's place, 0 to N-1 (default: 0)")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="with --nnodes: where node 0 serves the rendezvous (torchrun's --rdzv-endpoint)")
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module, as python -m MODULE does")


def split_argv(words: Sequence[str]) -> tuple[list[str], list[str]]:
    """(our words, the program's words): ours end at SCRIPT, after `-m MODULE` or at `--`.

    The program's words are passed on untouched (they are never parsed as ours, even
    `--workers` or `--debug`): SCRIPT ARGS, or the ARGS after -m MODULE.
    """
    parser = argparse.ArgumentParser(add_help=True)
    add_arguments(parser)
    takes_value = {flag for action in parser._actions for flag in action.option_strings if action.nargs != 0}
    ours: list[str] = []
    at = 0
    while at < len(words):
        word = words[at]
        if word == "--":
            return ours, list(words[at + 1:])
        if word == "-m":
            return ours + list(words[at:at + 2]), list(words[at + 2:])
        if word.startswith("-m") and not word.startswith("--"):  # -mMODULE, as python takes it
            return ours + ["-m", word[2:]], list(words[at + 1:])
        if not word.startswith("-") or word == "-":
            return ours, list(words[at:])
        ours.append(word)
        if word in takes_value:
            ours += words[at + 1:at + 2]
            at += 1
        at += 1
    return ours, []


def user_command(module: str | None, words: Sequence[str]) -> tuple[list[str], str]:
    """(the command each rank runs, how our messages name it), after checking the script or module exists."""
    if module is not None:
        check_module(module)
        return [sys.executable, "-m", module, *words], f"python -m {module}"
    if not words:
        raise UserError(f"no script to run; give SCRIPT [ARGS...] or -m MODULE [ARGS...], e.g. {EXAMPLE}")
    script, args = words[0], list(words[1:])
    check_script(script)
    return [sys.executable, script, *args], f"python {shlex.quote(script)}"


def check_script(script: str) -> None:
    path = Path(script)
    if path.is_dir():
        if not (path / "__main__.py").is_file():
            raise UserError(f"script '{script}' is a directory without a __main__.py; give the script in it")
        return
    if path.exists():
        return
    hint = ""
    if Path(script + ".py").is_file():
        hint = f"; did you mean {script}.py?"
    elif MODULE_NAME.fullmatch(script) and not script.endswith(".py"):
        hint = f"; to run the module {script}, use -m {script}"
    raise UserError(f"script '{script}' does not exist{hint or '; give the path of a Python file, or -m MODULE'}")


def check_module(module: str) -> None:
    """The module's top-level package must be importable by the ranks (which start in this directory)."""
    if module.endswith(".py") or "/" in module or not MODULE_NAME.fullmatch(module):
        hint = f"; to run the file, give it without -m: {shlex.join(['dptrain', 'run', module])}" if Path(module).is_file() else ""
        raise UserError(f"-m {module} is not a module name (like package.train){hint}")
    top = module.split(".")[0]
    if top in sys.builtin_module_names or top in sys.modules:
        return
    here = os.getcwd()
    sys.path.insert(0, here)  # `python -m` looks in the current directory first
    try:
        found = importlib.util.find_spec(top) is not None  # a top-level name: nothing is imported
    finally:
        sys.path.remove(here)
    if not found:
        raise UserError(f"-m {module}: no module named '{top}' in this directory or on the Python path")


def ranks_threads() -> int | None:
    """Each rank's OMP_NUM_THREADS: the user's own setting if any, else (None) the spawner's share of the cores."""
    from dptrain.runtime.nodes import users_threads

    return users_threads()


def main(args: argparse.Namespace) -> int:
    for flag, value, least in (("--workers", args.workers, 1), ("--max-restarts", args.max_restarts, 0)):
        if value < least:
            raise UserError(f"{flag} must be at least {least} (got {value})")
    for flag, value in (("--timeout", args.timeout), ("--grace", args.grace)):
        if value is not None and not value > 0:
            raise UserError(f"{flag} must be a positive number of seconds (got {value:g})")
    command, shown = user_command(args.module, getattr(args, "passthrough", None) or [])
    outer = detect()
    if outer.launched:  # each copy would start its own world on 127.0.0.1, none of them the job's
        raise UserError(f"dptrain run starts the ranks itself, but was started as rank {outer.rank} of "
                        f"{outer.world_size} (launcher {outer.launcher}); start `{shown}` under that launcher "
                        "directly, or dptrain run outside it")
    if args.nnodes > 1 or args.node_rank or args.master:
        from dptrain.runtime.nodes import launch_node, nodes_from

        if args.nnodes == 1:
            raise UserError("--node-rank and --master apply to several machines: give --nnodes N (N above 1)")
        if args.max_restarts:
            raise UserError(f"--max-restarts is not available across machines (--nnodes {args.nnodes}): each "
                            "machine's launcher stops its ranks when one fails; start the same commands again")
        nodes = nodes_from(args.nnodes, args.node_rank, args.master)
        return launch_node(command, args.workers, nodes, timeout=args.timeout, grace=args.grace, noun="rank",
                           of=f" of `{shown}`", others="the other ranks", hand_over=False)
    return run_ranks(command, shown, args.workers, args.max_restarts, args.timeout, args.grace)


def run_ranks(command: list[str], shown: str, workers: int, max_restarts: int, timeout: float,
              grace: float | None = None) -> int:
    """Run `command` as `workers` ranks, restarting a failed world up to `max_restarts` times; the exit code."""
    ranks = f"the {workers} rank{'s' if workers > 1 else ''} of `{shown}`"
    try:
        for attempt in range(max_restarts + 1):
            restart = {"DPTRAIN_RESTART": str(attempt), "TORCHELASTIC_RESTART_COUNT": str(attempt),
                       "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
            ended = spawn_ranks(command, workers, port=free_port(), threads=ranks_threads(),
                                extra_env=restart, linger=timeout, launcher=LAUNCHER, grace=grace)
            if ended.failed_code in (Interrupted.exit_code, -signal.SIGINT):  # a rank saw the Ctrl-C first
                raise KeyboardInterrupt
            say_how_ranks_ended(ended, timeout, noun="rank", of=f" of `{shown}`", others="the other ranks", grace=grace)
            code = ended.code
            if code in NOT_RESTARTED or ended.stop_signal is not None or attempt == max_restarts:
                return code
            print(f"dptrain: restarting {ranks} (restart {attempt + 1} of {max_restarts})", file=sys.stderr,
                  flush=True)
    except KeyboardInterrupt:
        print(f"dptrain: interrupted; stopped {ranks}", file=sys.stderr, flush=True)
        return Interrupted.exit_code
    raise AssertionError("unreachable: the last attempt returns")
