"""The wire copy of a bfloat16 shard: a whole-shard update writes each new value and
its bfloat16 rounding in one pass (the fused kernels' ``w``), and a pull sends that
copy, lent. The copy is exactly ``narrow(values)`` after every path that writes the
values (every optimizer, with and without numba; restore and install; a backup's
replicated apply; a sync step; a row update; a push beside a pack), and a buffer
a send still holds is never written."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from test_ps_client import make_cluster, run

from zmqps.core import _kernels, lowp, optimizers
from zmqps.core.optimizers import make_optimizer
from zmqps.core.packs import packable
from zmqps.core.store import ShardStore
from zmqps.core.variables import ShardDef, VariableDef

CONFIGS = [
    {"name": "sgd", "lr": 0.1},
    {"name": "sgd", "lr": 0.1, "weight_decay": 0.01},
    {"name": "momentum", "lr": 0.05, "momentum": 0.9},
    {"name": "momentum", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"name": "adagrad", "lr": 0.1},
    {"name": "adam", "lr": 1e-3, "weight_decay": 0.01},
    {"name": "ftrl", "lr": 0.1, "l1": 0.01},
]
IDS = [str(sorted(c.items())) for c in CONFIGS]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)
    )


def narrowed(values: np.ndarray) -> np.ndarray:
    """``narrow(values)``'s bits, by ml_dtypes' cast (the reference)."""
    with np.errstate(invalid="ignore"):
        return values.reshape(-1).astype(lowp.bfloat16()).view(np.uint16)


def _no_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimizers, "USE_KERNELS", False)
    monkeypatch.setattr(_kernels, "bits_kernel", lambda name: None)
    monkeypatch.setattr(_kernels, "kernel", lambda name, param: None)


def _start(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    p = rng.normal(size=n).astype(np.float32)
    # values on the rounding's edges: ties (odd and even), subnormals, the largest
    p[:8] = [1.00390625, 1.01171875, -1.00390625, 1e-40, -1e-45, 1.5e18, 0.0, -0.0]
    return p


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("grad_dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kernels", [True, False], ids=["numba", "numpy"])
def test_an_update_that_writes_the_wire_copy_changes_nothing_else(
    config: dict[str, Any], grad_dtype: str, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """p and slots are bit-identical to the update without a wire copy, and the copy is
    narrow(p) bit for bit, after each of several steps."""
    if not kernels:
        _no_numba(monkeypatch)
    n = 20_011
    opt = make_optimizer(config)
    runs = []
    for with_wire in (True, False):
        p = _start(n)
        slots = {k: v.reshape(-1) for k, v in opt.init_slots((n,), np.float32).items()}
        scratch = np.empty(opt.scratch_factor * n, np.float32)
        wire = np.empty(n, lowp.bfloat16()) if with_wire else None
        g_rng = np.random.default_rng(2)
        for step in range(1, 5):
            g: np.ndarray = g_rng.normal(size=n).astype(np.float32)
            if grad_dtype == "bfloat16":
                g = lowp.narrow(g)
            g.setflags(write=False)
            opt.apply_dense(p, g, slots, step, scratch, 0.5, wire)
            if wire is not None:
                assert same_bits(lowp.bits(wire), narrowed(p)), step
        runs.append((p, slots))
    (p_a, s_a), (p_b, s_b) = runs
    assert same_bits(p_a, p_b)
    for k in s_a:
        assert same_bits(s_a[k], s_b[k])


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_without_numba_the_wire_copy_has_the_kernels_rounding(
    config: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The numpy path (no compiled loop at all) writes the copy that the compiled
    rounding gives for the same values. (The two paths' updates may differ in the last
    bit where they order the operations differently; each one's copy is its own
    values' rounding.)"""
    n = 5_003
    opt = make_optimizer(config)
    p = _start(n)
    slots = {k: v.reshape(-1) for k, v in opt.init_slots((n,), np.float32).items()}
    wire = np.empty(n, lowp.bfloat16())
    g = lowp.narrow(np.random.default_rng(4).normal(size=n).astype(np.float32))
    with monkeypatch.context() as m:
        _no_numba(m)
        opt.apply_dense(p, g, slots, 1, np.empty(2 * n, np.float32), 1.0, wire)
    assert _kernels.bits_kernel("narrow_bf16") is not None
    assert same_bits(lowp.bits(wire), lowp.bits(lowp.narrow(p)))


