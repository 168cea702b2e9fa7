"""`python -m ringeqx`: the same command line as the `ringeqx` script."""

import sys

from ._cli._main import main


# Guarded so that importing the module (the docs build inspects every module) runs nothing.
if __name__ == "__main__":
    sys.exit(main())
