"""The side-car evaluator: scores the model on the test split while the cluster trains.

Rules of this module:

* The evaluator registers with the chief as role ``evaluator`` through a
  :class:`~zmqps.roles.worker.session.Session` (heartbeats, the generation), is
  never counted as a worker, waits for the placement and never pushes anything: it
  cannot change the model, and training never waits for it.
* Two sources of models. With a checkpoint directory it evaluates each new
  committed checkpoint it finds there (read from disk, verified; one that fails
  verification is skipped with a warning; one replaced while it is read, the final
  checkpoint of the step of the last periodic one, is read again as it is now: a
  checkpoint is known by its name and its manifest's time). Without one it pulls a
  snapshot of every dense variable from the PS, at most once per interval and only
  when the chief's global step has moved since the last evaluation.
* Each evaluation is published three ways: a log line, the ``zmqps_eval_*``
  metrics (when an exporter runs) and, optionally, a JSON line in the eval log.
* The end: training is over when the chief says ``finished`` (its summary is
  written and the final checkpoint committed). The chief keeps the PS up until this
  evaluator scored the final model (a snapshot pull, or the final checkpoint) and
  left; then the evaluator exits 0. If the chief and every PS refuse connections
  and the run was seen ending (a chief that could not wait: with a checkpoint
  directory, its newest checkpoint is the run's final one; without, the chief's last
  status had every worker done), the evaluator scores what it can and exits 0.
  Refused connections without that are a cluster whose processes are all down at
  once (a chief and its PS restarting), never taken for the end: the evaluator
  waits for them as for a silent chief. A chief that does not answer for
  ``chief_timeout`` seconds (a crash: the PS still listen; a network problem:
  connections time out; all of them down) is an error (exit 1).
  SIGTERM / SIGINT stop it cleanly (exit 0).
* A lone evaluator (no chief in its cluster, TF2's side-car evaluation job)
  evaluates the checkpoints of ``checkpoint_dir`` as they appear: each new committed
  one once, and it ends after a run's final checkpoint, or when none appeared for
  ``idle_timeout`` seconds after the last it evaluated (an error if it found none).
* Reading a checkpoint and scoring run in a worker thread, so the event loop
  keeps watching the chief and signals meanwhile.
* A CTR job (``--model ctr``) is scored like the chief scores it at the end: AUC and
  log loss on the held-out split (``test_auc``, ``test_logloss``, and on synthetic
  data ``ground_truth_auc`` / ``ground_truth_logloss``). A snapshot pulls the dense
  variables once and the test ids' rows read-only (``pull_rows(create=False)``: no
  row is created, touched or admitted for them; pieces are pulled one after another
  while training goes on, so rows and dense variables may be a few updates apart); a
  checkpoint's tables are read with ``read_table`` and looked up like a read-only
  pull (:class:`~zmqps.core.tableview.TableView`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy.typing as npt

from zmqps.config import split_address
from zmqps.core.tableview import TableView
from zmqps.core.variables import Placement
from zmqps.data import Dataset
from zmqps.data.ctr import CTRDataset
from zmqps.metrics import Metrics
from zmqps.metrics.summaries import Summaries, open_summaries
from zmqps.models import Model
from zmqps.models.ctr import CTRModel
from zmqps.roles._run import start_exporter
from zmqps.roles.client import ParameterClient
from zmqps.roles.configs import EvaluatorConfig
from zmqps.roles.ctr_job import ctr_scores, ctr_scores_summary
from zmqps.roles.homes import Homes
from zmqps.roles.worker.session import RunEnded, Session
from zmqps.transport import Client, Requester, SocketOptions, ZmqContext, new_context
from zmqps.transport.base import cancel_and_wait, waited
from zmqps.wire import ops as o
from zmqps.wire.errors import (
    ConfigError,
    DeadlineExceeded,
    NotReady,
    ShutdownError,
    ZmqpsError,
)

__all__ = [
    "Evaluation",
    "Evaluator",
    "EvaluatorConfig",
    "run_evaluator",
    "serve_evaluator",
]

log = logging.getLogger("zmqps.evaluator")

Array = npt.NDArray[Any]

#: Seconds between two looks at the chief's status (an evaluation still happens at
#: most once per interval).
STATUS_POLL_S = 0.5
#: The final snapshot's pull waits at most this long (the PS may be shutting down).
FINAL_PULL_S = 5.0


class ManifestLike(Protocol):
    """What the evaluator reads of a checkpoint's manifest."""

    @property
    def created(self) -> float: ...


