"""The side-car evaluator on a CTR job (hash-keyed tables), over the in-memory network:
AUC and log loss from live snapshots and from checkpoints, under the summary's keys, and
reads that leave the PS's tables exactly as training left them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_evaluator import CHIEF, PS, make_evaluator, run, until

from zmqps.checkpoint import CheckpointRoot, Manifest, ShardRecord
from zmqps.config import ClusterSpec
from zmqps.core.partition import Partitioner
from zmqps.data.ctr import CTRDataset
from zmqps.metrics import Metrics
from zmqps.models.ctr import CTRModel, SparseBatch
from zmqps.roles.chief import ChiefConfig, ChiefService
from zmqps.roles.client import ParameterClient
from zmqps.roles.ctr_job import ctr_scores, ctr_scores_summary
from zmqps.roles.evaluator import Evaluator
from zmqps.roles.job import JobConfig
from zmqps.roles.ps import PSService
from zmqps.transport import FakeNetwork

pytestmark = pytest.mark.timeout(90)

ADAM = {"name": "adam", "lr": 0.003}
JOB = JobConfig(model="ctr", dataset="synthetic-ctr", examples=2000, optimizer=ADAM)
SUMMARY_KEYS = {"test_auc", "test_logloss", "ground_truth_auc", "ground_truth_logloss"}


@pytest.fixture(scope="module")
def test_split() -> CTRDataset:
    return JOB.load_ctr("test")


class CTRCluster:
    """A chief and two PS (PS that can write checkpoints) with the CTR job's variables."""

    def __init__(self, root: Path) -> None:
        spec = ClusterSpec(chief=CHIEF, ps=PS, worker=("127.0.0.1:7200",))
        self.net = FakeNetwork()
        self.services = [PSService(i, checkpoint_dir=root) for i in range(len(PS))]
        for i, (addr, svc) in enumerate(zip(PS, self.services, strict=True)):
            self.net.serve(addr, svc, name=f"ps{i}")
        cfg = ChiefConfig(
            bind=f"tcp://{CHIEF}", cluster=spec, optimizer=dict(ADAM), partitioner=Partitioner()
        )
        self.chief = ChiefService(cfg, [self.net.client(a, "chief:0") for a in PS])
        self.net.serve(CHIEF, self.chief, name="chief")
        self.model = JOB.build_ctr_model(JOB.load_ctr("train"))

    async def create(self) -> None:
        await self.chief.create_variables(self.model.variables(), dict(ADAM))

    def client(self, who: str) -> ParameterClient:
        assert self.chief.placement is not None
        ps = [self.net.client(a, who) for a in PS]
        return ParameterClient(ps, self.chief.placement, worker=who, incarnation=1)

    def evaluator(self, test: CTRDataset, **cfg: Any) -> Evaluator:
        return make_evaluator(self.net, test, lambda _: False, job=JOB, **cfg)

    async def worker(self, op: str, **body: Any) -> None:
        who = {"role": "worker", "index": 0, "incarnation": 1, **body}
        if op != "register":
            who.setdefault("step", 0)
        await self.net.client(CHIEF, "worker:0").request(op, who)

    async def train(self, trainer: ParameterClient, steps: int, batch: int = 256) -> None:
        """What train_ctr does per step: rows of the batch's unique ids, pushed back."""
        model, data = self.model, JOB.load_ctr("train")
        for s in range(steps):
            part = data.take(slice(s * batch, (s + 1) * batch))
            sparse = SparseBatch.of(part.ids)
            params = await trainer.pull()
            rows = {n: await trainer.pull_rows(n, sparse.unique) for n in model.tables}
            _, grads, row_grads = model.loss_and_grads(params, rows, sparse, part.dense, part.y)
            for n, g in row_grads.items():
                await trainer.push_rows(n, sparse.unique, g)
            await trainer.push(grads)

    def table_state(self) -> list[Any]:
        """Every table shard's live rows, stamps and counters (copies)."""
        out = []
        for svc in self.services:
            for shard in svc.store.tables():
                ids, values, _, touched = shard.state()
                out.append((ids, values, touched, shard.stats()))
        return out

    async def checkpoint(self, root: CheckpointRoot, step: int) -> str:
        """What the chief's checkpointer does: every PS saves, the manifest commits."""
        assert self.chief.placement is not None
        temp = root.new_temp(step)
        records: list[ShardRecord] = []
        for i, addr in enumerate(PS):
            c = self.net.client(addr, "chief:0")
            await c.request("checkpoint_save", {"name": temp.name, "id": step})
            rep = await c.request("checkpoint_done", {"id": step, "wait": 5.0})
            records += [ShardRecord.from_json(r) for r in rep.body["shards"]]
            assert i == self.services[i].index
        manifest = Manifest(
            step=step,
            variables=[v.to_wire() for v in self.chief.placement.variables],
            optimizer=dict(self.chief.placement.optimizer),
            num_ps=len(PS),
            shards=records,
        )
        return root.commit(temp, manifest).name


def same_tables(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        np.array_equal(x[0], y[0])
        and np.array_equal(x[1], y[1])
        and np.array_equal(x[2], y[2])
        and x[3] == y[3]
        for x, y in zip(a, b, strict=True)
    )


