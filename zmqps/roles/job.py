"""The job: what the built-in training program trains, shared by chief and workers.

A frozen dataclass read once from the command line; the chief uses it to
create variables and to evaluate the final model, workers to train.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zmqps.data import DATASETS, Dataset, load_dataset
from zmqps.models import Model, build_model
from zmqps.wire.errors import ConfigError, InvalidArgument, ModelMismatch

if TYPE_CHECKING:
    from zmqps.data.ctr import CTRDataset
    from zmqps.models.ctr import CTRModel

__all__ = ["JobConfig"]


#: the largest ``--seed``: each variable's initializer takes ``seed + i`` (a few per
#: model), a 64-bit int on the wire
MAX_SEED = 2**62

#: rows per shard of each table of the built-in CTR job (its ``row_budget``): past it
#: new ids evict the least recently touched rows. Without one, any client pulling new
#: ids grew a PS toward half the machine's memory (4 pulls of 1M new ids: +0.9 GB);
#: with it, a table's shard holds at most this many rows (dim 8 with its Adagrad
#: slot: about 0.4 GB), far above what the synthetic data needs (1,600 rows)
CTR_ROW_BUDGET = 1 << 22


@dataclass(frozen=True)
class JobConfig:
    model: str = "mlp"
    dataset: str = "digits"
    data_dir: str | None = None
    hidden: tuple[int, ...] = (128,)
    batch_size: int = 32
    epochs: int = 20
    optimizer: Mapping[str, Any] = field(
        default_factory=lambda: {"name": "momentum", "lr": 0.05, "momentum": 0.9}
    )
    seed: int = 0
    log_every: int = 50
    #: synthetic CTR data (model ctr): training examples (the test split is a fifth)
    examples: int = 100_000

    def __post_init__(self) -> None:
        """Everything about the job that can be wrong without reading a file: found
        before any task starts (a task that fails on it exits with the configuration
        code, never restarted)."""
        from zmqps.core.optimizers import make_optimizer
        from zmqps.data.ctr import CTR_DATASETS

        known = CTR_DATASETS if self.is_ctr else DATASETS
        if self.dataset not in known:
            raise ConfigError(
                f"--model {self.model} cannot train on --dataset {self.dataset}"
                f" (ctr takes {', '.join(CTR_DATASETS)}; the others {', '.join(DATASETS)})"
            )
        if self.dataset in ("mnist", "criteo") and not self.data_dir:
            holds = "the MNIST IDX files" if self.dataset == "mnist" else "train.txt"
            raise ConfigError(
                f"--dataset {self.dataset} needs --data-dir (a folder holding {holds})"
            )
        for name in ("batch_size", "epochs", "log_every", "examples"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
        if not 0 <= self.seed <= MAX_SEED:
            # the data order draws from seeds >= 0 (a worker failed on its first batch),
            # the variables' initializers from seed + i on the wire (int64: the chief
            # failed creating them, restarted, with the wire's schema path as its error)
            raise ConfigError(f"--seed must be within [0, 2^62], got {self.seed}")
        lr, momentum = self.optimizer.get("lr"), self.optimizer.get("momentum", 0.0)
        if not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
            raise ConfigError(f"--lr must be a number > 0, got {lr}")
        if not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
            raise ConfigError(f"--momentum must be within [0, 1), got {momentum}")
        try:
            make_optimizer(self.optimizer)
        except InvalidArgument as exc:
            raise ConfigError(f"--optimizer {self.optimizer.get('name')}: {exc}") from None

    def definition(self) -> dict[str, Any]:
        """What defines this job's variables, as flags (a checkpoint records it: a run
        resumed on it must train the same model)."""
        out: dict[str, Any] = {"model": self.model}
        if self.model == "mlp":
            out["hidden"] = list(self.hidden)
        # the whole configuration: the PS hold it with the variables (a learning rate
        # of its own is another optimizer there)
        out["optimizer"] = dict(sorted(self.optimizer.items()))
        return out

    @staticmethod
    def same(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> bool:
        """Whether a recorded :meth:`definition` is ``now``'s (one that recorded the
        optimizer's name alone is compared on the name)."""
        if isinstance(recorded.get("optimizer"), str):
            now = {**now, "optimizer": dict(now.get("optimizer") or {}).get("name")}
        return dict(recorded) == dict(now)

    @staticmethod
    def describe(definition: Mapping[str, Any]) -> str:
        """``--model mlp --hidden 128 (--optimizer momentum --lr 0.05 --momentum 0.9)``
        of a :meth:`definition`."""
        hidden = definition.get("hidden")
        text = f"--model {definition.get('model')}"
        if isinstance(hidden, (list, tuple)):
            text += f" --hidden {','.join(map(str, hidden))}"
        opt = definition.get("optimizer")
        if isinstance(opt, Mapping):
            flags = [f"--optimizer {opt.get('name')}"]
            flags += [f"--{k.replace('_', '-')} {v}" for k, v in opt.items() if k != "name"]
            return f"{text} ({' '.join(flags)})"
        return f"{text} (--optimizer {opt})"

    def not_the_model(self, exc: ModelMismatch) -> ConfigError:
        """The configuration error ``exc`` is for this job: creating its variables met a
        different model already in the cluster (another task's flags, a checkpoint of
        another model); it would fail again on every restart."""
        return ConfigError(
            f"this task's {self.describe(self.definition())} is not the model the cluster"
            f" holds ({exc}):"
            " every task of a run takes the same job flags, and a checkpoint directory holds"
            " one model"
        )

    def check_data(self, read: bool = False) -> None:
        """Fail now, with one clear line, if the data set's files are not there;
        ``read``: read them whole too (``zmqps launch``, once before its tasks start: a
        corrupt file found by the tasks after the start failed them all, exit 1)."""
        from pathlib import Path

        if self.dataset == "mnist":
            from zmqps.data.mnist import find_mnist, load_mnist

            assert self.data_dir is not None
            try:
                for split in ("train", "test"):
                    if read:
                        load_mnist(self.data_dir, split)
                    else:
                        find_mnist(self.data_dir, split)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--data-dir: {exc}") from None
        elif self.dataset == "criteo":
            assert self.data_dir is not None
            path = Path(self.data_dir) / "train.txt"
            if not path.is_file():
                raise ConfigError(f"--data-dir: {path} not found (criteo reads DATA_DIR/train.txt)")

    @property
    def is_ctr(self) -> bool:
        """The click-through-rate job (``--model ctr``): hash tables, AUC, log loss."""
        return self.model == "ctr"

    def load_ctr(self, split: str) -> CTRDataset:
        from zmqps.data.ctr import load_ctr

        try:
            return load_ctr(self.dataset, split, self.examples, self.seed, self.data_dir)
        except ValueError as exc:  # unreadable data: trying again reads the same bytes
            raise ConfigError(f"--dataset {self.dataset}: {exc}") from None

    def build_ctr_model(self, data: CTRDataset) -> CTRModel:
        from zmqps.models.ctr import CTRModel

        return CTRModel(
            data.num_fields, data.num_dense, seed=self.seed, table={"row_budget": CTR_ROW_BUDGET}
        )

    def check_towers(self, towers: int) -> None:
        """Raise :class:`ConfigError` if this job cannot run on ``towers`` devices."""
        if towers > 1 and self.is_ctr:
            raise ConfigError(
                "towers (several devices per worker) train the dense models (mlp,"
                " softmax); the ctr program computes on the host: give one device"
            )

    def planned_steps(self, index: int, count: int, towers: int = 1) -> int:
        """Steps worker ``index`` of ``count`` takes in the whole job (with ``towers``
        devices, each taking ``batch_size`` examples a step)."""
        from zmqps.data import shard, steps_per_epoch

        n = (
            len(self.load_ctr("train").shard(index, count))
            if self.is_ctr
            else len(shard(self.load("train"), index, count))
        )
        return steps_per_epoch(n, self.batch_size * (1 if self.is_ctr else towers)) * self.epochs

    def load(self, split: str) -> Dataset:
        try:
            return load_dataset(self.dataset, split, data_dir=self.data_dir)
        except ValueError as exc:  # unreadable data: trying again reads the same bytes
            raise ConfigError(f"--dataset {self.dataset}: {exc}") from None

    def build_model(self, data: Dataset) -> Model:
        options: dict[str, Any] = {"seed": self.seed}
        if self.model == "mlp":
            options["hidden"] = self.hidden
        return build_model(self.model, data.x.shape[1], data.num_classes, **options)
