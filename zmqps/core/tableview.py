"""A frozen copy of a hash-keyed table's rows that reads like a read-only pull.

Rules of this module:

* A :class:`TableView` holds a table's live ids (ascending, unique) and their rows,
  as an export or a checkpoint carries them, plus what the PS would compute for an
  id without a row: the variable's initializer, name and seed (its initial value,
  :func:`~zmqps.core.hashtable.initial_rows`), or zeros when ids needed more than one
  sighting to be admitted (``admit_after > 1``).
* :meth:`TableView.rows` is what ``pull_rows(..., create=False)`` returns on the PS
  that held these rows (:meth:`~zmqps.core.hashshard.HashShard.peek`), bit for bit;
  it never changes the view.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.hashtable import TableConfig, initial_rows

__all__ = ["TableView"]

Array = npt.NDArray[Any]


@dataclass(frozen=True, eq=False)
class TableView:
    """Rows ``values`` (``(n, *row_shape)``) of ``ids`` (int64 ``(n,)``, ascending) of
    the table ``name``; ``init`` its initializer and ``table`` its row policy."""

    name: str
    ids: Array
    values: Array
    init: Mapping[str, Any]
    table: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids, values = np.asarray(self.ids), np.asarray(self.values)
        if ids.dtype != np.int64 or ids.ndim != 1:
            raise ValueError(f"table {self.name}: ids must be a 1-D int64 array")
        if values.ndim < 2 or values.shape[0] != ids.size:
            raise ValueError(
                f"table {self.name}: values {values.shape} do not match {ids.size} ids"
            )
        if ids.size > 1 and not bool((np.diff(ids) > 0).all()):
            raise ValueError(f"table {self.name}: ids must be unique and ascending")
        TableConfig.parse(self.table)  # a clear ValueError for a bad policy

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    @property
    def admits_at_once(self) -> bool:
        return TableConfig.parse(self.table).admit_after <= 1

    def __len__(self) -> int:
        return int(self.ids.size)

    def rows(self, ids: Any) -> Array:
        """Rows of ``ids`` (any int64, duplicates allowed): the stored row of a known id,
        else its initial value (zeros while ids need several sightings)."""
        q = np.asarray(ids, dtype=np.int64).reshape(-1)
        pos = np.searchsorted(self.ids, q)
        pos_c = np.minimum(pos, max(self.ids.size - 1, 0))
        known = (pos < self.ids.size) & (self.ids[pos_c] == q) if self.ids.size else pos < 0
        out = np.zeros((q.size, *self.row_shape), self.values.dtype)
        out[known] = self.values[pos_c[known]]
        if self.admits_at_once and not known.all():
            width = int(np.prod(self.row_shape))
            fresh = initial_rows(self.init, self.name, q[~known], width, str(self.values.dtype))
            out[~known] = fresh.reshape((-1, *self.row_shape))
        return out
