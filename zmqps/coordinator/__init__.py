"""Coordinator mode: the training loop in the chief process schedules functions onto
workers (the shape of TensorFlow's ``ClusterCoordinator`` / ParameterServerStrategy).

Layer map::

    coordinator  Coordinator, RemoteValue, PerWorkerDataset: schedule / join / done,
                 retries on lost workers (at least once), error -> cancel pending
    fit          fit() with callbacks: ModelCheckpoint, BackupAndRestore
    server       FunctionServer: a worker's handler of run / make_resource (functions
                 by name from its --job module, never code on the wire)
    serve        zmqps-worker --serve: a Worker (chief + PS) plus that server
    driver       zmqps-server --role chief --driver coordinator: chief + drive()
    steps        ready-made functions (train_step, batch_stream) for job modules
    digits       the built-in demo job (zmqps launch --driver coordinator)

Imports roles and the layers below them; imported by cli and bench only.
"""

from zmqps.coordinator.coordinator import (
    Coordinator,
    FunctionCancelled,
    PerWorkerDataset,
    PerWorkerIterator,
    RemoteValue,
    WorkerLost,
)
from zmqps.coordinator.fit import BackupAndRestore, Callback, History, ModelCheckpoint, fit
from zmqps.coordinator.server import FunctionContext
from zmqps.wire.errors import FunctionError

__all__ = [
    "BackupAndRestore",
    "Callback",
    "Coordinator",
    "FunctionCancelled",
    "FunctionContext",
    "FunctionError",
    "History",
    "ModelCheckpoint",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
    "WorkerLost",
    "fit",
]
