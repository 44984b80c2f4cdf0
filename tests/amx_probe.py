"""Does a fresh process on this machine need the plugin's AMX request? (issue 36)

    python -m tests.amx_probe [TILE_LIBRARY]

Runs one AMX tile instruction (``ldtilecfg``, ``tilezero``, ``tilerelease``, from a small C
library built with gcc, or the one given) in two fresh processes: one bare, which Linux
kills with SIGILL until the process asked for the tile state, and one after
``gateway.vllm.plugin.allow_amx_tiles`` (what the vLLM plugin runs in each engine process).
Prints what each saw; exits 0 when the bare one died of SIGILL and the other ran. Also used
by tests/gateway/test_vllm_plugin.py on machines that report AMX.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TILE_C = r"""
#include <immintrin.h>
#include <string.h>
struct tile_config { unsigned char palette, start_row, reserved[14];
                     unsigned short colsb[16]; unsigned char rows[16]; };
int run_tile(void) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1; config.rows[0] = 16; config.colsb[0] = 64;
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_release();
    return 1;
}
"""
_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1022, 18


def machine_has_amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def tile_permission() -> bool:
    """Whether Linux lets this process use AMX tile data (ARCH_GET_XCOMP_PERM)."""
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(0)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def build_tile_library(folder: Path) -> str:
    source, library = folder / "tile.c", folder / "tile.so"
    source.write_text(TILE_C)
    subprocess.run(
        ["gcc", "-O1", "-mamx-tile", "-shared", "-fPIC", str(source), "-o", str(library)],
        check=True,
    )
    return str(library)


def _child(library: str, mode: str) -> None:
    tiles = ctypes.CDLL(library)
    print("before", tile_permission(), flush=True)
    if mode == "plugin":
        from gateway.vllm.plugin import allow_amx_tiles

        print("allowed", allow_amx_tiles(), tile_permission(), flush=True)
    print("ran", tiles.run_tile(), flush=True)


def probe(library: str, mode: str) -> subprocess.CompletedProcess:
    """A fresh process running one tile instruction, bare or after the plugin's request."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", "tests.amx_probe", "--child", library, mode],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2])
        return 0
    print("amx_tile in /proc/cpuinfo:", machine_has_amx())
    library = argv[0] if argv else build_tile_library(Path(tempfile.mkdtemp(prefix="amx-")))
    bare, allowed = probe(library, "bare"), probe(library, "plugin")
    for name, run in (("bare", bare), ("plugin", allowed)):
        print(
            f"{name}: exit {run.returncode}; {run.stdout.strip()!r} {run.stderr.strip()[-300:]!r}"
        )
    ok = bare.returncode == -signal.SIGILL and allowed.returncode == 0 and "ran 1" in allowed.stdout
    print("AMX needs the request, and the plugin's request works:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
