"""The side-car evaluator against a real ChiefService and PSService over the in-memory network.

Workers are played by the test (register, heartbeat, leave, a push through a
ParameterClient); checkpoints are written with the checkpoint library into tmp_path.
Every test runs inside ``asyncio.run`` with a deadline.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from fake_replicated import chief_on, replicated_config, serve_ps

import zmqps
from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner, plan
from zmqps.data import Dataset, load_digits
from zmqps.metrics import Metrics
from zmqps.models import Model
from zmqps.roles.chief import ChiefConfig, ChiefService
from zmqps.roles.client import ParameterClient
from zmqps.roles.evaluator import Evaluator, EvaluatorConfig
from zmqps.roles.homes import Homes
from zmqps.roles.job import JobConfig
from zmqps.roles.ps import PSService
from zmqps.transport import FakeNetwork, Requester, TransportStats
from zmqps.wire.errors import ConfigError, DeadlineExceeded

pytestmark = pytest.mark.timeout(60)

T = TypeVar("T")
CHIEF = "127.0.0.1:7000"
PS = ("127.0.0.1:7100", "127.0.0.1:7101")
SGD = {"name": "sgd", "lr": 0.5}
JOB = JobConfig(model="softmax", optimizer=SGD)
FAST = 0.05  # seconds: the evaluation interval of these tests


def run(coro: Awaitable[T], timeout: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


@pytest.fixture(scope="module")
def test_split() -> Dataset:
    return load_digits("test")


async def until(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def make_evaluator(
    net: FakeNetwork, test: Any, probe: Callable[[str], bool], **cfg: Any
) -> Evaluator:
    """An evaluator on the in-memory network, asking CHIEF (fast interval, short
    timeouts unless ``cfg`` says otherwise; ``job`` defaults to this module's JOB)."""
    cfg.setdefault("interval", FAST)
    cfg.setdefault("chief_timeout", 5.0)
    cfg.setdefault("request_timeout", 0.2)
    metrics = cfg.pop("metrics", None)
    config = EvaluatorConfig(chief=CHIEF, job=cfg.pop("job", JOB), **cfg)

    def connect_ps(addresses: Any) -> list[Requester]:
        return [net.client(a, "evaluator:0") for a in addresses]

    return Evaluator(
        config, net.client(CHIEF, "evaluator:0:1"), connect_ps, test, metrics=metrics, probe=probe
    )


@dataclass
class Cluster:
    """A chief and two PS on a FakeNetwork, the softmax job's variables created."""

    net: FakeNetwork
    chief: ChiefService
    model: Model
    workers: int
    ps_stats: list[TransportStats]
    probe_answer: bool = False  # what the evaluator's port probe says (True: nobody listens)
    probed: list[str] = field(default_factory=list)

    def probe(self, address: str) -> bool:
        self.probed.append(address)
        return self.probe_answer

    def all_down(self) -> None:
        """The chief and every PS gone: nothing listens on their ports."""
        self.probe_answer = True
        self.net.remove(CHIEF)
        for addr in PS:
            self.net.remove(addr)

    def evaluator(self, test: Dataset, **cfg: Any) -> Evaluator:
        return make_evaluator(self.net, test, self.probe, **cfg)

    async def worker(self, index: int, op: str, **body: Any) -> None:
        who = {"role": "worker", "index": index, "incarnation": 1, **body}
        if op != "register":
            who.setdefault("step", 0)
        await self.net.client(CHIEF, f"worker:{index}").request(op, who)

    def params_client(self) -> ParameterClient:
        assert self.chief.placement is not None
        ps = [self.net.client(a, "trainer") for a in PS]
        return ParameterClient(
            ps, self.chief.placement, worker="trainer", incarnation=1, shared_memory=False
        )


async def make_cluster(test: Dataset, workers: int = 1, create: bool = True) -> Cluster:
    spec = ClusterSpec(
        chief=CHIEF, ps=PS, worker=tuple(f"127.0.0.1:{7200 + i}" for i in range(workers))
    )
    net = FakeNetwork()
    stats = [net.serve(addr, PSService(i), name=f"ps{i}") for i, addr in enumerate(PS)]
    cfg = ChiefConfig(
        bind=f"tcp://{CHIEF}",
        cluster=spec,
        optimizer=dict(SGD),
        partitioner=Partitioner(num_shards=2),
    )
    chief = ChiefService(cfg, [net.client(a, "chief:0") for a in PS])
    net.serve(CHIEF, chief, name="chief")
    model = JOB.build_model(test)
    if create:
        await chief.create_variables(model.variables(), dict(SGD))
    return Cluster(net, chief, model, workers, stats)


def read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- source B: snapshots pulled from the PS ---------------------------------------


def test_snapshots_follow_the_global_step_until_training_finishes(
    tmp_path: Path, test_split: Dataset
) -> None:
    log_path = tmp_path / "eval.jsonl"
    metrics = Metrics()

    async def body() -> None:
        c = await make_cluster(test_split)
        ev = c.evaluator(test_split, eval_log=str(log_path), metrics=metrics)
        task = asyncio.ensure_future(ev.run())
        await until(lambda: len(ev.evaluations) == 1, "the first evaluation")
        assert ev.evaluations[0].step == 0  # the initial model

        # The step does not move: no new evaluation, however many intervals pass.
        await asyncio.sleep(6 * FAST)
        assert len(ev.evaluations) == 1

        # A worker trains: one SGD step on the train split, reported in a heartbeat.
        await c.worker(0, "register", steps_planned=1)
        trainer = c.params_client()
        train = load_digits("train")
        params = await trainer.pull()
        _, grads = c.model.loss_and_grads(params, train.x[:256], train.y[:256])
        await trainer.push(grads)
        await c.worker(0, "heartbeat", step=1)
        await until(lambda: len(ev.evaluations) == 2, "an evaluation of step 1")
        trained = {k: v.copy() for k, v in (await trainer.pull()).items()}
        want = c.model.evaluate(trained, test_split.x, test_split.y)
        second = ev.evaluations[1]
        assert (second.step, second.source) == (1, "snapshot")
        assert second.accuracy == pytest.approx(want["accuracy"])
        assert second.loss == pytest.approx(want["loss"], rel=1e-6)

        # The worker leaves having done its work, the chief's process finishes the run
        # (summary written): finished; one last snapshot (step 2).
        await c.worker(0, "leave", step=2, reason="done")
        c.chief.finished = True
        evaluations = await asyncio.wait_for(task, 5.0)
        assert [e.step for e in evaluations] == [0, 1, 2]
        assert c.probed == []  # the end was seen in the status, not guessed
        # The evaluator only pulled (the one push is the trainer's).
        assert sum(s.by_op.get("pull", 0) for s in c.ps_stats) >= 3
        assert sum(s.by_op.get("push", 0) for s in c.ps_stats) == 2  # 1 push x 2 PS

    run(body())
    lines = read_log(log_path)
    assert [line["step"] for line in lines] == [0, 1, 2]
    for line in lines:
        assert set(line) == {"step", "accuracy", "loss", "source", "time"}
        assert 0.0 <= line["accuracy"] <= 1.0 and line["source"] == "snapshot"
    sample = metrics.registry.get_sample_value
    assert sample("zmqps_evaluations_total") == 3
    assert sample("zmqps_eval_step") == 2
    assert sample("zmqps_eval_accuracy") == pytest.approx(lines[-1]["accuracy"])
    assert sample("zmqps_eval_loss") == pytest.approx(lines[-1]["loss"])
    info = {"role": "evaluator", "index": "0", "mode": "async", "version": zmqps.__version__}
    assert sample("zmqps_info", info) == 1


def test_the_evaluator_is_not_a_worker(test_split: Dataset) -> None:
    async def body() -> None:
        c = await make_cluster(test_split, create=False)
        ev = c.evaluator(test_split)
        task = asyncio.ensure_future(ev.run())
        await asyncio.sleep(5 * FAST)
        assert ev.placement is None  # waiting for the variables
        assert c.chief.members.workers == {}  # registered, but not counted as a worker
        await c.chief.create_variables(c.model.variables(), dict(SGD))
        await until(lambda: ev.evaluations, "an evaluation once the variables exist")
        assert c.chief.members.workers == {}
        ev.stop()
        await asyncio.wait_for(task, 5.0)

    run(body())


def test_job_flags_that_do_not_match_the_cluster(test_split: Dataset) -> None:
    async def body() -> None:
        c = await make_cluster(test_split)
        ev = c.evaluator(test_split, job=JobConfig(model="mlp", hidden=(8,), optimizer=SGD))
        with pytest.raises(ConfigError, match="do not match --model mlp"):
            await ev.run()

    run(body())


def test_a_silent_chief_is_an_error_after_chief_timeout(test_split: Dataset) -> None:
    async def body() -> None:
        c = await make_cluster(test_split)
        ev = c.evaluator(test_split, chief_timeout=0.5)
        task = asyncio.ensure_future(ev.run())
        await until(lambda: ev.evaluations, "the first evaluation")
        c.net.remove(CHIEF)  # the chief crashed; the PS still listen (probe: False)
        with pytest.raises(DeadlineExceeded, match=r"has not answered status requests for 0\.5s"):
            await asyncio.wait_for(task, 5.0)
        assert CHIEF in c.probed and set(PS) <= set(c.probed)

    run(body())


async def training_at_step_3(c: Cluster, ev: Evaluator) -> asyncio.Future[Any]:
    """``ev`` running (its first evaluation made), worker 0 at step 3 of 5."""
    task = asyncio.ensure_future(ev.run())
    await until(lambda: ev.evaluations, "the first evaluation")
    await c.worker(0, "register", steps_planned=5)
    await c.worker(0, "heartbeat", step=3)
    await until(lambda: ev._watch.global_step == 3, "the step seen")
    return task


def test_a_cluster_that_shut_down_after_its_workers_finished_ends_the_evaluation(
    test_split: Dataset, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        c = await make_cluster(test_split)
        ev = c.evaluator(test_split, chief_timeout=30.0)
        task = await training_at_step_3(c, ev)
        await c.worker(0, "leave", step=5, reason="done")
        await until(lambda: ev._watch.workers_done, "every worker seen done")
        scored = len(ev.evaluations)
        # The chief ended and shut the PS down (it could not wait) between two polls:
        # every port is closed.
        c.all_down()
        evaluations = await asyncio.wait_for(task, 5.0)  # well before chief_timeout
        # no final snapshot: the PS are gone (one evaluation that pulled its values
        # before the ports closed may end after: a loaded CI machine saw it)
        assert scored <= len(evaluations) <= scored + 1

    with caplog.at_level(logging.INFO, logger="zmqps"):
        run(body())
    assert "closed their ports and every worker had finished" in caplog.text


def test_a_cluster_all_down_before_its_end_is_not_taken_for_the_end(
    test_split: Dataset, caplog: pytest.LogCaptureFixture
) -> None:
    """The chief and every PS refuse connections mid-run (all restarting at once): the
    evaluator waits for them as for a silent chief, and says so; it never ends as if
    training were over (exit 0, its last score not the final model's)."""

    async def body() -> None:
        c = await make_cluster(test_split)
        ev = c.evaluator(test_split, chief_timeout=1.5)
        task = await training_at_step_3(c, ev)
        c.all_down()
        await until(lambda: "not seen ending" in caplog.text, "the warning")
        assert not task.done()
        with pytest.raises(DeadlineExceeded, match="training was not seen finished"):
            await asyncio.wait_for(task, 5.0)

    with caplog.at_level(logging.INFO, logger="zmqps"):
        run(body())
    assert caplog.text.count("not seen ending") == 1  # once per outage
    assert "training is over" not in caplog.text


def test_stop_ends_it_promptly(test_split: Dataset) -> None:
    async def body() -> None:
        c = await make_cluster(test_split)
        ev = c.evaluator(test_split, interval=60.0)
        task = asyncio.ensure_future(ev.run())
        await until(lambda: ev.evaluations, "the first evaluation")
        ev.stop()
        await asyncio.wait_for(task, 1.0)

    run(body())


def test_config_checks() -> None:
    with pytest.raises(ConfigError, match="--eval-interval must be > 0"):
        EvaluatorConfig(chief=CHIEF, job=JOB, interval=0)
    with pytest.raises(ConfigError, match="--chief-timeout must be > 0"):
        EvaluatorConfig(chief=CHIEF, job=JOB, chief_timeout=-1)


# -- source A: checkpoints --------------------------------------------------------


def write_checkpoint(
    root_dir: Path, model: Model, params: dict[str, np.ndarray], step: int, final: bool = False
) -> str:
    """Commit ``params`` as the checkpoint of ``step`` (two PS, two shards a variable;
    ``final``: the run's last one, as the chief marks it)."""
    from zmqps.checkpoint import CheckpointRoot, Manifest, write_shard

    pl = plan(model.variables(), 2, Partitioner(num_shards=2), optimizer=dict(SGD))
    root = CheckpointRoot(root_dir, keep=0)
    temp = root.new_temp(step)
    records = []
    for _, sd in pl.shard_defs():
        rows = params[sd.var][sd.row_start : sd.row_start + sd.rows]
        records.append(write_shard(temp, sd, np.ascontiguousarray(rows), {}, version=step))
    manifest = Manifest(
        step=step,
        variables=[v.to_wire() for v in pl.variables],
        optimizer=dict(SGD),
        num_ps=2,
        shards=records,
        extra={"final": True} if final else {},
    )
    return root.commit(temp, manifest).name


def random_values(model: Model, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``count`` sets of random values of ``model``'s variables."""
    rng = np.random.default_rng(seed)
    return [
        {v.name: rng.normal(size=v.shape).astype(v.dtype) for v in model.variables()}
        for _ in range(count)
    ]


def corrupt(ckpt_dir: Path) -> None:
    shard = sorted(ckpt_dir.glob("shard-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x40
    shard.write_bytes(bytes(data))


def test_checkpoints_each_new_one_once_corrupted_ones_skipped(
    tmp_path: Path, test_split: Dataset, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("zmqps.checkpoint", reason="the checkpoint library is not available")
    ckpts = tmp_path / "ckpts"
    log_path = tmp_path / "eval.jsonl"

    async def body() -> None:
        c = await make_cluster(test_split)
        m = c.model
        values = random_values(m, 4, seed=0)
        ev = c.evaluator(test_split, checkpoint_dir=str(ckpts), eval_log=str(log_path))
        task = asyncio.ensure_future(ev.run())
        await asyncio.sleep(4 * FAST)
        assert ev.evaluations == []  # no checkpoint yet (the directory does not even exist)

        first = write_checkpoint(ckpts, m, values[0], 10)
        await until(lambda: len(ev.evaluations) == 1, "the first checkpoint's evaluation")
        await asyncio.sleep(4 * FAST)
        assert len(ev.evaluations) == 1  # evaluated once

        bad = write_checkpoint(ckpts, m, values[1], 20)
        corrupt(ckpts / bad)
        await until(lambda: "skipped" in caplog.text, "the warning about the corrupted one")
        good = write_checkpoint(ckpts, m, values[2], 30)
        await until(lambda: len(ev.evaluations) == 2, "the third checkpoint's evaluation")

        last = write_checkpoint(ckpts, m, values[3], 40)
        await c.worker(0, "register", steps_planned=1)
        await c.worker(0, "leave", step=1, reason="done")
        c.chief.finished = True  # the chief's process finished the run
        await until(lambda: ev._watch.finished, "the end of training seen")
        c.net.remove(CHIEF)  # the chief ends soon after "finished"
        evaluations = await asyncio.wait_for(task, 10.0)

        assert [(e.step, e.checkpoint) for e in evaluations] == [
            (10, first),
            (30, good),
            (40, last),
        ]
        for e, v in zip(evaluations, (values[0], values[2], values[3]), strict=True):
            want = m.evaluate(v, test_split.x, test_split.y)
            assert e.source == "checkpoint"
            assert e.accuracy == pytest.approx(want["accuracy"])
            assert e.loss == pytest.approx(want["loss"], rel=1e-6)

    with caplog.at_level(logging.WARNING, logger="zmqps"):
        run(body())
    assert "checkpoint ckpt-000000000020 skipped" in caplog.text
    lines = read_log(log_path)
    assert [(x["step"], x["checkpoint"]) for x in lines] == [
        (10, "ckpt-000000000010"),
        (30, "ckpt-000000000030"),
        (40, "ckpt-000000000040"),
    ]


@pytest.mark.parametrize("first", ["not final", "final"])
def test_all_down_ends_the_evaluation_only_once_the_final_checkpoint_is_committed(
    tmp_path: Path, test_split: Dataset, caplog: pytest.LogCaptureFixture, first: str
) -> None:
    """Checkpoint source: the chief and every PS refuse connections. While the newest
    checkpoint is not the run's final one, the evaluator waits; once the final one is
    there (the chief committed it and could not wait), it scores it and ends. A final
    one there before the evaluator started (``first``: a finished run's, which a
    resumed run keeps the newest until its first commit) is not this run's end."""
    pytest.importorskip("zmqps.checkpoint", reason="the checkpoint library is not available")
    ckpts = tmp_path / "ckpts"

    async def body() -> None:
        c = await make_cluster(test_split)
        m = c.model
        values = random_values(m, 2, seed=1)
        if first == "final":  # the first run's, before the evaluator started
            write_checkpoint(ckpts, m, values[0], 10, final=True)
        ev = c.evaluator(test_split, checkpoint_dir=str(ckpts), chief_timeout=30.0)
        task = asyncio.ensure_future(ev.run())
        if first == "not final":
            write_checkpoint(ckpts, m, values[0], 10)
        await until(lambda: len(ev.evaluations) == 1, "the first checkpoint's evaluation")
        c.all_down()
        await until(lambda: "not seen ending" in caplog.text, "the warning")
        await asyncio.sleep(4 * FAST)
        assert not task.done()
        final = write_checkpoint(ckpts, m, values[1], 20, final=True)
        evaluations = await asyncio.wait_for(task, 5.0)
        assert [(e.step, e.checkpoint) for e in evaluations][-1] == (20, final)
        want = m.evaluate(values[1], test_split.x, test_split.y)
        assert evaluations[-1].accuracy == pytest.approx(want["accuracy"])

    with caplog.at_level(logging.INFO, logger="zmqps"):
        run(body())
    assert "ckpt-000000000010, is the run's final one" not in caplog.text
    assert "the newest checkpoint, ckpt-000000000020, is the run's final one" in caplog.text


@pytest.mark.parametrize("when", ["verified", "read"])
def test_a_checkpoint_replaced_while_it_is_read_is_not_skipped(
    tmp_path: Path,
    test_split: Dataset,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    when: str,
) -> None:
    """The run's final checkpoint of the step of its last periodic one replaces that
    one under the same name. Replaced while the evaluator verifies or reads it, it is
    no failure of a checkpoint: the evaluator scores what replaced it (the final
    model), and skips nothing."""
    pytest.importorskip("zmqps.checkpoint", reason="the checkpoint library is not available")
    from zmqps.checkpoint import Checkpoint

    ckpts = tmp_path / "ckpts"
    patched = Checkpoint.verify if when == "verified" else Checkpoint.variables
    replaced: list[str] = []

    async def body() -> None:
        c = await make_cluster(test_split)
        m = c.model
        values = random_values(m, 3, seed=2)
        write_checkpoint(ckpts, m, values[0], 10)
        write_checkpoint(ckpts, m, values[1], 20)

        def replacing(self: Checkpoint) -> Any:
            if self.step == 20 and not replaced:  # the chief's final one, meanwhile
                replaced.append(write_checkpoint(ckpts, m, values[2], 20, final=True))
            return patched(self)

        monkeypatch.setattr(Checkpoint, patched.__name__, replacing)
        ev = c.evaluator(test_split, checkpoint_dir=str(ckpts))
        got = await ev._evaluate_new(final=True)
        assert replaced, "the replacement happened"
        assert got is not None and (got.step, got.checkpoint) == (20, replaced[0])
        want = m.evaluate(values[2], test_split.x, test_split.y)
        assert got.accuracy == pytest.approx(want["accuracy"])
        assert ev._final_seen  # the run's final checkpoint: a lone evaluator ends here
        assert await ev._evaluate_new(final=True) is None  # scored once

    with caplog.at_level(logging.WARNING, logger="zmqps"):
        run(body())
    assert "skipped" not in caplog.text


def test_a_damaged_final_checkpoint_leaves_the_scores_in_step_order(
    tmp_path: Path, test_split: Dataset, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 20 scored, then the final checkpoint of step 20 replaces it and fails
    verification: it is skipped, and the older step 10 (never scored: it was old when
    20 came) is not scored after 20."""
    pytest.importorskip("zmqps.checkpoint", reason="the checkpoint library is not available")
    ckpts = tmp_path / "ckpts"

    async def body() -> None:
        c = await make_cluster(test_split)
        m = c.model
        values = random_values(m, 3, seed=3)
        write_checkpoint(ckpts, m, values[0], 10)
        write_checkpoint(ckpts, m, values[1], 20)
        ev = c.evaluator(test_split, checkpoint_dir=str(ckpts))
        got = await ev._evaluate_new(final=False)
        assert got is not None and got.step == 20
        await asyncio.sleep(0.01)  # another manifest time
        corrupt(ckpts / write_checkpoint(ckpts, m, values[2], 20, final=True))
        assert await ev._evaluate_new(final=False) is None
        assert [e.step for e in ev.evaluations] == [20]

    with caplog.at_level(logging.WARNING, logger="zmqps"):
        run(body())
    assert caplog.text.count("checkpoint ckpt-000000000020 skipped: it failed verification") == 1


def test_checkpoint_of_another_model_is_skipped(
    tmp_path: Path, test_split: Dataset, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("zmqps.checkpoint", reason="the checkpoint library is not available")
    ckpts = tmp_path / "ckpts"

    async def body() -> None:
        c = await make_cluster(test_split)
        other = JobConfig(model="mlp", hidden=(4,)).build_model(test_split)
        params = {v.name: np.zeros(v.shape, v.dtype) for v in other.variables()}
        for step in (3, 4, 5):  # the newest says it: the older ones are not read
            write_checkpoint(ckpts, other, params, step)
        ev = c.evaluator(test_split, checkpoint_dir=str(ckpts))
        task = asyncio.ensure_future(ev.run())
        await until(lambda: "skipped" in caplog.text, "the warning")
        assert ev.evaluations == []
        ev.stop()
        await asyncio.wait_for(task, 5.0)

    with caplog.at_level(logging.WARNING, logger="zmqps"):
        run(body())
    assert "variables missing or of another shape: softmax/b, softmax/w" in caplog.text
    assert caplog.text.count("skipped") == 1, caplog.text


def test_a_lone_evaluator_that_can_score_nothing_says_what_it_skipped(
    tmp_path: Path, test_split: Dataset
) -> None:
    """An evaluator given another --model than the run's ended with "no committed
    checkpoint in DIR within 5s" while the folder held one: it names the checkpoint
    it skipped and why."""
    pytest.importorskip("zmqps.checkpoint", reason="the checkpoint library is not available")
    from zmqps.wire.errors import DeadlineExceeded

    ckpts = tmp_path / "ckpts"
    other = JobConfig(model="mlp", hidden=(4,)).build_model(test_split)
    write_checkpoint(
        ckpts, other, {v.name: np.zeros(v.shape, v.dtype) for v in other.variables()}, 3
    )
    cfg = EvaluatorConfig(
        chief=None, job=JOB, checkpoint_dir=str(ckpts), interval=FAST, idle_timeout=0.3
    )
    ev = Evaluator(cfg, None, lambda addresses: [], test_split)
    with pytest.raises(DeadlineExceeded) as err:
        run(asyncio.wait_for(ev.run(), 10.0))
    assert "no checkpoint in" in str(err.value) and "it could evaluate" in str(err.value)
    assert "ckpt-000000000003 was skipped: variables missing or of another shape" in str(err.value)


def test_snapshots_follow_a_ps_state_moved_by_a_fail_over(test_split: Dataset) -> None:
    """--replication 2, three PS: the process serving ps 1's state dies and a copy
    takes over (a new placement epoch, heard in a heartbeat). The evaluator's next
    snapshot pulls ps 1's shards from the new primary and scores the trained model."""

    async def body() -> None:
        ps3 = (*PS, "127.0.0.1:7102")
        net = FakeNetwork()
        for i, addr in enumerate(ps3):
            serve_ps(net, i, addr)
        chief = chief_on(net, replicated_config(CHIEF, ps3, SGD))
        homes = chief.recovery.homes
        assert homes is not None
        model = JOB.build_model(test_split)
        await chief.create_variables(model.variables(), dict(SGD))
        assert chief.placement is not None and any(s.ps == 1 for s in chief.placement.shards)
        ev = make_evaluator(net, test_split, lambda _: False)
        task = asyncio.ensure_future(ev.run())
        await until(lambda: len(ev.evaluations) == 1, "the first evaluation")
        # ps 1 dies; the chief fails its state over to the copy
        net.remove(ps3[1])
        await chief.recovery.fail_over([1])
        home = homes.of[1]
        assert home != 1
        # its heartbeats hear of the new epoch (the in-memory network has no requests
        # in flight to fail over: the step moves once the evaluator follows the state)
        await until(
            lambda: ev.homes is not None and ev.homes.of[1] == home, "the new placement heard"
        )
        # a worker trains on the new placement; the step is reported in a heartbeat
        wh = Homes([net.client(a, "trainer") for a in ps3])
        wh.update(chief.placement)
        trainer = ParameterClient(
            wh.links(), chief.placement, worker="trainer", incarnation=1, shared_memory=False
        )
        train = load_digits("train")
        params = await trainer.pull()
        _, grads = model.loss_and_grads(params, train.x[:256], train.y[:256])
        await trainer.push(grads)
        who = {"role": "worker", "index": 0, "incarnation": 1}
        await net.client(CHIEF, "worker:0").request("register", {**who, "steps_planned": 1})
        await net.client(CHIEF, "worker:0").request("heartbeat", {**who, "step": 1})
        await until(lambda: len(ev.evaluations) == 2, "an evaluation after the fail-over")
        trained = await trainer.pull()
        want = model.evaluate(trained, test_split.x, test_split.y)
        assert ev.evaluations[1].step == 1
        assert ev.evaluations[1].accuracy == pytest.approx(want["accuracy"])
        ev.stop()
        await asyncio.wait_for(task, 5.0)

    run(body())


def test_no_chief_at_the_start_of_a_finished_runs_folder_says_how_to_score_it(
    tmp_path: Path, test_split: Dataset
) -> None:
    """An evaluator started after its run ended waits its --connect-timeout for the
    chief and fails (exit 1: no chief answered); its error says that the newest
    checkpoint is a finished run's final one, and how to score it."""
    pytest.importorskip("zmqps.checkpoint", reason="the checkpoint library is not available")
    ckpts = tmp_path / "ckpts"

    async def body() -> None:
        c = await make_cluster(test_split)
        name = write_checkpoint(ckpts, c.model, random_values(c.model, 1, seed=3)[0], 10, True)
        c.all_down()
        ev = c.evaluator(test_split, checkpoint_dir=str(ckpts), connect_timeout=0.3)
        with pytest.raises(DeadlineExceeded) as err:
            await asyncio.wait_for(ev.run(), 10.0)
        assert f"{name}, is a finished run's final one" in str(err.value)
        assert "an evaluator whose cluster holds only itself" in str(err.value)
        assert ev.evaluations == []

    run(body())
