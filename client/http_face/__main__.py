"""``python -m client.http_face``: the same as ``engine-gateway http``."""

import sys

from .cli import http_main

sys.exit(http_main(sys.argv[1:]))
