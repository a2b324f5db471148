"""The job: what the built-in training program trains, shared by chief and workers.

A frozen dataclass read once from the command line; the chief uses it to
create variables and to evaluate the final model, workers to train.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zmqps.data import Dataset, load_dataset
from zmqps.models import Model, build_model

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

    def load(self, split: str) -> Dataset:
        return load_dataset(self.dataset, split, data_dir=self.data_dir)

    def build_model(self, data: Dataset) -> Model:
        options: dict[str, Any] = {"seed": self.seed}
        if self.model == "mlp":
            options["hidden"] = self.hidden
        return build_model(self.model, data.x.shape[1], data.num_classes, **options)
