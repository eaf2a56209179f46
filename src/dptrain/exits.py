"""How a dptrain program ends: known failures as one line and an exit code, then an exit without finalization.

Both the `dptrain` command and a user's own script go through here:

    def main():
        ...
        trainer.fit(...)

    if __name__ == "__main__":
        dptrain.run(main)

`run` calls `main`, turns the failures a user can cause or meet into one line and a code
(bad input 2, a peer that died or froze 1, a stop to be continued 75; bugs keep their
traceback), and leaves through `exit_process`, which avoids an abort at exit that torch's gloo
threads otherwise cause now and then (see dptrain.runtime.distributed.exit_process).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Callable, NoReturn

from dptrain.errors import (REPORTED_LAST, Interrupted, Preempted, StoppedStarting, UserError, debugging,
                            report_user_error)

_FINALIZE = True  # whether `run` lets a process that joined no process group finalize the interpreter


def skip_finalization() -> None:
    """Have `run` end this process without interpreter finalization although it joined no process group.

    For dptrain's own launcher: once its workers have ended it has nothing left to do, and
    tearing down torch's modules (imported to validate the run) would take half a second more
    (atexit handlers still run and the standard streams are flushed).
    """
    global _FINALIZE
    _FINALIZE = False


def report_errors(main: Callable[[], Any]) -> int:
    """main()'s exit code (an int it returns, else 0), or the code of the known failure it raised, said in one line."""
    try:
        result = main()
        return result if isinstance(result, int) and not isinstance(result, bool) else 0
    except UserError as exc:
        return report_user_error(exc)
    except (Preempted, StoppedStarting) as exc:
        print(f"dptrain: {exc}", file=sys.stderr)
        return exc.exit_code
    except Interrupted as exc:
        if str(exc):
            print(f"dptrain: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # outside training (starting up): rank 0 says so, unless our launcher does
        from dptrain.runtime.env import launcher_reports_interrupts
        if not launcher_reports_interrupts() and os.environ.get("RANK", "0") == "0":
            print("dptrain: interrupted", file=sys.stderr)
        return Interrupted.exit_code
    except Exception as exc:  # noqa: BLE001 - peer failures get one line; bugs keep their traceback
        from dptrain.runtime.distributed import PeerFailure
        from dptrain.runtime.group import PeerReported
        if isinstance(exc, PeerReported) and not debugging():  # the peer's own line said why
            # Leave after that peer (it waits for this rank to read its error, then exits): a launcher that
            # names the first rank to fail names the one whose line says why.
            time.sleep(REPORTED_LAST)
            return exc.code
        if isinstance(exc, PeerFailure) and not debugging():
            print(f"dptrain: error: {exc}", file=sys.stderr)
            return 1
        raise


def run(main: Callable[..., Any], *args: Any, **kwargs: Any) -> NoReturn:
    """Run `main(*args, **kwargs)` as a program and exit with its code (see the module's docstring)."""
    try:
        code = report_errors(lambda: main(*args, **kwargs))
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - a bug: show it, then exit as Python would
        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    # A process that never imported the distributed runtime joined no process group: it exits
    # plainly, without importing torch just to leave (which would double `dptrain --help`'s time).
    distributed = sys.modules.get("dptrain.runtime.distributed")
    if distributed is None:
        sys.exit(code or 0)
    distributed.exit_process(code or 0, finalize=None if _FINALIZE else False)
