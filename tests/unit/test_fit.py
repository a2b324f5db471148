"""fit() and its callbacks against a stand-in coordinator (sans-IO: no sockets)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from zmqps.coordinator import BackupAndRestore, ModelCheckpoint, fit
from zmqps.coordinator.fit import Callback, History
from zmqps.models import build_model
from zmqps.wire.errors import InvalidArgument


class Done:
    def __init__(self, value: Any) -> None:
        self.value = value

    def fetch(self) -> Any:
        return self.value


class FakeCoordinator:
    """Records what fit asks for; every function 'returns' its step count as the loss."""

    def __init__(self, steps_per_execution: int = 1) -> None:
        self.steps_per_execution = steps_per_execution
        self.retried = 0
        self.created: list[Any] = []
        self.scheduled: list[tuple[str, int]] = []
        self.joins = 0
        self.checkpoints = 0
        #: what the chief says restores took back, as fit asks (one value per ask)
        self.rewound: list[int] = []
        self.rewound_now = 0

    def rewound_steps(self) -> int:
        if self.rewound:
            self.rewound_now = self.rewound.pop(0)
        return self.rewound_now

    def create_variables(self, variables: Any, optimizer: Any = None) -> None:
        self.created.append(([v.name for v in variables], optimizer))

    def create_per_worker_dataset(self, fn: str, *args: Any) -> Any:
        name = f"iterator of {fn}{args}"

        class Iterator:  # like PerWorkerIterator: advanced on the workers only
            def __iter__(self) -> Iterator:
                return self

            def __next__(self) -> Any:
                raise TypeError

            def __repr__(self) -> str:
                return name

        class Dataset:
            def __iter__(self) -> Iterator:
                return Iterator()

        return Dataset()

    def schedule(self, fn: str, *args: Any, steps: int = 1) -> Done:
        assert repr(args[0]) == "iterator of batch_stream(32,)"
        assert args[1]["kind"] == "mlp" and args[1]["config"]["hidden"] == [8]
        self.scheduled.append((fn, steps))
        return Done(float(steps))

    def join(self) -> None:
        self.joins += 1

    def checkpoint(self) -> dict[str, Any]:
        self.checkpoints += 1
        return {"name": f"ckpt-{self.checkpoints:012d}", "step": 10 * self.checkpoints}


MODEL = build_model("mlp", 4, 3, hidden=(8,))


def test_an_epoch_is_its_steps_packed_steps_per_execution_per_function() -> None:
    coord = FakeCoordinator(steps_per_execution=4)
    history = fit(
        coord,  # type: ignore[arg-type]
        MODEL,
        "batch_stream",
        epochs=3,
        steps_per_epoch=10,
        dataset_args=(32,),
        optimizer={"name": "sgd", "lr": 0.1},
    )
    assert coord.created == [(["mlp/dense_0/w", "mlp/dense_0/b", "mlp/out/w", "mlp/out/b"],
                              {"name": "sgd", "lr": 0.1})]  # fmt: skip
    # 10 steps: functions of 4, 4 and 2 steps, each epoch, joined once per epoch
    assert coord.scheduled == [("train_step", 4), ("train_step", 4), ("train_step", 2)] * 3
    assert coord.joins == 3
    assert history.epochs == [0, 1, 2] and history.initial_epoch == 0
    assert history.loss == pytest.approx([10 / 3] * 3)
    assert [entry["functions"] for entry in history.logs] == [3, 3, 3]


def test_callbacks_are_called_in_order() -> None:
    seen: list[Any] = []

    class Spy(Callback):
        def on_train_begin(self, coordinator: Any, initial_epoch: int) -> int:
            seen.append(("begin", initial_epoch))
            return 1  # resume at the second epoch

        def on_epoch_end(self, coordinator: Any, epoch: int, logs: dict[str, Any]) -> None:
            seen.append(("epoch", epoch, logs["steps"]))

        def on_train_end(self, coordinator: Any, history: History) -> None:
            seen.append(("end", history.epochs))

    fit(FakeCoordinator(), MODEL, "batch_stream", epochs=3, steps_per_epoch=2,  # type: ignore[arg-type]
        dataset_args=(32,), callbacks=[Spy()])  # fmt: skip
    assert seen == [("begin", 0), ("epoch", 1, 2), ("epoch", 2, 2), ("end", [1, 2])]


def test_backup_and_restore_resumes_after_the_last_backed_up_epoch(tmp_path: Path) -> None:
    backup = BackupAndRestore(tmp_path / "backup", delete_on_end=True)
    coord = FakeCoordinator()

    class Interrupt(Callback):
        def on_epoch_end(self, coordinator: Any, epoch: int, logs: dict[str, Any]) -> None:
            if epoch == 1:
                raise KeyboardInterrupt  # the chief dies after backing up epoch 1

    with pytest.raises(KeyboardInterrupt):
        fit(coord, MODEL, "batch_stream", epochs=5, steps_per_epoch=2,  # type: ignore[arg-type]
            dataset_args=(32,), callbacks=[backup, Interrupt()])  # fmt: skip
    record = json.loads((tmp_path / "backup" / "fit.json").read_text())
    assert record["epoch"] == 1 and record["checkpoint"] == "ckpt-000000000002"
    assert coord.checkpoints == 2  # one per epoch, through the chief

    again = BackupAndRestore(tmp_path / "backup")
    history = fit(coord, MODEL, "batch_stream", epochs=5, steps_per_epoch=2,  # type: ignore[arg-type]
                  dataset_args=(32,), callbacks=[again])  # fmt: skip
    assert again.resumed_from == 1
    assert history.initial_epoch == 2 and history.epochs == [2, 3, 4]
    # a completed fit removes its record: the next one starts at epoch 0
    assert not (tmp_path / "backup" / "fit.json").exists()


def test_a_damaged_backup_record_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "fit.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match="unreadable backup record"):
        BackupAndRestore(tmp_path).on_train_begin(FakeCoordinator(), 0)  # type: ignore[arg-type]
    (tmp_path / "fit.json").write_text('{"epoch": "two"}')
    with pytest.raises(InvalidArgument, match="not a fit backup record"):
        BackupAndRestore(tmp_path).on_train_begin(FakeCoordinator(), 0)  # type: ignore[arg-type]


def test_model_checkpoint_every_n_epochs() -> None:
    coord = FakeCoordinator()
    ckpt = ModelCheckpoint(every_epochs=2)
    history = fit(coord, MODEL, "batch_stream", epochs=5, steps_per_epoch=1,  # type: ignore[arg-type]
                  dataset_args=(32,), callbacks=[ckpt])  # fmt: skip
    assert [s["name"] for s in ckpt.saved] == ["ckpt-000000000001", "ckpt-000000000002"]
    assert [entry.get("checkpoint") for entry in history.logs] == [
        None, "ckpt-000000000001", None, "ckpt-000000000002", None]  # fmt: skip
    with pytest.raises(InvalidArgument):
        ModelCheckpoint(every_epochs=0)
    with pytest.raises(InvalidArgument):
        fit(coord, MODEL, "batch_stream", epochs=0, steps_per_epoch=1)  # type: ignore[arg-type]


#: what an epoch of 10 steps schedules, 4 steps per execution
_PER_EPOCH = [("train_step", 4), ("train_step", 4), ("train_step", 2)]


def _fit_ten_steps(coord: FakeCoordinator, epochs: int) -> Any:
    return fit(
        coord,  # type: ignore[arg-type]
        MODEL,
        "batch_stream",
        epochs=epochs,
        steps_per_epoch=10,
        dataset_args=(32,),
    )


def test_steps_a_restore_took_back_are_trained_again() -> None:
    coord = FakeCoordinator(steps_per_execution=4)
    # asked at the start (3: from before this fit), after epoch 1 (3), after epoch 2
    # (12: a restore took back 9 steps), after their retraining (14: another took back
    # 2 of them), then nothing more
    coord.rewound = [3, 3, 12, 14, 14]
    history = _fit_ten_steps(coord, epochs=3)
    again = [("train_step", 4), ("train_step", 4), ("train_step", 1), ("train_step", 2)]
    assert coord.scheduled == _PER_EPOCH * 2 + again + _PER_EPOCH
    assert [e["trained_again"] for e in history.logs] == [0, 11, 0]
    assert (history.retrained, history.retrained_functions) == (11, 4)


def test_steps_a_restore_took_back_after_the_last_epoch_are_trained_again() -> None:
    """A PS lost after the last epoch's look (while the run ended): the restore took
    back 7 steps that nobody trained again; the run exited 0 with the model lacking
    them. fit looks once more before it returns, and says what it accounted for (the
    driver fails the run if a restore took back more after that)."""
    coord = FakeCoordinator(steps_per_execution=4)
    coord.rewound = [0, 0, 0, 7, 7]  # start, epoch 1, epoch 2, the last look, after it
    history = _fit_ten_steps(coord, epochs=2)
    assert coord.scheduled == _PER_EPOCH * 2 + [("train_step", 4), ("train_step", 3)]
    assert (history.retrained, history.retrained_functions) == (7, 2)
    assert coord.rewind_accounted == 7  # type: ignore[attr-defined]


class _LosingWorker:
    """A worker whose pushes restores drop before any PS keeps them, ``lose`` times."""

    def __init__(self, model: Any, lose: int) -> None:
        self.params = {v.name: np.zeros(v.shape, np.float32) for v in model.variables()}
        self.lose = lose
        self.lost_steps = 0
        self.pushes = 0
        self.placement = object()

    def pull(self) -> dict[str, np.ndarray]:
        return self.params

    def push_pull(self, grads: Any, **_: Any) -> dict[str, np.ndarray]:
        self.pushes += 1
        if self.lose:
            self.lose -= 1
            self.lost_steps += 1
        return self.params


def test_a_step_a_restore_dropped_before_any_ps_kept_it_is_trained_again() -> None:
    """Fault schedule 162 of run 9: pushes in flight when a PS's restore began were
    refused by every PS (values of before it); the restore's rewind counts only the
    steps a PS had applied, so the run ended 2 steps short on a PS that lived through."""
    from zmqps.coordinator.server import FunctionContext
    from zmqps.coordinator.steps import MAX_TRIES, train_step

    model = build_model("softmax", 64, 10)
    spec = {"kind": model.name, "config": model.config()}
    batches = iter(
        (np.zeros((4, 64), np.float32), np.zeros(4, np.int64)) for _ in range(2 * MAX_TRIES)
    )
    for lose, pushes in ((0, 1), (2, 3), (MAX_TRIES + 3, MAX_TRIES)):
        worker = _LosingWorker(model, lose)
        ctx = FunctionContext(0, 1, worker)  # type: ignore[arg-type]
        train_step(ctx, batches, spec)
        assert worker.pushes == pushes  # one batch per try, tries bounded


def test_a_run_whose_last_restore_took_back_untrained_steps_fails(tmp_path: Path) -> None:
    """The driver's end compares the steps restores took back (the chief's count) with
    those the training loop trained again: more is a failed run (exit code 3), said in
    the summary, not a good end with a model lacking them."""
    import json

    import pytest

    from zmqps.config import ClusterSpec
    from zmqps.coordinator.driver import _annotate
    from zmqps.roles.configs import ChiefConfig
    from zmqps.wire.errors import RunFailed

    path = tmp_path / "summary.json"
    cfg = ChiefConfig(
        bind="tcp://127.0.0.1:1",
        cluster=ClusterSpec("127.0.0.1:1", ("127.0.0.1:2",), ("127.0.0.1:3",)),
        summary_path=str(path),
    )
    path.write_text(json.dumps({"rewound_batches": 45}))
    _annotate(cfg, {"stats": {}, "rewind_accounted": 45})
    assert "failed" not in json.loads(path.read_text())
    path.write_text(json.dumps({"rewound_batches": 52}))
    with pytest.raises(RunFailed, match="took back 7 steps"):
        _annotate(cfg, {"stats": {}, "rewind_accounted": 45})
    assert "took back 7 steps" in json.loads(path.read_text())["failed"]