def test_a_wire_copy_must_fit_the_parameter() -> None:
    from zmqps.wire.errors import InvalidArgument

    opt = make_optimizer({"name": "sgd", "lr": 0.1})
    p, g, scratch = np.zeros(8, np.float32), np.ones(8, np.float32), np.zeros(8, np.float32)
    for wire in (np.empty(7, lowp.bfloat16()), np.empty(8, np.float32)):
        with pytest.raises(InvalidArgument, match="wire"):
            opt.apply_dense(p, g, {}, 1, scratch, 1.0, wire)
    with pytest.raises(InvalidArgument, match="wire"):  # float32 parameters only
        opt.apply_dense(
            p.astype(np.float64), g, {}, 1, scratch.astype(np.float64), 1.0,
            np.empty(8, lowp.bfloat16()),
        )  # fmt: skip


# -- the store --------------------------------------------------------------------


def bdef(
    sid: int = 0,
    *,
    optimizer: dict[str, Any] | None = None,
    shape: tuple[int, int] = (300, 50),
    wire: str | None = "bfloat16",
) -> ShardDef:
    return ShardDef(
        id=sid,
        var=f"v{sid}",
        index=0,
        dtype="float32",
        full_shape=shape,
        row_start=0,
        rows=shape[0],
        init={"name": "normal", "seed": sid + 1},
        optimizer=optimizer or {"name": "adam", "lr": 0.01},
        wire=wire,
    )


def grad(d: ShardDef, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed).normal(size=d.size).astype(np.float32)
    return lowp.narrow(g) if d.wire else g


def pulled(store: ShardStore, sid: int) -> tuple[int, np.ndarray]:
    """A pull's values: (version, the bits), the buffer let go of."""
    version, values = store.snapshot_wire(sid)
    return version, lowp.bits(values).copy()


def assert_exact(store: ShardStore, sid: int) -> None:
    shard = store.get(sid)
    version, bits = pulled(store, sid)
    assert version == shard.version
    assert same_bits(bits, narrowed(shard.values))


def fused(store: ShardStore, sid: int) -> bool:
    """Whether the shard's wire copy is its current version's (written by the update)."""
    shard = store.get(sid)
    return shard.wire_copy is not None and shard.wire_copy[0] == shard.version


