"""The chief's variables: creation (idempotent), the placement, shards on the PS.

Rules of this module:

* The placement is computed once, here, and handed to every worker; creating
  variables is idempotent (same definitions: same placement; different: error), and
  concurrent creations make one placement.
* Shards are created on the PS before any worker learns the placement, so a worker
  that has a placement can always pull.
* A placement adopted from running PS or taken from a checkpoint (:meth:`use`)
  counts as created.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from zmqps.core.initializers import validate_init
from zmqps.core.optimizers import make_optimizer
from zmqps.core.partition import plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.roles.configs import ChiefConfig
from zmqps.transport import Requester
from zmqps.transport.base import waited
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    ConfigError,
    DeadlineExceeded,
    InvalidArgument,
    ModelMismatch,
    NotReady,
)

__all__ = ["TERM", "Variables", "backups_of"]

log = logging.getLogger("zmqps.chief")

#: the term of a PS state's first primary (one more at every promotion)
TERM = 1


def backups_of(placement: Placement) -> dict[int, tuple[int, ...]]:
    """Each primary PS's backups (every shard of one PS has the same ones)."""
    out: dict[int, tuple[int, ...]] = {}
    for s in placement.shards:
        out.setdefault(s.ps, s.backups)
    return out


class Variables:
    def __init__(self, cfg: ChiefConfig, ps: Sequence[Requester]) -> None:
        self.cfg = cfg
        self.ps = list(ps)
        self.placement: Placement | None = None
        self.ready = asyncio.Event()
        self._creating: asyncio.Future[Placement] | None = None

    def plan(self, variables: Sequence[VariableDef], optimizer: dict[str, Any]) -> Placement:
        return plan(
            tuple(variables),
            len(self.ps),
            self.cfg.partitioner,
            self.cfg.placement,
            optimizer,
            replication=self.cfg.replication,
        )

    def holders(self) -> list[int]:
        """The PS states that hold shards of the placement."""
        assert self.placement is not None
        return sorted({s.state for s in self.placement.shards})

    def defs_by_ps(self) -> dict[int, list[dict[str, Any]]]:
        """Every PS state's shard definitions (wire form) under the placement (a state
        moved to another process keeps its shards)."""
        assert self.placement is not None
        by_state: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(self.ps))}
        for s, (_, d) in zip(self.placement.shards, self.placement.shard_defs(), strict=True):
            by_state[s.state].append(d.to_wire())
        return by_state

    def use(self, placement: Placement) -> None:
        """A placement that exists already (adopted PS, a checkpoint)."""
        self.placement = placement
        done: asyncio.Future[Placement] = asyncio.get_running_loop().create_future()
        done.set_result(placement)
        self._creating = done
        self.ready.set()

    async def wait(self, seconds: float) -> Placement | None:
        if self.placement is None and seconds > 0:
            await waited(self.ready.wait(), seconds)
        return self.placement

    async def create(
        self, variables: Sequence[VariableDef], optimizer: dict[str, Any]
    ) -> Placement:
        """Create the variables (every PS gets its shards), or return the placement
        they were created with; a different definition is refused. A dense float32
        variable with no wire dtype of its own travels as the job's (``wire_dtype``)."""
        if not variables:
            # created, an empty model held the cluster: every later creation was refused
            # as another model's, until every task was started again
            raise InvalidArgument("create_variables: no variables given (a model has one at least)")
        variables = tuple(v.with_wire(self.cfg.wire_dtype) for v in variables)
        make_optimizer(optimizer)
        for v in variables:
            validate_init(v.init)
            if v.optimizer is not None:
                make_optimizer(v.optimizer)
        if self._creating is None:
            self._creating = asyncio.ensure_future(self._create(variables, optimizer))
        placement = await asyncio.shield(self._creating)
        if placement.variables != variables or dict(placement.optimizer) != optimizer:
            same = [dataclasses.replace(v, wire=None) for v in placement.variables] == [
                dataclasses.replace(v, wire=None) for v in variables
            ]
            if same and dict(placement.optimizer) == optimizer:
                was = {v.wire for v in placement.variables if v.wire} or {"float32"}
                raise ModelMismatch(
                    "the variables were created travelling as"
                    f" {', '.join(sorted(was))}: give the chief that --wire-dtype"
                )
            raise ModelMismatch(
                "variables were already created with different definitions ("
                + _difference(placement.variables, variables, placement.optimizer, optimizer)
                + ")"
            )
        return placement

    async def _create(
        self, variables: tuple[VariableDef, ...], optimizer: dict[str, Any]
    ) -> Placement:
        try:
            placement = self.plan(variables, optimizer)
        except InvalidArgument:
            self._creating = None
            raise
        by_ps: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(self.ps))}
        for ps, d in placement.shard_defs():
            by_ps[ps].append(d.to_wire())
        deadline = time.monotonic() + self.cfg.startup_timeout
        wire = placement.to_wire()
        try:
            # the backups' copies first (empty, then their shards), so that nothing a
            # primary ships can find a copy missing
            copies = backups_of(placement)
            await asyncio.gather(
                *(
                    self._copy_on(q, p, by_ps[p], wire, deadline)
                    for p, qs in copies.items()
                    for q in qs
                )
            )
            await asyncio.gather(
                *(self._create_on(i, defs, wire, deadline) for i, defs in by_ps.items() if defs)
            )
            await asyncio.gather(
                *(self._replicate(p, qs, deadline) for p, qs in copies.items() if qs)
            )
        except BaseException:
            self._creating = None
            raise
        self.placement = placement
        self.ready.set()
        log.info(
            "created %d variables in %d shards on %d PS (%s placement)",
            len(variables),
            len(placement.shards),
            len(self.ps),
            self.cfg.placement,
        )
        return placement

    async def _copy_on(
        self,
        ps: int,
        slot: int,
        defs: list[dict[str, Any]],
        placement: dict[str, Any],
        deadline: float,
    ) -> None:
        """PS ``ps`` holds a backup of PS ``slot``'s state: an empty copy, then its shards."""
        body = o.ReplicaSet(slot, TERM, primary=False, make=True).to_wire()
        await self._until_answered(ps, "replica", body, deadline)
        await self._create_on(ps, defs, placement, deadline, slot=slot)

    async def _replicate(self, ps: int, backups: Sequence[int], deadline: float) -> None:
        """PS ``ps`` ships what it applies to ``backups``. A PS that refuses (it cannot
        reach the others: no CURVE client pair) fails the run's start as a configuration
        error: a restart would meet the same refusal, and the run must not go on with
        fewer copies than asked for."""
        links = tuple((q, self.ps[q].endpoint) for q in backups)
        body = o.ReplicaSet(ps, TERM, primary=True, backups=links).to_wire()
        try:
            await self._until_answered(ps, "replica", body, deadline)
        except InvalidArgument as exc:
            raise ConfigError(f"--replication {self.cfg.replication}: {exc}") from None

    async def _create_on(
        self,
        ps: int,
        defs: list[dict[str, Any]],
        placement: dict[str, Any],
        deadline: float,
        slot: int | None = None,
    ) -> None:
        body = o.CreateShards(tuple(defs), placement).to_wire()
        await self._until_answered(ps, "create_shards", body, deadline, slot)

    async def _until_answered(
        self, ps: int, op: str, body: dict[str, Any], deadline: float, slot: int | None = None
    ) -> None:
        while True:
            # never wait past the deadline: a short startup_timeout must be honored
            timeout = min(2.0, max(0.01, deadline - time.monotonic()))
            try:
                if slot is None:
                    await self.ps[ps].request(op, body, timeout=timeout)
                else:
                    await self.ps[ps].request(op, body, timeout=timeout, slot=slot)
                return
            except DeadlineExceeded:
                if time.monotonic() > deadline:
                    raise NotReady(
                        f"ps {ps} ({self.ps[ps].endpoint}) did not answer within"
                        f" {self.cfg.startup_timeout:g}s"
                    ) from None
                log.info("waiting for ps %d at %s", ps, self.ps[ps].endpoint)


