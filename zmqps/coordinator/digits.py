"""The built-in demo in coordinator mode (``zmqps launch --driver coordinator``).

Workers serve this module (``zmqps-worker --serve --job zmqps.coordinator.digits``):
the functions below are what the chief may schedule. The chief runs :func:`drive`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from zmqps.coordinator.coordinator import Coordinator
from zmqps.coordinator.fit import Callback, fit
from zmqps.coordinator.steps import batch_stream, noop, train_step
from zmqps.data import steps_per_epoch
from zmqps.roles.job import JobConfig

__all__ = ["batch_stream", "drive", "noop", "train_step"]


def drive(
    coordinator: Coordinator, job: JobConfig, callbacks: Sequence[Callback] = ()
) -> dict[str, Any]:
    """Train the job's built-in model on its dataset with :func:`fit`: ``job.epochs``
    epochs of one pass over the training split (all workers together)."""
    train = job.load("train")
    model = job.build_model(train)
    history = fit(
        coordinator,
        model,
        "batch_stream",
        epochs=job.epochs,
        steps_per_epoch=steps_per_epoch(len(train), job.batch_size),
        dataset_args=(job.dataset, job.batch_size, job.seed, job.data_dir),
        optimizer=dict(job.optimizer),
        callbacks=callbacks,
    )
    return {
        "epochs_run": len(history.epochs),
        "initial_epoch": history.initial_epoch,
        "final_loss": round(history.loss[-1], 4) if history.logs else None,
        "retrained_steps": history.retrained,
        "retrained_functions": history.retrained_functions,
    }
