"""The replication log of a replicated PS state (sans-IO): chain replication after
aggregation.

Rules of this module:

* The primary appends what it applied (an :class:`Entry`: its payload is opaque
  here, with its size in bytes) and numbers it: 1, 2, 3, ... in the order it was
  applied. The PS ships entries to the backups, which apply them in that order.
* An entry is *committed* once every in-sync backup has acknowledged it; only then
  may the push it holds be acknowledged to its worker. Acknowledgements are
  cumulative (a backup acknowledges the highest index it applied, having applied
  every one before it), so the committed entries are a prefix of the log.
* A backup applies entries strictly in order: a resent one is acknowledged again
  and not applied, a gap is refused (the primary resends from the backup's last
  acknowledgement), an entry of an older term (a primary since replaced) is refused:
  that is the fence against a primary that lost its place but still runs.
* Joining: a backup that got a copy of the state as of index ``at`` is sent the
  entries after ``at`` and is in sync once it has acknowledged the head; until then
  no commit waits for it. While its copy is still being installed (``installing``)
  nothing is sent to it and the entries after ``at`` are kept for it. One that falls
  more than the joining bound behind (``join_entries``, ``join_bytes``: larger than
  the commit bound, as a copy takes a while) is dropped (its copy must start
  again), so a slow copy never stalls training and never makes the log grow
  without bound.
* Bounded: the primary holds at most ``max_entries`` entries and ``max_bytes`` bytes
  that some backup has not acknowledged; :meth:`PrimaryLog.room` says whether one
  more fits (when not, the push waits for acknowledgements). A backup keeps the
  last ``max_entries`` entries it applied (at most ``max_bytes`` of them, the last
  one always), so that, promoted, it can bring the other backups up to its head: a
  backup further behind than that is dropped and copied afresh.
* Promotion (:func:`choose_primary`): among the in-sync copies still alive, the one
  with the highest applied index. Their logs are prefixes of one another's (each
  received one primary's log in order) and every committed entry is on all of
  them, so nothing acknowledged is lost and no survivor is ahead of the new
  primary. Its term is one more than the last. A survivor further behind it than
  the entries it kept (it joined with a recent copy) is dropped and copied afresh.
* :func:`fail_over` is the chief's plan when PS die: for each shard, its primary
  replaced by the in-sync survivor :func:`choose_primary` picks, the dead copies
  dropped, at a new placement epoch; shards with no copy left are listed (the
  cluster restores them from a checkpoint).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from itertools import islice
from typing import Any

from zmqps.core.variables import Placement, ShardInfo

__all__ = [
    "JOIN_BYTES",
    "JOIN_ENTRIES",
    "MAX_BYTES",
    "MAX_ENTRIES",
    "Entry",
    "FailOver",
    "Full",
    "Offer",
    "PrimaryLog",
    "ReplicaLog",
    "choose_primary",
    "fail_over",
]

#: entries a primary may hold unacknowledged by some backup (and a backup keeps)
MAX_ENTRIES = 64
#: bytes of those entries
MAX_BYTES = 1 << 30
#: entries (and bytes) kept for a joining backup, whose copy is being installed or
#: catching up: past this it is dropped and its copy starts again later
JOIN_ENTRIES = 1 << 16
JOIN_BYTES = 256 << 20


class Full(Exception):
    """The primary's log has no room for the entry: wait for acknowledgements."""


@dataclass(frozen=True)
class Entry:
    index: int
    term: int
    payload: Any = field(compare=False)
    nbytes: int = 0


class Offer(Enum):
    APPLY = "apply"  # the next entry: apply it, then acknowledge
    DUPLICATE = "duplicate"  # applied already: acknowledge again
    GAP = "gap"  # an entry before it is missing: ask for a resend from the last ack
    STALE = "stale"  # from a primary of an older term: refuse


@dataclass
class _Backup:
    acked: int  # the highest index it acknowledged (or its copy's, when joining)
    sent: int  # the highest index sent to it
    in_sync: bool
    installing: bool = False  # its copy is still being installed: send nothing yet


