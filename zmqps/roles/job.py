"""The job: what the built-in training program trains, shared by chief and workers.

A frozen dataclass read once from the command line; the chief uses it to
create variables and to evaluate the final model, workers to train.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from zmqps.data import Dataset, load_dataset
from zmqps.models import Model, build_model

if TYPE_CHECKING:
    from zmqps.data.ctr import CTRDataset
    from zmqps.models.ctr import CTRModel

__all__ = ["JobConfig"]


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

    @property
    def is_ctr(self) -> bool:
        """The click-through-rate job (``--model ctr``): hash tables, AUC, log loss."""
        return self.model == "ctr"

    def load_ctr(self, split: str) -> CTRDataset:
        from zmqps.data.ctr import load_ctr

        return load_ctr(self.dataset, split, self.examples, self.seed, self.data_dir)

    def build_ctr_model(self, data: CTRDataset) -> CTRModel:
        from zmqps.models.ctr import CTRModel

        return CTRModel(data.num_fields, data.num_dense, seed=self.seed)

    def planned_steps(self, index: int, count: int) -> int:
        """Steps worker ``index`` of ``count`` takes in the whole job."""
        from zmqps.data import shard, steps_per_epoch

        n = (
            len(self.load_ctr("train").shard(index, count))
            if self.is_ctr
            else len(shard(self.load("train"), index, count))
        )
        return steps_per_epoch(n, self.batch_size) * self.epochs

    def load(self, split: str) -> Dataset:
        return load_dataset(self.dataset, split, data_dir=self.data_dir)

    def build_model(self, data: Dataset) -> Model:
        options: dict[str, Any] = {"seed": self.seed}
        if self.model == "mlp":
            options["hidden"] = self.hidden
        return build_model(self.model, data.x.shape[1], data.num_classes, **options)