def test_snapshots_of_a_ctr_job_score_auc_and_change_no_table(
    tmp_path: Path, test_split: CTRDataset
) -> None:
    log_path = tmp_path / "eval.jsonl"
    metrics = Metrics()
    train_ids = np.unique(JOB.load_ctr("train").ids[:512])
    held_out_only = np.setdiff1d(np.unique(test_split.ids), train_ids)
    assert held_out_only.size > 100  # the test split names many ids training never touched

    async def body() -> None:
        c = CTRCluster(tmp_path / "unused")
        await c.create()
        await c.worker("register", steps_planned=2)
        trainer = c.client("trainer")
        await c.train(trainer, 2)
        trained = c.table_state()
        ev = c.evaluator(test_split, eval_log=str(log_path), metrics=metrics)
        task = asyncio.ensure_future(ev.run())
        await c.worker("heartbeat", step=2)
        await until(lambda: len(ev.evaluations) == 1, "the evaluation of step 2", 30)
        assert same_tables(c.table_state(), trained)  # no row made, stamped or admitted

        want = ctr_scores_summary(test_split, await ctr_scores(trainer, c.model, test_split))
        first = ev.evaluations[0]
        assert (first.step, first.source, first.accuracy) == (2, "snapshot", None)
        assert first.scores == want and set(want) == SUMMARY_KEYS
        assert first.loss == want["test_logloss"]

        await c.worker("leave", step=3, reason="done")
        c.chief.finished = True  # the chief's process finished the run
        evaluations = await asyncio.wait_for(task, 30.0)
        assert [e.step for e in evaluations] == [2, 3]
        assert same_tables(c.table_state(), trained)
        rows = sum(s[3]["rows"] for s in trained) // 2  # two tables, the same ids
        assert rows == train_ids.size

    run(body(), timeout=80)
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 3]
    for line in lines:
        assert set(line) == {"step", "loss", "source", "time", *SUMMARY_KEYS}
        assert line["loss"] == line["test_logloss"] and 0.5 < line["test_auc"] < 1.0
    sample = metrics.registry.get_sample_value
    assert sample("zmqps_eval_auc") == lines[-1]["test_auc"]
    assert sample("zmqps_eval_loss") == pytest.approx(lines[-1]["test_logloss"])
    assert sample("zmqps_evaluations_total") == 2


def test_checkpoints_of_a_ctr_job_score_what_the_ps_served(
    tmp_path: Path, test_split: CTRDataset
) -> None:
    root = CheckpointRoot(tmp_path / "ckpts", keep=0)

    async def body() -> None:
        c = CTRCluster(root.path)
        await c.create()
        ev = c.evaluator(test_split, checkpoint_dir=str(root.path))
        task = asyncio.ensure_future(ev.run())
        trainer = c.client("trainer")
        await c.worker("register", steps_planned=3)
        wants = []
        for step in (1, 3):
            await c.train(trainer, 1 if step == 1 else 2)
            await c.checkpoint(root, step)
            scores = await ctr_scores(trainer, c.model, test_split)
            wants.append(ctr_scores_summary(test_split, scores))
            await until(lambda: len(ev.evaluations) == len(wants), f"checkpoint {step}", 30)
        await c.worker("leave", step=3, reason="done")
        c.chief.finished = True  # the chief's process finished the run
        await until(lambda: ev._watch.finished, "the end of training seen")
        c.net.remove(CHIEF)
        evaluations = await asyncio.wait_for(task, 30.0)
        assert [(e.step, e.source) for e in evaluations] == [(1, "checkpoint"), (3, "checkpoint")]
        # the checkpoint's tables read exactly like the PS's read-only pulls
        assert [e.scores for e in evaluations] == wants
        assert wants[0] != wants[1]

    run(body(), timeout=80)


def test_ctr_job_flags_that_do_not_match_the_cluster(
    tmp_path: Path, test_split: CTRDataset
) -> None:
    from zmqps.wire.errors import ConfigError

    async def body() -> None:
        c = CTRCluster(tmp_path)
        other = CTRModel(test_split.num_fields, test_split.num_dense, dim=4)
        await c.chief.create_variables(other.variables(), dict(ADAM))
        ev = c.evaluator(test_split)
        with pytest.raises(ConfigError, match="different ctr/emb"):
            await ev.run()

    run(body())


def test_the_ctr_jobs_tables_hold_a_bounded_number_of_rows() -> None:
    """The job's tables had no ``row_budget``: any client pulling new ids grew a PS
    toward half the machine's memory. Each shard of each table now holds at most
    ``CTR_ROW_BUDGET`` rows, and the PS keeps that bound (created from the job's
    variables, as the chief creates them)."""
    from zmqps.core.hashtable import TableConfig
    from zmqps.roles.job import CTR_ROW_BUDGET

    model = JOB.build_ctr_model(JOB.load_ctr("train"))
    tables = [v for v in model.variables() if v.table is not None]
    assert {v.name for v in tables} == set(model.tables)
    for v in tables:
        assert TableConfig.parse(v.table).row_budget == CTR_ROW_BUDGET