class PrimaryLog:
    """The primary's side: what it applied, what each backup has, what is committed."""

    def __init__(
        self,
        term: int,
        head: int = 0,
        backups: Mapping[str, int] | Iterable[str] = (),
        retained: Iterable[Entry] = (),
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
        join_entries: int = JOIN_ENTRIES,
        join_bytes: int = JOIN_BYTES,
    ):
        """A primary of ``term`` whose state is as of index ``head``; ``backups``: the
        in-sync backups, with the index each applied (a name alone: ``head``);
        ``retained``: entries up to ``head`` the backups behind may need."""
        self.term = term
        self.head = head
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.join_entries = join_entries
        self.join_bytes = join_bytes
        acked = dict(backups) if isinstance(backups, Mapping) else dict.fromkeys(backups, head)
        #: entries some backup has not acknowledged, oldest first (consecutive)
        self.entries: deque[Entry] = deque(e for e in retained if e.index <= head)
        #: bytes of every entry appended up to each of ``entries`` (aligned with it), and
        #: up to the head: the bytes between two indices without a walk of the log
        self._cum: deque[int] = deque()
        total = 0
        for e in self.entries:
            total += e.nbytes
            self._cum.append(total)
        self._total = total
        self.backups: dict[str, _Backup] = {}
        #: backups dropped: joining ones that fell too far behind, and (promoted) ones
        #: further behind than the entries kept; each needs a fresh copy (the PS reads
        #: and clears this)
        self.dropped: list[str] = []
        for name, at in acked.items():
            if at > head:
                raise ValueError(f"backup {name} at {at} is ahead of the primary's {head}")
            if at < head - len(self.entries):
                self.dropped.append(name)
            else:
                self.backups[name] = _Backup(at, at, True)
        self.committed = min((b.acked for b in self.backups.values()), default=head)
        self._advance()

    # -- appending -----------------------------------------------------------------

    def _bytes_after(self, index: int) -> int:
        """Bytes of the retained entries after ``index`` (at least the oldest's index - 1)."""
        if not self.entries or index >= self.head:
            return 0
        first = self.entries[0].index
        if index < first:
            return self._total - self._cum[0] + self.entries[0].nbytes
        return self._total - self._cum[index - first]

    def _after(self, index: int) -> list[Entry]:
        """The retained entries after ``index``, in order."""
        n = min(self.head - index, len(self.entries))  # the entries end at the head
        if n <= 0:
            return []
        return list(islice(reversed(self.entries), n))[::-1]

    def unacked(self) -> tuple[int, int]:
        """Entries and bytes not yet committed (that commits wait for)."""
        return self.head - self.committed, self._bytes_after(self.committed)

    def room(self, nbytes: int, entries: int = 1) -> bool:
        """Whether ``entries`` more entries of ``nbytes`` in all fit (an empty log takes
        any one entry, or two: a batch of held pushes and the request after them)."""
        n, b = self.unacked()
        return n == 0 or (n + entries <= self.max_entries and b + nbytes <= self.max_bytes)

    def append(self, payload: Any, nbytes: int = 0, *, force: bool = False) -> Entry:
        """Log what the primary applied. It is committed at once when no backup is
        in sync (``entry.index <= self.committed``). ``force``: room was made sure of
        for this entry and the one after it (:meth:`room` with ``entries=2``)."""
        if not force and not self.room(nbytes):
            raise Full(f"{self.unacked()[0]} entries wait for acknowledgement")
        self.head += 1
        entry = Entry(self.head, self.term, payload, nbytes)
        if self.backups:
            self.entries.append(entry)
            self._total += nbytes
            self._cum.append(self._total)
        self._advance()
        return entry

    # -- backups ---------------------------------------------------------------------

    def to_send(self, backup: str) -> list[Entry]:
        """The entries ``backup`` was not sent yet, in order (marked sent)."""
        b = self.backups[backup]
        if b.installing:
            return []
        out = self._after(b.sent)
        b.sent = max(b.sent, self.head)
        return out

    def resend(self, backup: str) -> None:
        """Send ``backup`` everything after its acknowledgement again (a gap, a
        reconnect)."""
        b = self.backups[backup]
        b.sent = b.acked

    def ack(self, backup: str, index: int) -> list[Entry]:
        """``backup`` applied every entry up to ``index``: the entries newly committed."""
        b = self.backups.get(backup)
        if b is None or b.installing or index <= b.acked:
            return []
        b.acked = min(index, self.head)
        b.sent = max(b.sent, b.acked)
        if b.acked == self.head:
            b.in_sync = True
        return self._advance()

    def remove(self, backup: str) -> list[Entry]:
        """``backup`` is gone (dead, or dropped): the entries that no longer wait for it."""
        self.backups.pop(backup, None)
        return self._advance()

    def join(self, backup: str, at: int, *, installing: bool = False) -> None:
        """``backup`` holds a copy as of index ``at`` (the head when the copy was
        taken): it is sent what came after and counts for commits once it has
        acknowledged the head. ``installing``: its copy is still on its way (taken
        now, ``at`` the head): nothing is sent to it before :meth:`installed`, and it
        counts for no commit before it caught up."""
        oldest = self.entries[0].index - 1 if self.entries else self.head
        if not oldest <= at <= self.head:
            raise ValueError(f"a copy as of {at} is outside the retained {oldest}..{self.head}")
        self.backups[backup] = _Backup(at, at, at == self.head and not installing, installing)

    def installed(self, backup: str) -> None:
        """``backup``'s copy is installed: send it what came after its index."""
        b = self.backups.get(backup)
        if b is not None:
            b.installing = False
            b.sent = b.acked
            if b.acked == self.head:
                b.in_sync = True
                self._advance()

    def joining(self) -> list[str]:
        """Backups not in sync yet (a copy installing or catching up)."""
        return [name for name, b in self.backups.items() if not b.in_sync]

    def in_sync(self) -> list[str]:
        return [name for name, b in self.backups.items() if b.in_sync]

    # -- internals ---------------------------------------------------------------------

    def _advance(self) -> list[Entry]:
        # a joining backup further behind than the bound is dropped: its copy starts
        # again later, and the log never grows past the bound for it
        for name, b in list(self.backups.items()):
            if not b.in_sync and (
                self.head - b.acked > self.join_entries
                or self._bytes_after(b.acked) > self.join_bytes
            ):
                del self.backups[name]
                self.dropped.append(name)
        committed = min((b.acked for b in self.backups.values() if b.in_sync), default=self.head)
        newly = [e for e in self._after(self.committed) if e.index <= committed]
        self.committed = max(self.committed, committed)
        keep_from = min((b.acked for b in self.backups.values()), default=self.head)
        while self.entries and self.entries[0].index <= keep_from:
            self.entries.popleft()
            self._cum.popleft()
        return newly


