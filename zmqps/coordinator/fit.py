"""``fit``: a Keras-shaped training loop over a :class:`Coordinator`, with callbacks.

Rules of this module:

* An epoch is ``steps_per_epoch`` training steps, scheduled as closures of
  ``steps_per_execution`` steps each, then joined; its loss is the mean of the
  closures' returned losses (each the last step of its closure).
* Callbacks see ``on_train_begin`` (may move the first epoch: a resumed run),
  ``on_epoch_end`` and ``on_train_end``. :class:`ModelCheckpoint` and
  :class:`BackupAndRestore` use the chief's checkpoint machinery (its checkpoint
  root, ``checkpoint`` op, restore of the latest checkpoint on start); nothing here
  writes model values itself.
* Progress is logged once per epoch (and returned in the history).
* A restore that went back to a checkpoint takes back the updates of the steps after
  it: the chief counts them, and the epoch in which that is seen trains as many steps
  again (on the workers' next batches: the per-worker datasets are endless streams,
  so the run trains every step it planned, not the very same batches).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zmqps.coordinator.coordinator import Coordinator, RemoteValue
from zmqps.models import Model
from zmqps.wire.errors import InvalidArgument

__all__ = ["BackupAndRestore", "Callback", "History", "ModelCheckpoint", "fit"]

log = logging.getLogger("zmqps.coordinator")


@dataclass
class History:
    """What :func:`fit` did: per-epoch logs, the epochs run and the first one."""

    initial_epoch: int = 0
    epochs: list[int] = field(default_factory=list)
    logs: list[dict[str, Any]] = field(default_factory=list)
    #: steps trained again because a restore took their updates back, and the
    #: functions scheduled for them
    retrained: int = 0
    retrained_functions: int = 0

    @property
    def loss(self) -> list[float]:
        return [float(entry["loss"]) for entry in self.logs]


class Callback:
    """Hooks called by :func:`fit` in the coordinator's thread."""

    def on_train_begin(self, coordinator: Coordinator, initial_epoch: int) -> int:
        """Returns the epoch to start at (``initial_epoch`` unless resuming)."""
        return initial_epoch

    def on_epoch_end(self, coordinator: Coordinator, epoch: int, logs: dict[str, Any]) -> None:
        """After every function of ``epoch`` finished."""

    def on_train_end(self, coordinator: Coordinator, history: History) -> None:
        """After the last epoch."""


class ModelCheckpoint(Callback):
    """A checkpoint through the chief every ``every_epochs`` epochs (and after the last),
    written to the chief's checkpoint root (``--checkpoint-dir``) and pruned by it."""

    def __init__(self, every_epochs: int = 1) -> None:
        if every_epochs < 1:
            raise InvalidArgument("every_epochs must be >= 1")
        self.every_epochs = every_epochs
        self.saved: list[dict[str, Any]] = []

    def on_epoch_end(self, coordinator: Coordinator, epoch: int, logs: dict[str, Any]) -> None:
        if (epoch + 1) % self.every_epochs == 0:
            ckpt = coordinator.checkpoint()
            self.saved.append(ckpt)
            logs["checkpoint"] = ckpt["name"]
            log.info("epoch %d: checkpoint %s (step %s)", epoch + 1, ckpt["name"], ckpt["step"])


class BackupAndRestore(Callback):
    """Resume an interrupted ``fit`` (TensorFlow's ``BackupAndRestore``).

    At the end of every epoch the chief takes a checkpoint and ``backup_dir/fit.json``
    records the epoch and that checkpoint (written atomically). A restarted chief
    restores the latest checkpoint of its root on start, and a new ``fit`` with this
    callback starts after the recorded epoch. After a run that completes every epoch
    the record is deleted, so the next ``fit`` starts from epoch 0 (its checkpoints stay).
    The model restored is the chief's latest checkpoint: at least the backed-up epoch's.
    """

    def __init__(self, backup_dir: str | os.PathLike[str], delete_on_end: bool = True) -> None:
        self.path = Path(backup_dir) / "fit.json"
        self.delete_on_end = delete_on_end
        self.resumed_from: int | None = None

    def state(self) -> dict[str, Any] | None:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise InvalidArgument(f"{self.path}: unreadable backup record ({exc})") from exc
        if not isinstance(raw, dict) or not isinstance(raw.get("epoch"), int):
            raise InvalidArgument(f"{self.path}: not a fit backup record")
        return raw

    def on_train_begin(self, coordinator: Coordinator, initial_epoch: int) -> int:
        st = self.state()
        if st is None:
            return initial_epoch
        self.resumed_from = int(st["epoch"])
        log.warning(
            "resuming fit after epoch %d (backed up with checkpoint %s)",
            self.resumed_from + 1,
            st.get("checkpoint"),
        )
        return max(initial_epoch, self.resumed_from + 1)

    def on_epoch_end(self, coordinator: Coordinator, epoch: int, logs: dict[str, Any]) -> None:
        ckpt = coordinator.checkpoint()
        record = {"epoch": epoch, "checkpoint": ckpt["name"], "step": ckpt["step"], "logs": logs}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps(record, default=str) + "\n")
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)

    def on_train_end(self, coordinator: Coordinator, history: History) -> None:
        if self.delete_on_end:
            self.path.unlink(missing_ok=True)


