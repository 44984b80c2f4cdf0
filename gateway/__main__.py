"""``python -m gateway serve ...``: same as the ``engine-gateway`` command. The process
ends without the interpreter's teardown (``gateway.quick_exit``)."""

from .cli import main
from .quick_exit import exit_now

if __name__ == "__main__":
    exit_now(main())
