"""What the client needs from Python 3.11+, for Python 3.10 (vLLM supports 3.10-3.13)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator

__all__ = ["timeout"]

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:

    @contextlib.asynccontextmanager
    async def timeout(delay: float | None) -> AsyncIterator[None]:
        """``asyncio.timeout`` for Python 3.10: TimeoutError once ``delay`` seconds passed."""
        task = asyncio.current_task()
        assert task is not None
        fired = False

        def expire() -> None:
            nonlocal fired
            fired = True
            task.cancel()

        handle = None if delay is None else asyncio.get_running_loop().call_later(delay, expire)
        try:
            yield
        except asyncio.CancelledError:
            if fired:
                raise TimeoutError from None
            raise
        finally:
            if handle is not None:
                handle.cancel()
