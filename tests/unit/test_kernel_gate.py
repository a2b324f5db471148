"""A PS loads its compiled kernels in a thread, holding only the requests that need them.

Found by an unfaulted replicated sync run on a loaded machine: the first push made
the PS import numba and load its kernels inside the event loop (1-4 s), the chief
heard nothing from any PS past its 2.5 s heartbeat timeout, took all three for dead
and restored the cluster from its checkpoint.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from zmqps.roles.ps.serve import KERNEL_OPS, KernelGate
from zmqps.roles.ps.warm import warm_kernels
from zmqps.wire import Message


def _msg(op: str, i: int) -> Message:
    return Message(op, i, b"w", {}, [])


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def __call__(self, msg: Message) -> Any:
        self.seen.append((msg.op, msg.id))
        if msg.op == "pull":  # an awaitable answer, as a replicated primary's
            return self._later(msg)
        return msg

    async def _later(self, msg: Message) -> Message:
        await asyncio.sleep(0)
        return msg


async def _answer(out: Any) -> Message:
    return await out if asyncio.iscoroutine(out) else out


def test_requests_that_need_no_kernel_are_answered_while_the_kernels_load() -> None:
    release = threading.Event()

    def warm() -> float:
        release.wait(10)
        return 0.5

    async def main() -> None:
        rec = _Recorder()
        gate = KernelGate(rec, warm)
        held = [asyncio.ensure_future(_answer(gate(_msg("push", 1))))]
        held.append(asyncio.ensure_future(_answer(gate(_msg("pull", 2)))))
        await asyncio.sleep(0.05)
        # the event loop answers at once what needs no kernel
        for i, op in enumerate(("ping", "ps_state", "status", "wait_step"), start=10):
            assert (await _answer(gate(_msg(op, i)))).id == i
        assert [op for op, _ in rec.seen] == ["ping", "ps_state", "status", "wait_step"]
        assert not any(t.done() for t in held)
        held.append(asyncio.ensure_future(_answer(gate(_msg("push_rows", 3)))))
        release.set()
        assert [m.id for m in await asyncio.gather(*held)] == [1, 2, 3]
        # held ones were handed on in the order they came, then the gate opens
        assert [i for _, i in rec.seen if i < 10] == [1, 2, 3]
        assert gate.ready
        out = gate(_msg("push", 4))
        assert isinstance(out, Message) and rec.seen[-1] == ("push", 4)

    asyncio.run(main())


def test_a_request_that_comes_as_the_held_ones_are_handed_on_waits_its_turn() -> None:
    release = threading.Event()

    async def main() -> None:
        rec = _Recorder()
        gate = KernelGate(rec, lambda: float(release.wait(10)))
        first = [asyncio.ensure_future(_answer(gate(_msg("push", i)))) for i in range(3)]
        await asyncio.sleep(0.05)
        release.set()
        while not rec.seen:  # the first held one is handed on: the others are not yet
            await asyncio.sleep(0)
        late = asyncio.ensure_future(_answer(gate(_msg("push", 9))))
        await asyncio.gather(*first, late)
        assert [i for _, i in rec.seen] == [0, 1, 2, 9]

    asyncio.run(main())


def test_a_failed_load_holds_nothing_back() -> None:
    def warm() -> float:
        raise RuntimeError("no compiler here")

    async def main() -> None:
        rec = _Recorder()
        gate = KernelGate(rec, warm)
        assert (await _answer(gate(_msg("push", 1)))).id == 1
        assert gate.ready and rec.seen == [("push", 1)]

    asyncio.run(main())


def test_the_ops_held_are_those_that_may_run_a_kernel() -> None:
    assert {"push", "push_pull", "push_rows", "pull", "pull_rows", "replicate"} <= KERNEL_OPS
    # what the chief's start and its watch wait on is never held
    assert not {"ping", "ps_state", "status", "shutdown", "wait_step", "sync_config"} & KERNEL_OPS


def test_warming_loads_every_kernel_once_per_process() -> None:
    pytest.importorskip("numba")
    first = warm_kernels()
    assert first >= 0.0
    assert warm_kernels() == first  # once: the later calls return at once


def test_a_ps_starts_loading_as_it_starts_serving_and_loads_once() -> None:
    calls: list[int] = []

    def warm() -> float:
        calls.append(1)
        return 0.0

    async def main() -> None:
        rec = _Recorder()
        gate = KernelGate(rec, warm)
        gate.start()  # serve_ps: before the first request
        gate.start()
        await asyncio.sleep(0.05)
        assert calls == [1] and not rec.seen
        assert (await _answer(gate(_msg("push", 1)))).id == 1
        assert gate.ready and calls == [1]

    asyncio.run(main())


def test_loading_never_holds_the_process_open() -> None:
    """Found by CI: a PS stopped by SIGTERM while its kernels loaded logged "stopped"
    and then lived 2 s more, as interpreter exit joins the loop's executor threads.
    The loading thread is a daemon of its own: exit does not wait for it."""
    release = threading.Event()

    async def main() -> None:
        gate = KernelGate(_Recorder(), lambda: float(release.wait(10)))
        gate.start()
        loaders = [t for t in threading.enumerate() if t.name == "zmqps-kernels"]
        assert len(loaders) == 1 and loaders[0].daemon
        release.set()
        await asyncio.wait_for(asyncio.shield(gate._loading), 5)  # type: ignore[arg-type]
        loaders[0].join(5)
        assert not loaders[0].is_alive()

    asyncio.run(main())


def test_a_loading_that_ends_after_the_loop_closed_is_dropped_quietly() -> None:
    release = threading.Event()
    done = threading.Event()

    def warm() -> float:
        release.wait(10)
        done.set()
        return 0.1

    async def main() -> KernelGate:
        gate = KernelGate(_Recorder(), warm)
        gate.start()
        return gate

    asyncio.run(main())  # the loop closes with the loading still under way
    release.set()
    assert done.wait(5)
