"""The PS states one PS process serves (its "slots"), and each one's part in replication.

With replication a process holds, beside its own PS state, a copy of the state of
each PS it backs up, and once a backup is promoted it serves that state as the
primary. Each state is a whole :class:`PSService` (shards, dedup window, ledgers,
sync mode), so the same code serves and applies every copy. A request names the
state it is for by its ``slot`` (a PS index; none: the process's own);
:class:`PSSlots` is the handler that sends it there:

* ``replica`` (from the chief, the slot in its body): this process's part in a
  state's copies: primary (with the backups it ships to) or backup; a backup of a
  state not held yet starts as an empty copy (its shards come by ``create_shards``
  for that slot).
* ``replicate`` (from the primary): an entry, applied by the state's backup.
* A state whose primary this process is: a request that changes it is applied, then
  answered once its backups have it (:class:`~zmqps.roles.ps.replica.Primary`).
* ``join`` (from the chief, the slot in its body): the state's primary brings one
  more backup in with a whole copy (:meth:`Primary.join`); ``install`` (from the
  primary): a part of that copy, for the state's backup.
* A state this process only backs up serves ``ping``, ``status``, ``ps_state`` and
  the chief's ``create_shards``; anything else is refused with ``not_primary``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from zmqps.core.replication import Entry
from zmqps.core.variables import Placement
from zmqps.roles.ps.image import take
from zmqps.roles.ps.modes import Accumulate
from zmqps.roles.ps.replica import Backup, Primary, changes_state, entry_resolver
from zmqps.roles.ps.service import _JOINED_OPS, PSService, split_index
from zmqps.transport import Requester
from zmqps.wire import Message, reply
from zmqps.wire import ops as o
from zmqps.wire.errors import InvalidArgument, NotFound, NotPrimary, Superseded, ZmqpsError
from zmqps.wire.schema import MAX_REPLICATION

__all__ = ["MAX_COPIES", "PSSlots"]

log = logging.getLogger("zmqps.ps")

#: copies of other PS's states one process may hold (a placement gives each about
#: R - 1; the bound keeps a flood of ``replica`` requests from making states without end)
MAX_COPIES = 256

#: what a copy in the backup role serves directly
_BACKUP_OPS = frozenset({"ping", "status", "ps_state", "create_shards"})

#: a requester to PS ``ps`` at ``endpoint``, its requests for state ``slot``
LinkFactory = Callable[[int, str, int], Requester]


#: the ops only some keys may send, and whose: the chief creates shards, sets the
#: sync mode, takes checkpoints, restores and shuts a PS down, tells it which copies
#: it holds (``replica``) and whom to copy its state to (``join``); a primary sends
#: its entries and copies (``replicate``, ``install``); a worker (or the chief's
#: training loop, coordinator mode) pushes, takes sync tokens and says it left
#: (``fence``: the chief fences too). Under CURVE they are refused from any other key:
#: a forged entry would make a backup differ from its primary (a fail-over would then
#: serve it), a forged restore or ``create_shards`` would replace the model, an
#: evaluator's or the operator's (``status``) key could change the model, count a
#: refused gradient toward a sync step, take a step's token, or fence a worker out.
PEER_OPS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "replica",
            "placement",
            "join",
            "shutdown",
            "create_shards",
            "sync_config",
            "checkpoint_save",
            "checkpoint_done",
            "restore",
        ),
        ("chief",),
    ),
    **dict.fromkeys(("replicate", "install", "replica_ring"), ("ps",)),
    **dict.fromkeys(
        ("push", "push_pull", "push_rows", "push_pull_rows", "take_token", "fence"),
        ("worker", "chief"),
    ),
}

#: what each role is called in a refusal
_WHO = {"chief": "the chief", "ps": "a PS", "worker": "a worker"}


#: what a primary sends a backup, by op
_FROM_PRIMARY = {"replicate": "entry", "install": "copy", "replica_ring": "ring"}


def _peer_role(msg: Message) -> tuple[str, ...] | None:
    """The roles that alone may send ``msg`` (None: anyone on the allow-list). A
    ``wait_step`` that releases tokens is the chief's: a forged release would hand
    every worker asking this PS a token of a step of its choosing."""
    if msg.op == "wait_step":
        return ("chief",) if msg.body.get("released") is not None else None
    return PEER_OPS.get(msg.op)


def _speaks_for(body: Any) -> str | None:
    """The task a request speaks for: a push's or fence's ``worker``, a token request's
    flattened ``Who`` (``role:index``); None: it names none."""
    worker = body.get("worker")
    if worker is not None:
        return str(worker)
    if "role" in body and "index" in body:
        return f"{body.get('role')}:{body.get('index')}"
    return None


def _check_peer(msg: Message, index: int, roles: tuple[str, ...]) -> None:
    """Refuse ``msg`` unless the allow-list names its sender's key for one of ``roles``
    (``ps`` also matches per-process names such as ``ps3``, ``worker`` per-task ones
    such as ``worker3``). A worker's own key (``worker3``) speaks only for that worker:
    a push or fence of another's name is refused too."""
    name = msg.peer
    for role in roles:
        number = name[len(role) :]
        if name == role or (name.startswith(role) and number.isdigit()):
            said = _speaks_for(msg.body) if role == "worker" else None
            mine = f"worker:{int(number)}" if number else None
            if said is not None and (said != mine if mine else not said.startswith("worker:")):
                raise InvalidArgument(
                    f"ps {index}: the key named {name!r} on the allow-list speaks only for"
                    f" {mine or 'workers'}, not {said[:64]!r}"
                )
            return
    who = " or ".join(_WHO.get(r, r) for r in roles)
    raise InvalidArgument(
        f"ps {index}: {msg.op} is sent only by {who}; refused from the key named {name!r}"
        " on the allow-list"
    )


