"""Sync: the next step's values with the push's reply (``Push.fresh``).

A sync step's pull reads the values of its token's step. The PS has them the moment
it applied the step the push before counted toward, when it also releases the next
token: a push that asks (sent as ``push_pull`` with ``fresh``) is answered then, with
those values and the step they are of, and the worker's next :meth:`Worker.pull`
returns them without a request of its own: a sync step costs the round trips of an
async one less one.

Rules of this module (sans-IO: the worker calls it around its pushes and pulls):

* Asked only where the next pull would take exactly those values: sync, the values
  on the worker's host, the last pull one of every dense variable into the worker's
  own arrays, and a push of every dense variable.
* Served only to the pull right after that push, when the values are of the step of
  the token the worker then holds, of the generation it is in (no restore since),
  and cover the names it pulls. Anything else pulls as without.
* A miss (the step not applied within the PS's short wait, e.g. a slower worker;
  no values brought) backs off: the next 1, 2, 4 ... :data:`MAX_BACKOFF` pushes do
  not ask, so a job whose workers wait long for each other does not move its values
  twice a step.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

__all__ = ["MAX_BACKOFF", "FreshValues"]

#: the most pushes in a row that do not ask after misses
MAX_BACKOFF = 64


@dataclass
class FreshValues:
    """One worker's record of the values its last push brought (see the module)."""

    #: the last pull took every dense variable into the worker's own arrays
    whole_pull: bool = False
    #: the last push asked; the (step, generation, names) of what it brought, if any
    asked: bool = False
    have: tuple[int, int, frozenset[str]] | None = None
    backoff: int = 1
    skip: int = 0
    hits: int = 0
    misses: int = 0
    _names: frozenset[str] = field(default_factory=frozenset)

    def ask(self, pushed: Collection[str], dense: Iterable[str], allowed: bool = True) -> bool:
        """Whether a push of ``pushed`` asks for the values of after its step (never
        unless ``allowed``: sync, and every PS of them said it takes the field)."""
        self.asked, self.have = False, None
        if not allowed or not self.whole_pull or not set(dense) <= set(pushed):
            return False
        if self.skip > 0:
            self.skip -= 1
            return False
        self.asked, self._names = True, frozenset(pushed)
        return True

    def brought(self, step: int | None, gen: int) -> None:
        """What the push that asked brought: values of sync step ``step`` (None: none
        from some PS), of generation ``gen``."""
        self.have = None if step is None else (step, gen, self._names)

    def serve(
        self, token: int | None, gen: int, wanted: Collection[str] | None, dense: Collection[str]
    ) -> bool:
        """Whether a pull of ``wanted`` (None: every dense variable) into the worker's own
        arrays, holding the token of step ``token`` in generation ``gen``, may return
        what the last push brought (forgotten either way)."""
        asked, have = self.asked, self.have
        self.asked, self.have = False, None
        names = set(dense if wanted is None else wanted)
        self.whole_pull = names >= set(dense)
        if not asked:
            return False
        if have is not None and have[0] == token and have[1] == gen and names <= have[2]:
            self.hits += 1
            self.backoff = 1
            return True
        self.misses += 1
        self.skip, self.backoff = self.backoff, min(MAX_BACKOFF, 2 * self.backoff)
        return False

    def pulled_whole(self) -> None:
        """A pull of every dense variable into the arrays a push's values land in
        (a step pipeline's host buffers), not served: the next push may ask."""
        self.asked, self.have, self.whole_pull = False, None, True

    def pulled_elsewhere(self) -> None:
        """A pull into the caller's arrays (or staged to a device): nothing is served,
        and the next push does not ask."""
        self.asked, self.have, self.whole_pull = False, None, False
