"""`python -m dptrain` (and `torchrun -m dptrain`): the same as the `dptrain` command."""

from dptrain.cli import entry

entry()
