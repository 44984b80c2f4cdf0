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

__all__ = ["CurveConfig", "ControlPolicy"]


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


@dataclass(frozen=True)
class ControlPolicy:
    """Who may call control operations (Pause, Resume, ResetPrefixCache, GetStats, weights,
    LoRA) and send ``kv_transfer_params`` on a Generate (the KV blocks a connector loads
    serve every client).

    Default: nobody. ``open``: every client (a trusted loopback or an ipc:// path guarded
    by file permissions). ``allowed_keys``: CURVE clients whose public key (Z85, the
    ZAP User-Id of their messages) is listed; needs CURVE on the socket.
    """

    open: bool = False
    allowed_keys: frozenset[str] = frozenset()

    @classmethod
    def from_key_files(cls, files: list[Path]) -> ControlPolicy:
        """The public keys of these certificate files (``NAME.key``)."""
        keys = set()
        for file in files:
            public, _ = zmq.auth.load_certificate(file)
            keys.add(public.decode("ascii"))
        return cls(allowed_keys=frozenset(keys))

    @property
    def needs_user_id(self) -> bool:
        """Whether the server must read each message's CURVE User-Id."""
        return bool(self.allowed_keys) and not self.open

    @property
    def allows_nobody(self) -> bool:
        """The default: no client may call control operations."""
        return not (self.open or self.allowed_keys)

    def allows(self, user_id: str | None) -> bool:
        return self.open or (user_id is not None and user_id in self.allowed_keys)
