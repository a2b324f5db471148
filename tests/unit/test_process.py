"""zmqps.process and zmqps.blas: the BLAS threads each task gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from zmqps.blas import one_thread
from zmqps.process import THREAD_VARS, blas_threads, thread_env, usable_cores


@pytest.mark.parametrize(
    ("cores", "compute", "others", "want"),
    [
        (16, 4, 3, 3),  # 4 CPU workers beside a chief and 2 PS: 13 cores left, 3 each
        (16, 1, 6, 10),  # one CPU worker beside GPU workers
        (2, 4, 3, 1),  # fewer cores than tasks: one thread each, never zero
        (64, 1, 1, 63),
    ],
)
def test_the_cores_are_shared_among_the_tasks_computing_on_the_host(
    cores: int, compute: int, others: int, want: int
) -> None:
    assert blas_threads(cores, compute, others) == want


def test_a_thread_count_the_user_set_wins() -> None:
    assert thread_env(3, {}) == dict.fromkeys(THREAD_VARS, "3")
    for var in THREAD_VARS:  # any one of them set: nothing is changed
        assert thread_env(3, {var: "8", "PATH": "/bin"}) == {}
    assert usable_cores() >= 1


def test_a_file_written_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk left 0-byte summaries and said only "[Errno 28] No space left on
    device": the file is written whole or left as it was, and the error names it."""
    import errno

    from zmqps.process import write_text_whole
    from zmqps.wire.errors import ZmqpsError

    target = tmp_path / "summary.json"
    write_text_whole(target, '{"a": 1}\n', "the summary")
    assert target.read_text() == '{"a": 1}\n'
    real = Path.write_text

    def full(self: Path, text: str, *args: object, **kwargs: object) -> int:
        real(self, text[:3])  # part of it, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(ZmqpsError) as err:
        write_text_whole(target, '{"a": 2}\n', "the summary")
    assert str(err.value) == f"cannot write the summary {target}: No space left on device"
    monkeypatch.undo()
    assert target.read_text() == '{"a": 1}\n'  # the old one, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # nothing left


def test_a_link_or_a_file_that_is_not_regular_is_written_not_replaced(tmp_path: Path) -> None:
    """Renamed over, a link to a results folder became a file of its own (the folder's
    file unchanged), and ``--summary /dev/stdout`` run as root replaced the link with a
    file: a link is followed, a pipe or device written in place."""
    import os
    import stat
    import threading

    from zmqps.process import write_text_whole

    real = tmp_path / "results" / "summary.json"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "summary.json"
    link.symlink_to(real)
    write_text_whole(link, "new\n", "the summary")
    assert link.is_symlink() and real.read_text() == "new\n"

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    write_text_whole(fifo, "through a pipe\n", "the summary")
    reader.join(10)
    assert got == ["through a pipe\n"] and stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe", "results", "summary.json"]


def test_a_chief_or_ps_takes_one_blas_thread_unless_the_user_chose() -> None:
    env = {"PATH": "/bin"}
    assert one_thread(env)
    assert env == {"PATH": "/bin", **dict.fromkeys(THREAD_VARS, "1")}
    for var in THREAD_VARS:  # any one of them set: nothing is changed
        mine = {var: "8"}
        assert not one_thread(mine) and mine == {var: "8"}
