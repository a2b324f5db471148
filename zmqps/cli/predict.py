"""``zmqps predict``: run an exported model (:mod:`zmqps.export`) on a file of examples.

A CTR export (hash-keyed tables) reads text in the Criteo layout instead:
:mod:`zmqps.cli.predict_ctr`.

Rules of this module:

* Inputs are ``.npy`` (read with ``allow_pickle=False``) or ``.csv`` (numbers
  separated by commas, an optional header row); nothing else is guessed.
* Every problem a user can fix (a missing or corrupted export, an unreadable
  input, examples whose width differs from the model's input) is one line and
  exit code 2.
* Inputs are raw, in the training data's own units (the digits' 0..16, MNIST's
  0..255): the export's ``preprocessing`` (:mod:`zmqps.data.preprocessing`, recorded by
  the run that trained it) turns them into the model's features as training did, e.g.
  dividing by 16. ``--preprocessed`` says they are the model's features already, taken
  as they are. Values that contradict either (raw values beyond the raw range or all
  within the scaled one; values said to be preprocessed beyond the scaled range) print
  one ``zmqps: warning:`` line on stderr, and predict goes on. An export that records
  no preprocessing (older ones) takes its inputs as they are.
* Predictions go to ``--output`` (``.npy`` or ``.csv``), else to stdout, one
  example per line. With labels (``--labels`` or ``--label-column``) the
  accuracy and loss line goes to stdout when predictions went to a file, to
  stderr when they went to stdout (so stdout stays pure data).
* A reader that closes stdout early (``zmqps predict ... | head``) ends the writing
  quietly: the rest is dropped, no error line, and the exit code stays 0 (the accuracy
  line still goes to stderr).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import numpy.typing as npt

from zmqps.cli.args import drop_stdout
from zmqps.data.preprocessing import prepare
from zmqps.export import ExportError, load_model
from zmqps.models import Model, softmax_cross_entropy
from zmqps.wire.errors import ConfigError, ZmqpsError

__all__ = ["add_args", "emit", "predict", "read_examples", "read_labels", "run", "say", "score"]

Array = npt.NDArray[Any]
FORMATS = ("classes", "probabilities")
#: examples per forward pass (bounds the memory of the activations).
BATCH = 4096


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="an exported model's directory")
    p.add_argument(
        "--input",
        required=True,
        metavar="FILE",
        help="examples: .npy (n, d) or .csv (n rows); a ctr export: Criteo-layout text",
    )
    p.add_argument(
        "--output",
        metavar="FILE",
        help="write predictions to FILE (.npy or .csv) instead of stdout",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        help="classes (one int per example) or probabilities (one row per example);"
        " default: classes, for a ctr export probabilities",
    )
    p.add_argument(
        "--threshold",
        type=float,
        metavar="P",
        help="(ctr export, --format classes) class 1 where the click probability >= P"
        " (default 0.5)",
    )
    p.add_argument(
        "--preprocessed",
        action="store_true",
        help="the inputs are the model's features already (e.g. digits divided by 16): take"
        " them as they are; by default predict applies the preprocessing the export"
        " records to raw inputs",
    )
    p.add_argument(
        "--labels",
        metavar="FILE",
        help="true labels (.npy or one-column .csv): print accuracy and loss (ctr: AUC and"
        " log loss)",
    )
    p.add_argument(
        "--label-column",
        type=int,
        metavar="N",
        help="the input's column N (0-based; -1 the last) holds the labels: split it off"
        " and print accuracy and loss (a ctr export: 0, and a line's width says anyway)",
    )


def _suffix(path: Path, what: str) -> str:
    suffix = path.suffix.lower()
    if suffix not in (".npy", ".csv"):
        raise ConfigError(f"{what} {path}: expected a .npy or .csv file")
    return suffix


def _check_output(path: Path) -> None:
    """``--output`` names a .npy or .csv file this process can write, checked before the
    model is read and run (its folder missing found after the predictions, the error
    was the bare errno)."""
    _suffix(path, "--output")
    folder = path.parent
    if path.is_dir():
        raise ConfigError(f"--output {path}: is a folder (name a .npy or .csv file in it)")
    if not folder.exists():
        raise ConfigError(f"--output {path}: folder {folder} does not exist")
    if not folder.is_dir():
        raise ConfigError(f"--output {path}: {folder} is not a folder")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise ConfigError(f"--output {path}: the file is not writable")
    elif not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {path}: folder {folder} is not writable")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _read_csv(path: Path) -> Array:
    """The numeric rows of ``path`` as float64 ``(n, d)``; a non-numeric first row is a header."""
    try:
        with path.open(newline="") as f:
            rows = [(i, r) for i, r in enumerate(csv.reader(f), 1) if any(c.strip() for c in r)]
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"input {path}: cannot read: {exc}") from None
    if rows and not all(_is_number(c) for c in rows[0][1]):
        rows = rows[1:]  # header
    if not rows:
        raise ConfigError(f"input {path}: no rows of numbers")
    width = len(rows[0][1])
    out = np.empty((len(rows), width), dtype=np.float64)
    for k, (line, row) in enumerate(rows):
        if len(row) != width:
            raise ConfigError(
                f"input {path}: line {line} has {len(row)} columns, the first row has {width}"
            )
        try:
            out[k] = [float(c) for c in row]
        except ValueError:
            raise ConfigError(
                f"input {path}: line {line} has a value that is not a number"
            ) from None
    return out


def _read_npy(path: Path, what: str) -> Array:
    try:
        a: Array = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise ConfigError(f"{what} {path}: cannot read as .npy: {exc}") from None
    if not isinstance(a, np.ndarray):
        raise ConfigError(f"{what} {path}: not a single array")
    return a


def read_examples(path: str | Path, label_column: int | None = None) -> tuple[Array, Array | None]:
    """The examples of ``path`` as float32 ``(n, d)`` and, with ``label_column``, their labels."""
    path = Path(path)
    suffix = _suffix(path, "input")
    a = _read_npy(path, "input") if suffix == ".npy" else _read_csv(path)
    if a.dtype.kind not in "biuf":
        raise ConfigError(f"input {path}: dtype {a.dtype} is not numeric")
    if a.ndim == 1:
        a = a.reshape(1, -1)  # one example
    if a.ndim != 2 or a.shape[0] == 0:
        raise ConfigError(f"input {path}: expected a (examples, features) array, got {a.shape}")
    labels = None
    if label_column is not None:
        if not -a.shape[1] <= label_column < a.shape[1]:
            raise ConfigError(f"--label-column {label_column}: the input has {a.shape[1]} columns")
        col = label_column % a.shape[1]
        labels = _as_labels(a[:, col], f"input {path}: column {label_column}")
        a = np.delete(a, col, axis=1)
    x = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ConfigError(f"input {path}: holds NaN or infinite values")
    return x, labels


def _as_labels(a: Array, what: str) -> Array:
    a = np.asarray(a).reshape(-1)
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or not np.array_equal(a, np.round(a)):
            raise ConfigError(f"{what}: labels must be whole numbers")
    elif a.dtype.kind not in "biu":
        raise ConfigError(f"{what}: labels must be integers, got dtype {a.dtype}")
    labels: Array = a.astype(np.int64)
    return labels


def read_labels(path: str | Path) -> Array:
    """Integer labels from a ``.npy`` vector or a one-column ``.csv``."""
    path = Path(path)
    suffix = _suffix(path, "labels")
    a = _read_npy(path, "labels") if suffix == ".npy" else _read_csv(path)
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1:
        raise ConfigError(f"labels {path}: expected one label per example, got shape {a.shape}")
    return _as_labels(a, f"labels {path}")


def predict(model: Model, params: Mapping[str, Array], x: Array, fmt: str = "classes") -> Array:
    """Classes ``(n,)`` int64 or probabilities ``(n, classes)`` float32, in batches."""
    parts = []
    for i in range(0, len(x), BATCH):
        batch = x[i : i + BATCH]
        if fmt == "classes":
            parts.append(model.predict(params, batch))
        else:
            parts.append(model.predict_proba(params, batch).astype(np.float32))
    out: Array = np.concatenate(parts)
    return out


def score(model: Model, params: Mapping[str, Array], x: Array, labels: Array) -> tuple[int, float]:
    """(examples classified right, mean cross-entropy) of ``model`` on ``(x, labels)``."""
    correct, loss_sum = 0, 0.0
    for i in range(0, len(x), BATCH):
        bx, by = x[i : i + BATCH], labels[i : i + BATCH]
        logits = model.logits(params, bx)
        loss, _ = softmax_cross_entropy(logits, by)
        correct += int(np.sum(logits.argmax(axis=1) == by))
        loss_sum += loss * len(bx)
    return correct, loss_sum / len(x)


def _write(out: Array, path: Path | None, stream: TextIO) -> None:
    if path is not None and _suffix(path, "--output") == ".npy":
        with path.open("wb") as f:  # the name as given (np.save adds .npy to out.NPY)
            np.save(f, out, allow_pickle=False)
        return
    fmt = "%d" if out.dtype.kind in "iu" else "%.6g"
    rows = out.reshape(len(out), -1)
    if path is None:
        np.savetxt(stream, rows, fmt=fmt, delimiter=",")
        return
    with path.open("w") as f:
        np.savetxt(f, rows, fmt=fmt, delimiter=",")


def emit(out: Array, output: Path | None) -> None:
    """Predictions to ``output`` or to stdout (flushed); a stdout closed early by its
    reader ends the writing quietly."""
    try:
        _write(out, output, sys.stdout)
        sys.stdout.flush()
    except BrokenPipeError:
        drop_stdout()
    except OSError as exc:  # a full disk, a folder gone meanwhile
        if output is None:
            raise
        why = exc.strerror or exc
        raise ZmqpsError(f"cannot write the predictions to {output}: {why}") from None


def say(line: str, to_stdout: bool) -> None:
    """One line to stdout (quietly dropped when its reader is gone) or stderr."""
    try:
        print(line, file=sys.stdout if to_stdout else sys.stderr, flush=True)
    except BrokenPipeError:
        drop_stdout()


def run(args: argparse.Namespace) -> int:
    if args.labels is not None and args.label_column is not None:
        raise ConfigError("give --labels or --label-column, not both")
    output = Path(args.output) if args.output else None
    if output is not None:
        _check_output(output)
    try:
        model, params, signature = load_model(args.model)
    except ExportError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(model, Model):
        from zmqps.cli import predict_ctr

        return predict_ctr.run(args, model, params, signature, output)
    if args.threshold is not None:
        raise ConfigError(f"--threshold: {args.model} is a classifier (its class: the argmax)")
    fmt = args.format or "classes"
    x, labels = read_examples(args.input, args.label_column)
    if args.labels is not None:
        labels = read_labels(args.labels)
    width = int(signature["inputs"]["x"]["shape"][1])
    if x.shape[1] != width:
        raise ConfigError(
            f"input {args.input}: {x.shape[1]} features per example, the model takes {width}"
            + (" (after removing the label column)" if args.label_column is not None else "")
        )
    if labels is not None:
        if len(labels) != len(x):
            raise ConfigError(f"{len(labels)} labels for {len(x)} examples")
        if labels.min() < 0 or labels.max() >= model.num_classes:
            raise ConfigError(f"labels must lie in 0..{model.num_classes - 1}")
    steps = (signature.get("preprocessing") or {}).get("inputs", {})
    x, warning = prepare(
        x, steps.get("x"), preprocessed=args.preprocessed, what=f"input {args.input}"
    )
    if warning is not None:
        print(f"zmqps: warning: {warning}", file=sys.stderr, flush=True)
    out = predict(model, params, x, fmt)
    emit(out, output)
    if labels is not None:
        correct, loss = score(model, params, x, labels)
        say(
            f"accuracy {correct / len(x):.6f} ({correct}/{len(x)}), loss {loss:.6f}",
            to_stdout=output is not None,
        )
    elif output is not None:
        print(f"{len(x)} predictions written to {output}", file=sys.stderr)
    return 0