def fit(
    coordinator: Coordinator,
    model: Model,
    dataset_fn: str,
    *,
    epochs: int,
    steps_per_epoch: int,
    callbacks: Sequence[Callback] = (),
    dataset_args: Sequence[Any] = (),
    optimizer: dict[str, Any] | None = None,
    step_fn: str = "train_step",
    steps_per_execution: int | None = None,
) -> History:
    """Train ``model`` (a built-in :class:`~zmqps.models.Model`) for ``epochs`` epochs of
    ``steps_per_epoch`` steps: create its variables through the chief, make the
    per-worker dataset ``dataset_fn(ctx, *dataset_args)`` of the job module, and
    schedule ``step_fn(ctx, iterator, model_signature)`` (by default
    :func:`zmqps.coordinator.steps.train_step`, which the job module re-exports)."""
    if epochs < 1 or steps_per_epoch < 1:
        raise InvalidArgument("epochs and steps_per_epoch must be >= 1")
    per_call = steps_per_execution or coordinator.steps_per_execution
    if per_call < 1:
        raise InvalidArgument("steps_per_execution must be >= 1")
    coordinator.create_variables(model.variables(), optimizer)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn, *dataset_args))
    spec = {"kind": model.name, "config": model.config()}
    history = History()
    start = 0
    for cb in callbacks:
        start = cb.on_train_begin(coordinator, start)
    history.initial_epoch = start
    taken_back = coordinator.rewound_steps()

    def run_steps(steps: int, losses: list[RemoteValue]) -> int:
        """Schedule ``steps`` steps as functions, wait for them; how many functions."""
        left, calls = steps, 0
        while left > 0:
            n = min(per_call, left)
            left -= n
            losses.append(coordinator.schedule(step_fn, iterator, spec, steps=n))
            calls += 1
        coordinator.join()
        return calls

    def catch_up(when: str, losses: list[RemoteValue]) -> int:
        """A restore that went back to a checkpoint took back the updates of the steps
        after it: as many steps are trained again (on the workers' next batches), so
        the run trains every step it planned. Returns how many."""
        nonlocal taken_back
        again = 0
        while (now := coordinator.rewound_steps()) > taken_back:
            lost, taken_back = now - taken_back, now
            log.warning("%s: a restore took back %d steps: training them again", when, lost)
            again += lost
            history.retrained_functions += run_steps(lost, losses)
        coordinator.rewind_accounted = taken_back
        history.retrained += again
        return again

    for epoch in range(start, epochs):
        started = time.perf_counter()
        retried = coordinator.retried
        losses: list[RemoteValue] = []
        run_steps(steps_per_epoch, losses)
        again = catch_up(f"epoch {epoch + 1}", losses)
        values = [float(v.fetch()) for v in losses]
        logs: dict[str, Any] = {
            "epoch": epoch + 1,
            "loss": sum(values) / len(values),
            "steps": steps_per_epoch,
            "functions": len(losses),
            "retried": coordinator.retried - retried,
            "trained_again": again,
            "seconds": round(time.perf_counter() - started, 3),
        }
        log.info(
            "epoch %d/%d: loss %.4f, %d steps in %d functions, %.2f s%s%s",
            epoch + 1,
            epochs,
            logs["loss"],
            steps_per_epoch,
            len(losses),
            logs["seconds"],
            f", {logs['retried']} retried" if logs["retried"] else "",
            f", {again} trained again after a restore" if again else "",
        )
        for cb in callbacks:
            cb.on_epoch_end(coordinator, epoch, logs)
        history.epochs.append(epoch)
        history.logs.append(logs)
    # a PS lost after the last epoch's look (its end, the callbacks' checkpoints) takes
    # steps back too: trained again before training ends
    last: list[RemoteValue] = []
    if catch_up("after the last epoch", last):
        for v in last:
            v.fetch()
    for cb in callbacks:
        cb.on_train_end(coordinator, history)
    return history
