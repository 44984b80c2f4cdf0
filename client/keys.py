"""CURVE keys for ``AsyncClient(curve_keys=...)``, from pyzmq certificate files."""

from __future__ import annotations

from pathlib import Path

import zmq.auth

__all__ = ["load_client_keys"]


def load_client_keys(
    server_public_file: str | Path, client_secret_file: str | Path
) -> tuple[bytes, bytes, bytes]:
    """(server public, client public, client secret), as AsyncClient's ``curve_keys``."""
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    public, secret = zmq.auth.load_certificate(client_secret_file)
    if secret is None:
        raise ValueError(f"{client_secret_file} holds no secret key")
    return server_public, public, secret