@pytest.mark.parametrize("kernels", [True, False], ids=["numba", "numpy"])
@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
def test_a_push_writes_the_wire_copy_a_pull_then_sends(
    config: dict[str, Any], kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not kernels:
        _no_numba(monkeypatch)
    d = bdef(optimizer=config)
    store = ShardStore(chunk_elems=4_000)  # several pieces per chunk
    store.create([d])
    assert_exact(store, 0)  # the initial values: rounded at the first pull
    size = d.size
    for step in range(3):
        g = grad(d, step)
        chunks = [(0, g[: size // 3]), (size // 3, g[size // 3 :])]
        store.apply_dense(0, chunks, store.get(0).version)
        assert fused(store, 0)
        assert_exact(store, 0)


def test_a_float32_twin_and_the_fused_shard_hold_the_same_values() -> None:
    """The float32 master values do not change a bit for keeping a wire copy."""
    a, b = ShardStore(), ShardStore()
    a.create([bdef()])
    b.create([bdef(wire=None)])
    for step in range(4):
        g = grad(bdef(), step)
        a.apply_dense(0, [(0, g)], step)
        b.apply_dense(0, [(0, g)], step)
        assert same_bits(a.get(0).values, b.get(0).values)
        assert same_bits(a.get(0).slots["m"], b.get(0).slots["m"])
    assert b.get(0).wire_copy is None


def test_a_lent_wire_copy_is_never_written() -> None:
    """A pull's buffer, while held (a send in flight), keeps the values of its version;
    the update writes another buffer, and buffers are reused once let go of."""
    store = ShardStore()
    store.create([bdef()])
    store.apply_dense(0, [(0, grad(bdef(), 0))], 0)
    _, held = store.snapshot_wire(0)
    kept = lowp.bits(held).copy()
    seen = {id(held)}
    for step in range(1, 6):
        store.apply_dense(0, [(0, grad(bdef(), step))], step)
        assert same_bits(lowp.bits(held), kept)  # untouched while held
        assert_exact(store, 0)
        seen.add(id(store.get(0).wire_copy[1]))  # type: ignore[index]
    assert len(seen) == 2  # the held one, and one more, reused every step after
    del held
    store.apply_dense(0, [(0, grad(bdef(), 9))], 6)
    assert_exact(store, 0)
    assert id(store.get(0).wire_copy[1]) in seen  # type: ignore[index]


def test_the_wire_copy_after_a_restore_and_an_install() -> None:
    store = ShardStore()
    store.create([bdef()])
    store.apply_dense(0, [(0, grad(bdef(), 0))], 0)
    shard = store.get(0)
    values, slots = (
        shard.values.copy() * np.float32(1.5),
        {k: v.copy() for k, v in shard.slots.items()},
    )
    store.replace([(bdef(), values, slots, 7)])
    assert not fused(store, 0)
    assert_exact(store, 0)  # rounded on demand from the restored values
    assert same_bits(store.get(0).values, values)
    store.apply_dense(0, [(0, grad(bdef(), 1))], 7)
    assert fused(store, 0)
    assert_exact(store, 0)

    other = ShardStore()
    other.replace([(bdef(), values, slots, 3)])
    store.install([*other])
    assert_exact(store, 0)
    assert same_bits(store.get(0).values, values)


def test_the_wire_copy_after_a_row_update_and_a_counted_push() -> None:
    """Updates that do not write the copy leave it at an older version: the next pull
    rounds the values afresh."""
    store = ShardStore()
    d = bdef(optimizer={"name": "sgd", "lr": 0.1})
    store.create([d])
    store.apply_dense(0, [(0, grad(d, 0))], 0)
    rows = np.array([3, 5, 200])
    store.apply_rows(0, rows, np.ones((3, 50), np.float32), 1)
    assert not fused(store, 0)
    assert_exact(store, 0)
    # a backup's replay of a sync step's push: counted, the values unchanged
    before = lowp.bits(store.snapshot_wire(0)[1]).copy()
    store.apply(store.plan_counted(0, 2, rows=False))
    assert store.get(0).version == 3
    assert_exact(store, 0)
    assert same_bits(pulled(store, 0)[1], before)


def test_a_pack_pushed_with_a_bfloat16_shard() -> None:
    """bfloat16 shards are never packed (a pack travels as float32); one push of a pack
    and such a shard keeps its copy exact."""
    sgd = {"name": "sgd", "lr": 0.1}
    small = [bdef(sid, shape=(4, 4), wire=None, optimizer=sgd) for sid in (1, 2, 3)]
    big = bdef(0, optimizer=sgd)
    assert not packable(bdef(5, shape=(4, 4)))
    store = ShardStore()
    store.create([big, *small])
    (pack,) = store.packs()
    assert pack.ids == (1, 2, 3) and store.get(0).pack is None
    for step in range(3):
        updates = [
            store.plan_pack(pack, np.full(pack.size, 0.5, np.float32), [step] * 3),
            store.plan_dense(0, [(0, grad(big, step))], step),
        ]
        store.apply_all(updates)
        assert fused(store, 0)
        assert_exact(store, 0)


# -- through the roles: a sync step, a backup's replicated apply --------------------


def _exact_everywhere(services: Any) -> int:
    """Every bfloat16 shard of every service: a pull sends exactly narrow(values)."""
    n = 0
    for svc in services:
        for shard in svc.store:
            if shard.is_table or not shard.keeps_wire_copy:
                continue
            assert_exact(svc.store, shard.definition.id)
            n += 1
    return n


def test_a_sync_step_writes_the_wire_copy() -> None:
    from test_sync import sync_job, until

    w = dataclasses.replace(VariableDef("w", (600, 4), init={"name": "ones"}), wire="bfloat16")

    async def body() -> None:
        job = await sync_job(2, 2, variables=(w,))
        for step in range(2):
            gs = [
                {"w": np.random.default_rng(i + 10 * step).normal(size=(600, 4)).astype(np.float32)}
                for i in (0, 1)
            ]
            for i in (0, 1):
                await job.token(i)
            for i in (0, 1):
                assert await job.workers[i].push(gs[i], step=step)
            await until(lambda s=step: job.step == s + 1)
        services = job.env.services
        held = [s for svc in services for s in svc.store if s.keeps_wire_copy]
        assert held and all(s.version == 2 for s in held)
        assert all(s.wire_copy is not None and s.wire_copy[0] == 2 for s in held)
        assert _exact_everywhere(services) == len(held)
        await job.close()

    run(body(), timeout=20)


def test_a_backup_applies_and_keeps_its_wire_copy_exact() -> None:
    from test_ps_replication import Cluster

    async def body() -> None:
        c = Cluster(3, 2)
        c.variables.cfg = dataclasses.replace(c.variables.cfg, wire_dtype="bfloat16")
        placement = await c.create()
        w = c.worker("worker:0")
        await w.pull()
        rng = np.random.default_rng(0)
        for _ in range(3):
            g = {"w": rng.standard_normal((12, 4)).astype(np.float32)}
            g["b"] = rng.standard_normal(7).astype(np.float32)
            await w.push(g, pull=True)
        await c.settle()
        assert c.check_copies() >= 3
        copies = []
        for s in {s.ps: s for s in placement.shards}.values():
            for q in (s.ps, *s.backups):
                copies.append(c.copy(q, s.ps))
        fresh = [sh for svc in copies for sh in svc.store if sh.keeps_wire_copy and sh.version > 0]
        assert fresh and all(sh.wire_copy[0] == sh.version for sh in fresh)  # type: ignore[index]
        assert _exact_everywhere(copies) >= len(fresh)

    run(body(), timeout=30)


def test_pulls_through_a_cluster_get_the_fused_copy() -> None:
    v = VariableDef("w", (64, 32), init={"name": "normal", "seed": 3}, wire="bfloat16")

    async def body() -> None:
        c = await make_cluster((v,), 1, 1)
        client = c.client()
        await client.pull()
        for step in range(3):
            g = np.random.default_rng(step).normal(size=(64, 32)).astype(np.float32)
            await client.push({"w": g}, pull=True)
            want = lowp.narrow(c.shard_values("w")).astype(np.float32).reshape(64, 32)
            assert same_bits(client.params["w"], want)
        assert _exact_everywhere(c.services) >= 1
        await client.close()

    run(body())


# -- a large update cut across threads --------------------------------------------


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("wire", ["bfloat16", None])
def test_an_update_cut_across_threads_gives_the_same_bits(
    config: dict[str, Any], wire: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard past PARALLEL_BYTES is updated by the store's ``parts`` runner in pieces
    at once: values, slots and wire copy bit-identical to one piece after another
    (FTRL, which has no kernel, stays serial)."""
    import zmqps.core.store as store_module
    from zmqps.roles.threads import CheckThreads

    monkeypatch.setattr(store_module, "PARALLEL_BYTES", 1)
    threads = CheckThreads(3)
    calls: list[int] = []
    run_calls = threads.run

    def counted(c: Any) -> Any:
        calls.append(len(c))
        return run_calls(c)

    monkeypatch.setattr(threads, "run", counted)
    try:
        d = bdef(optimizer=config, wire=wire)
        serial, cut = ShardStore(chunk_elems=1_000), ShardStore(chunk_elems=1_000, parts=threads)
        for s in (serial, cut):
            s.create([d])
        size = d.size
        for step in range(3):
            g = grad(d, step)
            chunks = [(size // 5, g[size // 5 :]), (0, g[: size // 5])]  # any order
            for s in (serial, cut):
                s.apply_dense(0, chunks, step)
            a, b = serial.get(0), cut.get(0)
            assert same_bits(a.values, b.values)
            for k in a.slots:
                assert same_bits(a.slots[k], b.slots[k])
            if wire:
                assert same_bits(lowp.bits(a.wire_copy[1]), lowp.bits(b.wire_copy[1]))  # type: ignore[index]
                assert_exact(cut, 0)
        assert calls == ([] if config["name"] == "ftrl" else [3, 3, 3])
    finally:
        threads.close()
