"""CURVE key files: make them, and load them for ``AsyncClient(curve_keys=...)``.

Files are pyzmq's certificate format (``zmq.auth``): ``NAME.key`` holds the
public key, ``NAME.key_secret`` both keys (readable by its owner only).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import zmq.auth

__all__ = ["create_keys", "load_client_keys"]


def create_keys(
    directory: str | Path, name: str, *, allow_dir: str | Path | None = None, force: bool = False
) -> tuple[Path, Path]:
    """Make ``directory/NAME.key`` and ``NAME.key_secret`` (folders created as needed).

    ``allow_dir``: also copy the public key there (the gateway's --curve-allow-dir).
    Refuses to overwrite an existing secret unless ``force``. Returns (public, secret).
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name {name!r}: expected a plain file name")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    if not force and (public.exists() or secret.exists()):
        raise FileExistsError(
            f"{secret} or {public} exists; to replace it, pass force=True"
            " (`engine-gateway keys ... --force`)"
        )
    made_public, made_secret = zmq.auth.create_certificates(folder, name)
    os.chmod(made_secret, 0o600)
    if allow_dir is not None:
        allowed = Path(allow_dir)
        allowed.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(made_public, allowed / public.name)
    return Path(made_public), Path(made_secret)


def load_client_keys(
    server_public_file: str | Path, client_secret_file: str | Path
) -> tuple[bytes, bytes, bytes]:
    """(server public, client public, client secret), as AsyncClient's ``curve_keys``."""
    server_public, _ = zmq.auth.load_certificate(server_public_file)
    public, secret = zmq.auth.load_certificate(client_secret_file)
    if secret is None:
        raise ValueError(f"{client_secret_file} holds no secret key")
    return server_public, public, secret
