"""Checks ``engine-gateway serve`` makes before it starts the engine (~30 s on a CPU).

Rule: each check raises ``UsageError`` naming the flag and the problem, in one
line; the CLI prints it and exits with status 2. Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import socket
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "UsageError",
    "check_bind_address",
    "check_address_free",
    "ipc_path_in_use",
    "check_curve_files",
    "check_control_keys",
    "check_model",
    "bounded",
]

# AF_UNIX socket paths are at most 107 bytes on Linux (108 with the NUL).
_MAX_IPC_PATH = 107
# A Hugging Face repo id ("gpt2", "org/name"): anything else that is not on disk is a typo.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class UsageError(Exception):
    """A bad command line: ``flag`` (or None for the model) and what is wrong with it."""

    def __init__(self, flag: str | None, message: str):
        super().__init__(f"{flag}: {message}" if flag else message)
        self.flag = flag
        self.message = message


def bounded(
    kind: type[int] | type[float], low: float, high: float | None = None
) -> Callable[[str], float]:
    """An argparse ``type=`` for a number in [low, high]; argparse names the flag."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if value != value or value < low or (high is not None and value > high):  # nan too
            span = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid <name> value" wording
    return parse


def check_bind_address(address: str) -> None:
    """A ``--bind`` value the gateway can bind: tcp://HOST:PORT or ipc://PATH."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc"):
        raise UsageError("--bind", f"{address!r}: expected tcp://HOST:PORT or ipc://PATH")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host:
            raise UsageError("--bind", f"{address!r}: expected tcp://HOST:PORT")
        if port != "*" and not (port.isdigit() and 0 <= int(port) <= 65535):
            raise UsageError("--bind", f"{address!r}: port must be 0-65535 or *")
        return
    path = Path(rest)
    if not rest:
        raise UsageError("--bind", f"{address!r}: expected ipc://PATH")
    if len(os.fsencode(path)) > _MAX_IPC_PATH:
        raise UsageError(
            "--bind", f"{address!r}: ipc path longer than {_MAX_IPC_PATH} bytes (AF_UNIX limit)"
        )
    folder = path.parent
    if not folder.is_dir():
        raise UsageError("--bind", f"{address!r}: folder {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError("--bind", f"{address!r}: folder {str(folder)!r} is not writable")


def ipc_path_in_use(path: str) -> bool:
    """Whether a live process listens on this AF_UNIX path.

    ZeroMQ binds an ipc:// path over an existing socket file, silently taking
    the address from the process serving there; a stale file (nobody
    listening) is fine to bind over.
    """
    try:
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            return False
    except OSError:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def check_address_free(address: str) -> None:
    """Nobody serves on this (syntactically valid) address now; port 0 or * is always free."""
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        if os.path.exists(rest) and not stat.S_ISSOCK(os.stat(rest).st_mode):
            raise UsageError("--bind", f"{address}: {rest!r} exists and is not a socket")
        if ipc_path_in_use(rest):
            raise UsageError(
                "--bind", f"{address}: address already in use (a process serves there)"
            )
        return
    host, _, port = rest.rpartition(":")
    if port in ("*", "0"):
        return
    host = host.strip("[]")
    host = "0.0.0.0" if host == "*" else host
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError("--bind", f"{address}: unknown host ({exc.strerror})") from None
    family, _, _, _, sockaddr = infos[0]
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
    try:
        probe.bind(sockaddr)
    except OSError as exc:
        reason = "address already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise UsageError("--bind", f"{address}: {reason}") from None
    finally:
        probe.close()


def check_model(model: str) -> None:
    """A model that is a local folder with a config.json, or a Hugging Face repo id."""
    path = Path(model).expanduser()
    if path.exists():
        if path.is_dir() and not (path / "config.json").is_file():
            raise UsageError(None, f"model folder {model!r} has no config.json")
        return
    looks_like_path = model.startswith(("/", ".", "~")) or model.count("/") > 1
    if looks_like_path or not _REPO_ID.match(model):
        raise UsageError(None, f"model {model!r}: no such folder, and not a Hugging Face repo id")


def check_curve_files(secret_file: Path | None, allow_dir: Path | None) -> None:
    """CURVE flags: both or neither; a readable secret certificate; allowed public keys."""
    if secret_file is None and allow_dir is None:
        return
    if secret_file is None or allow_dir is None:
        raise UsageError(
            "--curve-secret-key" if secret_file is None else "--curve-allow-dir",
            "--curve-secret-key and --curve-allow-dir go together",
        )
    import zmq.auth

    flag = "--curve-secret-key"
    if not secret_file.is_file():
        raise UsageError(flag, f"{str(secret_file)!r}: no such file")
    try:
        _, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise UsageError(
            flag, f"{str(secret_file)!r}: not a readable certificate ({exc})"
        ) from None
    if secret is None:
        raise UsageError(
            flag, f"{str(secret_file)!r} holds no secret key (give the .key_secret file)"
        )
    flag = "--curve-allow-dir"
    if not allow_dir.is_dir():
        raise UsageError(flag, f"{str(allow_dir)!r}: no such folder")
    keys = sorted(allow_dir.glob("*.key"))
    if not keys:
        raise UsageError(flag, f"{str(allow_dir)!r} holds no client public keys (*.key)")
    for key in keys:
        try:
            zmq.auth.load_certificate(key)
        except (OSError, ValueError) as exc:
            raise UsageError(flag, f"{str(key)!r}: not a readable certificate ({exc})") from None


def check_control_keys(files: list[Path], curve_on: bool) -> None:
    """``--control-key`` files: readable public keys, and CURVE on (it names the clients)."""
    if not files:
        return
    if not curve_on:
        raise UsageError(
            "--control-key",
            "needs --curve-secret-key and --curve-allow-dir (CURVE identifies the clients);"
            " without CURVE use --control-open on a trusted address",
        )
    import zmq.auth

    for file in files:
        try:
            zmq.auth.load_certificate(file)
        except (OSError, ValueError) as exc:
            raise UsageError(
                "--control-key", f"{str(file)!r}: not a readable key ({exc})"
            ) from None


def gateway_bind_addresses(binds: list[str], count: int) -> list[list[str]]:
    """The addresses of each of ``count`` gateways (``--gateway-count``) from ``--bind``.

    One gateway binds ``binds`` as given. With several, gateway i binds every address
    shifted by i: tcp://HOST:PORT becomes tcp://HOST:PORT+i (port 0 or * stays
    ephemeral), ipc://DIR/NAME.EXT becomes ipc://DIR/NAME-i.EXT.
    """
    if count == 1:
        return [list(binds)]
    result = []
    for index in range(count):
        mine = []
        for address in binds:
            scheme, _, rest = address.partition("://")
            if scheme == "tcp":
                host, _, port = rest.rpartition(":")
                if port.isdigit() and int(port) != 0:
                    if int(port) + index > 65535:
                        raise UsageError(
                            "--gateway-count", f"{address!r}: port {int(port) + index} > 65535"
                        )
                    port = str(int(port) + index)
                mine.append(f"tcp://{host}:{port}")
            else:
                path = Path(rest)
                mine.append(f"ipc://{path.with_name(f'{path.stem}-{index}{path.suffix}')}")
        result.append(mine)
    return result
