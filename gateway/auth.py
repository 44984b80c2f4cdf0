"""Optional ZeroMQ CURVE encryption with a client-key allow-list (off by default).

Keys are files in pyzmq's certificate format (``zmq.auth.create_certificates``):
the server's secret certificate, and a directory of the public certificates of
allowed clients. A client whose key is not in the directory completes no
handshake: it is never served, and sees nothing from the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

__all__ = ["CurveConfig"]


@dataclass(frozen=True)
class CurveConfig:
    """Server secret certificate file and the directory of allowed client public keys."""

    server_secret_file: Path
    allowed_clients_dir: Path

    def apply(self, ctx: zmq.asyncio.Context, sock: zmq.Socket) -> AsyncioAuthenticator:
        """Make ``sock`` a CURVE server; returns the running ZAP authenticator to stop later."""
        public, secret = zmq.auth.load_certificate(self.server_secret_file)
        if secret is None:
            raise ValueError(f"{self.server_secret_file} holds no secret key")
        if not any(Path(self.allowed_clients_dir).glob("*.key")):
            raise ValueError(f"no client public keys (*.key) in {self.allowed_clients_dir}")
        authenticator = AsyncioAuthenticator(ctx)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(self.allowed_clients_dir))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        return authenticator