class ReplicaLog:
    """A backup's side: the index it applied up to, and its last entries."""

    def __init__(
        self,
        term: int,
        applied: int = 0,
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
    ):
        self.term = term
        self.applied = applied
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        #: its last entries (at most ``max_entries`` and ``max_bytes``): what the other
        #: backups may lack if it is promoted
        self.kept: deque[Entry] = deque()
        self._kept_bytes = 0

    def offer(self, entry: Entry) -> Offer:
        """What to do with an entry from the primary."""
        if entry.term < self.term:
            return Offer.STALE
        if entry.index <= self.applied:
            return Offer.DUPLICATE
        if entry.index > self.applied + 1:
            return Offer.GAP
        self.term = entry.term
        self.applied = entry.index
        self.kept.append(entry)
        self._kept_bytes += entry.nbytes
        while len(self.kept) > self.max_entries or (
            len(self.kept) > 1 and self._kept_bytes > self.max_bytes
        ):
            self._kept_bytes -= self.kept.popleft().nbytes
        return Offer.APPLY

    def forget(self, committed: int) -> None:
        """Every in-sync backup applied the entries up to ``committed``: none of them
        is needed should this copy be promoted (the others hold them), so they are
        not kept (a backup of two copies keeps none)."""
        while self.kept and self.kept[0].index <= committed:
            self._kept_bytes -= self.kept.popleft().nbytes

    def fence(self, term: int) -> None:
        """A new primary of ``term`` was chosen: entries of older terms are refused
        from now on (one from the replaced primary, still in flight)."""
        self.term = max(self.term, term)

    def promote(self, term: int, backups: Mapping[str, int]) -> PrimaryLog:
        """This copy becomes the primary of ``term``; ``backups``: the other in-sync
        survivors and the index each applied (at most this copy's, which
        :func:`choose_primary` ensures)."""
        if term < self.term:
            raise ValueError(f"a promotion's term {term} is below {self.term}")
        self.term = term
        return PrimaryLog(term, self.applied, backups, self.kept, self.max_entries, self.max_bytes)


def choose_primary(heads: Mapping[str, int]) -> str | None:
    """The in-sync surviving copy to promote: the highest applied index (ties: the
    first name), or None when none survived (restore from a checkpoint)."""
    if not heads:
        return None
    return min(heads, key=lambda name: (-heads[name], name))


@dataclass(frozen=True)
class FailOver:
    """What :func:`fail_over` decided."""

    placement: Placement  # the new placement (its epoch one more)
    promoted: dict[int, int]  # shard id -> its new primary
    lost: list[int]  # shards with no copy left (restore them)
    under_replicated: list[int]  # shards with fewer copies than the replication


def fail_over(
    placement: Placement,
    dead: Iterable[int],
    heads: Mapping[int, Mapping[int, int]],
    replication: int | None = None,
) -> FailOver:
    """The placement once the PS ``dead`` are gone. ``heads[sid]``: the in-sync
    surviving copies of shard ``sid`` that answered (PS -> the index it applied);
    a survivor not in it (behind, or silent) is not promoted and not kept.
    ``replication``: the copies wanted (None: as many as the placement has now)."""
    gone = set(dead)
    want = placement.replication if replication is None else replication
    shards: list[ShardInfo] = []
    promoted: dict[int, int] = {}
    lost: list[int] = []
    under: list[int] = []
    for s in placement.shards:
        if not gone & set(s.copies):
            shards.append(s)
            continue
        alive = {
            ps: h for ps, h in heads.get(s.id, {}).items() if ps in s.copies and ps not in gone
        }
        if s.ps not in gone:  # only backups died: the primary stays, they are dropped
            keep = tuple(b for b in s.backups if b not in gone)
            shards.append(replace(s, backups=keep))
        else:
            new = choose_primary({str(ps): h for ps, h in alive.items()})
            if new is None:
                lost.append(s.id)
                shards.append(s)
                continue
            primary = int(new)
            promoted[s.id] = primary
            keep = tuple(b for b in s.backups if b in alive and b != primary)
            # the shard stays in its PS state (``slot``), now served by another PS
            shards.append(replace(s, ps=primary, backups=keep, slot=s.state))
        if 1 + len(shards[-1].backups) < want:
            under.append(s.id)
    new_placement = replace(placement, shards=tuple(shards), epoch=placement.epoch + 1)
    return FailOver(new_placement, promoted, lost, under)
