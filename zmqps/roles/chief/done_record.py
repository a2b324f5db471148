"""The chief's record of the workers that finished their work, on disk.

It lives beside the run's checkpoints (``CHECKPOINT_DIR/workers-done.json``), or,
a run without checkpoints, beside its summary (``SUMMARY.workers-done.json``); a
chief with neither keeps none. The format and what it decides are sans-IO
(:mod:`zmqps.core.finished`); this module only reads, writes (atomically: temp
file, fsync, rename) and removes the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path

from zmqps.checkpoint.format import write_file_atomic
from zmqps.core.finished import (
    RECORD_NAME,
    SUMMARY_SUFFIX,
    Finished,
    parse_record,
    record_bytes,
)

__all__ = ["RECORD_NAME", "DoneRecord", "GenerationMark", "record_path"]

log = logging.getLogger("zmqps.chief")


def record_path(checkpoint_dir: str | None, summary_path: str | None) -> Path | None:
    """Where a chief with these keeps its record (None: nowhere durable)."""
    if checkpoint_dir:
        return Path(checkpoint_dir) / RECORD_NAME
    if summary_path:
        summary = Path(summary_path)
        return summary.with_name(summary.stem + SUMMARY_SUFFIX)
    return None


class DoneRecord:
    """The record at ``path``. Blocking calls: run them in a thread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: what the file holds as far as this process knows (None: not read yet)
        self._held: dict[int, Finished] | None = None

    def load(self) -> dict[int, Finished]:
        """The workers the record holds ({} when there is none; one that does not read
        is said in the log and taken as none)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._held = {}
            return {}
        except OSError as exc:
            log.warning("cannot read %s (the workers that finished): %s", self.path, exc)
            return {}
        try:
            held = parse_record(raw)
        except ValueError as exc:
            log.warning(
                "%s is not a record of the workers that finished (%s): ignored", self.path, exc
            )
            return {}
        self._held = held
        return dict(held)

    def save(self, finished: Mapping[int, Finished]) -> bool:
        """The record holds ``finished`` from now (written only if that changes it);
        True when it was written. Raises OSError."""
        want = dict(finished)
        if want == self._held:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(self.path, record_bytes(want))
        self._held = want
        return True

    def remove(self) -> None:
        """The run ended in order: the record goes (a new run here starts with none)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._held = {}


class GenerationMark:
    """The highest generation a chief of this run restored the PS to, beside the
    record (``…generation.json``). A restore takes the next generation past it, so a
    chief killed during a restore, whose PS restarted too, never hands out a
    generation a worker heard already with other values (fault schedule 723: two
    restores of one checkpoint, each in generation 1). Blocking calls: run them in a
    thread."""

    def __init__(self, record: Path) -> None:
        self.path = record.with_name(record.name.replace(RECORD_NAME, "generation.json"))

    def load(self) -> int:
        """The generation held (0 when there is none, or it does not read: said)."""
        try:
            data = json.loads(self.path.read_bytes())
        except FileNotFoundError:
            return 0
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (the last generation): %s", self.path, exc)
            return 0
        gen = data.get("generation") if isinstance(data, dict) else None
        if isinstance(gen, int) and not isinstance(gen, bool) and 0 <= gen < 2**62:
            return gen
        log.warning("%s holds no generation: ignored", self.path)
        return 0

    def save(self, gen: int) -> None:
        """Raises OSError."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(self.path, json.dumps({"generation": gen}).encode() + b"\n")
