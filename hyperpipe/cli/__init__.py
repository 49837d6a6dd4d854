"""The `hyperpipe` command (also `python -m hyperpipe`): one module per subcommand, each
with its parser and its `run`; the flags several commands share are declared once. The
commands translate library errors into one line and an exit status (0 success, 2 bad
input, 1 anything else, 130/143 on SIGINT/SIGTERM); the logic lives in the library.
"""

import os
import sys

from hyperpipe.core import stopping

if os.path.basename(sys.argv[0] if sys.argv else "") == "hyperpipe":
    stopping.install()    # the `hyperpipe` script: before the heavy imports below

from hyperpipe.cli.main import main  # noqa: E402

__all__ = ["main"]
