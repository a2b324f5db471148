"""A variable's wire dtype (``--wire-dtype bfloat16``): its values and gradients travel
rounded to bfloat16 (half the bytes) by TCP and by shared memory alike, while the PS
keep float32 values and slots and update them in float32 with the gradient widened
exactly; the chief's and an evaluator's pulls get the exact values; a float32 gradient
for such a variable is refused naming both dtypes; sync steps and backups take the
same bfloat16 gradients (copies stay bit-identical)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_ps_client import LR, Recorder, initial, make_cluster, run

from zmqps.core import lowp
from zmqps.core.variables import VariableDef
from zmqps.wire import Tensor
from zmqps.wire.errors import InvalidArgument, NonFiniteGradient

W = VariableDef("w", (40, 16), init={"name": "glorot_uniform", "seed": 1}, wire="bfloat16")
B = VariableDef("b", (7,), init={"name": "normal", "stddev": 0.5, "seed": 2})  # float32 wire
VARS = (W, B)


def rounded(a: np.ndarray) -> np.ndarray:
    """``a`` as it arrives through a bfloat16 wire (rounded, widened back)."""
    return lowp.narrow(a).astype(np.float32).reshape(a.shape)


def grads(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {v.name: rng.standard_normal(v.shape).astype(np.float32) for v in VARS}


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_a_bfloat16_variable_travels_rounded_and_is_updated_in_float32(shm: bool) -> None:
    async def body() -> None:
        c = await make_cluster(VARS, 2, 2)
        client = c.client(shared_memory=shm, wrap=Recorder)
        params = await client.pull()
        np.testing.assert_array_equal(params["w"], rounded(initial(W)))
        np.testing.assert_array_equal(params["b"], initial(B))  # float32 travels as it is
        master = {v.name: initial(v) for v in VARS}
        for step in range(3):
            g = grads(step)
            await client.push(g, pull=True)
            # the PS: float32 master, the gradient as it came (rounded), widened exactly
            master["w"] = master["w"] + np.float32(-LR) * rounded(g["w"])
            master["b"] = master["b"] + np.float32(-LR) * g["b"]
            np.testing.assert_array_equal(c.shard_values("w"), master["w"])
            np.testing.assert_array_equal(c.shard_values("b"), master["b"])
            np.testing.assert_array_equal(client.params["w"], rounded(master["w"]))
        if not shm:  # half the bytes: every w tensor on the wire is bfloat16
            sent = [t for r in client.ps for _, _, ts in r.sent for t in ts]  # type: ignore[attr-defined]
            back = [t for r in client.ps for rep in r.replies for t in rep.tensors]  # type: ignore[attr-defined]
            for t in sent + back:
                want = lowp.bfloat16() if c.placement.shards[t.ref].var == "w" else np.float32
                assert t.array.dtype == want
        await client.close()

    run(body())


def test_a_float32_gradient_for_a_bfloat16_variable_is_refused_naming_both() -> None:
    async def body() -> None:
        c = await make_cluster(VARS, 1, 1)
        (sid,) = [s.id for s in c.placement.shards_of("w")]
        before = c.shard_values("w").copy()
        raw = c.net.client("ps0", "w9:0")
        body_ = {"shards": [sid], "versions": [0], "worker": "w9", "inc": 0, "seq": 1}
        g = np.ones(40 * 16, np.float32)
        with pytest.raises(InvalidArgument, match=r"float32, the variable is float32 \(travels as"):
            await raw.request("push", body_, [Tensor(g, "grad", sid)])
        bad = lowp.narrow(g)
        bad[17] = np.nan
        with pytest.raises(NonFiniteGradient, match="element 17"):
            await raw.request("push", {**body_, "seq": 2}, [Tensor(bad, "grad", sid)])
        huge = lowp.narrow(g)
        huge[3] = 2.0**33
        with pytest.raises(NonFiniteGradient, match="element 3"):
            await raw.request("push", {**body_, "seq": 3}, [Tensor(huge, "grad", sid)])
        np.testing.assert_array_equal(c.shard_values("w"), before)

    run(body())


def test_an_exact_client_pulls_the_values_as_the_ps_keep_them() -> None:
    async def body() -> None:
        from zmqps.roles.client import ParameterClient

        c = await make_cluster(VARS, 2, 2)
        worker = c.client()
        await worker.push(grads(5))
        reqs = [c.net.client(f"ps{i}", "chief:0") for i in range(2)]
        exact = ParameterClient(reqs, c.placement, worker="chief", incarnation=0, exact=True)
        params = await exact.pull()
        np.testing.assert_array_equal(params["w"], c.shard_values("w"))  # not rounded
        assert not np.array_equal(params["w"], rounded(params["w"]))

    run(body())


def test_only_dense_float32_variables_travel_narrower() -> None:
    with pytest.raises(InvalidArgument, match="dense variables only"):
        VariableDef("e", (4, 2), sparse=True, wire="bfloat16")
    with pytest.raises(InvalidArgument, match="for float32 variables, not float64"):
        VariableDef("d", (4,), dtype="float64", wire="bfloat16")
    with pytest.raises(InvalidArgument, match="not in bfloat16"):
        VariableDef("d", (4,), wire="int8")
    plain = VariableDef("d", (4,))
    assert plain.with_wire("bfloat16").wire == "bfloat16"
    assert VariableDef("e", (4, 2), sparse=True).with_wire("bfloat16").wire is None
    assert VariableDef("h", (4,), dtype="float16").with_wire("bfloat16").wire is None
    assert VariableDef.from_wire(plain.with_wire("bfloat16").to_wire()).wire == "bfloat16"
    assert "wire" not in plain.to_wire()  # a placement without wire dtypes reads as before


def test_sync_steps_and_backups_take_the_same_bfloat16_gradients() -> None:
    """Sync: the step applies the mean of the gradients as they came (rounded);
    replicated: every backup ends bit-identical to its primary."""
    from test_ps_replication import Cluster

    async def body() -> None:
        c = Cluster(3, 2)
        c.variables.cfg = dataclasses.replace(c.variables.cfg, wire_dtype="bfloat16")
        placement = await c.create()
        assert placement.variable("w").wire == "bfloat16"
        assert placement.variable("e").wire is None  # sparse: as it is
        w = c.worker("worker:0")
        await w.pull()
        rng = np.random.default_rng(0)
        for _ in range(4):
            g = {"w": rng.standard_normal((12, 4)).astype(np.float32)}
            g["b"] = rng.standard_normal(7).astype(np.float32)
            await w.push(g, pull=True)
        await c.settle()
        assert c.check_copies() >= 3

    run(body(), timeout=30)


def test_a_sync_step_is_the_mean_of_the_rounded_gradients() -> None:
    from test_sync import LR as SYNC_LR
    from test_sync import sync_job, until

    w = dataclasses.replace(VariableDef("w", (6, 4), init={"name": "ones"}), wire="bfloat16")

    async def body() -> None:
        job = await sync_job(2, 2, variables=(w,))
        gs = [
            {"w": np.random.default_rng(i).standard_normal((6, 4)).astype(np.float32)}
            for i in (0, 1)
        ]
        for i in (0, 1):
            await job.token(i)
        for i in (0, 1):
            assert await job.workers[i].push(gs[i], step=0)
        await until(lambda: job.step == 1)
        total = rounded(gs[0]["w"]) + rounded(gs[1]["w"])
        want = np.float32(1) + np.float32(-SYNC_LR) * (total * np.float32(0.5))
        np.testing.assert_allclose(job.values("w"), want, rtol=0, atol=1e-7)
        await job.close()

    run(body(), timeout=20)


def test_pulls_of_one_version_share_its_rounded_values() -> None:
    """A peer sending bfloat16 pulls and never reading the replies grew a PS by about
    1 MB per pull: each reply was a fresh rounded copy, under the size whose unread
    bytes a server counts. The copy is made once per version and shared (a peer that
    never reads pins one per version, as a lent float32 buffer does)."""

    async def body() -> None:
        c = await make_cluster(VARS, 1, 1)
        store = c.services[0].store
        (sid,) = [s.id for s in c.placement.shards_of("w")]
        first = [store.snapshot_wire(sid) for _ in range(1000)]
        assert len({id(a) for _, a in first}) == 1 and first[0][0] == 0
        await c.client().push(grads(1))
        version, after = store.snapshot_wire(sid)
        assert version == 1 and after is not first[0][1]
        np.testing.assert_array_equal(after, lowp.narrow(store.get(sid).values))

    run(body())


def test_variables_of_another_wire_dtype_are_a_clear_mismatch() -> None:
    """A chief resumed without the run's --wire-dtype found the variables 'created with
    different definitions' and named the model, which was the same: it names the wire
    dtype now (and zmqps launch --resume refuses it up front)."""
    from test_ps_replication import Cluster

    from zmqps.wire.errors import ModelMismatch

    async def body() -> None:
        c = Cluster(2, 1)
        cfg = c.variables.cfg
        c.variables.cfg = dataclasses.replace(cfg, wire_dtype="bfloat16")
        await c.create()
        c.variables.cfg = cfg
        with pytest.raises(
            ModelMismatch, match="travelling as bfloat16: give the chief that --wire"
        ):
            await c.create()

    run(body(), timeout=30)
