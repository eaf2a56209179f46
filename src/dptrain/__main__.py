"""`python -m dptrain` (and `torchrun -m dptrain`): the same as the `dptrain` command."""

import sys

if sys.argv[1:2] == ["train"]:
    # Before anything heavy is imported: a scheduler's stop signal that arrives while this rank
    # starts up is remembered and honoured at the first epoch end instead of killing it.
    from dptrain.train.preemption import catch_stop_signals_early

    catch_stop_signals_early()

from dptrain.cli import entry  # noqa: E402 - after the signal handlers, on purpose

entry()
