"""Workers that finished their work, known to a restarted chief (``zmqps.core.finished``
and the chief's record of them).

The defect (fault schedule 13110): the workers finished and left, the lone PS lost its
state (no copy, ``--replication 1``) before the final checkpoint was committed, and the
chief was restarted. It found empty PS and no checkpoint, started anew and waited for
ever for workers 0 and 1 to register ("waiting for workers [0, 1] to register"): what
said they had finished was kept on the PS only, and went with their state. The chief
now keeps it in a record of its own, and a start that would go back past the work of
workers who left ends the run failed, saying so, instead of waiting for them.
"""

from __future__ import annotations

import asyncio
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from test_chief import CHIEF, SGD, VARS, call, make_env, run, who

from zmqps.core.finished import (
    Finished,
    Held,
    lost_verdict,
    parse_record,
    record_bytes,
    work_lost,
)
from zmqps.core.partition import Partitioner, plan
from zmqps.roles.checkpointer import Checkpointer
from zmqps.roles.chief import ChiefService
from zmqps.roles.chief.done_record import DoneRecord, record_path
from zmqps.roles.configs import CheckpointPolicy
from zmqps.roles.ps import PSService
from zmqps.roles.worker.session import Session
from zmqps.transport.fake import FakeNetwork
from zmqps.wire import ops as o

DONE = {0: Finished(40, 0), 1: Finished(38, 0)}

# ---------------------------------------------------------------- the decision (sans-IO)


def test_no_checkpoint_holds_none_of_the_finished_work() -> None:
    assert work_lost(DONE, Held()) == {0: (0, 40), 1: (0, 38)}


def test_a_checkpoint_holding_every_batch_loses_nothing() -> None:
    held = Held("ckpt-000000000078", 78, {"worker:0": 40, "worker:1": 38})
    assert work_lost(DONE, held) == {}


def test_a_checkpoint_of_before_the_end_loses_the_batches_after_it() -> None:
    held = Held("ckpt-000000000050", 50, {"worker:0": 30, "worker:1": 38})
    assert work_lost(DONE, held) == {0: (30, 40)}
    # a checkpoint that does not say its cursors shows nothing of any worker
    assert work_lost(DONE, Held("ckpt-000000000050", 50, None)) == {0: (0, 40), 1: (0, 38)}


def test_a_final_checkpoint_holds_the_work_of_its_run_only() -> None:
    # the run's own final checkpoint (taken once every worker was done) holds it all
    assert work_lost(DONE, Held("ckpt-000000000078", 78, None, final=True, gen=0)) == {}
    assert work_lost(DONE, Held("ckpt-000000000078", 78, {}, final=True, gen=2)) == {}
    # one of an earlier run (a resumed run is in a later generation): its cursors count
    # another run's batches
    old = Held("ckpt-000000000078", 78, {"worker:0": 99, "worker:1": 99}, final=True, gen=0)
    later = {0: Finished(40, 1)}
    assert work_lost(later, old) == {0: (0, 40)}


def test_a_worker_that_did_no_batch_lost_nothing() -> None:
    assert work_lost({0: Finished(0, 0)}, Held()) == {}


def test_the_verdict_is_one_line_that_names_the_workers_and_the_way_on() -> None:
    line = lost_verdict({0: (0, 40), 1: (0, 38)}, Held(), "the PS lost it")
    assert "\n" not in line
    assert line.startswith("the run cannot finish: workers 0, 1 finished their work (78 batches)")
    assert "no checkpoint was committed" in line and "train again" in line
    held = Held("ckpt-000000000050", 50, {"worker:0": 30})
    line = lost_verdict({0: (30, 40)}, held, "the PS lost it")
    assert "worker 0 finished its work (40 batches)" in line
    assert "ckpt-000000000050 (step 50) holds 30 of those 40 batches" in line
    assert "zmqps launch --resume" in line and "the other 10 again" in line


# ---------------------------------------------------------------- the record's format


