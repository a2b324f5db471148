"""The engines test's base image: Debian bookworm (minbase, python3, python3-venv,
passwd) made with debootstrap from the mirror apt uses, as a rootfs tarball kept
between runs on one machine (``~/.cache/zmqps/engines``).

debootstrap takes minutes, most of them waiting on the mirror: ``bin/test`` makes the
tarball in the background while the unit tests run (``python tests/engines/base_image.py``)
and waits for it before the tests that start servers; tests/engines/test_compose.py
makes it itself where it is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the base image's rootfs, kept between runs on one machine (debootstrap takes minutes)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zmqps" / "engines"
TARBALL = CACHE / "bookworm-minbase-python3.tar"


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (ZMQPS_DEBIAN_MIRROR wins)."""
    if os.environ.get("ZMQPS_DEBIAN_MIRROR"):
        return os.environ["ZMQPS_DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        if not path.is_file() or path.suffix not in ("", ".list", ".sources"):
            continue
        text = path.read_text(errors="replace")
        m = re.search(r"^URIs:\s*(\S*/debian)\s*$", text, re.M) or re.search(
            r"^deb\s+(?:\[[^]]*\]\s+)?(\S*/debian)\s+bookworm\b", text, re.M
        )
        if m:
            return m.group(1)
    return "http://deb.debian.org/debian"


def make_tarball(work: Path) -> float | None:
    """Make :data:`TARBALL` (its rootfs under ``work``) unless it exists: the seconds
    it took, None when it was there. A failed debootstrap raises RuntimeError with
    the end of its output."""
    if TARBALL.exists():
        return None
    started = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    rootfs = work / "rootfs"
    try:
        out = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,passwd",
                "bookworm",
                str(rootfs),
                debian_mirror(),
            ],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
        if out.returncode != 0:
            raise RuntimeError(f"debootstrap failed: {out.stderr[-2000:]}")
        # a name of this process's own: two runs at once never write one file
        partial = TARBALL.with_suffix(f".partial-{os.getpid()}")
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True)
        partial.rename(TARBALL)
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return round(time.monotonic() - started, 1)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="zmqps-base-") as work:
        try:
            took = make_tarball(Path(work))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            print(f"base image: {e}", file=sys.stderr)
            return 1
    said = "cached" if took is None else f"made in {took:.0f} s"
    print(f"base image {said}: {TARBALL}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
