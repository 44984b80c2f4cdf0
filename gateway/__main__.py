"""``python -m gateway serve ...``: same as the ``engine-gateway`` command."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