def _difference(
    held: Sequence[VariableDef],
    asked: Sequence[VariableDef],
    held_optimizer: Mapping[str, Any],
    asked_optimizer: Mapping[str, Any],
) -> str:
    """What tells the model asked for from the one the cluster holds, briefly: the
    first variables each lacks, or the first that differs and in what (the names of
    every variable made a line of thousands of names that said nothing of why)."""
    have, want = {v.name: v for v in held}, {v.name: v for v in asked}
    parts = []
    if missing := [n for n in have if n not in want]:
        parts.append(f"the cluster's {_few(missing)} not asked for")
    if extra := [n for n in want if n not in have]:
        parts.append(f"{_few(extra)} not in the cluster")
    for name, v in want.items():
        old = have.get(name)
        if old is None or old == v:
            continue
        fields = [
            f"{f.name} {getattr(old, f.name)!r} -> {getattr(v, f.name)!r}"
            for f in dataclasses.fields(VariableDef)
            if getattr(old, f.name) != getattr(v, f.name)
        ]
        parts.append(f"{name}: {'; '.join(fields)}")
        break
    if not parts and dict(held_optimizer) != dict(asked_optimizer):
        was, now = dict(sorted(held_optimizer.items())), dict(sorted(asked_optimizer.items()))
        parts.append(f"optimizer {was!r} -> {now!r}")
    if not parts and [v.name for v in held] != [v.name for v in asked]:
        parts.append("the same variables in another order")
    return "; ".join(parts) or "of another definition"


def _few(names: Sequence[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