class PSSlots:
    """A process's PS states by slot; its own is ``own.index``."""

    def __init__(
        self,
        own: PSService,
        *,
        make_copy: Callable[[int], PSService] | None = None,
        link: LinkFactory | None = None,
    ):
        self.own = own
        self._slots: dict[int, PSService] = {own.index: own}
        self._roles: dict[int, Primary | Backup] = {}
        self._make_copy = make_copy
        self._link = link
        #: primaries replaced by a backup role, being closed
        self._closing: set[asyncio.Future[None]] = set()
        #: the highest placement epoch the chief told (``replica``)
        self.epoch = 0
        #: the newest placement the chief published (``placement``; one, replaced)
        self.newest: dict[str, Any] | None = None

    def add(self, service: PSService) -> None:
        """Serve ``service`` (a copy of PS ``service.index``'s state) too."""
        if service.index in self._slots:
            raise InvalidArgument(f"ps {self.own.index} already holds ps {service.index}'s state")
        self._slots[service.index] = service

    def remove(self, index: int) -> PSService:
        """Stop serving PS ``index``'s state (never the process's own)."""
        if index == self.own.index:
            raise InvalidArgument(f"ps {index} cannot drop its own state")
        if isinstance(self._roles.get(index), Primary):
            raise InvalidArgument(f"ps {self.own.index} is ps {index}'s primary")
        role = self._roles.pop(index, None)
        if isinstance(role, Backup):
            role.close()
        service = self._slots.pop(index)
        service.replica = None
        return service

    def slots(self) -> list[int]:
        return sorted(self._slots)

    def role(self, slot: int) -> Primary | Backup | None:
        return self._roles.get(slot)

    def replication_stats(self) -> dict[int, dict[str, Any]]:
        """Each replicated state's part here, for the metrics: primary or not, and as
        its primary how far behind its backups are."""
        out: dict[int, dict[str, Any]] = {}
        for slot, role in list(self._roles.items()):  # read from the exporter's thread
            if isinstance(role, Primary) and not role.fenced:
                waited, behind = role.lag()
                out[slot] = {"primary": True, "lag_seconds": waited, "lag_entries": behind}
            else:
                out[slot] = {"primary": False}
        return out

    def service(self, slot: int) -> PSService:
        """The copy of PS ``slot``'s state this process holds (KeyError: none)."""
        return self._slots[slot]

    def services(self) -> list[PSService]:
        return [self._slots[s] for s in self.slots()]

    def __call__(self, msg: Message) -> Message | Awaitable[Message]:
        role_only = _peer_role(msg) if msg.peer else None
        if role_only is not None:
            _check_peer(msg, self.own.index, role_only)
        if msg.op == "replica":
            return self._op_replica(msg)
        if msg.op == "join":
            return self._op_join(msg)
        if msg.op == "placement":
            return self._op_placement(msg)
        if msg.op == "shutdown":  # the process's, whatever part its own state plays
            return self.own(msg)
        if msg.op == "ps_state" and msg.slot is None and (self._roles or self.newest):
            return self._ps_state(msg)
        slot = self.own.index if msg.slot is None else msg.slot
        service = self._slots.get(slot)
        if service is None:  # the sender's placement is not this process's (a fail-over)
            raise NotPrimary(f"ps {self.own.index} holds no copy of ps {slot}'s state")
        role = self._roles.get(slot)
        if msg.op in _FROM_PRIMARY:
            if not isinstance(role, Backup):
                self._superseded(msg, slot, role)
                raise NotPrimary(
                    f"ps {self.own.index} is not a backup of ps {slot}'s state:"
                    f" {_FROM_PRIMARY[msg.op]} refused"
                )
            if msg.op == "replicate":
                return role.receive(msg, service, service.replay_step, service.checked)
            if msg.op == "replica_ring":
                return role.attach_ring(msg)
            return role.install(msg, service)
        if isinstance(role, Backup) and msg.op not in _BACKUP_OPS:
            raise NotPrimary(
                f"ps {self.own.index} holds a backup of ps {slot}'s state, not its primary:"
                " send to the primary the placement names"
            )
        if isinstance(role, Primary):
            if "counts" in msg.body and msg.op in _JOINED_OPS:
                msg = split_index(msg)  # logged as a client that does not join sends it
            if msg.op == "push_pull_rows":
                return self._push_pull_rows(msg, role, service)
            if changes_state(msg, service.store):
                # a row push's rows in the worker's region: logged as the tensors a TCP
                # push carries (views of the region, which the worker leaves alone
                # until it has the answer)
                return role.run(service.rows_in_place(msg), service)
        return service(msg)

    async def _push_pull_rows(self, msg: Message, role: Primary, service: PSService) -> Message:
        """A replicated state's ``push_pull_rows``: its ``push_rows``, then its
        ``pull_rows``, each through the log as if sent on its own (the backups get the
        same two entries), answered as one once both are."""
        req = o.PushPullRows.from_wire(msg.body)
        push, pull, _ = service.split_push_pull_rows(msg, req)
        pushed = await role.run(push, service)
        if changes_state(pull, service.store):
            pulled = await role.run(pull, service)
        else:
            got = service(pull)
            pulled = await got if inspect.isawaitable(got) else got
        return service.joined_rows(msg, pushed, pulled)

    def _ps_state(self, msg: Message) -> Message:
        """The process's own state's ``ps_state``, with its part in every state's copies
        and the placement epoch it was told: what a restarted chief rebuilds the
        placement from (which copy is each state's primary, at which term)."""
        rep = self.own(msg)
        assert isinstance(rep, Message)
        roles = []
        for slot, role in sorted(self._roles.items()):
            if isinstance(role, Primary):
                in_sync = sorted(int(b) for b in role.log.in_sync())
                roles.append([slot, "primary", role.term, role.log.head, role.fenced, in_sync])
            else:
                roles.append([slot, "backup", role.term, role.log.applied, False, []])
        extra = {"roles": roles, "epoch": self.epoch}
        if self.newest is not None:
            extra["newest"] = self.newest
        return reply(msg, {**rep.body, **extra})

    def _retire_later(self, role: Primary) -> None:
        """Stop a replaced primary's shipping and close its links, in the background."""
        closing = asyncio.ensure_future(_retire(role))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    def _superseded(self, msg: Message, slot: int, role: Primary | Backup | None) -> None:
        """An entry or copy from a primary of an older term than this copy, the state's
        primary now: its sender was replaced while it was cut off or stopped, and must
        stop (it would otherwise send again until its requests' deadlines)."""
        if not isinstance(role, Primary):
            return
        term = int(msg.body["term"])  # every op from a primary carries its term (checked)
        if term < role.term:
            raise Superseded(
                f"ps {self.own.index} is ps {slot}'s primary at term {role.term}; the {msg.op}"
                f" is of term {term} (a primary since replaced)"
            )

    def _op_replica(self, msg: Message) -> Message:
        req = o.ReplicaSet.from_wire(msg.body)
        if req.epoch is not None:
            self.epoch = max(self.epoch, req.epoch)
        if req.drop:
            return self._drop(msg, req)
        service = self._slots.get(req.slot)
        if service is None:
            if self._make_copy is None or not req.make:
                raise NotFound(f"ps {self.own.index} holds no copy of ps {req.slot}'s state")
            if len(self._slots) - 1 >= MAX_COPIES:  # the process's own is no copy
                raise InvalidArgument(
                    f"ps {self.own.index} holds {MAX_COPIES} copies of other PS's states already"
                )
            service = self._make_copy(req.slot)
            self._slots[req.slot] = service
        role = self._roles.get(req.slot)
        if role is not None and req.term < role.term:
            raise InvalidArgument(
                f"ps {self.own.index}: ps {req.slot}'s copies are at term {role.term};"
                f" term {req.term} is older"
            )
        if req.primary:
            role = self._primary(service, req, role)
        else:
            if isinstance(role, Primary) and not (role.fenced or req.term > role.term):
                raise InvalidArgument(
                    f"ps {self.own.index} is ps {req.slot}'s primary; it cannot become its backup"
                )
            if isinstance(role, Primary):  # replaced while cut off: a backup from now on
                log.warning(
                    "ps %d: no longer ps %d's primary (term %d): a backup of term %d",
                    self.own.index,
                    req.slot,
                    role.term,
                    req.term,
                )
                self._retire_later(role)
                role = Backup(req.slot, req.term)
            elif role is None:
                if service is self.own and len(service.store):
                    # the only copy of this state, serving: no copy elsewhere can take
                    # its place, so a stray (or hostile) message must not demote it
                    raise InvalidArgument(
                        f"ps {self.own.index} holds its own state and no other copy of it"
                        " exists: it cannot become a backup of it"
                    )
                if not req.make:
                    # its own state, empty, and no part in its copies: the process
                    # restarted since it held one. A fence is of a copy it holds; taken
                    # as an empty backup, a hand-over promoted it, the state's shards
                    # lost (fault schedule 831, replayed: a move onto a process killed
                    # and restarted 2 s before, its primary still counting it in sync)
                    raise NotFound(
                        f"ps {self.own.index} holds no copy of ps {req.slot}'s state"
                        " (restarted since it held one)"
                    )
                role = Backup(req.slot, req.term)
            else:
                role.log.fence(req.term)
            if req.make and isinstance(role, Backup):
                role.expect_copy()
        was = self._roles.get(req.slot)
        if isinstance(was, Backup) and was is not role:  # promoted: the ring is the old primary's
            was.close()
        self._roles[req.slot] = role
        service.replica = role
        applied = role.log.head if isinstance(role, Primary) else role.log.applied
        state = o.ReplicaState(req.slot, role.term, req.primary, applied, service.boot)
        return reply(msg, state.to_wire())

    def _drop(self, msg: Message, req: o.ReplicaSet) -> Message:
        """The state moved to another process (``drop``): this copy goes. The process's
        own state cannot go; it is emptied and stays a backup, which refuses every
        request for the state with ``not_primary`` (a client with an older placement
        is sent to the new home), until the state comes back by a whole copy."""
        role = self._roles.get(req.slot)
        service = self._slots.get(req.slot)
        if service is None:
            return reply(msg, o.ReplicaState(req.slot, req.term, False, 0).to_wire())
        if isinstance(role, Primary) and not role.fenced and req.term <= role.term:
            raise InvalidArgument(
                f"ps {self.own.index} is ps {req.slot}'s primary at term {role.term}:"
                " it steps down before its copy is dropped"
            )
        if isinstance(role, Primary):
            self._retire_later(role)
        if req.slot != self.own.index:
            if isinstance(role, Backup):
                role.close()
            self._roles.pop(req.slot, None)
            del self._slots[req.slot]
            service.replica = None
            service.regions.close()
            service.check_threads.close()
            log.info("ps %d: its copy of ps %d's state dropped (moved)", self.own.index, req.slot)
        else:
            kept = role if isinstance(role, Backup) else Backup(req.slot, req.term)
            if kept.term < req.term:
                kept.log.fence(req.term)
            self._roles[req.slot] = kept
            service.replica = kept
            service.store.clear()
            log.info("ps %d: its own state moved away; its copy emptied", self.own.index)
        return reply(msg, o.ReplicaState(req.slot, req.term, False, 0).to_wire())

    def _op_placement(self, msg: Message) -> Message:
        """Keep the chief's placement if it is the newest this process heard (what
        ``ps_state`` reports: a restarted chief trusts no copy it does not name)."""
        req = o.PlacementNote.from_wire(msg.body)
        try:
            epoch = Placement.from_wire(req.placement).epoch
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZmqpsError) as exc:
            raise InvalidArgument(f"ps {self.own.index}: not a placement: {exc}") from None
        if self.newest is None or epoch >= int(self.newest.get("epoch") or 0):
            self.newest = dict(req.placement)
        self.epoch = max(self.epoch, epoch)
        return reply(msg, {})

    def _op_join(self, msg: Message) -> Message:
        req = o.Join.from_wire(msg.body)
        role = self._roles.get(req.slot)
        if not isinstance(role, Primary) or role.fenced:
            raise NotPrimary(f"ps {self.own.index} is not ps {req.slot}'s primary")
        if req.term != role.term:
            raise InvalidArgument(
                f"ps {self.own.index}: ps {req.slot}'s copies are at term {role.term},"
                f" not {req.term}"
            )
        if req.ps == self.own.index or self._link is None:
            raise InvalidArgument(f"ps {self.own.index} cannot back up its own copy")
        if req.ps in role.backups():
            raise InvalidArgument(f"ps {req.ps} is a backup of ps {req.slot}'s state already")
        if len(role.backups()) >= MAX_REPLICATION - 1:
            raise InvalidArgument(f"ps {req.slot}'s state has its most backups already")
        service = self._slots[req.slot]
        link = self._link(req.ps, req.endpoint, req.slot)
        role.flush()  # the copy is of a state every entry so far made, and nothing more
        at = role.join(req.ps, link, take(service), req.rate)
        return reply(msg, o.Joining(at).to_wire())

    def _primary(
        self, service: PSService, req: o.ReplicaSet, role: Primary | Backup | None
    ) -> Primary:
        wanted = {int(ps): str(endpoint) for ps, endpoint in req.backups}
        if self.own.index in wanted:
            raise InvalidArgument(f"ps {self.own.index} cannot back up its own copy")
        if isinstance(role, Primary) and role.term == req.term:
            for ps in set(role.backups()) - set(wanted):
                role.drop(ps)
            if set(wanted) - set(role.backups()):
                raise InvalidArgument(
                    f"ps {req.slot}: a backup joins with a copy of the state, not by name"
                )
            return role
        head: int = 0
        if isinstance(role, Primary) and req.term > role.term and not wanted:
            # the chief takes the state's copies down at a newer term (before a restore:
            # a fail-over fenced the other copies at it, and this one may be fenced too)
            log.warning(
                "ps %d: ps %d's only copy from now on (term %d)", self.own.index, req.slot, req.term
            )
            head = role.log.head
            self._retire_later(role)
            role = None
        if isinstance(role, Primary):
            raise InvalidArgument(f"ps {self.own.index}: ps {req.slot} is replicated already")
        if wanted and self._link is None:
            raise InvalidArgument(f"ps {self.own.index} cannot reach other PS")
        retained: tuple[Entry, ...] = ()
        acked: dict[int, int] | None = None
        if isinstance(role, Backup) and wanted and req.applied is None:
            # a promotion with backups says how far each got (the chief fenced them
            # first); one without is a word meant for a primary (its backups told
            # again) reaching a copy that stepped down since: promoted, it would count
            # its entries from its own, and a backup ahead of it would take them for
            # ones it has (fault schedule 831: acknowledged pushes lost)
            raise InvalidArgument(
                f"ps {self.own.index} holds a backup of ps {req.slot}'s state: a promotion"
                " names how far each backup got"
            )
        if isinstance(role, Backup):  # a promotion: this copy goes on from its head
            # the chief fences every surviving copy at the new term first (their
            # answers say how far each got), then promotes one at that same term
            # the entries kept go to the copies behind this one at the new term: each
            # came from the one primary of its term, so every copy that has it has the
            # same, and a copy fenced at the new term refuses an entry of an older one
            # (from the primary replaced) as stale
            head = role.log.applied
            retained = tuple(replace(e, term=req.term) for e in role.log.kept)
            given = req.applied or (head,) * len(wanted)
            if len(given) != len(wanted) or max(given, default=0) > head:
                raise InvalidArgument(
                    f"ps {self.own.index}: the other copies of ps {req.slot} must be at most"
                    f" at entry {head}"
                )
            acked = dict(zip(wanted, given, strict=True))
            log.warning(
                "ps %d: now the primary of ps %d's state (term %d, entry %d)",
                self.own.index,
                req.slot,
                req.term,
                head,
            )
        links = {
            ps: self._link(ps, endpoint, req.slot)  # type: ignore[misc]
            for ps, endpoint in wanted.items()
        }
        primary = Primary(
            req.slot,
            req.term,
            links,
            head=head,
            retained=retained,
            acked=acked,
            resolve=entry_resolver(
                lambda sids, ref, worker, packs: service.regions.views(
                    service.store, sids, ref, worker, packs
                )
            ),
            step=lambda: service.mode.step,
            on_commit=service.waiters.notify,
            sync=lambda: service.mode.shards if isinstance(service.mode, Accumulate) else None,
            finite=service.finite,
            checked=service.checked,
        )
        for name in list(primary.log.dropped):  # further behind than the entries kept
            log.warning(
                "ps %d: %s's copy of ps %d is too far behind", self.own.index, name, req.slot
            )
            primary.drop(int(name))
        return primary

    async def close(self) -> None:
        """Stop shipping, close the links and every copy's resources."""
        for role in self._roles.values():
            if isinstance(role, Primary):
                await _retire(role)
            else:
                role.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        for slot, service in self._slots.items():
            if slot != self.own.index:
                service.regions.close()
                service.check_threads.close()


async def _retire(role: Primary) -> None:
    """Stop a primary's shipping and close its links."""
    await role.close()
    for link in list(role.links.values()):
        with contextlib.suppress(Exception):
            await link.close()
