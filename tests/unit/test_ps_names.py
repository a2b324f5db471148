"""A PS's table of worker names, at its bound, never locks out a worker the chief
registers: pushes under invented names (no worker registered with them) made a PS
refuse the real worker's fence for good, and training never started. Runs through the
in-memory cluster of tests/unit/test_ps_client.py."""

from __future__ import annotations

import numpy as np
import pytest
from test_ps_client import ALL, DENSE, grads_for, initial, make_cluster, run

from zmqps.wire.errors import InvalidArgument


def zeros() -> dict[str, np.ndarray]:
    """A push that changes nothing (SGD of a zero gradient)."""
    return {v.name: np.zeros(v.shape, v.dtype) for v in DENSE}


def test_a_registered_worker_takes_the_place_of_an_invented_name() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 1, 1)
        ps = c.services[0]
        ps.dedup.max_workers = 6
        for i in range(6):  # a client inventing names fills the table
            assert await c.client(f"invented{i}").push(zeros())
        with pytest.raises(InvalidArgument, match="refused"):
            await c.client("invented6").push(zeros())
        chief = c.net.client("ps0", "chief:0")
        rep = await chief.request("fence", {"worker": "worker:0", "inc": 7})
        assert rep.body["cursor"] == 0
        assert "invented0" not in ps.dedup and "worker:0" in ps.dedup
        w = c.client("worker:0", 7)
        assert await w.push(grads_for(DENSE, 1))  # the registered worker trains
        assert not np.array_equal(c.shard_values("w"), initial(DENSE[0]))
        # once every name is one the chief registered, a new one is refused
        for i in range(1, 6):
            await chief.request("fence", {"worker": f"worker:{i}", "inc": 1})
        assert ps.dedup.unregistered() is None
        with pytest.raises(InvalidArgument, match="refused"):
            await chief.request("fence", {"worker": "worker:6", "inc": 1})

    run(body())
