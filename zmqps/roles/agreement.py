"""The job flags every task of a run must agree on (sans-IO).

Tasks started by hand each take their own flags, and nothing made them agree: a chief
with ``--epochs 2`` and workers with ``--epochs 300``, a worker whose ``--ps-hosts``
lists 2 PS where the chief's lists 1. A worker sends :func:`job_flags` when it
registers (``Register.job``, each flag as its text); the chief compares them with
its own (:func:`compare`):

* **refused** (:data:`REFUSED`): the worker cannot be part of this run. Another cluster
  layout (``--ps-hosts``, ``--worker-hosts``: a worker's share of the data is its
  1/M, and a different list is another cluster's), or another model: ``--model``,
  ``--hidden``, ``--dataset``, and what defines the variables the chief creates
  (``--optimizer``, ``--lr``, ``--momentum``, ``--seed``: the initializers' seeds),
  which would fail later anyway, at ``create_vars``, without naming the flag.
* **warned about** (:data:`WARNED`), once per worker and flag in the chief's log,
  naming which value wins: ``--mode`` (the chief's: workers follow it; compared only
  when the worker was given one), ``--epochs`` and ``--batch-size`` (the worker's:
  its own passes and steps), ``--examples`` of the synthetic CTR data (the worker's
  for its training data, the chief's for the test split).

A flag missing on either side (an older peer, a chief without a built-in model) is
not compared; nor is a flag neither side knows (a newer peer's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zmqps.config import ClusterSpec
from zmqps.roles.job import JobConfig

__all__ = ["REFUSED", "WARNED", "Difference", "compare", "job_flags", "refusal"]

#: flags whose difference refuses the worker: why it cannot run with them
REFUSED: Mapping[str, str] = {
    "--ps-hosts": "every task of a run takes the same cluster spec",
    "--worker-hosts": "every task of a run takes the same cluster spec (each worker trains"
    " its 1/M of the data)",
    "--model": "the chief creates, evaluates and exports its own model",
    "--hidden": "the chief creates, evaluates and exports its own model",
    "--dataset": "the chief evaluates on its own data set",
    "--optimizer": "the chief creates the variables with its optimizer",
    "--lr": "the chief creates the variables with its optimizer",
    "--momentum": "the chief creates the variables with its optimizer",
    "--seed": "the chief creates the variables with its seeds",
}
#: flags whose difference runs: which value wins
WARNED: Mapping[str, str] = {
    "--mode": "the chief's wins (workers follow the chief's mode)",
    "--epochs": "the worker's wins (it trains that many passes over its own data)",
    "--batch-size": "the worker's wins (its steps take that many examples; checkpoints"
    " record the chief's)",
    "--examples": "the worker's wins for its training data, the chief's for the test split",
}


def job_flags(cluster: ClusterSpec, job: JobConfig | None, mode: str | None) -> dict[str, str]:
    """A task's job flags, each as its text: the cluster layout, the built-in job's
    (``job`` None: none), and ``mode`` when given (None: not compared)."""
    out = {"--ps-hosts": ",".join(cluster.ps), "--worker-hosts": ",".join(cluster.worker)}
    if mode is not None:
        out["--mode"] = mode
    if job is None:
        return out
    out["--model"] = job.model
    if job.model == "mlp":
        out["--hidden"] = ",".join(str(h) for h in job.hidden)
    out["--dataset"] = job.dataset
    if job.dataset == "synthetic-ctr":
        out["--examples"] = str(job.examples)
    out["--batch-size"] = str(job.batch_size)
    out["--epochs"] = str(job.epochs)
    out["--optimizer"] = str(job.optimizer.get("name"))
    out["--lr"] = str(job.optimizer.get("lr"))
    if "momentum" in job.optimizer:
        out["--momentum"] = str(job.optimizer["momentum"])
    out["--seed"] = str(job.seed)
    return out


#: the longest value a refusal or warning shows (a worker's comes off the wire)
SHOWN_CHARS = 300


def _shown(value: str) -> str:
    """``value`` as a log line shows it: cut after :data:`SHOWN_CHARS` characters."""
    if len(value) <= SHOWN_CHARS:
        return value
    return f"{value[:SHOWN_CHARS]}... ({len(value)} characters)"


@dataclass(frozen=True)
class Difference:
    """One flag whose value differs between the chief and a worker."""

    flag: str
    chief: str
    worker: str
    refused: bool
    #: why it refuses, or which value wins
    why: str

    def refusal(self) -> str:
        mine, theirs = _shown(self.chief), _shown(self.worker)
        return f"{self.flag}: the chief's is {mine}, this worker's {theirs} ({self.why})"

    def warning(self, worker: int) -> str:
        return (
            f"worker {worker} runs with {self.flag} {_shown(self.worker)}, the chief with"
            f" {self.flag} {_shown(self.chief)}: {self.why}"
        )


def compare(chief: Mapping[str, str], worker: Mapping[str, str]) -> list[Difference]:
    """The flags given on both sides whose values differ, refused ones first."""
    out = []
    for flag, why, refused in [
        *((f, w, True) for f, w in REFUSED.items()),
        *((f, w, False) for f, w in WARNED.items()),
    ]:
        mine, theirs = chief.get(flag), worker.get(flag)
        if mine is not None and theirs is not None and mine != theirs:
            out.append(Difference(flag, mine, theirs, refused, why))
    return out


def refusal(worker: int, differences: list[Difference]) -> str | None:
    """The one line that refuses worker ``worker`` (None: the differences may run)."""
    refused = [d.refusal() for d in differences if d.refused]
    if not refused:
        return None
    return f"the chief refuses worker {worker}, started for another run: " + "; ".join(refused)
