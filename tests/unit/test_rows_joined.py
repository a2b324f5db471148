"""A row request's index tensors joined into one (``counts``), sent to a PS that says
it takes ``rows_joined``: split by the PS into the request a client that does not join
them sends (:func:`split_index`), so that the tables, the rows read, the versions and a
replicated state's backups end byte for byte as with one index tensor per shard; a PS
that does not say it takes them never gets them; a malformed one is refused whole."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from test_ps_client import ALL, EMB, Recorder, make_cluster, recorders, run
from test_push_pull_rows import ADAM, SGD, batches, one_request, shard_state, two_requests

from zmqps.roles.ps import service as ps_service
from zmqps.roles.ps.service import split_index
from zmqps.wire import Message, Tensor
from zmqps.wire.errors import InvalidArgument

TAKES = ps_service.TAKES
IDS = np.arange(10, dtype=np.int64)
ROWS = np.arange(20, dtype=np.float32).reshape(10, 2)


def _split(op: str, body: dict[str, Any], tensors: list[Tensor]) -> list[tuple[str, int, Any]]:
    got = split_index(Message(op, 7, "w", body, tuple(tensors)))
    assert "counts" not in got.body and got.id == 7 and got.sender == "w"
    assert {k: v for k, v in body.items() if k != "counts"} == got.body
    return [(t.kind, t.ref, t.array.tolist()) for t in got.tensors]


def test_split_pull_rows() -> None:
    body = {"shards": [4, 5, 6], "counts": [3, 0, 7]}
    assert _split("pull_rows", body, [Tensor(IDS, "index", -1)]) == [
        ("index", 4, [0, 1, 2]),
        ("index", 5, []),
        ("index", 6, [3, 4, 5, 6, 7, 8, 9]),
    ]


def test_split_a_tcp_push_puts_each_shards_rows_after_its_ids() -> None:
    body = {"shards": [1, 2], "counts": [4, 6]}
    r1, r2 = Tensor(ROWS[:4], "rows", 1), Tensor(ROWS[4:], "rows", 2)
    got = _split("push_rows", body, [Tensor(IDS, "index", -1), r1, r2])
    assert [(k, ref) for k, ref, _ in got] == [("index", 1), ("rows", 1), ("index", 2), ("rows", 2)]
    assert got[0][2] == [0, 1, 2, 3] and got[2][2] == [4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("shm", [False, True])
def test_split_push_pull_rows(shm: bool) -> None:
    body: dict[str, Any] = {"shards": [1, 2], "pull": [2, 3], "counts": [2, 3, 1, 4]}
    tensors = [Tensor(IDS, "index", -1)]
    if shm:
        body["shm"] = {"region": 1, "offsets": [0, 64]}
    else:
        tensors += [Tensor(ROWS[:2], "rows", 1), Tensor(ROWS[2:5], "rows", 2)]
    got = _split("push_pull_rows", body, tensors)
    want = [("index", 1, [0, 1])]
    want += [] if shm else [("rows", 1, ROWS[:2].tolist())]
    want += [("index", 2, [2, 3, 4])]
    want += [] if shm else [("rows", 2, ROWS[2:5].tolist())]
    want += [("index", 2, [5]), ("index", 3, [6, 7, 8, 9])]
    assert got == want


@pytest.mark.parametrize(
    ("body", "tensors"),
    [
        ({"shards": [1, 2], "counts": [10]}, [Tensor(IDS, "index", -1)]),  # a count short
        ({"shards": [1, 2], "counts": [5, 4]}, [Tensor(IDS, "index", -1)]),  # 9 of 10 ids
        ({"shards": [1, 2], "counts": [5, 6]}, [Tensor(IDS, "index", -1)]),  # 11 of 10
        ({"shards": [1], "counts": [10]}, []),  # no tensor
        ({"shards": [1], "counts": [10]}, [Tensor(IDS, "index", 1)]),  # not ref -1
        ({"shards": [1], "counts": [10]}, [Tensor(IDS.astype(np.float32), "rows", -1)]),
        ({"shards": [1], "counts": [10]}, [Tensor(IDS.reshape(2, 5), "index", -1)]),
        ({"shards": [1], "counts": [10]}, [Tensor(IDS, "index", -1), Tensor(IDS, "index", 1)]),
    ],
)
def test_a_malformed_joined_pull_is_refused(body: dict[str, Any], tensors: list[Tensor]) -> None:
    with pytest.raises(InvalidArgument):
        split_index(Message("pull_rows", 1, "w", body, tuple(tensors)))


def test_a_tcp_push_without_its_rows_is_refused() -> None:
    body = {"shards": [1, 2], "counts": [4, 6]}
    for extra in ([], [Tensor(ROWS[:4], "rows", 1)]):
        with pytest.raises(InvalidArgument):
            split_index(Message("push_rows", 1, "w", body, (Tensor(IDS, "index", -1), *extra)))


def _counted(client: Any) -> tuple[int, int]:
    """(requests sent with their ids joined, row requests sent)"""
    sent = [(op, body) for r in recorders(client) for op, body, _ in r.sent]
    rows = [b for op, b in sent if op in ("pull_rows", "push_rows", "push_pull_rows")]
    return sum("counts" in b for b in rows), len(rows)


@pytest.mark.parametrize(("num_ps", "num_shards"), [(1, 4), (2, 3), (3, 7)])
@pytest.mark.parametrize("optimizer", [SGD, ADAM], ids=["sgd", "adam"])
def test_joined_ids_change_nothing(
    num_ps: int, num_shards: int, optimizer: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same seeded steps (repeated ids, ids at shard edges, an empty batch) against
    PS that take joined ids and PS that do not: the same rows, tables and versions."""

    async def body(joined: bool) -> tuple[Any, Any, Any, Any]:
        assert "rows_joined" in TAKES
        takes = TAKES if joined else tuple(t for t in TAKES if t != "rows_joined")
        monkeypatch.setattr(ps_service, "TAKES", takes)
        rng = np.random.default_rng(num_ps * 10 + num_shards)
        seq = batches(rng, EMB.shape[0], 12, 10)
        grads = [rng.standard_normal((ids.size, 3)).astype(np.float32) for ids in seq]
        c = await make_cluster(ALL, num_ps, num_shards, optimizer=optimizer)
        client = c.client(wrap=Recorder)
        got = await one_request(client, "emb", seq, grads)
        got += await two_requests(client, "emb", seq, grads)
        n_joined, n_rows = _counted(client)
        assert (n_joined > 0) == joined and n_rows > 0
        assert (client.rows_joined == set(range(num_ps))) == joined
        return got, shard_state(c.services), client.versions, client.version_gens

    plain = run(body(False), 20.0)
    joined = run(body(True), 20.0)
    for a, b in zip(plain[0], joined[0], strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    assert plain[1:] == joined[1:]


def test_a_replicated_primary_logs_them_split() -> None:
    """Through a replicated primary, joined requests are split before they are logged:
    every backup ends equal to its primary."""
    from test_push_pull_rows import replicated_rows

    async def body() -> None:
        c, w, rng, ids, width = await replicated_rows(4)
        for name in ids:
            await w.pull_rows(name, ids[name])
        for _ in range(4):
            for name in ids:
                nxt = np.concatenate([ids[name][:2], ids[name][::-1]])
                g = rng.standard_normal((ids[name].size, width[name])).astype(np.float32)
                applied, rows = await w.push_pull_rows(name, ids[name], g, nxt)
                assert applied and rows.shape == (nxt.size, width[name])
                ids[name] = nxt
                assert c.check_copies() > 0
        sent = [body for r in w.ps for _, body, _ in r.sent]  # type: ignore[attr-defined]
        assert any("counts" in b for b in sent)

    run(body(), 30.0)
