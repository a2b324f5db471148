"""Checkpoints under faults: SIGKILL at random points while writing (scenario 12),
disk full (scenario 13), and ``zmqps inspect`` on good and corrupted roots.

The crash test runs ``ckpt_writer.py`` (checkpoints in a loop, one 8 MiB variable in
three shard files) and kills it with SIGKILL after a random delay, again and again on
the same root. After every kill: the newest committed checkpoint verifies and holds
exactly what the writer committed, no committed checkpoint is damaged or lost (the
latest step never goes back), ``LATEST`` names a good checkpoint, and
``clean_orphans`` leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ckpt_writer
import numpy as np
import pytest
from helpers import tmpfs

from zmqps.checkpoint import (
    LATEST,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointRoot,
    shard_file_name,
)
from zmqps.checkpoint import format as ckpt_format

pytestmark = pytest.mark.timeout(120)

WRITER = Path(__file__).with_name("ckpt_writer.py")
BIG_ROWS = 8192  # the "big" variable: 8192 x 256 float32 = 8 MiB, in 3 shard files
KILLS = 60


# -- crash consistency (scenario 12) -----------------------------------------------------


def landed(root: Path) -> str:
    """Where the writer was when it died, judged from what it left on disk."""
    names = os.listdir(root) if root.exists() else []
    if any(n.startswith(".old-ckpt-") for n in names):
        return "mid re-commit"
    if any(n.startswith(".del-ckpt-") for n in names):
        return "mid prune"
    if any(n.startswith(".tmp-LATEST") for n in names):
        return "mid LATEST"
    for name in names:
        if name.startswith(".tmp-ckpt-"):
            inner = os.listdir(root / name)
            if any(n.startswith(".tmp-shard-") for n in inner):
                return "mid shard file"
            if MANIFEST in inner:
                return "manifest written, not renamed"
            if any(n.startswith(".tmp-manifest") for n in inner):
                return "mid manifest"
            return "between shard files"
    return "between checkpoints"


def check_content(ckpt: Checkpoint) -> None:
    """The checkpoint holds exactly what the writer commits for its step."""
    step = ckpt.step
    for var in ckpt.variable_defs():
        n = var.shape[0]
        for start, rows in ((0, 1), (n - 1, 1), (n // 3, 2)):
            values, slots, version = ckpt.read_rows(var.name, start, rows)
            assert values.tobytes() == ckpt_writer.expected(var, step, start, rows).tobytes()
            assert version == step
            for name, a in slots.items():
                assert np.all(a == ckpt_writer.slot_value(name, step)), (var.name, name)
    assert ckpt.manifest.extra == {"worker_steps": {"0": step}}


def no_leftovers(root: Path) -> None:
    for name in os.listdir(root):
        assert not name.startswith("."), f"left behind: {name}"
        if name != LATEST:
            inner = [n for n in os.listdir(root / name) if n.startswith(".")]
            assert not inner, f"left behind in {name}: {inner}"


def start_writer(root: Path, *extra: str) -> subprocess.Popen[str]:
    """A writer for ``root``, started: it imports, then waits for :func:`run_writer` to
    let it go (meanwhile it does not touch the root)."""
    return subprocess.Popen(
        [sys.executable, str(WRITER), str(root), str(BIG_ROWS), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_writer(
    root: Path,
    *extra: str,
    delay: float | None = None,
    proc: subprocess.Popen[str] | None = None,
) -> str:
    """Run the writer (``proc``, from :func:`start_writer`, else a new one) until it is
    killed (``delay`` s after it has read the root and starts writing, or by itself);
    its stdout."""
    proc = proc or start_writer(root, *extra)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready == "ready\n", f"writer did not start: {ready!r}"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        starting = proc.stdout.readline()
        assert starting.startswith("starting "), f"writer did not start: {starting!r}"
        if delay is not None:
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, err
    return ready + starting + out


@dataclass
class After:
    """What a kill left: the latest checkpoint before and after ``clean_orphans``."""

    before: Checkpoint | None
    removed: list[str]
    after: Checkpoint | None


def check_after_kill(root_path: Path, committed: bool, last_step: int) -> After:
    """The invariants after any kill. ``committed``: a commit has happened."""
    root = CheckpointRoot(root_path)
    before = root.latest()
    assert root.skipped == [], f"damaged committed checkpoints: {root.skipped}"
    if committed:
        assert before is not None, "no checkpoint after a commit"
    if before is not None:  # latest() verified every file's size and sha256
        assert before.step >= last_step, f"latest went back from {last_step} to {before.step}"
        check_content(before)

    removed = root.clean_orphans()
    no_leftovers(root_path)
    after = root.latest()
    assert root.skipped == []
    if before is not None:
        # cleaning may put back a checkpoint a re-commit had moved away, never lose one
        assert after is not None and after.step >= before.step
        check_content(after)
    named = root.latest_name()
    if (root_path / LATEST).exists():
        assert named is not None, "LATEST holds garbage"
        assert after is not None and (named == after.name or root.get(named).verify() == [])
    return After(before, removed, after)


def test_sigkill_at_random_points(tmp_path: Path) -> None:
    root_path = tmp_path / "root"
    rng = random.Random(20240612)
    where: Counter[str] = Counter()
    last_step = 0
    commits = 0
    # made here: the first writer may die before it has made the root
    root_path.mkdir()
    t0 = time.monotonic()
    following = start_writer(root_path)
    try:
        for i in range(KILLS):
            writer = following
            # the next writer imports while this one runs; it waits for its turn
            following = start_writer(root_path) if i + 1 < KILLS else None
            # Every fifth kill right after start (mid scan / first shard), the others
            # anywhere in the next few checkpoints.
            delay = 0.0 if i % 5 == 0 else rng.uniform(0.0, 0.3)
            out = run_writer(root_path, delay=delay, proc=writer)
            commits += out.count("committed")
            where[landed(root_path)] += 1
            try:
                state = check_after_kill(root_path, commits > 0, last_step)
            except AssertionError as exc:
                raise AssertionError(f"kill {i}: {exc}") from exc
            if state.after is not None:
                last_step = state.after.step
    finally:
        if following is not None:
            following.kill()
            following.communicate()
    elapsed = time.monotonic() - t0
    print(f"\n{KILLS} kills in {elapsed:.1f}s, latest step {last_step}; landed: {dict(where)}")
    assert last_step >= 10, "the writer never got far: kills too early to mean much"
    assert where["mid shard file"] >= 5, f"too few kills mid-write: {dict(where)}"


@pytest.mark.parametrize(
    ("phase", "n", "where"),
    [
        ("manifest", 2, "manifest written, not renamed"),
        ("old", 1, "mid re-commit"),
        ("commit", 2, "between checkpoints"),
        ("latest", 2, "between checkpoints"),
        ("del", 1, "mid prune"),
    ],
)
def test_sigkill_in_each_commit_window(tmp_path: Path, phase: str, n: int, where: str) -> None:
    """Kill right after each rename of the commit protocol (steps 1, 2, 3, 3 again, 4...)."""
    root_path = tmp_path / "root"
    run_writer(root_path, f"{phase}:{n}")
    assert landed(root_path) == where
    committed = phase != "manifest" or n > 1
    state = check_after_kill(root_path, committed, 0)
    assert state.before is not None and state.after is not None
    root = CheckpointRoot(root_path)
    if phase == "manifest":  # step 2's manifest written, the directory never renamed
        assert state.before.step == 1 == state.after.step
        assert [r for r in state.removed if r.startswith(".tmp-ckpt-000000000002-")]
    elif phase == "old":  # the re-commit of step 3 moved the old one away, then died
        assert state.before.step == 2
        assert "restored ckpt-000000000003" in state.removed
        assert state.after.step == 3
    elif phase == "commit":  # step 2 committed; LATEST still names step 1
        assert state.before.step == 2 == state.after.step
        assert root.latest_name() == "ckpt-000000000001"
    elif phase == "latest":  # LATEST names step 2; nothing pruned yet
        assert state.after.step == 2 and root.latest_name() == "ckpt-000000000002"
    elif phase == "del":  # committing step 4 pruned step 1: out of sight, not yet removed
        assert state.after.step == 4
        assert [r for r in state.removed if r.startswith(".del-ckpt-000000000001-")]
        assert [c.step for c in root.checkpoints()] == [2, 3, 4]


# -- disk full (scenario 13) -------------------------------------------------------------


def first_checkpoint(root: CheckpointRoot, big_rows: int = 64) -> Checkpoint:
    ckpt_writer.commit(root, ckpt_writer.placement(big_rows), 1)
    ckpt = root.latest()
    assert ckpt is not None and ckpt.step == 1
    return ckpt


def assert_previous_intact(root: CheckpointRoot, previous: Checkpoint) -> None:
    latest = root.latest()
    assert latest is not None and latest.name == previous.name
    assert latest.verify() == []
    assert root.latest_name() == previous.name
    check_content(latest)
    assert [n for n in os.listdir(root.path) if n.startswith(".")] == []


def enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_while_writing_a_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = CheckpointRoot(tmp_path)
    previous = first_checkpoint(root)
    real_save = ckpt_format.save_file

    def save_half(tensors: Any, filename: Any, metadata: Any = None) -> None:
        real_save(tensors, filename, metadata=metadata)
        os.truncate(filename, os.path.getsize(filename) // 2)
        raise ckpt_format.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(ckpt_format, "save_file", save_half)
    temp = root.new_temp(2)
    with pytest.raises(CheckpointError, match="no space left on device"):
        ckpt_writer.commit_into(root, temp, ckpt_writer.placement(64), 2)
    assert os.listdir(temp) == []  # the partial file is gone
    root.abort(temp)
    assert_previous_intact(root, previous)


def test_disk_full_while_committing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = CheckpointRoot(tmp_path)
    previous = first_checkpoint(root)
    temp = root.new_temp(2)
    manifest = ckpt_writer.write_shards(temp, ckpt_writer.placement(64), 2)
    with monkeypatch.context() as m:
        m.setattr(os, "write", enospc)
        with pytest.raises(CheckpointError, match="No space left on device"):
            root.commit(temp, manifest)
    assert MANIFEST not in os.listdir(temp)
    assert [n for n in os.listdir(temp) if n.startswith(".")] == []
    root.abort(temp)
    assert_previous_intact(root, previous)


def fill(directory: Path) -> Path:
    """Fill the file system with one file until ENOSPC."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(chunk)
    return filler