class CheckpointLike(Protocol):
    """What the evaluator reads of a committed checkpoint."""

    @property
    def step(self) -> int: ...

    @property
    def name(self) -> str: ...

    @property
    def manifest(self) -> ManifestLike: ...

    @property
    def final(self) -> bool: ...

    def verify(self) -> list[str]: ...

    def variables(self) -> dict[str, Array]: ...


class CheckpointRootLike(Protocol):
    """A checkpoint directory: its committed checkpoints, oldest first."""

    def checkpoints(self) -> Sequence[CheckpointLike]: ...

    def get(self, name: str) -> CheckpointLike: ...


def identity(ckpt: CheckpointLike) -> tuple[str, float]:
    """A committed checkpoint as it was committed: its name and its manifest's time.
    The name alone is not enough: the run's final checkpoint of the step of its last
    periodic one replaces that one under the same name."""
    return ckpt.name, float(ckpt.manifest.created)


#: a checkpoint replaced or pruned while it was read is looked for again at once, at
#: most this many times (then at the next evaluation)
REREADS = 3
#: checkpoints evaluated or skipped that the evaluator remembers (the latest ones)
SEEN_MAX = 1024


def port_closed(address: str, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to ``address`` (host:port) is refused: nobody listens.

    A timeout or an unreachable host is not "closed" (the peer may be alive behind a
    slow or broken network).
    """
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def open_checkpoint_root(directory: str) -> CheckpointRootLike:
    """The checkpoint library's view of ``directory``."""
    from zmqps.checkpoint import CheckpointRoot

    root: CheckpointRootLike = CheckpointRoot(directory)
    return root


@dataclass(frozen=True)
class Evaluation:
    """One model scored on the test split."""

    step: int
    accuracy: float | None  # None for a CTR job (scored by AUC: see scores)
    loss: float  # a CTR job: the log loss
    source: str  # "checkpoint" or "snapshot"
    time: float  # Unix time of the evaluation
    checkpoint: str | None = None
    #: a CTR job: test_auc, test_logloss (and ground_truth_auc / ground_truth_logloss)
    scores: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        out["loss"] = self.loss if math.isfinite(self.loss) else None
        out.update(self.scores)
        out["source"] = self.source
        out["time"] = round(self.time, 3)
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        return out


@dataclass
class _Watch:
    """What the evaluator knows of the chief."""

    last_contact: float
    finished: bool = False
    global_step: int | None = None
    gen: int = 0  # restores so far: pulls must carry it
    mode: str = ""
    #: the last status had every expected worker done (the run's end was near)
    workers_done: bool = False
    #: the chief and every PS refuse connections, and the run was not seen ending
    #: (said once per outage)
    all_down: bool = False


@dataclass
class Evaluator:
    """The evaluator's state and loop; IO comes in as a chief client and a PS-client
    factory, so tests can run it over :class:`~zmqps.transport.FakeNetwork`."""

    cfg: EvaluatorConfig
    chief: Requester | None  # None: a lone evaluator (checkpoints only)
    connect_ps: Callable[[Sequence[str]], list[Requester]]
    test: Dataset | CTRDataset
    metrics: Metrics | None = None
    open_root: Callable[[str], CheckpointRootLike] = open_checkpoint_root
    probe: Callable[[str], bool] = port_closed  # whether nobody listens at an address
    clock: Callable[[], float] = time.monotonic
    incarnation: int = field(default_factory=lambda: time.time_ns() // 1000)
    evaluations: list[Evaluation] = field(default_factory=list)
    #: TensorBoard: each evaluation's scores at its global step (``--logdir``)
    summaries: Summaries | None = None

    def __post_init__(self) -> None:
        self.model: Model | CTRModel
        if isinstance(self.test, CTRDataset):
            self.model = self.cfg.job.build_ctr_model(self.test)
        else:
            self.model = self.cfg.job.build_model(self.test)
        self.stopping = asyncio.Event()
        self.placement: Placement | None = None
        self.ps: list[Requester] = []
        self.ps_addresses: list[str] = []
        self._ps_gone = False  # the PS were seen shut down: no snapshot to pull
        self._client: ParameterClient | None = None
        #: the process serving each PS state (snapshots follow a fail-over)
        self.homes: Homes | None = None
        #: checkpoints evaluated or skipped (:func:`identity`)
        #: (the latest :data:`SEEN_MAX`: older ones were pruned from the folder long ago)
        self._seen: dict[tuple[str, float], None] = {}
        #: the last checkpoint skipped and why (said when nothing could be evaluated)
        self._last_skip: tuple[str, str] | None = None
        self._final_seen = False  # the last checkpoint evaluated is a run's final one
        #: the newest checkpoint, a final one, before the chief was first heard: a
        #: finished run's, which this one resumed from (not this run's end)
        self._final_before: tuple[str, float] | None = None
        self._last_step: int | None = None  # snapshot: step of the last evaluation
        self._watch = _Watch(last_contact=self.clock())
        self._next_eval = 0.0
        self.session: Session | None = None
        if self.chief is not None:
            who = o.Who("evaluator", 0, self.incarnation)
            self.session = Session(self.chief, who)

    # ------------------------------------------------------------------ control

    def stop(self) -> None:
        """Ask the loop to end (signal handlers call this)."""
        self.stopping.set()

    async def _sleep(self, seconds: float) -> None:
        await waited(self.stopping.wait(), max(0.0, seconds))

    async def _ask(self, op: str, body: Mapping[str, Any], timeout: float) -> dict[str, Any] | None:
        """The chief's reply body, or None when it did not answer (or is going away)."""
        assert self.chief is not None
        try:
            rep = await self.chief.request(op, body, timeout=timeout)
        except (DeadlineExceeded, ShutdownError):
            return None
        self._watch.last_contact = self.clock()
        return dict(rep.body)

    def _chief_lost(self, what: str) -> ZmqpsError:
        assert self.chief is not None
        return DeadlineExceeded(
            f"evaluator: the chief at {self.chief.endpoint} has not answered {what} for"
            f" {self.cfg.chief_timeout:g}s and training was not seen finished"
        )

    # ------------------------------------------------------------------ setup

    async def _register(self) -> o.ClusterInfo | None:
        assert self.session is not None
        info = await self.session.open(self.cfg.connect_timeout)
        self._watch.last_contact = self.clock()
        return info

    async def _wait_placement(self, info: o.ClusterInfo) -> Placement | None:
        assert self.chief is not None
        wire = info.placement
        while wire is None and not self.stopping.is_set():
            try:
                rep = await self.chief.request("get_placement", {"wait": 5.0}, timeout=10.0)
                self._watch.last_contact = self.clock()
                wire = rep.body["placement"]
            except NotReady:
                self._watch.last_contact = self.clock()
                log.info("evaluator: waiting for the model's variables")
            except (DeadlineExceeded, ShutdownError):
                if self.clock() - self._watch.last_contact > self.cfg.chief_timeout:
                    raise self._chief_lost("get_placement") from None
        return None if wire is None else Placement.from_wire(wire)

    def _check_variables(self, placement: Placement) -> None:
        """The job flags must describe the model the cluster trains."""
        have = {v.name: (v.shape, v.dtype) for v in placement.variables if not v.sparse or v.hashed}
        want = {v.name: (v.shape, v.dtype) for v in self.model.variables()}
        if have != want:
            missing = sorted(set(want) - set(have))
            differ = sorted(n for n in set(want) & set(have) if want[n] != have[n])
            detail = (
                f"missing {', '.join(missing)}" if missing else f"different {', '.join(differ)}"
            )
            if not missing and not differ:
                detail = f"extra {', '.join(sorted(set(have) - set(want)))}"
            raise ConfigError(
                f"evaluator: the cluster's variables do not match --model {self.cfg.job.model}"
                f" on --dataset {self.cfg.job.dataset} ({detail}); pass the job flags the"
                " workers got"
            )

    # ------------------------------------------------------------------ the loop

    async def run(self) -> list[Evaluation]:
        """Register, then evaluate until training ends or :meth:`stop` is called (which
        abandons a request or pull in flight); returns the evaluations made."""
        work = asyncio.ensure_future(self._run())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            if not work.done():
                await cancel_and_wait(work)
        if work.cancelled():
            log.info("evaluator: stopped after %d evaluations", len(self.evaluations))
            return self.evaluations
        return work.result()

    async def _run(self) -> list[Evaluation]:
        if self.session is None:
            return await self._alone()
        if self.cfg.checkpoint_dir is not None:
            newest = await asyncio.to_thread(self._newest_listed)
            if newest is not None and newest.final:
                self._final_before = identity(newest)
        try:
            info = await self._register()
        except RunEnded as ended:
            # the chief was started again after its run ended: its PS hold nothing
            # (or are gone), and the final model was scored when the run ended
            log.warning("evaluator: %s: nothing to evaluate", ended)
            return self.evaluations
        except DeadlineExceeded as exc:
            if self._final_before is None:
                raise
            # most likely started after its run ended: say how to score that run
            raise DeadlineExceeded(
                f"{exc}; the newest checkpoint in {self.cfg.checkpoint_dir},"
                f" {self._final_before[0]}, is a finished run's final one: if that run"
                " is the one to score, an evaluator whose cluster holds only itself"
                " scores it (TF_CONFIG naming only the evaluator, with --checkpoint-dir)"
            ) from None
        if self.stopping.is_set() or info is None:
            return self.evaluations
        self._watch.mode = info.mode
        if self.metrics is not None:
            self.metrics.set_info("evaluator", 0, self._watch.mode)
        self.session.start_heartbeats(info.heartbeat_interval)
        placement = await self._wait_placement(info)
        if placement is None:
            return self.evaluations
        self._check_variables(placement)
        self.placement = placement
        self.ps_addresses = list(info.ps)
        self.ps = self.connect_ps(self.ps_addresses)
        session = self.session
        # PS states, wherever they are served (a fail-over moves them: --replication)
        self.homes = Homes(self.ps)
        self.homes.update(placement)
        session.on_placement = self._placement_moved
        self._client = ParameterClient(
            self.homes.links(),
            placement,
            worker="evaluator",
            incarnation=0,
            timeout=self.cfg.pull_timeout,
            shared_memory=False,
            generation=lambda: session.gen,
            exact=True,  # the model as the PS keep it, not as a lighter wire rounds it
        )
        self._announce()
        if await self._loop():
            await self._evaluate_new(final=True)
            log.info("evaluator: training finished; %d evaluations", len(self.evaluations))
            if not self._ps_gone:
                # the chief may shut the PS down now (it answers at once, or is gone)
                await session.leave("done", timeout=max(1.0, 2 * self.cfg.request_timeout))
        else:
            log.info("evaluator: stopped after %d evaluations", len(self.evaluations))
        return self.evaluations

    async def _placement_moved(self) -> None:
        """A heartbeat named a newer placement epoch: PS states moved (a fail-over);
        snapshot pulls follow them (one in flight is sent again to the new home)."""
        assert self.chief is not None
        try:
            rep = await self.chief.request("get_placement", {"wait": 0.0}, timeout=5.0)
            placement = Placement.from_wire(rep.body["placement"])
        except (ZmqpsError, KeyError, TypeError, ValueError) as exc:
            log.info("evaluator: the new placement is not known yet: %s", exc)
            return
        if self.homes is not None:
            moved = self.homes.update(placement)
            if moved:
                log.info(
                    "evaluator: ps %s now served elsewhere (placement epoch %d)",
                    ", ".join(map(str, moved)),
                    placement.epoch,
                )

    def _announce(self) -> None:
        log.info(
            "evaluator: %s on %s, every %gs, source %s%s",
            self.cfg.job.model,
            self.cfg.job.dataset,
            self.cfg.interval,
            self.cfg.source,
            f" ({self.cfg.checkpoint_dir})" if self.cfg.checkpoint_dir else " (PS)",
        )

    async def _alone(self) -> list[Evaluation]:
        """No chief: evaluate each new checkpoint until a run's final one, or until none
        appeared for ``idle_timeout`` seconds."""
        assert self.cfg.checkpoint_dir is not None
        self._announce()
        idle_since = self.clock()
        while not self.stopping.is_set():
            ev = await self._from_checkpoint(self.cfg.checkpoint_dir)
            if ev is not None:
                idle_since = self.clock()
                if self._final_seen:
                    log.info("evaluator: that was the run's final checkpoint")
                    return self.evaluations
            elif self.clock() - idle_since > self.cfg.idle_timeout:
                if not self.evaluations:
                    skipped = self._last_skip
                    raise DeadlineExceeded(
                        f"evaluator: no committed checkpoint in {self.cfg.checkpoint_dir}"
                        f" within {self.cfg.idle_timeout:g}s"
                        if skipped is None
                        else f"evaluator: no checkpoint in {self.cfg.checkpoint_dir} it could"
                        f" evaluate within {self.cfg.idle_timeout:g}s ({skipped[0]} was"
                        f" skipped: {skipped[1]})"
                    )
                log.info(
                    "evaluator: no new checkpoint for %gs; %d evaluations",
                    self.cfg.idle_timeout,
                    len(self.evaluations),
                )
                return self.evaluations
            await self._sleep(min(STATUS_POLL_S, self.cfg.interval))
        return self.evaluations

    async def _loop(self) -> bool:
        """Watch the chief and evaluate; True once training is over."""
        w = self._watch
        while not self.stopping.is_set():
            status = await self._ask("status", {}, timeout=self.cfg.request_timeout)
            now = self.clock()
            if status is not None:
                self._take_status(status)
            elif w.finished:
                log.info("evaluator: the chief has gone away after the end of training")
                return True
            elif await self._cluster_shut_down():
                ended = await asyncio.to_thread(self._seen_ending)
                if ended is not None:
                    self._ps_gone = True
                    log.info(
                        "evaluator: the chief and every PS have closed their ports and %s:"
                        " the cluster has shut down (training is over)",
                        ended,
                    )
                    return True
                if not w.all_down:
                    w.all_down = True
                    log.warning(
                        "evaluator: the chief and every PS refuse connections, but training"
                        " was not seen ending: waiting up to %gs for them to come back",
                        max(0.0, self.cfg.chief_timeout - (now - w.last_contact)),
                    )
                if now - w.last_contact > self.cfg.chief_timeout:
                    raise self._chief_lost("status requests")
            elif now - w.last_contact > self.cfg.chief_timeout:
                raise self._chief_lost("status requests")
            if w.finished:
                log.info("evaluator: the chief reports training finished")
                return True
            if now >= self._next_eval and status is not None:
                self._next_eval = now + self.cfg.interval
                await self._evaluate_new(final=False)
            await self._sleep(min(STATUS_POLL_S, self.cfg.interval))
        return False

    async def _cluster_shut_down(self) -> bool:
        """Whether the chief and every PS refuse connections: their processes exited.

        The chief shuts the PS down when training ends, so both being gone tells an
        ended job from a lost chief (the PS still listen) or a network partition
        (connections time out instead of being refused).
        """
        assert self.cfg.chief is not None
        addresses = [self.cfg.chief, *self.ps_addresses]
        closed = await asyncio.gather(*(asyncio.to_thread(self.probe, a) for a in addresses))
        return all(closed)

    def _seen_ending(self) -> str | None:
        """Why the run is known to have ended, with its processes gone (None: it is not):
        with a checkpoint directory, its newest committed checkpoint is the run's final
        one (not one there before the chief was first heard: a resumed run's start);
        without, the chief's last status had every worker done."""
        if self.cfg.checkpoint_dir is None:
            return "every worker had finished" if self._watch.workers_done else None
        newest = self._newest_listed()
        if newest is not None and newest.final and identity(newest) != self._final_before:
            return f"the newest checkpoint, {newest.name}, is the run's final one"
        return None

    def _newest_listed(self) -> CheckpointLike | None:
        """The newest committed checkpoint in the checkpoint directory, if any."""
        assert self.cfg.checkpoint_dir is not None
        try:
            listed = list(self.open_root(self.cfg.checkpoint_dir).checkpoints())
        except (ZmqpsError, OSError, ValueError) as exc:
            log.warning("evaluator: cannot list checkpoints: %s", exc)
            return None
        return listed[-1] if listed else None

    def _take_status(self, status: Mapping[str, Any]) -> None:
        w = self._watch
        w.all_down = False
        workers, expected = status.get("workers"), status.get("workers_expected")
        if isinstance(workers, list) and isinstance(expected, int):
            done = [x for x in workers if isinstance(x, dict) and x.get("state") == "done"]
            w.workers_done = expected > 0 and len(done) >= expected
        # Training is over when the chief says so: its summary is written, its final
        # checkpoint committed, and it keeps the PS up until this evaluator leaves.
        w.finished = w.finished or bool(status.get("finished", False))
        step = status.get("global_step")
        if isinstance(step, int):
            w.global_step = step
        gen = status.get("gen")
        if isinstance(gen, int):
            w.gen = gen
            if self.session is not None and not status.get("recovering"):
                self.session.enter(gen)
        mode = status.get("mode")
        if isinstance(mode, str) and mode != w.mode:
            w.mode = mode
            if self.metrics is not None:
                self.metrics.set_info("evaluator", 0, mode)

    # ------------------------------------------------------------------ evaluating

    async def _evaluate_new(self, *, final: bool) -> Evaluation | None:
        if self.cfg.checkpoint_dir is not None:
            return await self._from_checkpoint(self.cfg.checkpoint_dir)
        return await self._from_snapshot(final)

    async def _from_checkpoint(self, directory: str) -> Evaluation | None:
        found = await asyncio.to_thread(self._newest_checkpoint, directory)
        if found is None:
            return None
        ckpt, variables = found
        return await self._score(variables, int(ckpt.step), "checkpoint", ckpt.name)

    def _newest_checkpoint(self, directory: str) -> tuple[CheckpointLike, dict[str, Any]] | None:
        """The newest committed checkpoint not evaluated yet, verified, and its variables.

        One that fails verification is skipped with a warning and the next older one
        tried, back to the first one seen before (scores stay in step order: not past a
        name evaluated or skipped before, as a final checkpoint replacing one evaluated
        is). One of another model is skipped, and nothing older tried (they are too). A
        checkpoint may be replaced (the final one of the same step) or pruned while it
        is read: that is no failure of it. The directory is looked at again at once."""
        for _ in range(REREADS):
            try:
                root = self.open_root(directory)
                listed = list(root.checkpoints())
            except (ZmqpsError, OSError, ValueError) as exc:
                log.warning("evaluator: cannot list checkpoints in %s: %s", directory, exc)
                return None
            names = {name for name, _ in self._seen}
            for ckpt in reversed(listed):
                if identity(ckpt) in self._seen:
                    return None
                variables, why, damaged = self._read_checkpoint(ckpt)
                # read as it was verified: still what its directory holds afterwards
                if self._replaced(root, ckpt):
                    break  # list again: what replaced it is the newest
                if variables is not None:
                    self._saw(ckpt)
                    self._final_seen = ckpt.final
                    return ckpt, variables
                self._skip(ckpt, why)
                if not damaged or ckpt.name in names:
                    return None
            else:
                return None
        return None

    def _read_checkpoint(self, ckpt: CheckpointLike) -> tuple[dict[str, Any] | None, str, bool]:
        """A checkpoint's variables, verified; or None, why they cannot be used, and
        whether that is damage of this checkpoint (it fails verification), not a
        mismatch every checkpoint of the directory has (another model's)."""
        try:
            problems = ckpt.verify()
            if problems:
                return None, f"it failed verification: {'; '.join(problems)}", True
            variables: dict[str, Any] = dict(ckpt.variables())
        except (ZmqpsError, OSError, ValueError, KeyError) as exc:
            return None, f"it failed verification: {exc}", True
        missing = sorted(
            v.name
            for v in self.model.variables()
            if not v.hashed and (v.name not in variables or variables[v.name].shape != v.shape)
        )
        if missing:
            why = f"variables missing or of another shape: {', '.join(missing)}"
            return None, why, False
        if isinstance(self.model, CTRModel):
            try:
                variables.update(self._checkpoint_tables(ckpt))
            except (ZmqpsError, OSError, ValueError, KeyError) as exc:
                return None, f"its tables cannot be read: {exc}", False
        return variables, "", False

    @staticmethod
    def _replaced(root: CheckpointRootLike, ckpt: CheckpointLike) -> bool:
        """Whether ``ckpt`` is no longer what its directory holds (replaced, pruned)."""
        try:
            return identity(root.get(ckpt.name)) != identity(ckpt)
        except (ZmqpsError, OSError, ValueError):
            return True

    def _checkpoint_tables(self, ckpt: Any) -> dict[str, TableView]:
        """Every hash-keyed table of a checkpoint, as lookups that read like the PS."""
        from zmqps.checkpoint.tables import read_table

        out: dict[str, TableView] = {}
        for v in self.model.variables():
            if v.hashed:
                saved = ckpt.variable(v.name)
                if not saved.hashed or saved.shape[1:] != v.shape[1:]:
                    raise ValueError(f"{v.name} is not a table of rows {v.shape[1:]} there")
                ids, values, _, _, _ = read_table(ckpt, v.name, 0, saved.shape[0])
                out[v.name] = TableView(v.name, ids, values, saved.init, saved.table or {})
        return out

    def _skip(self, ckpt: CheckpointLike, why: str) -> None:
        self._last_skip = (ckpt.name, why)
        if identity(ckpt) not in self._seen:
            log.warning("evaluator: checkpoint %s skipped: %s", ckpt.name, why)
            self._saw(ckpt)

    def _saw(self, ckpt: CheckpointLike) -> None:
        self._seen[identity(ckpt)] = None
        if len(self._seen) > SEEN_MAX:
            del self._seen[next(iter(self._seen))]

    async def _from_snapshot(self, final: bool) -> Evaluation | None:
        step = self._watch.global_step
        if step is None or step == self._last_step or self._client is None:
            return None
        if self._ps_gone:
            log.info("evaluator: no final snapshot (the PS have shut down)")
            return None
        if final:
            # A chief that could not wait shuts the PS down: do not hang on them.
            self._client.timeout = min(self._client.timeout, FINAL_PULL_S)
        try:
            if isinstance(self.model, CTRModel) and isinstance(self.test, CTRDataset):
                probabilities = await ctr_scores(
                    self._client, self.model, self.test, compute=asyncio.to_thread
                )
                self._last_step = step
                return self._publish_ctr(probabilities, step, "snapshot", None)
            params = await self._client.pull()
        except (ZmqpsError, OSError) as exc:
            if final:
                log.info("evaluator: no final snapshot (the PS are gone: %s)", exc)
            else:
                log.warning("evaluator: pull failed: %s; retrying in %gs", exc, self.cfg.interval)
            return None
        self._last_step = step
        return await self._score(params, step, "snapshot", None)

    async def _score(
        self, params: Mapping[str, Any], step: int, source: str, checkpoint: str | None
    ) -> Evaluation:
        if isinstance(self.model, CTRModel) and isinstance(self.test, CTRDataset):
            test = self.test
            probabilities = await asyncio.to_thread(
                self.model.predict, params, test.ids, test.dense
            )
            return self._publish_ctr(probabilities, step, source, checkpoint)
        assert isinstance(self.model, Model) and isinstance(self.test, Dataset)
        scores = await asyncio.to_thread(self.model.evaluate, params, self.test.x, self.test.y)
        ev = Evaluation(
            step=step,
            accuracy=float(scores["accuracy"]),
            loss=float(scores["loss"]),
            source=source,
            time=time.time(),
            checkpoint=checkpoint,
        )
        self._publish(ev)
        return ev

    def _publish_ctr(
        self, probabilities: Array, step: int, source: str, checkpoint: str | None
    ) -> Evaluation:
        assert isinstance(self.test, CTRDataset)
        scores = ctr_scores_summary(self.test, probabilities)
        ev = Evaluation(
            step=step,
            accuracy=None,
            loss=float(scores["test_logloss"]),
            source=source,
            time=time.time(),
            checkpoint=checkpoint,
            scores=scores,
        )
        self._publish(ev)
        return ev

    def _publish(self, ev: Evaluation) -> None:
        self.evaluations.append(ev)
        where = f"({ev.source}{f' {ev.checkpoint}' if ev.checkpoint else ''})"
        if "test_auc" in ev.scores:
            log.info(
                "evaluator: step %d, test AUC %.4f, log loss %.4f %s",
                ev.step,
                ev.scores["test_auc"],
                ev.loss,
                where,
            )
        else:
            log.info(
                "evaluator: step %d, accuracy %.4f, loss %.4f %s",
                ev.step,
                ev.accuracy,
                ev.loss,
                where,
            )
        m = self.metrics
        if m is not None:
            if ev.accuracy is not None:
                m.eval_accuracy.set(ev.accuracy)
            if "test_auc" in ev.scores:
                m.eval_auc.set(ev.scores["test_auc"])
            m.eval_loss.set(ev.loss)
            m.eval_step.set(ev.step)
            m.evaluations.inc()
        if self.cfg.eval_log:
            with Path(self.cfg.eval_log).open("a") as f:
                f.write(json.dumps(ev.to_json()) + "\n")
        if self.summaries is not None:
            scores: dict[str, float | None] = {"eval/loss": ev.loss, "eval/accuracy": ev.accuracy}
            scores.update({f"eval/{k.removeprefix('test_')}": v for k, v in ev.scores.items()})
            self.summaries.scalars(ev.step, scores)
            self.summaries.flush()  # evaluations are rare: each is seen at once

    async def close(self) -> None:
        for c in self.ps:
            await c.close()
        if self.session is not None:
            await self.session.close()


async def serve_evaluator(
    cfg: EvaluatorConfig,
    ctx: ZmqContext,
    options: SocketOptions | None = None,
    test: Dataset | CTRDataset | None = None,
) -> list[Evaluation]:
    """Run an evaluator over real sockets until training ends or a signal stops it."""
    # before any socket: a failure here (a --logdir it cannot create) is raised with
    # nothing to close (after its clients were made, the context's termination waited
    # for them for ever: the evaluator hung, silent)
    summaries = open_summaries(cfg.logdir, "evaluator")
    metrics = Metrics() if cfg.metrics_port is not None else None
    exporter = start_exporter(metrics, cfg.metrics_host, cfg.metrics_port, "evaluator")
    if metrics is not None:
        metrics.set_info("evaluator", 0, "")
    if test is None:
        test = cfg.job.load_ctr("test") if cfg.job.is_ctr else cfg.job.load("test")
    incarnation = time.time_ns() // 1000
    chief: Requester | None = None
    if cfg.chief is not None:
        chief = Client(
            ctx,
            cfg.chief,
            f"evaluator:0:{incarnation}",
            options=options,
            timeout=cfg.request_timeout,
        )

    def connect_ps(addresses: Sequence[str]) -> list[Requester]:
        # An identity of its own per process: two evaluators never take over each
        # other's connections (ROUTER_HANDOVER).
        return [
            Client(ctx, a, f"evaluator:0:{incarnation}", options=options, timeout=cfg.pull_timeout)
            for a in addresses
        ]

    ev = Evaluator(cfg, chief, connect_ps, test, metrics, incarnation=incarnation)
    ev.summaries = summaries
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, ev.stop)
    try:
        return await ev.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
        await ev.close()
        if ev.summaries is not None:
            ev.summaries.close()
        if exporter is not None:
            exporter.close()


def run_evaluator(cfg: EvaluatorConfig, options: SocketOptions | None = None) -> int:
    """The evaluator as a process: 0 when training ended (or on SIGTERM), else an error."""

    async def main() -> None:
        ctx = new_context()
        try:
            await serve_evaluator(cfg, ctx, options)
        finally:
            ctx.term()

    asyncio.run(main())
    return 0