def test_the_record_reads_back_what_was_written() -> None:
    raw = record_bytes(DONE)
    assert parse_record(raw) == DONE
    assert json.loads(raw)["workers"] == {
        "0": {"steps": 40, "gen": 0},
        "1": {"steps": 38, "gen": 0},
    }


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        pickle.dumps({"workers": {}}),
        b'{"format": "other", "version": 1, "workers": {}}',
        b'{"format": "zmqps-workers-done", "version": 2, "workers": {}}',
        b'{"format": "zmqps-workers-done", "version": 1, "workers": []}',
        b'{"format": "zmqps-workers-done", "version": 1, "workers": {"a": {"steps": 1}}}',
        b'{"format": "zmqps-workers-done", "version": 1, "workers": {"-1": {"steps": 1}}}',
        b'{"format": "zmqps-workers-done", "version": 1, "workers": {"0": {"steps": -1}}}',
        b'{"format": "zmqps-workers-done", "version": 1, "workers": {"0": {"steps": true}}}',
        b'{"format": "zmqps-workers-done", "version": 1, "workers": {"0": {"steps": 1.5}}}',
        b'{"format": "zmqps-workers-done", "version": 1, "workers": {"0": 3}}',
    ],
)
def test_anything_else_is_not_a_record(raw: bytes) -> None:
    with pytest.raises(ValueError):
        parse_record(raw)


def test_where_the_record_lives(tmp_path: Path) -> None:
    ckpts, summary = str(tmp_path / "ckpts"), str(tmp_path / "run" / "summary.json")
    assert record_path(ckpts, summary) == tmp_path / "ckpts" / "workers-done.json"
    assert record_path(None, summary) == tmp_path / "run" / "summary.workers-done.json"
    assert record_path(None, None) is None
    record = DoneRecord(tmp_path / "ckpts" / "workers-done.json")
    assert record.load() == {}
    assert record.save(DONE) and not record.save(DONE)  # unchanged: not written again
    assert DoneRecord(record.path).load() == DONE
    record.path.write_bytes(b"garbage")
    assert DoneRecord(record.path).load() == {}  # said in the log, taken as none
    record.remove()
    record.remove()  # gone already: nothing to do
    assert not record.path.exists()


# ---------------------------------------------------------------- a restarted chief


async def _finished_and_ps_lost(tmp_path: Path, **cfg: Any) -> tuple[Any, list[Any]]:
    """Two workers finished their work (10 and 12 batches) and left; then the lone PS
    restarted without its state (no copy), before any final checkpoint: the chief's
    configuration and the clients a restarted chief reaches the new PS with."""
    env = make_env(1, num_workers=2, summary_path=str(tmp_path / "summary.json"), **cfg)
    if "checkpoint" in cfg:
        env.services[0] = PSService(0, checkpoint_dir=cfg["checkpoint"].directory)
        env.stats[0] = env.net.serve(env.cfg.cluster.ps[0], env.services[0], name="ps0")
    await env.chief.start()
    await env.chief.create_variables(VARS, SGD)
    for i, steps in ((0, 10), (1, 12)):
        await call(env.chief, "register", who(i, 1, steps_planned=steps))
        await call(env.chief, "leave", who(i, 1, step=steps, reason="done"))
    assert env.chief.all_done.is_set()
    env.serve(0)  # a new PS process at its address: empty
    clients = [env.net.client(addr, "chief:0") for addr in env.cfg.cluster.ps]
    return env, clients


def _lingering(env: Any, index: int, position: int) -> Session:
    """The session of worker ``index`` (incarnation 1), its work done after ``position``
    batches, waiting for the run's end: it speaks to the chief served at CHIEF."""
    s = Session(
        env.net.client(CHIEF, f"worker:{index}:1"),
        o.Who("worker", index, 1),
        recovery_timeout=5.0,
        progress=lambda: (position, 4 * position, None, 0),
    )
    s.info = o.ClusterInfo(ps=(), mode="async", heartbeat_interval=0.01)
    s.steps_done = 0
    return s


async def _watched(chief: ChiefService, seconds: float) -> None:
    """The chief's watch of the workers, ``seconds`` of the chief's clock later."""
    chief.recovery.clock.now += seconds  # type: ignore[attr-defined]
    watch = asyncio.ensure_future(chief.recovery.watch_workers())
    await asyncio.sleep(4 * chief.cfg.heartbeat_interval)
    watch.cancel()


