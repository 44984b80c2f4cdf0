"""Client: a blocking wrapper over AsyncClient for scripts and notebooks.

It runs its own event loop on a daemon thread; every call is submitted to
that loop and waits at most ``timeout_s`` (then TimeoutError, and the call is
cancelled there: a request is aborted). Breaking out of a ``generate`` loop,
or Ctrl-C while it waits, aborts the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from codec import (
    AbortAck,
    HealthReply,
    ModelInfoReply,
    MultimodalItem,
    PrefixReply,
    RequestOptions,
    RequestOutput,
    SamplingParams,
)

from .aio import AsyncClient
from .results import Completion

__all__ = ["Client"]


_CLIENT_TIMEOUT = object()  # Client._run's default: the client's own timeout_s


class Client:
    """Blocking client; use as ``with Client(address) as client``.

    ``timeout_s`` bounds every call (None: wait for ever); other keyword
    arguments go to AsyncClient.
    """

    def __init__(self, address: str, *, timeout_s: float | None = 300.0, **kwargs: Any):
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="gateway-client-loop"
        )
        self._thread.start()
        # Connecting waits as long as a call would, and says why it failed (AsyncClient).
        kwargs.setdefault("connect_timeout_s", 60.0 if timeout_s is None else min(60.0, timeout_s))
        self._async = AsyncClient(address, **kwargs)
        try:
            self._run(self._async.connect(), timeout_s=None)
        except BaseException:
            self._stop_loop()
            raise

    def _run(self, coro: Any, timeout_s: Any = _CLIENT_TIMEOUT) -> Any:
        """``coro`` on the client's loop, waited for ``timeout_s`` (default: the client's;
        None: as long as it takes)."""
        wait = self.timeout_s if timeout_s is _CLIENT_TIMEOUT else timeout_s
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(wait)
        except concurrent.futures.TimeoutError:  # (TimeoutError itself on Python 3.11+)
            if future.done():
                raise  # the call's own TimeoutError
            future.cancel()
            raise TimeoutError(f"no answer within {self.timeout_s}s") from None
        except BaseException:  # Ctrl-C: cancel the call on the loop (aborts a request)
            future.cancel()
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def hello_ack(self):  # noqa: ANN201 - HelloAck
        return self._async.hello_ack

    def generate(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        stream: bool = True,
        request_id: str | None = None,
        options: RequestOptions | None = None,
        multimodal: Sequence[MultimodalItem] | None = None,
    ) -> Iterator[RequestOutput]:
        """Like AsyncClient.generate, as a plain iterator."""
        requests = self._async.generate(
            prompt_token_ids,
            sampling,
            stream=stream,
            request_id=request_id,
            options=options,
            multimodal=multimodal,
        )
        try:
            while True:
                try:
                    yield self._run(requests.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            if self._loop.is_running():  # else the client is closed: nothing is live
                asyncio.run_coroutine_threadsafe(requests.aclose(), self._loop).result(5)

    def complete(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None, **kwargs: Any
    ) -> Completion:
        return self._run(self._async.complete(prompt_token_ids, sampling, **kwargs))

    def complete_samples(
        self, prompt_token_ids: Sequence[int], sampling: SamplingParams | None = None, **kwargs: Any
    ) -> list[Completion]:
        return self._run(self._async.complete_samples(prompt_token_ids, sampling, **kwargs))

    def abort(self, request_ids: Sequence[str] | None = None) -> AbortAck:
        return self._run(self._async.abort(request_ids))

    def ping(self) -> float:
        return self._run(self._async.ping())

    def model_info(self) -> ModelInfoReply:
        return self._run(self._async.model_info())

    def pause(self, mode: str = "keep", *, clear_cache: bool = False):  # noqa: ANN201
        """Pause the engine (control operation; see AsyncClient.pause)."""
        return self._run(self._async.pause(mode, clear_cache=clear_cache))

    def resume(self):  # noqa: ANN201 - ControlDone
        return self._run(self._async.resume())

    def reset_prefix_cache(self, *, reset_running: bool = False) -> bool:
        return self._run(self._async.reset_prefix_cache(reset_running=reset_running))

    def reload_weights(self, path: str, *, version: str | None = None):  # noqa: ANN201
        return self._run(self._async.reload_weights(path, version=version))

    def set_weight_version(self, version: str):  # noqa: ANN201 - ControlDone
        return self._run(self._async.set_weight_version(version))

    def sleep(self, level: int = 1):  # noqa: ANN201 - ControlDone
        return self._run(self._async.sleep(level))

    def wake_up(self, tags: list[str] | None = None):  # noqa: ANN201 - ControlDone
        return self._run(self._async.wake_up(tags))

    def load_lora(self, name: str, path: str):  # noqa: ANN201 - ControlDone
        return self._run(self._async.load_lora(name, path))

    def unload_lora(self, name: str):  # noqa: ANN201 - ControlDone
        return self._run(self._async.unload_lora(name))

    def init_weight_transfer_engine(self, init_info: dict):  # noqa: ANN201 - ControlDone
        return self._run(self._async.init_weight_transfer_engine(init_info))

    def start_weight_update(self, pause: str | None = None):  # noqa: ANN201 - ControlDone
        return self._run(self._async.start_weight_update(pause))

    def abandon_weight_update(self):  # noqa: ANN201 - ControlDone
        return self._run(self._async.abandon_weight_update())

    def update_weights(self, update_info: dict | list[dict]):  # noqa: ANN201 - ControlDone
        return self._run(self._async.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None):  # noqa: ANN201
        return self._run(self._async.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self):  # noqa: ANN201 - ControlDone
        return self._run(self._async.shutdown_weight_transfer_engine())

    def list_loras(self) -> list[str]:
        return self._run(self._async.list_loras())

    def stats(self):  # noqa: ANN201 - StatsReply
        return self._run(self._async.stats())

    @property
    def connected(self) -> bool:
        """Whether a session with the gateway is open now."""
        return self._async.connected

    def health(self) -> HealthReply:
        return self._run(self._async.health())

    def prefix_query(
        self, prompt_token_ids: Sequence[int], options: RequestOptions | None = None
    ) -> PrefixReply:
        """See ``AsyncClient.prefix_query``."""
        return self._run(self._async.prefix_query(prompt_token_ids, options))

    def close(self) -> None:
        if self._loop.is_running():
            try:
                self._run(self._async.aclose())
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
