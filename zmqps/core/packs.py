"""Packs: one PS state's small dense shards, moved and updated as one buffer (sans-IO).

A model of many small variables (biases, norms, small layers) costs a PS and a worker
per shard: a frame, a spec, a version check and an optimizer call each, hundreds of
times per step. A pack lays such shards out back to back, in one buffer on the PS
(values and each optimizer slot) and in one frame or one span of a shared-memory
region on the wire, so a pull is one copy and a push one check and one kernel call.

Rules of this module:

* :func:`plan_packs` is a pure function of the shards' definitions: the PS (from the
  shards it creates) and the worker (from the placement) compute the same packs.
  Neither relies on it: a message names its shards, in order, and a PS that does not
  hold them as one pack takes the message shard by shard (:func:`split`).
* A shard is packed when it is dense, float32 on the wire and in memory, and at most
  :data:`PACK_SHARD_BYTES`; shards pack with shards of the same optimizer
  configuration only (one kernel call applies one configuration), in shard-id order,
  at most :data:`PACK_BYTES` per pack (one frame, one optimizer pass), two or more per
  pack.
* Each shard keeps its own version, staleness and optimizer step: a pack is applied
  by one kernel call only when every shard in it is at the same version (then the
  optimizer's step is the same for all); otherwise shard by shard.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.variables import ShardDef
from zmqps.wire.errors import InvalidArgument

__all__ = ["PACK_BYTES", "PACK_SHARD_BYTES", "packable", "plan_packs", "split", "units"]

Array = npt.NDArray[Any]

#: the largest shard that is packed (bytes of values)
PACK_SHARD_BYTES = 64 << 10
#: the most bytes of values in one pack: one frame of the default chunk size
PACK_BYTES = 4 << 20


def packable(d: ShardDef) -> bool:
    """Whether shard ``d`` may travel and be updated in a pack."""
    return (
        not d.sparse
        and d.table is None
        and d.dtype == "float32"
        and d.wire is None
        and d.nbytes <= PACK_SHARD_BYTES
    )


def _config_key(d: ShardDef) -> str:
    return json.dumps(dict(d.optimizer), sort_keys=True, default=str)


def plan_packs(defs: Iterable[ShardDef]) -> list[tuple[int, ...]]:
    """The packs of one PS state's shards: each a tuple of shard ids, ascending.

    Deterministic: the same definitions in any order give the same packs."""
    by_config: dict[str, list[ShardDef]] = {}
    for d in sorted(defs, key=lambda d: d.id):
        if packable(d):
            by_config.setdefault(_config_key(d), []).append(d)
    packs: list[tuple[int, ...]] = []
    for key in sorted(by_config):
        current: list[int] = []
        size = 0
        for d in by_config[key]:
            if current and size + d.nbytes > PACK_BYTES:
                packs.append(tuple(current))
                current, size = [], 0
            current.append(d.id)
            size += d.nbytes
        packs.append(tuple(current))
    return sorted((p for p in packs if len(p) >= 2), key=lambda p: p[0])


def split(flat: Array, sizes: Sequence[int], what: str) -> list[Array]:
    """``flat`` (1-D) cut into consecutive views of ``sizes`` elements, which must
    cover it exactly (InvalidArgument otherwise, naming ``what``)."""
    if not isinstance(flat, np.ndarray) or flat.ndim != 1:
        raise InvalidArgument(f"{what}: a packed tensor must be 1-D")
    total = int(sum(sizes))
    if flat.shape[0] != total:
        raise InvalidArgument(
            f"{what}: a packed tensor of {flat.shape[0]} elements for shards of {total}"
        )
    out: list[Array] = []
    pos = 0
    for n in sizes:
        out.append(flat[pos : pos + n])
        pos += n
    return out


def units(sids: Sequence[int], packs: Sequence[int]) -> tuple[list[Sequence[int]], list[int]]:
    """A message's shards as its leading packs (``packs``: the number of shards in
    each) and the shards that travel on their own (InvalidArgument if the packs name
    more shards than the message has)."""
    if sum(packs) > len(sids):
        raise InvalidArgument(f"packs of {sum(packs)} shards in a message of {len(sids)}")
    spans: list[Sequence[int]] = []
    pos = 0
    for n in packs:
        spans.append(sids[pos : pos + n])
        pos += n
    return spans, list(sids[pos:])