def test_a_restarted_chief_with_the_ps_and_no_checkpoint_lost_trains_the_work_again_or_fails(
    tmp_path: Path,
) -> None:
    """The chief and the lone PS lost after both workers finished, no checkpoint: the
    new chief starts anew and waits for them. Worker 0, still waiting for the run's end,
    speaks to it and trains its 10 batches again; worker 1 does not speak within the
    heartbeat timeout (it exited): the run fails, saying why (exit code 3). Before, it
    failed at once, worker 0 still running."""

    async def body() -> None:
        env, clients = await _finished_and_ps_lost(tmp_path, heartbeat_interval=0.02)
        record = tmp_path / "summary.workers-done.json"
        assert parse_record(record.read_bytes()) == {
            0: Finished(10, 0, 0, 0.0),
            1: Finished(12, 0, 0, 0.0),
        }
        restarted = ChiefService(env.cfg, clients, clock=env.clock)
        await restarted.start()
        assert sorted(restarted.recovery.awaited) == [0, 1]
        assert not restarted.all_done.is_set()
        assert sorted(parse_record(record.read_bytes())) == [0, 1]  # kept while awaited
        env.net.serve(CHIEF, restarted, name="chief")
        w0 = _lingering(env, 0, 10)
        lingering = asyncio.ensure_future(w0.linger(10, lambda: False))
        await asyncio.sleep(0.3)
        # the initial values are made anew first, in a generation past the lost one's
        # (both were generation 0): until then it is asked to register again
        assert not lingering.done() and restarted.members.workers[0].incarnation == 0
        await restarted.create_variables(VARS, SGD)  # (a built-in job's chief does)
        assert await asyncio.wait_for(lingering, 5.0) == 0
        assert w0.gen == restarted.recovery.gen >= 1  # the initial values, made anew
        assert sorted(restarted.recovery.awaited) == [1]
        assert sorted(parse_record(record.read_bytes())) == [1]  # 0 trains again
        within = restarted.recovery.awaited_for()
        await _watched(restarted, within / 2)
        assert not restarted.failure
        await _watched(restarted, within)
        said = restarted.failure
        assert said.startswith("the run cannot finish: worker 1 finished its work (12"), said
        assert "no checkpoint was committed" in said, said
        assert said.endswith(
            f"(worker 1 was not heard within {within:g}s of this chief's start: not running)"
        ), said
        assert restarted.shutdown_requested.is_set()
        assert record.exists()  # a chief started again awaits worker 1 too
        w0._heartbeats.cancel()  # type: ignore[union-attr]

    run(body())


def test_a_restarted_chief_whose_ps_kept_their_state_finishes_the_run(tmp_path: Path) -> None:
    """...and counts the examples the workers that finished before it said (kill -9 of
    the chief during the final checkpoint: the summary said 26,428 to 46,353 examples
    for 57,520, and 0 examples a second)."""

    async def body() -> None:
        env = make_env(1, num_workers=2, summary_path=str(tmp_path / "summary.json"))
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        for i, examples in ((0, 160), (1, 152)):
            await call(env.chief, "register", who(i, 1))
            env.clock.now += 2.0
            await call(env.chief, "leave", who(i, 1, step=5, reason="done", examples=examples))
        record = parse_record((tmp_path / "summary.workers-done.json").read_bytes())
        assert {i: f.examples for i, f in record.items()} == {0: 160, 1: 152}
        clients = [env.net.client(addr, "chief:0") for addr in env.cfg.cluster.ps]
        restarted = ChiefService(env.cfg, clients, clock=env.clock)
        await restarted.start()  # adopts the PS: their state holds every batch
        assert restarted.all_done.is_set()
        assert restarted.members.examples == 312
        assert restarted.status()["examples"] == 312

    run(body())


