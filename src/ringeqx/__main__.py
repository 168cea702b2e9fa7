"""`python -m ringeqx`: the same command line as the `ringeqx` script."""

import sys

from ._cli import main


sys.exit(main())
