"""Running several calls as one: ``all_or_none`` ends every call when one fails."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

__all__ = ["all_or_none"]

T = TypeVar("T")


async def all_or_none(calls: Iterable[Awaitable[T]]) -> list[T]:
    """Every call's result, in order; when one raises (or the caller is cancelled), the
    others are cancelled and awaited before the error is raised, so none runs on unseen
    (a request's stream closed by its cancellation is aborted). ``asyncio.gather`` leaves
    the others running, ``asyncio.TaskGroup`` is Python 3.11+ only."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
