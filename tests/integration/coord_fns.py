"""A job module for the coordinator tests: the functions worker servers run by name."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from zmqps.coordinator import FunctionContext


def add(ctx: FunctionContext, a: Any, b: Any) -> Any:
    return a + b


def echo(ctx: FunctionContext, *args: Any, **kwargs: Any) -> Any:
    return {"args": args, "kwargs": kwargs, "worker": ctx.index}


def count(ctx: FunctionContext) -> int:
    ctx.state["n"] = ctx.state.get("n", 0) + 1
    return int(ctx.state["n"])


def boom(ctx: FunctionContext, message: str) -> None:
    raise ValueError(message)


def slow(ctx: FunctionContext, seconds: float, tag: int) -> tuple[int, int]:
    time.sleep(seconds)
    ctx.state.setdefault("tags", []).append(tag)
    return ctx.index, tag


def counter_dataset(ctx: FunctionContext, start: int) -> Iterator[int]:
    n = start
    while True:
        yield n
        n += 1


def take(ctx: FunctionContext, iterator: Iterator[int]) -> int:
    return next(iterator)


def opaque(ctx: FunctionContext) -> object:
    return object()  # cannot cross the wire


_private = add
