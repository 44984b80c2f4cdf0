"""The codec's public surface is pinned, and it imports with msgspec alone."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import client
import codec

EXPECTED_CODEC = {
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_FRAME_BYTES",
    "VERSION_FRAME",
    "ProtocolError",
    "encode",
    "encode_payload",
    "decode_client",
    "decode_server",
    "wire_type",
    "prompt_too_long",
    "TokenId",
    "FinishReason",
    "ErrorCode",
    "SamplingParams",
    "RequestOptions",
    "TENSOR_DTYPE_SIZES",
    "FLOATING_DTYPES",
    "Tensor",
    "MultimodalItem",
    "Hello",
    "Generate",
    "Abort",
    "AbortSamples",
    "Goodbye",
    "Ping",
    "GetModelInfo",
    "GetHealth",
    "ClientMessage",
    "ModelInfo",
    "TensorSchema",
    "EmbeddingRule",
    "ItemSchema",
    "Limits",
    "Logprobs",
    "Finished",
    "RequestTimings",
    "RequestOutput",
    "HelloAck",
    "Outputs",
    "Error",
    "AbortAck",
    "Pong",
    "Overloaded",
    "ModelInfoReply",
    "HealthReply",
    "ListLoras",
    "UnloadLora",
    "LoadLora",
    "WakeUp",
    "Sleep",
    "WeightVersionSpan",
    "SetWeightVersion",
    "ReloadWeights",
    "Pause",
    "Resume",
    "ResetPrefixCache",
    "GetStats",
    "ControlDone",
    "EngineLoad",
    "EngineStats",
    "StatsReply",
    "CONTROL_MESSAGES",
    "WEIGHT_TRANSFER_MESSAGES",
    "InitWeightTransfer",
    "StartWeightUpdate",
    "UpdateWeights",
    "FinishWeightUpdate",
    "ShutdownWeightTransfer",
    "AbandonWeightUpdate",
    "PrefixQuery",
    "PrefixReply",
    "ServerMessage",
}


def test_codec_all_is_pinned():
    assert set(codec.__all__) == EXPECTED_CODEC
    assert all(hasattr(codec, name) for name in codec.__all__)


def test_client_exports_exist():
    assert all(hasattr(client, name) for name in client.__all__)


def _import_with_blocked(modules: str, blocked: list[str]) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {blocked!r}:
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import {modules}
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in
                        ('vllm', 'torch', 'zmq', 'asyncio', 'uvloop'))
        print(loaded)
    """)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=str(__import__("pathlib").Path(codec.__file__).parent.parent),
    )


def test_codec_imports_without_zmq_asyncio_vllm_or_torch():
    result = _import_with_blocked("codec", ["zmq", "vllm", "torch", "uvloop"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_client_library_imports_without_vllm_or_torch():
    result = _import_with_blocked("client", ["vllm", "torch", "uvloop", "gateway"])
    assert result.returncode == 0, result.stderr
