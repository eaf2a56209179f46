"""Errors a user can cause: reported as one sentence and exit code 2, never a traceback.

Wherever one is raised: `dptrain` (the command) and `dptrain.run(main)` say it and exit 2, and so does a user's
own script that lets one go uncaught (`install_excepthook`, done on `import dptrain`). `--debug` or
DPTRAIN_DEBUG=1 shows the traceback before the line.
"""

import os
import sys
import time
import traceback

REPORTED_LAST = 0.5  # seconds a rank told of a peer's error waits before it exits (report_user_error)


class UserError(Exception):
    """Bad input from the user (config, data, model, paths).

    The message is one sentence that names the bad value and what would be valid.
    The CLI prints it and exits with code 2; programming errors stay loud tracebacks.
    """

    exit_code = 2


class UserValueError(UserError, ValueError):
    """A bad value of an argument of dptrain's Python API (a loss name, an amp setting): a UserError, and the
    ValueError that Python code catching bad values expects."""


class UserTypeError(UserError, TypeError):
    """An argument of dptrain's Python API of the wrong type (a strategy's name instead of the object): a
    UserError, and the TypeError that Python code catching wrong types expects."""


def debugging() -> bool:
    """--debug anywhere on the command line, or DPTRAIN_DEBUG=1 (which spawned workers inherit)."""
    return os.environ.get("DPTRAIN_DEBUG") == "1"


def report_user_error(error: UserError) -> int:
    """Say `error` in one line (`dptrain: error: ...`, its traceback first when debugging) and tell the peers
    of a process group this process joined, so that they end with its code and no line of their own; its
    exit code. A peer that failed the same way at once and said so first leaves the line to that peer."""
    if debugging():
        traceback.print_exception(error)
    distributed = sys.modules.get("dptrain.runtime.distributed")  # looked up, not imported: no torch here
    if distributed is not None:
        distributed.report_error(error.exit_code)
    if distributed is not None and distributed.error_said_first() is not None and not debugging():
        time.sleep(REPORTED_LAST)  # leave after that peer, so that a launcher names the rank whose line says why
        return error.exit_code
    print(f"dptrain: error: {error}", file=sys.stderr, flush=True)
    return error.exit_code


def _say_and_exit(kind, error, trace, previous=sys.__excepthook__) -> None:
    """sys.excepthook: a UserError nobody caught ends the program as under dptrain.run (one line, its exit
    code); anything else goes to the hook there was before."""
    if not isinstance(error, UserError):
        return previous(kind, error, trace)
    code = report_user_error(error)
    distributed = sys.modules.get("dptrain.runtime.distributed")
    if distributed is not None:  # a process group joined: leave without the abort gloo's threads may cause
        distributed.exit_process(code)
    sys.exit(code)  # raised in an excepthook, SystemExit sets the exit code


def install_excepthook() -> None:
    """Have a user's script that lets a UserError go uncaught end with its one line and exit code 2 instead of a
    traceback (DPTRAIN_DEBUG=1: the traceback too); every other exception reaches the hook installed before."""
    if getattr(sys.excepthook, "dptrain", False):
        return
    previous = sys.excepthook

    def hook(kind, error, trace) -> None:
        _say_and_exit(kind, error, trace, previous)

    hook.dptrain = True
    sys.excepthook = hook


class Preempted(Exception):
    """The run stopped on request (SIGTERM, SIGUSR1 or SIGUSR2) after saving a checkpoint; rerun to continue."""

    exit_code = 75  # EX_TEMPFAIL: try again later


class StoppedStarting(BaseException):
    """A stop signal (SIGTERM, SIGUSR1, SIGUSR2) reached the launcher while it validated the run and started its
    workers, before they had work: it stopped them at once (dptrain.runtime.launcher.stop_while_starting).

    A BaseException, as KeyboardInterrupt is: code that turns a failure into a user's error (`except Exception`
    around reading the data) must not take a stop for a bad input."""

    exit_code = Preempted.exit_code  # as a stop signal after the start: run the same command again

    def __init__(self, signal_name: str) -> None:
        super().__init__(f"stopped by {signal_name} while the workers were starting: stopped them before they "
                         "began training; the same command again starts the run (or continues it from its last "
                         "checkpoint)")


class Left(Preempted):
    """This rank alone was asked to stop (--min-workers): it left at an epoch end and the others go on without it."""


class GroupLost(Left):
    """A rank of this rank's replica group was lost (--shard hybrid with --min-workers): the group's shards have no
    second copy, so its other ranks leave (exit code 75, as a rank that left on request) and the other replica
    groups go on."""


class JoinedTooLate(Preempted):
    """A worker waiting to join a running job (a replacement, `dptrain join`) was not needed: the run ended first."""

    exit_code = 0


class Diverged(UserError):
    """The model's weights became NaN or infinite: the settings (learning rate, clipping) do not hold training."""


class Interrupted(Exception):
    """Ctrl-C (SIGINT) during training: the message says after which epoch and how to continue."""

    exit_code = 130  # 128 + SIGINT, as a shell reports it


def closest(name: str, candidates: "list[str] | tuple[str, ...]") -> "str | None":
    """The candidate a user most likely meant by `name`, or None.

    Tried in order: a candidate whose words begin `name` (`--lr-rate` -> `--lr`), a candidate
    spelled by the initials of `name`'s words (`learning_rate` -> `lr`), then difflib.
    """
    import difflib
    import re

    def words(text: str) -> list[str]:
        return [w for w in re.split(r"[-_.\s]+", text.lower()) if w]

    typed = words(name)
    prefixed = [c for c in candidates if words(c) and typed[:len(words(c))] == words(c) and len(typed) > len(words(c))]
    if prefixed:
        return max(prefixed, key=lambda c: len(words(c)))
    initials = "".join(w[0] for w in typed)
    for candidate in candidates:
        if len(typed) > 1 and "".join(words(candidate)) == initials:
            return candidate
    match = difflib.get_close_matches(name, list(candidates), n=1)
    return match[0] if match else None


def did_you_mean(name: str, candidates: "list[str] | tuple[str, ...]") -> str:
    """The hint phrase for a mistyped `name`: "did you mean 'lr'?", or "" when nothing is close.

    Options are shown bare, as they are typed (`did you mean --lr?`); other names are quoted.
    """
    match = closest(name, candidates)
    if match is None:
        return ""
    return f"did you mean {match}?" if match.startswith("-") else f"did you mean '{match}'?"


def unknown_name(kind: str, name: str, valid: "list[str] | tuple[str, ...]", alternative: str = "") -> UserError:
    """The one line for a `name` that is none of the `valid` names of `kind`: the did-you-mean hint, then the
    valid names (and `alternative`, what else would do). Every registry lookup says it this way."""
    hint = did_you_mean(name, valid)
    also = f", {alternative}" if alternative else ""
    return UserError(f"unknown {kind} '{name}'; {hint + ' ' if hint else ''}valid names are {', '.join(valid)}{also}")