def test_a_record_of_before_examples_were_kept_reads_as_not_known() -> None:
    raw = b'{"format": "zmqps-workers-done", "version": 1, "workers": {"0": {"steps": 4}}}'
    assert parse_record(raw) == {0: Finished(4, 0, None)}
    with_examples = {0: Finished(4, 1, 128, 2.5)}
    assert parse_record(record_bytes(with_examples)) == with_examples
    with pytest.raises(ValueError, match="examples"):
        parse_record(raw.replace(b'"steps": 4', b'"steps": 4, "examples": -1'))
    for bad in (b"-1", b"true", b'"3"', b"1e999"):
        with pytest.raises(ValueError, match="seconds"):
            parse_record(raw.replace(b'"steps": 4', b'"steps": 4, "seconds": ' + bad))


def _checkpoint(
    tmp_path: Path, cursors: dict[str, int], step: int, extra: dict[str, Any] | None = None
) -> None:
    """A committed checkpoint of the run's variables at ``step`` holding ``cursors``."""
    placement = plan(VARS, 1, Partitioner(num_shards=2), optimizer=dict(SGD))

    async def write() -> None:
        net = FakeNetwork()
        net.serve("ps0", PSService(0, checkpoint_dir=str(tmp_path)), name="ps0")
        client = net.client("ps0", "chief:0")
        defs = tuple(d.to_wire() for _, d in placement.shard_defs())
        restore = o.Restore(0, 0, defs, None, placement.to_wire(), cursors, False)
        await client.request("restore", restore.to_wire())
        ck = Checkpointer(CheckpointPolicy(str(tmp_path)), [client])
        assert (await ck.take(step, placement, "async", 0, extra or {})) is not None

    asyncio.run(write())


