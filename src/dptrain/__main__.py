"""`python -m dptrain` (and `torchrun -m dptrain`): the same as the `dptrain` command."""

import sys

from dptrain.cli import main

sys.exit(main())
