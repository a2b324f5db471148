"""The chief's checkpoint at the end of a run says the run finished, even when the
schedule's checkpoint of that very step came first (async: it polls every 0.2 s and
may snap the last step as the last pushes land). Unmarked, a resume took the
finished run for one cut short: its workers' cursors past the epochs asked for,
they trained nothing (seen as a flaky cluster test)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from zmqps.roles.chief.checkpoints import ChiefCheckpoints


class FakeCheckpointer:
    def __init__(self, last_step: int, last_final: bool | None) -> None:
        self.last_step = last_step
        self.last_committed = (
            None if last_final is None else SimpleNamespace(step=last_step, final=last_final)
        )
        self.taken: list[tuple[int, dict[str, Any]]] = []

    async def wait(self) -> None:
        return None

    async def take(self, step: int, placement: Any, mode: str, gen: int, extra: Any) -> str:
        self.taken.append((step, dict(extra)))
        return f"ckpt-{step}"


def chief(step: int) -> Any:
    shard = SimpleNamespace(copies=[0])
    return SimpleNamespace(
        variables=SimpleNamespace(placement=SimpleNamespace(shards=[shard])),
        recovery=SimpleNamespace(recovering=False, gen=1),
        consistency=SimpleNamespace(name="async", global_step=step, step_offset=0),
        global_step=step,
        members=SimpleNamespace(
            workers={}, examples=0, num_workers=2, train_seconds=lambda now: 1.0
        ),
        clock=lambda: 0.0,
        cfg=SimpleNamespace(job=None, wire_dtype=None),
    )


@pytest.mark.parametrize(
    ("last_step", "last_final", "finished", "taken"),
    [
        (460, False, True, True),  # the schedule's, of the last step: taken again, final
        (460, True, True, False),  # the final one already
        (460, False, False, False),  # a shutdown, not the end: nothing changed since
        (400, False, True, True),  # steps since the last one: taken, final
        (400, False, False, True),  # steps since the last one: taken, not final
        (0, None, True, True),  # none yet
    ],
)
def test_the_end_of_a_run_is_always_in_its_last_checkpoint(
    last_step: int, last_final: bool | None, finished: bool, taken: bool
) -> None:
    ck = FakeCheckpointer(last_step, last_final)
    checkpoints = ChiefCheckpoints(ck, chief(460))  # type: ignore[arg-type]
    got = asyncio.run(checkpoints.final(finished=finished))
    if not taken:
        assert got is None and ck.taken == []
        return
    assert got == "ckpt-460"
    ((step, extra),) = ck.taken
    assert step == 460
    assert extra.get("final", False) is finished


@pytest.mark.parametrize(
    ("committed", "failed_just_before", "lost"),
    [
        (None, True, "no checkpoint of this run is committed"),  # none yet
        (400, True, "ckpt-400 (step 400) stays the latest"),  # an older one is
        (460, False, ""),  # the end is in the latest: nothing to say
    ],
)
def test_a_checkpoint_of_the_last_step_that_failed_just_before_the_end_fails_the_run(
    committed: int | None, failed_just_before: bool, lost: str
) -> None:
    """The schedule tried the last step's checkpoint just before the end and the disk
    was full: the final one then had nothing new to take (its step tried already),
    and the run failed only for its export, the checkpoint's failure unsaid (a
    ``--resume`` found no checkpoint and nothing said why)."""
    from zmqps.roles.chief.serve import _final_checkpoint

    ck = FakeCheckpointer(460, None)
    ck.failed = 1 if failed_just_before else 0  # type: ignore[attr-defined]
    ck.last_transient = False  # type: ignore[attr-defined]
    ck.last_error = "cannot write shard 0: no space left on device"  # type: ignore[attr-defined]
    if committed is not None:
        ck.last_committed = SimpleNamespace(name=f"ckpt-{committed}", step=committed, final=True)
    service = SimpleNamespace(checkpoints=ChiefCheckpoints(ck, chief(460)))  # type: ignore[arg-type]
    said = asyncio.run(_final_checkpoint(service))  # type: ignore[arg-type]
    assert ck.taken == []  # nothing new to take: its step was tried
    if not lost:
        assert said == ""
        return
    assert said.startswith("the final checkpoint could not be written (cannot write shard 0")
    assert said.endswith(lost), said