def test_real_disk_full_on_tmpfs(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        root = CheckpointRoot(mnt / "root")
        previous = first_checkpoint(root)  # a few KiB
        # A checkpoint with an 8 MiB variable does not fit in 4 MiB.
        temp = root.new_temp(2)
        with pytest.raises(CheckpointError, match="no space left on device"):
            ckpt_writer.commit_into(root, temp, ckpt_writer.placement(BIG_ROWS), 2)
        assert [n for n in os.listdir(temp) if n.startswith(".")] == []
        root.abort(temp)
        assert_previous_intact(root, previous)

        # The shard files fit, then the disk fills up before the manifest.
        temp = root.new_temp(3)
        manifest = ckpt_writer.write_shards(temp, ckpt_writer.placement(64), 3)
        filler = fill(mnt)
        with pytest.raises(CheckpointError, match="No space left on device"):
            root.commit(temp, manifest)
        root.abort(temp)
        filler.unlink()
        assert_previous_intact(root, previous)


# -- zmqps inspect ----------------------------------------------------------------------------


def inspect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zmqps.cli.main", "inspect", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def two_checkpoints(tmp_path: Path) -> CheckpointRoot:
    root = CheckpointRoot(tmp_path / "root")
    pl = ckpt_writer.placement(64)
    for step in (1, 2):
        ckpt_writer.commit(root, pl, step)
    return root


def test_inspect_lists_checkpoints(two_checkpoints: CheckpointRoot) -> None:
    root = two_checkpoints
    r = inspect(str(root.path))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for text in ("ckpt-000000000001", "ckpt-000000000002", "LATEST ckpt-000000000002"):
        assert text in out
    for text in ("big", "emb", "bias", "(64, 256)", "(50, 8)", "sparse", "float64", "m,v"):
        assert text in out
    assert "step 2  generation 0  mode sync" in out
    assert "a restore would use: ckpt-000000000002" in out
    assert out.count("  ok") == 2

    r = inspect(str(root.path), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["latest"] == "ckpt-000000000002"
    assert [c["step"] for c in report["checkpoints"]] == [1, 2]
    c = report["checkpoints"][1]
    assert c["verified"] is True and c["shards"] == 9 and c["num_ps"] == 2
    emb = next(v for v in c["variables"] if v["name"] == "emb")
    assert emb == {
        "name": "emb",
        "shape": [50, 8],
        "dtype": "float32",
        "sparse": True,
        "optimizer": {"name": "adam", "lr": 0.01},
        "slots": ["m", "v"],
        "rows": [[0, 17], [17, 34], [34, 50]],
        "versions": [2, 2, 2],
    }

    r = inspect(str(root.path / "ckpt-000000000001"))
    assert r.returncode == 0, r.stderr
    assert "ckpt-000000000001" in r.stdout and "ckpt-000000000002" not in r.stdout


def test_inspect_corrupted(two_checkpoints: CheckpointRoot) -> None:
    root = two_checkpoints
    victim = root.path / "ckpt-000000000002" / shard_file_name(4)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    r = inspect(str(root.path))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FAILED" in r.stdout and "sha256 mismatch" in r.stdout
    assert "a restore would use: ckpt-000000000001" in r.stdout
    assert inspect(str(root.path), "--no-verify").returncode == 0
    assert inspect(str(victim.parent)).returncode == 1

    (root.path / "ckpt-000000000001" / MANIFEST).write_text("{}")
    r = inspect(str(root.path), "--json")
    assert r.returncode == 1
    report = json.loads(r.stdout)
    assert [b["name"] for b in report["broken"]] == ["ckpt-000000000001"]
    assert report["usable"] is None


def test_inspect_bad_paths(tmp_path: Path) -> None:
    r = inspect(str(tmp_path / "nope"))
    assert r.returncode == 2 and "does not exist" in r.stderr
    f = tmp_path / "file"
    f.write_text("x")
    r = inspect(str(f))
    assert r.returncode == 2 and "not a directory" in r.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    r = inspect(str(empty))
    assert r.returncode == 1 and "0 committed checkpoints" in r.stdout


def test_inspect_entry_point(two_checkpoints: CheckpointRoot) -> None:
    exe = shutil.which("zmqps", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the zmqps entry point is not installed beside this Python")
    r = subprocess.run([exe, "inspect", str(two_checkpoints.path)], capture_output=True, text=True)
    assert r.returncode == 0 and "ckpt-000000000002" in r.stdout


def test_inspect_given_a_run_folder_points_at_its_checkpoints(tmp_path: Path) -> None:
    """``zmqps inspect RUN_DIR`` said "0 committed checkpoints" (exit 1) with no word of
    RUN_DIR/checkpoints, where they are."""
    root = CheckpointRoot(tmp_path / "run" / "checkpoints")
    ckpt_writer.commit(root, ckpt_writer.placement(64), 1)
    r = inspect(str(tmp_path / "run"))
    assert r.returncode == 1
    assert f"its checkpoints are in {tmp_path / 'run' / 'checkpoints'}" in r.stderr, r.stderr
    assert inspect(str(tmp_path / "run" / "checkpoints")).returncode == 0