async def _lost_after_a_checkpoint(
    tmp_path: Path, cursors: dict[str, int], step: int, extra: dict[str, Any] | None = None
) -> tuple[Any, list[Any], Path]:
    """:func:`_finished_and_ps_lost` with checkpoints in ``tmp_path/ckpts``, one of
    ``step`` holding ``cursors`` committed, the new PS empty and reading them."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    env, clients = await _finished_and_ps_lost(
        tmp_path, checkpoint=CheckpointPolicy(str(ckpts), secs=600.0)
    )
    await asyncio.to_thread(_checkpoint, ckpts, cursors, step, extra)  # its own loop, there
    env.services[0] = PSService(0, checkpoint_dir=str(ckpts))  # empty, reads ckpts
    env.stats[0] = env.net.serve(env.cfg.cluster.ps[0], env.services[0], name="ps0")
    return env, clients, ckpts


@pytest.mark.parametrize(
    ("cursors", "lost"), [({"worker:0": 10, "worker:1": 12}, False), ({"worker:0": 6}, True)]
)
def test_a_restarted_chief_restores_the_checkpoint_and_finishes_only_if_it_holds_the_work(
    tmp_path: Path, cursors: dict[str, int], lost: bool
) -> None:
    """A committed checkpoint holding every batch of the workers that finished: the run
    finishes from it (nothing was lost). One of before their last batches: the run
    cannot finish (they left, nobody trains those again) and says where to go on from."""

    async def body() -> None:
        env, clients, _ = await _lost_after_a_checkpoint(tmp_path, cursors, 22)
        restarted = ChiefService(env.cfg, clients, clock=env.clock)
        await restarted.start()
        assert restarted.recovery.gen >= 1  # restored from the checkpoint
        if not lost:
            assert restarted.all_done.is_set()
            return
        # worker 0 is awaited (6 of its 10 batches held), worker 1 too (none of its 12)
        assert sorted(restarted.recovery.awaited) == [0, 1]
        assert not restarted.all_done.is_set()
        await _watched(restarted, 2 * restarted.recovery.awaited_for())
        assert "ckpt-000000000022 (step 22) holds 6 of those 22" in restarted.failure

    run(body(), timeout=20.0)


def test_a_chief_restarted_with_its_ps_lost_sends_running_workers_back_to_the_checkpoint(
    tmp_path: Path,
) -> None:
    """The lone PS and the chief lost while the workers ran on (fault schedule 10309):
    the new chief restores the latest checkpoint, which holds 12 batches of each worker.
    Worker 0 (started again after its 13 batches) and worker 1 (running through it all,
    13 batches done) register again: each hears to go back to the 12 the checkpoint
    holds. Before, neither heard of a rewind: worker 0 went on after 13, the batch
    between never trained, the run two steps short of the unfaulted one."""
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()

    async def body() -> None:
        policy = CheckpointPolicy(str(ckpts), secs=600.0)
        env = make_env(1, num_workers=2, checkpoint=policy)
        env.services[0] = PSService(0, checkpoint_dir=str(ckpts))
        env.stats[0] = env.net.serve(env.cfg.cluster.ps[0], env.services[0], name="ps0")
        await env.chief.start()
        await env.chief.create_variables(VARS, SGD)
        for i in (0, 1):
            await call(env.chief, "register", who(i, 1, steps_planned=40))
            await call(env.chief, "heartbeat", who(i, 1, step=13))
        await asyncio.to_thread(_checkpoint, ckpts, {"worker:0": 12, "worker:1": 12}, 12)
        env.services[0] = PSService(0, checkpoint_dir=str(ckpts))  # restarted: empty
        env.stats[0] = env.net.serve(env.cfg.cluster.ps[0], env.services[0], name="ps0")
        clients = [env.net.client(addr, "chief:0") for addr in env.cfg.cluster.ps]
        restarted = ChiefService(env.cfg, clients, clock=env.clock)
        await restarted.start()
        gen = restarted.recovery.gen
        assert gen >= 1  # restored from the checkpoint
        running = ((0, 2, 13, 0), (1, 1, 0, 13))  # index, incarnation, steps_done, step
        for i, inc, done, _ in running:
            await call(restarted, "register", who(i, inc, steps_planned=40, steps_done=done))
        for i, inc, _, step in running:
            rep = await call(restarted, "heartbeat", who(i, inc, step=step))
            beat = o.HeartbeatReply.parse(rep.body)
            assert (beat.gen, beat.rewind) == (gen, 12), (i, beat)
        # that chief lost too, before a worker heard it: the next one adopts the PS,
        # which kept the cursors, and says them all the same
        third = ChiefService(env.cfg, clients, clock=env.clock)
        await third.start()
        assert third.recovery.gen == gen
        await call(third, "register", who(0, 3, steps_planned=40, steps_done=13))
        beat = o.HeartbeatReply.parse((await call(third, "heartbeat", who(0, 3, step=0))).body)
        assert (beat.gen, beat.rewind) == (gen, 12), beat

    run(body(), timeout=20.0)


def test_a_chief_restarted_with_its_ps_lost_sends_a_finished_worker_still_waiting_back(
    tmp_path: Path,
) -> None:
    """Fault schedule 10502: worker 1 finished its work (12 batches) and waited for the
    run's end; the chief and the lone PS were lost before the final checkpoint, and the
    latest one holds 6 of those batches. The new chief failed the run at once (exit 3,
    "go on from it with --resume"), worker 1 still running. It waits for it: worker 1
    hears it is not known, says again that its work is done, is refused (a restore
    since) and goes back to its batch 6. Worker 0, whose 10 batches the checkpoint
    holds, says the same and stays done; once worker 1 is done again, the run ends."""

    async def body() -> None:
        held = {"worker:0": 10, "worker:1": 6}
        env, clients, ckpts = await _lost_after_a_checkpoint(tmp_path, held, 16)
        restarted = ChiefService(env.cfg, clients, clock=env.clock)
        await restarted.start()
        gen = restarted.recovery.gen
        assert sorted(restarted.recovery.awaited) == [1]
        # that chief lost too, before worker 1 spoke: the next one adopts the PS, and
        # awaits worker 1 still (the record says it, the PS where it goes back to)
        record = ckpts / "workers-done.json"
        assert parse_record(record.read_bytes())[1] == Finished(12, 0, 0, 0.0, held=6)
        restarted = ChiefService(env.cfg, clients, clock=env.clock)
        await restarted.start()
        assert restarted.recovery.gen == gen and sorted(restarted.recovery.awaited) == [1]
        env.net.serve(CHIEF, restarted, name="chief")
        w1 = _lingering(env, 1, 12)
        assert await asyncio.wait_for(w1.linger(12, lambda: False), 5.0) == 6
        assert w1.gen == gen
        assert not restarted.recovery.awaited and not restarted.members.workers[1].done
        w0, stop = _lingering(env, 0, 10), asyncio.Event()
        waiting = asyncio.ensure_future(w0.linger(10, stop.is_set))
        for _ in range(200):
            w = restarted.members.workers.get(0)
            if w is not None and w.done and w.incarnation == 1:
                break
            await asyncio.sleep(0.01)
        assert restarted.members.workers[0].done and restarted.members.workers[0].waits
        assert not restarted.all_done.is_set()  # worker 1 trains its 6 batches again
        assert await w1.leave("done", waits=True)
        assert restarted.all_done.is_set()
        assert restarted.members.global_step == 22
        stop.set()
        assert await asyncio.wait_for(waiting, 5.0) is None
        done = parse_record(record.read_bytes())
        assert {i: (f.steps, f.held) for i, f in done.items()} == {0: (10, None), 1: (12, None)}
        assert done[1].gen == gen  # finished again, in the generation of the restore

    run(body(), timeout=20.0)


def test_a_chief_lost_right_after_its_start_restore_leaves_the_workers_awaited(
    tmp_path: Path,
) -> None:
    """Fault trial D3 (sync, no checkpoint but the launch's periodic one): the chief
    that awaited the workers was killed right after its start restore, before it wrote
    the record: the next one adopted the restored PS, took both workers for done from
    the record, and ended the run at global step 644 of 920, exit code 0. The record
    says the awaited workers before any PS is restored; and where it does not (a record
    of before), the restore the PS keep says what it took back of each."""

    async def body() -> None:
        held = {"worker:0": 8, "worker:1": 6}
        env, clients, ckpts = await _lost_after_a_checkpoint(tmp_path, held, 14)
        ps = env.services[0]
        record = ckpts / "workers-done.json"
        before = record.read_bytes()
        told: list[dict[int, Finished]] = []

        def spy(msg: Any) -> Any:
            if msg.op == "restore":
                told.append(parse_record(record.read_bytes()))
            return ps(msg)

        env.stats[0] = env.net.serve(env.cfg.cluster.ps[0], spy, name="ps0")
        second = ChiefService(env.cfg, clients, clock=env.clock)
        await second.start()
        assert told and (told[0][0].held, told[0][1].held) == (8, 6)
        record.write_bytes(before)  # as if that chief was lost before it wrote it
        third = ChiefService(env.cfg, clients, clock=env.clock)
        await third.start()
        assert third.recovery.gen == second.recovery.gen
        assert sorted(third.recovery.awaited) == [0, 1]
        assert not third.all_done.is_set()

    run(body(), timeout=20.0)


def test_a_chief_lost_before_it_restored_the_values_it_made_anew_leaves_them_awaited(
    tmp_path: Path,
) -> None:
    """No checkpoint: the chief that awaited the workers made the initial values anew
    and was lost before it restored them past the lost cluster's generation. The next
    one adopts those PS (generation 0, which may be the one the workers trained in):
    it awaits the workers the record says and restores the values first."""

    async def body() -> None:
        env, clients = await _finished_and_ps_lost(tmp_path, heartbeat_interval=0.02)
        second = ChiefService(env.cfg, clients, clock=env.clock)
        await second.start()
        assert sorted(second.recovery.awaited) == [0, 1]
        placement = plan(VARS, 1, Partitioner(num_shards=2), optimizer=dict(SGD))
        defs = tuple(d.to_wire() for _, d in placement.shard_defs())
        body = o.CreateShards(defs, placement.to_wire()).to_wire()
        await clients[0].request("create_shards", body)  # that chief's, then lost
        third = ChiefService(env.cfg, clients, clock=env.clock)
        await third.start()
        assert third.recovery.gen == 0 and sorted(third.recovery.awaited) == [0, 1]
        env.net.serve(CHIEF, third, name="chief")
        w0 = _lingering(env, 0, 10)
        assert await asyncio.wait_for(w0.linger(10, lambda: False), 5.0) == 0
        assert w0.gen == third.recovery.gen >= 1

    run(body())


def test_a_worker_that_finished_in_a_cluster_lost_unrecorded_trains_its_work_again() -> None:
    """The chief and the lone PS lost before the chief recorded that worker 0 finished
    (its leave not answered), no checkpoint: the new chief starts anew, knowing of no
    one that finished. Worker 0, waiting for the run's end, tells it; the chief makes
    the values anew past the lost cluster's generation, and the worker goes back to its
    batch 0 (before, no PS knew a cursor of it: it heard of no rewind and its 10
    batches were lost)."""

    async def body() -> None:
        env = make_env(1, num_workers=2, heartbeat_interval=0.02)
        await env.chief.start()  # empty PS, no checkpoint, no record: fresh
        await env.chief.create_variables(VARS, SGD)
        env.net.serve(CHIEF, env.chief, name="chief")
        w0 = _lingering(env, 0, 10)
        # it registers again (its leave, refused: not registered), and the values are
        # made anew before it says the leave again
        await w0._reregister()
        for _ in range(200):
            if env.chief.recovery.gen == 1 and not env.chief.recovery.recovering:
                break
            await asyncio.sleep(0.01)
        assert await asyncio.wait_for(w0.linger(10, lambda: False), 5.0) == 0
        assert w0.gen == env.chief.recovery.gen == 1

    run(body())


def test_workers_of_a_lost_cluster_are_sent_back_by_a_chief_that_adopts_values_made_anew() -> None:
    """Fault trial E1r (found on the code before too): the chief and the PS lost before
    the chief recorded that the workers finished; the next chief started anew (no
    record, no checkpoint), created the variables, and was lost before any worker
    registered; the third adopted those PS, in generation 0 like the lost cluster, and
    took the workers' leaves (generation 0) as done: exit 0 at global step 0, accuracy
    0.0975. PS that no worker pushed to are taken as made anew: the workers' leaves wait
    for the values restored past that generation, and the workers train again."""

    async def body() -> None:
        env = make_env(1, num_workers=2, heartbeat_interval=0.02)
        await env.chief.start()  # empty PS, no checkpoint, no record: fresh
        await env.chief.create_variables(VARS, SGD)
        clients = [env.net.client(addr, "chief:0") for addr in env.cfg.cluster.ps]
        third = ChiefService(env.cfg, clients, clock=env.clock)
        await third.start()  # adopts the PS: nothing pushed to them
        assert third.recovery.made_anew == third.recovery.gen == 0
        env.net.serve(CHIEF, third, name="chief")
        lingering = [_lingering(env, i, 10 + 2 * i) for i in (0, 1)]
        backs = await asyncio.wait_for(
            asyncio.gather(*(w.linger(10 + 2 * i, lambda: False) for i, w in enumerate(lingering))),
            5.0,
        )
        assert backs == [0, 0]
        assert not third.all_done.is_set()
        assert {w.gen for w in lingering} == {third.recovery.gen} and third.recovery.gen >= 1

    run(body())


def test_a_chief_lost_after_its_runs_final_checkpoint_ends_the_run_at_its_step(
    tmp_path: Path,
) -> None:
    """Async: both workers finished (10 and 12 batches), the chief committed the run's
    final checkpoint (step 22) and was killed with the PS before its summary. The chief
    started again restored that checkpoint as a new run on a finished one's: its step
    as the offset, the finished workers' 22 pushes on top, global step 44 and exit 0
    (the trial's: 3,680 for 1,840). It is this run's own end: global step 22."""

    async def body() -> None:
        final = {"final": True, "step_offset": 0}
        held = {"worker:0": 10, "worker:1": 12}
        env, clients, _ = await _lost_after_a_checkpoint(tmp_path, held, 22, final)
        restarted = ChiefService(env.cfg, clients, clock=env.clock)
        await restarted.start()
        assert restarted.all_done.is_set()
        assert restarted.global_step == 22
        assert restarted.status()["global_step"] == 22

    run(body(), timeout=20.0)
