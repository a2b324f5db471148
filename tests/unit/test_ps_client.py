"""Two peers in memory: ParameterClient <-> PSService over the FakeNetwork (real codec).

The placement comes from ``plan`` (several shards forced with ``Partitioner(num_shards=...)``)
and shards are created on each PS with ``create_shards``, as the chief does.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pytest

from zmqps.core.initializers import initialize
from zmqps.core.partition import Partitioner, plan
from zmqps.core.variables import Placement, VariableDef
from zmqps.roles.client import ParameterClient
from zmqps.roles.ps import PSService
from zmqps.transport.base import Requester
from zmqps.transport.fake import FakeClient, FakeNetwork
from zmqps.wire import Message, Tensor, request
from zmqps.wire.errors import FencedError, InvalidArgument, NotFound, ProtocolError, RolledBack

T = TypeVar("T")

LR = 0.1
SGD = {"name": "sgd", "lr": LR}

W = VariableDef("w", (10, 4), init={"name": "glorot_uniform", "seed": 1})
B = VariableDef("b", (7,), init={"name": "normal", "stddev": 0.5, "seed": 2})
E = VariableDef("e", (20, 3), init={"name": "uniform", "low": -1.0, "high": 1.0, "seed": 3})
EMB = VariableDef(
    "emb", (23, 3), init={"name": "uniform", "low": -1.0, "high": 1.0, "seed": 4}, sparse=True
)
DENSE = (W, B, E)
ALL = (*DENSE, EMB)

LAYOUTS = [(1, 1), (1, 3), (2, 1), (2, 4), (3, 3), (3, 7)]  # (num_ps, num_shards)


def run(coro: Awaitable[T], timeout: float = 5.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


def initial(v: VariableDef) -> np.ndarray:
    return initialize(v.init, v.name, v.shape, v.dtype, 0, v.shape[0])


def grads_for(variables: Sequence[VariableDef], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.shape).astype(v.dtype) for v in variables}


class Recorder:
    """A Requester wrapper that remembers every request and reply (tests only)."""

    def __init__(self, inner: Requester) -> None:
        self.inner = inner
        self.endpoint = inner.endpoint
        self.sent: list[tuple[str, dict[str, Any], list[Tensor]]] = []
        self.replies: list[Message] = []

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
    ) -> Message:
        self.sent.append((op, dict(body or {}), list(tensors)))
        rep = await self.inner.request(op, body, tensors, timeout=timeout, attempts=attempts)
        self.replies.append(rep)
        return rep

    async def close(self) -> None:
        await self.inner.close()


class DoublePush(Recorder):
    """Sends every push twice, as a retry after a lost reply would; returns the second reply."""

    async def request(
        self,
        op: str,
        body: Mapping[str, Any] | None = None,
        tensors: Sequence[Tensor] = (),
        *,
        timeout: float | None = None,
        attempts: int = 1,
    ) -> Message:
        if op.startswith("push"):
            await super().request(op, body, tensors, timeout=timeout, attempts=attempts)
        return await super().request(op, body, tensors, timeout=timeout, attempts=attempts)


def recorders(client: ParameterClient) -> list[Recorder]:
    out = [r for r in client.ps if isinstance(r, Recorder)]
    assert len(out) == len(client.ps)
    return out


@dataclass
class Cluster:
    net: FakeNetwork
    services: list[PSService]
    placement: Placement

    def client(
        self,
        worker: str = "w0",
        incarnation: int = 0,
        *,
        chunk_bytes: int = 4 << 20,
        wrap: Callable[[FakeClient], Requester] | None = None,
        shared_memory: bool = False,
    ) -> ParameterClient:
        """A client; TCP-style frames unless ``shared_memory`` (tests/unit/test_shm.py)."""
        reqs: list[Requester] = []
        for i in range(len(self.services)):
            c = self.net.client(f"ps{i}", f"{worker}:{incarnation}")
            reqs.append(wrap(c) if wrap else c)
        return ParameterClient(
            reqs,
            self.placement,
            worker=worker,
            incarnation=incarnation,
            chunk_bytes=chunk_bytes,
            shared_memory=shared_memory,
        )

    def shard_values(self, name: str) -> np.ndarray:
        """The variable as the PS hold it, gathered from their stores."""
        v = self.placement.variable(name)
        out = np.empty(v.shape, v.dtype)
        for s in self.placement.shards_of(name):
            out[s.row_start : s.row_start + s.rows] = self.services[s.ps].store.get(s.id).values
        return out

    def versions(self) -> dict[int, int]:
        return {s.id: self.services[s.ps].store.get(s.id).version for s in self.placement.shards}


async def make_cluster(
    variables: Sequence[VariableDef] = ALL,
    num_ps: int = 2,
    num_shards: int | None = 3,
    *,
    optimizer: Mapping[str, Any] = SGD,
    chunk_bytes: int = 4 << 20,
) -> Cluster:
    placement = plan(variables, num_ps, Partitioner(num_shards=num_shards), optimizer=optimizer)
    net = FakeNetwork()
    services = [PSService(i, chunk_bytes=chunk_bytes) for i in range(num_ps)]
    for i, svc in enumerate(services):
        net.serve(f"ps{i}", svc, name=f"ps{i}")
    by_ps: dict[int, list[dict[str, Any]]] = {}
    for ps, d in placement.shard_defs():
        by_ps.setdefault(ps, []).append(d.to_wire())
    for ps, defs in by_ps.items():
        rep = await net.client(f"ps{ps}", "chief:0").request("create_shards", {"shards": defs})
        assert rep.body["shards"] == [d["id"] for d in defs]
    return Cluster(net, services, placement)


# ---------------------------------------------------------------- dense pull / push


@pytest.mark.parametrize(("num_ps", "num_shards"), LAYOUTS)
def test_pull_returns_initial_values(num_ps: int, num_shards: int) -> None:
    async def body() -> None:
        c = await make_cluster(ALL, num_ps, num_shards)
        assert len(c.placement.shards) == sum(min(num_shards, v.shape[0]) for v in ALL)
        assert {s.ps for s in c.placement.shards} == set(range(num_ps))
        client = c.client()
        params = await client.pull()
        assert set(params) == {"w", "b", "e"}  # sparse tables are not pulled whole
        for v in DENSE:
            assert params[v.name].dtype == np.dtype(v.dtype)
            np.testing.assert_array_equal(params[v.name], initial(v))
        assert client.global_step == 0
        # a sparse table can still be pulled whole by name
        emb = (await client.pull(["emb"]))["emb"]
        np.testing.assert_array_equal(emb, initial(EMB))

    run(body())


@pytest.mark.parametrize(("num_ps", "num_shards"), LAYOUTS)
def test_push_then_pull_applies_sgd(num_ps: int, num_shards: int) -> None:
    async def body() -> None:
        c = await make_cluster(ALL, num_ps, num_shards)
        client = c.client()
        g = grads_for(DENSE, seed=7)
        await client.push(g)
        assert client.global_step == 0  # a plain push does not refresh values or versions
        params = await client.pull()
        for v in DENSE:
            expected = initial(v) - np.float32(LR) * g[v.name]
            np.testing.assert_array_equal(params[v.name], expected)
            np.testing.assert_array_equal(c.shard_values(v.name), expected)
        dense_ids = {s.id for s in c.placement.shards if s.var != "emb"}
        assert {
            sid: ver for sid, ver in client.versions.items() if sid in dense_ids
        } == dict.fromkeys(dense_ids, 1)
        assert client.global_step == 1
        assert sum(svc.store.updates_applied for svc in c.services) == len(dense_ids)
        # the sparse table was not touched
        np.testing.assert_array_equal(c.shard_values("emb"), initial(EMB))

    run(body())


def test_push_of_some_variables_touches_only_their_shards() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 3, 3)
        client = c.client()
        g = grads_for([B], seed=1)
        await client.push(g)
        b_ids = {s.id for s in c.placement.shards_of("b")}
        assert {sid for sid, ver in c.versions().items() if ver} == b_ids
        np.testing.assert_array_equal(c.shard_values("w"), initial(W))

    run(body())


def test_push_pull_returns_updated_values_in_one_round_trip() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 3, 4)
        client = c.client(wrap=Recorder)
        g = grads_for(DENSE, seed=3)
        await client.push(g, pull=True)
        for v in DENSE:
            np.testing.assert_array_equal(
                client.params[v.name], initial(v) - np.float32(LR) * g[v.name]
            )
        ops = [op for r in recorders(client) for op, _, _ in r.sent]
        assert ops == ["push_pull"] * 3  # one message per PS, nothing else
        assert client.global_step == 1

    run(body())


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_small_chunks_give_identical_results(dtype: str) -> None:
    big_var = VariableDef("big", (40, 8), init={"name": "normal", "seed": 5})
    variables = tuple(
        VariableDef(v.name, v.shape, dtype, v.init, v.optimizer, v.sparse)
        for v in (*DENSE, big_var)
    )
    grads = [grads_for(variables, seed=s) for s in (1, 2, 3)]
    per_chunk = 64 // np.dtype(dtype).itemsize

    async def train(chunk_bytes: int) -> tuple[dict[str, np.ndarray], Cluster, list[Recorder]]:
        c = await make_cluster(variables, 2, 3, chunk_bytes=chunk_bytes)
        client = c.client(chunk_bytes=chunk_bytes, wrap=Recorder)
        await client.pull()
        await client.push(grads[0])
        await client.pull()
        for g in grads[1:]:
            await client.push(g, pull=True)
        return {k: v.copy() for k, v in client.params.items()}, c, recorders(client)

    async def body() -> None:
        big, _, _ = await train(4 << 20)
        small, c, recs = await train(64)
        for name in big:
            np.testing.assert_array_equal(small[name], big[name])
        # every frame is at most 64 bytes, and each shard travelled as ceil(size / chunk)
        # frames both ways
        sizes = {s.id: s.rows * c.placement.variable(s.var).row_size for s in c.placement.shards}
        chunked = 0
        for r in recs:
            for (op, body_, ts), rep in zip(r.sent, r.replies, strict=True):
                frames = rep.tensors if op.startswith("pull") or op == "push_pull" else ()
                for group in (ts, frames):
                    assert all(t.array.nbytes <= 64 for t in group)
                    for sid in body_["shards"]:
                        n = sum(1 for t in group if t.ref == sid)
                        if group:
                            assert n == -(-sizes[sid] // per_chunk), (op, sid)
                            chunked += n > 1
        assert chunked > 0

    run(body())


def test_versions_and_global_step_advance_by_one_per_push() -> None:
    async def body() -> None:
        c = await make_cluster(DENSE, 2, 3)
        client = c.client()
        dense_ids = [s.id for s in c.placement.shards]
        for k in range(1, 5):
            await client.push(grads_for(DENSE, seed=k), pull=True)
            assert client.global_step == k
            assert c.versions() == dict.fromkeys(dense_ids, k)
            assert client.versions == dict.fromkeys(dense_ids, k)
            assert client.last_staleness == 0
        total = sum(svc.status()["updates_applied"] for svc in c.services)
        assert total == 4 * len(dense_ids)

    run(body())


# ---------------------------------------------------------------- staleness


def test_staleness_of_interleaved_clients() -> None:
    async def body() -> None:
        c = await make_cluster(DENSE, 2, 2)
        a = c.client("a", wrap=Recorder)
        b = c.client("b")
        await a.pull()
        await b.push(grads_for(DENSE, 1), pull=True)
        await b.push(grads_for(DENSE, 2), pull=True)
        assert b.last_staleness == 0
        await a.push(grads_for(DENSE, 3))
        assert a.last_staleness == 2
        for r in recorders(a):
            rep = r.replies[-1]
            assert rep.body["staleness"] == [2] * len(rep.body["versions"])
            assert rep.body["versions"] == [3] * len(rep.body["versions"])
        for i, svc in enumerate(c.services):
            n = sum(1 for s in c.placement.shards if s.ps == i)
            st = svc.status()["staleness"]
            assert st["count"] == 3 * n
            assert st["max"] == 2
            assert st["sum"] == 2 * n
            assert st["histogram"] == {"0": 2 * n, "2": n}
            assert svc.store.stats()["staleness"] == st
        # SGD applies stale gradients as they come: the sum of all three updates
        p = await a.pull()
        g = [grads_for(DENSE, s) for s in (1, 2, 3)]
        for v in DENSE:
            expected = initial(v)
            for gk in g:
                expected = expected - np.float32(LR) * gk[v.name]
            np.testing.assert_allclose(p[v.name], expected, rtol=1e-6, atol=1e-6)

    run(body())


# ---------------------------------------------------------------- row-sparse


@pytest.mark.parametrize(("num_ps", "num_shards"), LAYOUTS)
def test_pull_rows_duplicates_and_order(num_ps: int, num_shards: int) -> None:
    async def body() -> None:
        c = await make_cluster(ALL, num_ps, num_shards)
        client = c.client()
        ids = [22, 0, 5, 5, 17, 0, 3, 22, 11]
        rows = await client.pull_rows("emb", ids)
        assert rows.shape == (len(ids), 3)
        assert rows.dtype == np.float32
        np.testing.assert_array_equal(rows, initial(EMB)[ids])
        assert (await client.pull_rows("emb", [])).shape == (0, 3)
        one = await client.pull_rows("emb", np.array([9]))
        np.testing.assert_array_equal(one, initial(EMB)[[9]])

    run(body())


@pytest.mark.parametrize(("num_ps", "num_shards"), LAYOUTS)
def test_push_rows_sums_duplicates(num_ps: int, num_shards: int) -> None:
    async def body() -> None:
        c = await make_cluster(ALL, num_ps, num_shards)
        client = c.client(wrap=Recorder)
        ids = np.array([4, 19, 4, 0, 22, 19, 4])
        g = np.random.default_rng(5).standard_normal((ids.size, 3)).astype(np.float32)
        await client.push_rows("emb", ids, g)

        summed = np.zeros((23, 3), np.float32)
        np.add.at(summed, ids, g)
        expected = initial(EMB)
        touched = np.unique(ids)
        expected[touched] -= np.float32(LR) * summed[touched]
        got = await client.pull_rows("emb", np.arange(23))
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
        untouched = np.setdiff1d(np.arange(23), touched)
        np.testing.assert_array_equal(got[untouched], initial(EMB)[untouched])
        np.testing.assert_array_equal(c.shard_values("emb"), got)
        # ids were deduplicated on the worker: each unique id travelled once
        sent = [
            t.array
            for r in recorders(client)
            for op, _, ts in r.sent
            if op == "push_rows"
            for t in ts
            if t.kind == "index"
        ]
        assert sorted(np.concatenate(sent).tolist()) == touched.tolist()
        # only the shards owning touched rows moved on
        owners = {
            s.id
            for s in c.placement.shards_of("emb")
            if any(s.row_start <= i < s.row_start + s.rows for i in touched)
        }
        assert {sid for sid, ver in c.versions().items() if ver} == owners
        # dense variables untouched
        np.testing.assert_array_equal(c.shard_values("w"), initial(W))

    run(body())


def test_push_rows_momentum_is_lazy() -> None:
    """Untouched rows keep their value and their momentum slot (no decay)."""
    mom = {"name": "momentum", "lr": 0.05, "momentum": 0.9}
    emb = VariableDef("emb", (12, 2), "float64", {"name": "ones"}, mom, sparse=True)

    async def body() -> None:
        c = await make_cluster([emb], 2, 3)
        client = c.client()
        steps = [([1, 7, 1], 1), ([7, 11], 2), ([1, 2, 11, 11], 3)]
        p = np.ones((12, 2))
        m = np.zeros((12, 2))
        for ids, seed in steps:
            g = np.random.default_rng(seed).standard_normal((len(ids), 2))
            await client.push_rows("emb", ids, g)
            summed = np.zeros((12, 2))
            np.add.at(summed, ids, g)
            u = np.unique(ids)
            m[u] = m[u] * 0.9 + summed[u]
            p[u] -= 0.05 * m[u]
        got = await client.pull_rows("emb", np.arange(12))
        np.testing.assert_allclose(got, p, rtol=1e-12, atol=1e-12)
        never = [0, 3, 4, 5, 6, 8, 9, 10]
        np.testing.assert_array_equal(got[never], 1.0)
        slots = np.concatenate(
            [c.services[s.ps].store.get(s.id).slots["momentum"] for s in c.placement.shards]
        )
        np.testing.assert_allclose(slots, m, rtol=1e-12, atol=1e-12)

    run(body())


def test_row_ids_out_of_range() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 2, 3)
        client = c.client(wrap=Recorder)
        for bad in ([0, 23], [-1], [5, 100]):
            with pytest.raises(InvalidArgument):
                await client.pull_rows("emb", bad)
            with pytest.raises(InvalidArgument):
                await client.push_rows("emb", bad, np.ones((len(bad), 3), np.float32))
        assert all(not r.sent for r in recorders(client))

        # the PS checks too: a row outside the shard it is sent to
        shard = c.placement.shards_of("emb")[0]
        ps = c.net.client(f"ps{shard.ps}", "rogue")
        outside = np.array([shard.row_start + shard.rows], np.int64)
        with pytest.raises(InvalidArgument, match="row index outside"):
            await ps.request(
                "pull_rows", {"shards": [shard.id]}, [Tensor(outside, "index", shard.id)]
            )
        push = {"shards": [shard.id], "versions": [0], "worker": "rogue", "inc": 0, "seq": 1}
        tensors = [
            Tensor(outside, "index", shard.id),
            Tensor(np.ones((1, 3), np.float32), "rows", shard.id),
        ]
        with pytest.raises(InvalidArgument):
            await ps.request("push_rows", push, tensors)
        assert all(ver == 0 for ver in c.versions().values())

    run(body())


def test_row_ids_that_are_not_integers_are_refused_before_anything_is_sent() -> None:
    """Float ids were cut to integers (1.5 read row 1; NaN, and floats past 2^63 such as
    a hash held as float64, all became one id), a bool mask read rows 0 and 1, and a
    string or None failed in numpy with its own error. Integer ids of any width, a list
    of ints and an empty list still go."""
    h = VariableDef("h", (64, 2), table={"row_budget": 40})

    async def body() -> None:
        c = await make_cluster((*ALL, h), 2, 3)
        client = c.client(wrap=Recorder)
        bad: list[object] = [
            np.array([1.5]),
            np.array([1.0, 2.0]),
            np.array([np.nan]),
            np.array([1.8e19]),
            np.array([True, False]),
            ["a"],
            [None],
            [2**70],
        ]
        for name, width in (("emb", 3), ("h", 2)):
            for ids in bad:
                with pytest.raises(InvalidArgument, match=f"row ids of {name} must be integers"):
                    await client.pull_rows(name, ids)
                with pytest.raises(InvalidArgument, match=f"row ids of {name} must be integers"):
                    await client.push_rows(name, ids, np.ones((1, width), np.float32))
            with pytest.raises(InvalidArgument, match=f"row ids of {name} must be integers"):
                await client.push_pull_rows(
                    name, [1], np.ones((1, width), np.float32), np.array([1.5])
                )
        assert all(not r.sent for r in recorders(client))
        assert all(ver == 0 for ver in c.versions().values())
        for ids in ([1, 2], np.array([1, 2], np.int8), np.array([1, 2], np.uint64), []):
            rows = await client.pull_rows("emb", ids)
            np.testing.assert_array_equal(rows, initial(EMB)[np.asarray(ids, np.int64)])
        wide = np.array([2**64 - 1], np.uint64)  # a hash key past 2^63: the same bits
        np.testing.assert_array_equal(
            await client.pull_rows("h", wide), await client.pull_rows("h", [-1])
        )

    run(body())


# ---------------------------------------------------------------- refused before sending


def test_bad_gradients_refused_before_anything_is_sent() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 2, 3)
        client = c.client(wrap=Recorder)
        g = grads_for(DENSE, 1)
        with pytest.raises(InvalidArgument, match="shape"):
            await client.push({**g, "w": np.ones((4, 10), np.float32)})
        with pytest.raises(InvalidArgument, match="unknown variable"):
            await client.push({**g, "nope": np.ones(3, np.float32)})
        with pytest.raises(InvalidArgument, match="shape"):
            await client.push({"b": np.ones((7, 1), np.float32)}, pull=True)
        with pytest.raises(InvalidArgument, match="shape"):
            await client.push_rows("emb", [1, 2], np.ones((3, 3), np.float32))
        with pytest.raises(InvalidArgument, match="shape"):
            await client.push_rows("emb", [1, 2], np.ones((2, 4), np.float32))
        with pytest.raises(InvalidArgument, match="unknown"):
            await client.pull(["nope"])
        with pytest.raises(InvalidArgument):
            await client.pull_rows("nope", [1])
        with pytest.raises(InvalidArgument):
            await client.push_rows("nope", [1], np.ones((1, 3), np.float32))
        assert all(not r.sent for r in recorders(client))
        assert client._seq == [0, 0]  # no sequence number was spent
        # and the client still works
        await client.push(g, pull=True)
        assert client.global_step == 1

    run(body())


def test_client_refuses_a_placement_on_unknown_ps() -> None:
    async def body() -> None:
        c = await make_cluster(DENSE, 3, 3)
        with pytest.raises(InvalidArgument, match="placed on PS 2"):
            ParameterClient(
                [c.net.client("ps0", "x"), c.net.client("ps1", "x")],
                c.placement,
                worker="x",
                incarnation=0,
            )

    run(body())


def test_ps_validates_a_push_whole() -> None:
    """A push naming two shards, one of them bad, changes nothing; its retry still counts."""

    async def body() -> None:
        c = await make_cluster([W], 1, 2)
        svc = c.services[0]
        s0, s1 = c.placement.shards
        size0, size1 = s0.rows * 4, s1.rows * 4
        push = {"shards": [0, 1], "versions": [0, 0], "worker": "w", "inc": 0, "seq": 1}
        good = [
            Tensor(np.ones(size0, np.float32), "grad", 0),
            Tensor(np.ones(size1, np.float32), "grad", 1),
        ]
        bad = [good[0], Tensor(np.ones(size1 - 1, np.float32), "grad", 1)]
        ps = c.net.client("ps0", "w")
        with pytest.raises(InvalidArgument):
            await ps.request("push", push, bad)
        assert c.versions() == {0: 0, 1: 0}
        np.testing.assert_array_equal(c.shard_values("w"), initial(W))
        rep = await ps.request("push", push, good)  # same seq: not recorded as applied before
        assert rep.body["applied"] is True
        assert c.versions() == {0: 1, 1: 1}
        # more malformed pushes, all refused with nothing changed
        cases: list[tuple[dict[str, Any], list[Tensor], type[Exception]]] = [
            ({**push, "seq": 2, "shards": [0, 0], "versions": [1, 1]}, good[:1], InvalidArgument),
            ({**push, "seq": 2, "versions": [1]}, good, InvalidArgument),
            # a version ahead of the PS's: values it never had (gone with a PS made
            # anew since): pull again
            ({**push, "seq": 2, "versions": [1, 5]}, good, RolledBack),
            ({**push, "seq": 2, "versions": [1, -1]}, good, ProtocolError),
            ({**push, "seq": 2, "shards": [0, 9], "versions": [1, 0]}, good[:1], NotFound),
            ({**push, "seq": 2, "shards": [0], "versions": [1]}, good, InvalidArgument),
            ({**push, "seq": 2}, [good[0]], InvalidArgument),  # no gradient for shard 1
            (
                {**push, "seq": 2, "versions": [1, 1]},
                [good[0], Tensor(good[1].array, "value", 1)],
                InvalidArgument,
            ),
        ]
        for b, ts, exc in cases:
            with pytest.raises(exc):
                await ps.request("push", b, ts)
        assert c.versions() == {0: 1, 1: 1}
        assert svc.store.updates_applied == 2
        assert svc.dropped["rolled_back"] == 1  # the version ahead, counted
        with pytest.raises(NotFound):
            await ps.request("pull", {"shards": [0, 9]})

    run(body())


# ---------------------------------------------------------------- exactly once, fencing


def test_retried_push_message_is_applied_once() -> None:
    async def body() -> None:
        c = await make_cluster([W, B], 1, 2)
        svc = c.services[0]
        client = c.client()
        sids = [s.id for s in c.placement.shards]
        g = grads_for([W, B], 9)
        tensors = [Tensor(_part(g, c, s.id), "grad", s.id) for s in c.placement.shards]
        body_ = {"shards": sids, "versions": [0] * len(sids), "worker": "w0", "inc": 0, "seq": 1}
        msg = request("push", body_, tensors, id=1, sender="w0:0")
        first = svc(msg)
        second = svc(msg)  # the same message again: a retry after a lost reply
        assert first.body["applied"] is True
        assert second.body["applied"] is False
        assert second.body["staleness"] == []
        assert first.body["versions"] == second.body["versions"] == [1] * len(sids)
        assert svc.duplicates == 1
        assert svc.status()["updates_applied"] == len(sids)
        params = await client.pull()
        for v in (W, B):
            np.testing.assert_array_equal(params[v.name], initial(v) - np.float32(LR) * g[v.name])
        # push_pull retried: applied once, but both replies carry the fresh values
        msg2 = request("push_pull", {**body_, "versions": [1] * len(sids), "seq": 2}, tensors, id=2)
        r1, r2 = svc(msg2), svc(msg2)
        assert (r1.body["applied"], r2.body["applied"]) == (True, False)
        assert r1.body["versions"] == r2.body["versions"] == [2] * len(sids)
        for t1, t2 in zip(r1.tensors, r2.tensors, strict=True):
            np.testing.assert_array_equal(t1.array, t2.array)

    run(body())


def _part(g: Mapping[str, np.ndarray], c: Cluster, sid: int) -> np.ndarray:
    s = c.placement.shards[sid]
    v = c.placement.variable(s.var)
    flat = g[s.var].reshape(-1)
    return flat[s.row_start * v.row_size : (s.row_start + s.rows) * v.row_size]


@pytest.mark.parametrize("pull", [False, True])
def test_client_retry_is_applied_once(pull: bool) -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 3, 3)
        client = c.client(wrap=DoublePush)
        g = grads_for(DENSE, 4)
        await client.push(g, pull=pull)
        ids = np.array([3, 3, 9])
        rg = np.ones((3, 3), np.float32)
        await client.push_rows("emb", ids, rg)
        params = await client.pull()
        for v in DENSE:
            np.testing.assert_array_equal(params[v.name], initial(v) - np.float32(LR) * g[v.name])
        expected = initial(EMB)
        expected[3] -= np.float32(LR) * 2
        expected[9] -= np.float32(LR)
        np.testing.assert_allclose(
            await client.pull_rows("emb", np.arange(23)), expected, rtol=1e-6
        )
        assert all(v == 1 for sid, v in c.versions().items() if sid in _touched(c, [3, 9]))
        pushes = sum(1 for r in recorders(client) for op, _, _ in r.sent if op.startswith("push"))
        assert sum(svc.duplicates for svc in c.services) == pushes // 2

    run(body())


def _touched(c: Cluster, rows: Sequence[int]) -> set[int]:
    out = {s.id for s in c.placement.shards if s.var != "emb"}
    for s in c.placement.shards_of("emb"):
        if any(s.row_start <= r < s.row_start + s.rows for r in rows):
            out.add(s.id)
    return out


def test_older_incarnation_is_fenced() -> None:
    async def body() -> None:
        c = await make_cluster(ALL, 2, 2)
        old = c.client("w0", incarnation=1)
        new = c.client("w0", incarnation=2)
        g1, g2, g3 = (grads_for(DENSE, s) for s in (1, 2, 3))
        await old.push(g1)
        await old.push_rows("emb", [0, 22], np.ones((2, 3), np.float32))
        await new.push(g2)  # the restarted worker takes over on every PS
        await new.push_rows("emb", [0, 22], np.ones((2, 3), np.float32))
        before = c.versions()
        with pytest.raises(FencedError):
            await old.push(g3)
        with pytest.raises(FencedError):
            await old.push(g3, pull=True)
        with pytest.raises(FencedError):
            await old.push_rows("emb", [0], np.ones((1, 3), np.float32))
        assert c.versions() == before
        assert sum(svc.status()["fenced"] for svc in c.services) >= 3
        # pulls are not fenced: a replaced worker can still read
        params = await old.pull()
        for v in DENSE:
            np.testing.assert_allclose(
                params[v.name],
                initial(v) - np.float32(LR) * g1[v.name] - np.float32(LR) * g2[v.name],
                rtol=1e-6,
                atol=1e-6,
            )
        # the new incarnation carries on
        await new.push(g3, pull=True)
        assert new.global_step == 3

    run(body())


# ---------------------------------------------------------------- optimizers through the PS


def _adam_ref(
    cfg: Mapping[str, Any], steps: int
) -> Callable[[np.ndarray, list[np.ndarray]], np.ndarray]:
    def ref(p: np.ndarray, gs: list[np.ndarray]) -> np.ndarray:
        lr, b1, b2, eps = (
            cfg["lr"],
            cfg.get("beta1", 0.9),
            cfg.get("beta2", 0.999),
            cfg.get("eps", 1e-8),
        )
        m, v = np.zeros_like(p), np.zeros_like(p)
        for t, g in enumerate(gs[:steps], start=1):
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
            p = p - lr_t * m / (np.sqrt(v) + eps)
        return p

    return ref


def _momentum_ref(
    cfg: Mapping[str, Any], steps: int
) -> Callable[[np.ndarray, list[np.ndarray]], np.ndarray]:
    def ref(p: np.ndarray, gs: list[np.ndarray]) -> np.ndarray:
        lr, mu, nesterov = cfg["lr"], cfg.get("momentum", 0.9), cfg.get("nesterov", False)
        m = np.zeros_like(p)
        for g in gs[:steps]:
            m = mu * m + g
            p = p - lr * (g + mu * m) if nesterov else p - lr * m
        return p

    return ref


OPTIMIZERS = [
    ({"name": "adam", "lr": 0.01}, _adam_ref),
    ({"name": "adam", "lr": 0.05, "beta1": 0.5, "beta2": 0.9, "eps": 1e-6}, _adam_ref),
    ({"name": "momentum", "lr": 0.05, "momentum": 0.9}, _momentum_ref),
    ({"name": "momentum", "lr": 0.05, "momentum": 0.8, "nesterov": True}, _momentum_ref),
]


@pytest.mark.parametrize(
    ("cfg", "make_ref"), OPTIMIZERS, ids=lambda x: str(x) if isinstance(x, dict) else ""
)
@pytest.mark.parametrize(("num_ps", "num_shards"), [(1, 1), (3, 4)])
def test_optimizer_through_ps_matches_numpy(
    cfg: dict[str, Any], make_ref: Any, num_ps: int, num_shards: int
) -> None:
    variables = tuple(VariableDef(v.name, v.shape, "float64", v.init) for v in DENSE)
    steps = 5
    gs = [grads_for(variables, s) for s in range(steps)]

    async def body() -> None:
        c = await make_cluster(variables, num_ps, num_shards, optimizer=cfg)
        client = c.client()
        for g in gs:
            await client.push(g, pull=True)
        ref = make_ref(cfg, steps)
        for v in variables:
            expected = ref(initial(v), [g[v.name] for g in gs])
            np.testing.assert_allclose(client.params[v.name], expected, rtol=1e-12, atol=1e-12)

    run(body())


def test_per_variable_optimizers() -> None:
    """Each variable keeps its own optimizer; the others use the job default (SGD)."""
    adam = {"name": "adam", "lr": 0.01}
    mom = {"name": "momentum", "lr": 0.05, "momentum": 0.9}
    variables = (
        VariableDef("w", (10, 4), "float64", W.init, adam),
        VariableDef("b", (7,), "float64", B.init, mom),
        VariableDef("e", (20, 3), "float64", E.init),
    )
    gs = [grads_for(variables, s) for s in range(4)]

    async def body() -> None:
        c = await make_cluster(variables, 2, 3)
        client = c.client()
        for g in gs:
            await client.push(g, pull=True)
        refs = {"w": _adam_ref(adam, 4), "b": _momentum_ref(mom, 4)}
        for v in variables:
            seq = [g[v.name] for g in gs]
            if v.name in refs:
                expected = refs[v.name](initial(v), seq)
            else:
                expected = initial(v) - LR * sum(seq)
            np.testing.assert_allclose(client.params[v.name], expected, rtol=1e-12, atol=1e-12)
        slots = {s.var: set(c.services[s.ps].store.get(s.id).slots) for s in c.placement.shards}
        assert slots == {"w": {"m", "v"}, "b": {"momentum"}, "e": set()}

    run(body())


def test_ps_ping_status_and_unknown_op() -> None:
    async def body() -> None:
        c = await make_cluster(DENSE, 2, 2)
        ps1 = c.net.client("ps1", "x")
        assert (await ps1.request("ping")).body == {"role": "ps", "index": 1}
        st = (await ps1.request("status")).body
        assert st["role"] == "ps" and st["index"] == 1
        assert st["shards"] == len(c.services[1].store)
        assert st["bytes"] == c.services[1].store.nbytes() > 0
        assert (st["duplicates"], st["fenced"], st["updates_applied"]) == (0, 0, 0)
        with pytest.raises(ProtocolError, match="does not serve"):
            await ps1.request("register", {"role": "worker", "index": 0, "incarnation": 0})
        await ps1.request("shutdown", {"reason": "test"})
        assert c.services[1].shutdown_requested.is_set()
        assert not c.services[0].shutdown_requested.is_set()

    run(body())
