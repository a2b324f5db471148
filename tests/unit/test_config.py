"""Cluster configuration (zmqps.config): TF_CONFIG shapes, flags, precedence, errors."""

from __future__ import annotations

import json

import pytest

from zmqps.config import (
    NO_CLUSTER_MESSAGE,
    ClusterSpec,
    TaskSpec,
    cluster_from_flags,
    load_cluster_file_or_json,
    parse_tf_config,
    resolve,
    split_address,
)
from zmqps.wire.errors import ConfigError

SVC = "default.svc:2222"

# --- TF_CONFIG shapes in the wild ------------------------------------------------

KUBEFLOW_CHIEF = {
    "cluster": {
        "chief": [f"mnist-chief-0.{SVC}"],
        "evaluator": [f"mnist-evaluator-0.{SVC}"],
        "ps": [f"mnist-ps-0.{SVC}", f"mnist-ps-1.{SVC}"],
        "worker": [f"mnist-worker-0.{SVC}", f"mnist-worker-1.{SVC}"],
    },
    "task": {"type": "worker", "index": 1},
    "environment": "cloud",
}
KUBEFLOW_MASTER = {
    "cluster": {
        "master": [f"mnist-master-0.{SVC}"],
        "ps": [f"mnist-ps-0.{SVC}"],
        "worker": [f"mnist-worker-0.{SVC}"],
    },
    "task": {"type": "master", "index": 0},
    "environment": "cloud",
}
KUBEFLOW_EVALUATOR = {**KUBEFLOW_CHIEF, "task": {"type": "evaluator", "index": 0}}
CLOUD_ML_ENGINE = {
    "cluster": {
        "master": ["127.0.0.1:2222"],
        "ps": ["127.0.0.1:2223"],
        "worker": ["127.0.0.1:2224", "127.0.0.1:2225"],
    },
    "environment": "cloud",
    "task": {"type": "ps", "index": 0, "trial": "", "cloud": "w0b1c2d3e-ml"},
    "job": {
        "scale_tier": "CUSTOM",
        "master_type": "standard",
        "worker_count": "2",
        "parameter_server_count": "1",
        "package_uris": ["gs://bucket/trainer-0.1.tar.gz"],
        "python_module": "trainer.task",
        "region": "us-central1",
        "runtime_version": "1.15",
        "run_on_raw_vm": True,
    },
}
CLOUD_ML_EVALUATOR = {  # evaluator is never in the cluster there
    **CLOUD_ML_ENGINE,
    "task": {"type": "evaluator", "index": 0, "trial": "3", "cloud": "w0b1c2d3e-ml"},
}
AI_PLATFORM_CHIEF = {
    "cluster": {"chief": ["cmle-chief:2222"], "ps": ["cmle-ps:2222"], "worker": ["cmle-w:2222"]},
    "task": {"type": "chief", "index": "0", "trial": "1"},
    "job": {"job_name": "j1", "args": ["--epochs", "3"]},
    "environment": "cloud",
}
INDEX_AS_STRING = {
    "cluster": {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w:1", "w:2", "w:3"]},
    "task": {"type": "worker", "index": "2"},
    "rpc_layer": "grpc",
}
NO_TASK = {"cluster": {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w:1"]}}
EMPTY_TASK = {**NO_TASK, "task": {}}
SINGLE_STRINGS_AND_INDEXED = {
    "cluster": {"chief": "c:1", "ps": {"1": "p:2", "0": "p:1"}, "worker": []},
    "task": {"type": "ps", "index": 1},
}
IPV6 = {
    "cluster": {"chief": ["[::1]:2222"], "ps": ["[fe80::1%eth0]:2223"], "worker": ["[::1]:2224"]},
    "task": {"type": "worker", "index": 0},
}


@pytest.mark.parametrize(
    ("tf_config", "cluster", "task"),
    [
        (
            KUBEFLOW_CHIEF,
            ClusterSpec(
                f"mnist-chief-0.{SVC}",
                (f"mnist-ps-0.{SVC}", f"mnist-ps-1.{SVC}"),
                (f"mnist-worker-0.{SVC}", f"mnist-worker-1.{SVC}"),
                (f"mnist-evaluator-0.{SVC}",),
            ),
            TaskSpec("worker", 1),
        ),
        (
            KUBEFLOW_MASTER,
            ClusterSpec(
                f"mnist-master-0.{SVC}", (f"mnist-ps-0.{SVC}",), (f"mnist-worker-0.{SVC}",)
            ),
            TaskSpec("chief", 0),
        ),
        (
            KUBEFLOW_EVALUATOR,
            ClusterSpec(
                f"mnist-chief-0.{SVC}",
                (f"mnist-ps-0.{SVC}", f"mnist-ps-1.{SVC}"),
                (f"mnist-worker-0.{SVC}", f"mnist-worker-1.{SVC}"),
                (f"mnist-evaluator-0.{SVC}",),
            ),
            TaskSpec("evaluator", 0),
        ),
        (
            CLOUD_ML_ENGINE,
            ClusterSpec(
                "127.0.0.1:2222", ("127.0.0.1:2223",), ("127.0.0.1:2224", "127.0.0.1:2225")
            ),
            TaskSpec("ps", 0),
        ),
        (
            CLOUD_ML_EVALUATOR,
            ClusterSpec(
                "127.0.0.1:2222", ("127.0.0.1:2223",), ("127.0.0.1:2224", "127.0.0.1:2225")
            ),
            TaskSpec("evaluator", 0),
        ),
        (
            AI_PLATFORM_CHIEF,
            ClusterSpec("cmle-chief:2222", ("cmle-ps:2222",), ("cmle-w:2222",)),
            TaskSpec("chief", 0),
        ),
        (
            INDEX_AS_STRING,
            ClusterSpec("c:1", ("p:1",), ("w:1", "w:2", "w:3")),
            TaskSpec("worker", 2),
        ),
        (NO_TASK, ClusterSpec("c:1", ("p:1",), ("w:1",)), None),
        (EMPTY_TASK, ClusterSpec("c:1", ("p:1",), ("w:1",)), None),
        (SINGLE_STRINGS_AND_INDEXED, ClusterSpec("c:1", ("p:1", "p:2"), ()), TaskSpec("ps", 1)),
        (
            IPV6,
            ClusterSpec("[::1]:2222", ("[fe80::1%eth0]:2223",), ("[::1]:2224",)),
            TaskSpec("worker", 0),
        ),
    ],
    ids=[
        "kubeflow-chief",
        "kubeflow-master",
        "kubeflow-evaluator-in-cluster",
        "cloud-ml-engine",
        "cloud-ml-evaluator-outside-cluster",
        "ai-platform-chief-string-index",
        "index-as-string-rpc-layer",
        "no-task",
        "empty-task",
        "single-string-and-indexed-jobs",
        "ipv6",
    ],
)
def test_parse_tf_config_shapes(tf_config, cluster, task):
    got_cluster, got_task = parse_tf_config(json.dumps(tf_config))
    assert got_cluster == cluster
    assert got_task == task


BASE = {"chief": ["c:1"], "ps": ["p:1"], "worker": ["w:1", "w:2"]}


def cfg(cluster=None, task=None, **extra):
    obj = {"cluster": BASE if cluster is None else cluster, **extra}
    if task is not None:
        obj["task"] = task
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{nope", "TF_CONFIG: not valid JSON (Expecting property name enclosed in double quotes"),
        ("", "TF_CONFIG: empty; expected a JSON object"),
        ("[1, 2]", "TF_CONFIG: must be a JSON object, got a list"),
        ('"x"', "TF_CONFIG: must be a JSON object, got a string"),
        ('{"task": {"type": "worker", "index": 0}}', "TF_CONFIG: no 'cluster' key"),
        ('{"cluster": []}', "TF_CONFIG: 'cluster' must be an object, got a list"),
        (
            cfg({"chief": ["c:1"], "ps": []}),
            "TF_CONFIG: cluster has no 'ps' tasks; at least one is needed",
        ),
        (
            cfg({"chief": ["c:1"], "worker": ["w:1"]}),
            "TF_CONFIG: cluster has no 'ps' tasks; at least one is needed",
        ),
        (
            cfg({"ps": ["p:1"], "worker": ["w:1"]}),
            "TF_CONFIG: cluster has no 'chief' (or 'master') task; zmqps needs one",
        ),
        (
            cfg({"chief": ["c:1"], "master": ["m:1"], "ps": ["p:1"]}),
            "TF_CONFIG: cluster has both 'chief' and 'master' (master is the legacy name of chief);"
            " keep one",
        ),
        (
            cfg({"chief": ["c:1", "c:2"], "ps": ["p:1"]}),
            "TF_CONFIG: cluster lists 2 'chief' tasks; exactly one is allowed",
        ),
        (
            cfg({**BASE, "evaluator": ["e:1", "e:2"]}),
            "TF_CONFIG: at most one 'evaluator' task is supported, got 2",
        ),
        (
            cfg({**BASE, "workers": ["w:3"]}),
            "TF_CONFIG: unknown job 'workers' in cluster"
            " (expected chief, master, ps, worker or evaluator; did you mean 'worker'?)",
        ),
        (
            cfg({**BASE, "ps": 5}),
            "TF_CONFIG: 'ps' must be a list of 'host:port' addresses, got a number",
        ),
        (
            cfg({**BASE, "ps": {"0": "p:1", "2": "p:2"}}),
            "TF_CONFIG: 'ps' tasks given by index must be numbered 0..1, got ['0', '2']",
        ),
        (cfg({**BASE, "ps": ["p"]}), "TF_CONFIG: ps 0: 'p' is not host:port"),
        (
            cfg({**BASE, "ps": [2222]}),
            "TF_CONFIG: ps 0: address must be a 'host:port' string, got 2222",
        ),
        (cfg({**BASE, "worker": ["w:1", ":2"]}), "TF_CONFIG: worker 1: ':2': empty host"),
        (cfg({**BASE, "chief": ["c:x"]}), "TF_CONFIG: chief: 'c:x': port 'x' is not a number"),
        (cfg({**BASE, "ps": ["p:0"]}), "TF_CONFIG: ps 0: 'p:0': port 0 out of range 1..65535"),
        (cfg({**BASE, "ps": ["p:65536"]}), "TF_CONFIG: ps 0: 'p:65536': port 65536 out of range"),
        (
            cfg({**BASE, "ps": ["::1:2222"]}),
            "TF_CONFIG: ps 0: '::1:2222': write IPv6 hosts in brackets, e.g. [::1]:2222",
        ),
        (cfg({**BASE, "ps": ["[zz]:1"]}), "TF_CONFIG: ps 0: '[zz]:1': 'zz' is not an IPv6 address"),
        (
            cfg({**BASE, "ps": ["tcp://p:1"]}),
            "TF_CONFIG: ps 0: 'tcp://p:1': give host:port without a scheme",
        ),
        (
            cfg({**BASE, "ps": ["bad host:1"]}),
            "TF_CONFIG: ps 0: 'bad host:1': bad host name 'bad host'",
        ),
        (
            cfg({**BASE, "ps": ["w:2"]}),
            "TF_CONFIG: address 'w:2' is used by both ps 0 and worker 1",
        ),
        (
            cfg(task={"type": "worker", "index": 3}),
            "TF_CONFIG: task index 3 out of range for 'worker' (2 tasks)",
        ),
        (
            cfg(task={"type": "ps", "index": "1"}),
            "TF_CONFIG: task index 1 out of range for 'ps' (1 task)",
        ),
        (
            cfg(task={"type": "worker", "index": -1}),
            "TF_CONFIG: task index must be >= 0, got -1",
        ),
        (
            cfg(task={"type": "worker", "index": "one"}),
            "TF_CONFIG: task index 'one' is not an integer",
        ),
        (cfg(task={"type": "worker", "index": 1.5}), "TF_CONFIG: task index 1.5 is not an integer"),
        (
            cfg(task={"type": "worker", "index": True}),
            "TF_CONFIG: task index True is not an integer",
        ),
        (
            cfg(task={"type": "chief", "index": 1}),
            "TF_CONFIG: task index 1 out of range for 'chief' (there is only one chief, index 0)",
        ),
        (
            cfg(task={"type": "evaluator", "index": 1}),
            "TF_CONFIG: task index 1 out of range for 'evaluator' (there is only one evaluator,"
            " index 0)",
        ),
        (
            cfg(task={"type": "trainer", "index": 0}),
            "TF_CONFIG: unknown task type 'trainer'"
            " (expected chief, master, ps, worker or evaluator)",
        ),
        (cfg(task={"index": 1}), "TF_CONFIG: 'task' has an index but no type"),
        (cfg(task=["worker", 1]), "TF_CONFIG: 'task' must be an object, got a list"),
    ],
)
def test_parse_tf_config_errors_are_one_clear_line(text, message):
    with pytest.raises(ConfigError) as info:
        parse_tf_config(text)
    got = str(info.value)
    assert "\n" not in got
    assert got.startswith(message)


def test_parse_tf_config_source_label_and_port_zero():
    text = cfg({"chief": ["localhost:0"], "ps": ["localhost:0", "localhost:0"], "worker": []})
    with pytest.raises(ConfigError, match=r"^launch: chief: 'localhost:0': port 0 out of range"):
        parse_tf_config(text, source="launch")
    cluster, _ = parse_tf_config(text, allow_port_zero=True)  # port 0 may repeat
    assert cluster.ps == ("localhost:0", "localhost:0")
    with pytest.raises(ConfigError, match="used by both"):
        parse_tf_config(cfg({**BASE, "ps": ["c:1"]}), allow_port_zero=True)


# --- ClusterSpec / TaskSpec ------------------------------------------------------


def test_cluster_spec_accessors_and_round_trip():
    spec = ClusterSpec("c:1", ["p:1", "p:2"], ("w:1", "w:2", "w:3"), ["e:1"])
    assert spec.ps == ("p:1", "p:2") and spec.evaluator == ("e:1",)  # lists become tuples
    assert hash(spec) == hash(ClusterSpec("c:1", ("p:1", "p:2"), ("w:1", "w:2", "w:3"), ("e:1",)))
    assert (spec.num_ps, spec.num_workers) == (2, 3)
    assert spec.address("chief") == "c:1"
    assert spec.address("master", 0) == "c:1"
    assert spec.address("worker", 2) == "w:3"
    assert spec.address("evaluator") == "e:1"
    assert list(spec.tasks()) == [
        ("chief", 0, "c:1"),
        ("ps", 0, "p:1"),
        ("ps", 1, "p:2"),
        ("worker", 0, "w:1"),
        ("worker", 1, "w:2"),
        ("worker", 2, "w:3"),
        ("evaluator", 0, "e:1"),
    ]
    for role, index, _ in spec.tasks():
        text = spec.to_tf_config(role, index)
        assert parse_tf_config(text) == (spec, TaskSpec(role, index))
    assert json.loads(spec.to_tf_config("master"))["task"] == {"type": "chief", "index": 0}


def test_cluster_spec_errors():
    spec = ClusterSpec("c:1", ("p:1",), ("w:1", "w:2"))
    with pytest.raises(ConfigError, match=r"task index 2 out of range for 'worker' \(2 tasks\)"):
        spec.address("worker", 2)
    with pytest.raises(ConfigError, match="evaluator is not in the cluster"):
        spec.address("evaluator")
    with pytest.raises(ConfigError, match="unknown role 'gpu'"):
        spec.address("gpu", 0)
    with pytest.raises(ConfigError, match=r"^to_tf_config: task index 5 out of range for 'ps'"):
        spec.to_tf_config("ps", 5)
    # an evaluator outside the cluster is a valid task (it only connects)
    assert json.loads(spec.to_tf_config("evaluator"))["task"]["type"] == "evaluator"
    with pytest.raises(ConfigError, match=r"^cluster spec: cluster has no 'ps' tasks"):
        ClusterSpec("c:1", (), ("w:1",))
    with pytest.raises(ConfigError, match=r"^cluster spec: cluster has no 'chief'"):
        ClusterSpec("", ("p:1",), ())
    with pytest.raises(ConfigError, match="'ps' must be a list of addresses, not a string"):
        ClusterSpec("c:1", "p:1", ())
    with pytest.raises(
        ConfigError, match=r"^mine: address 'c:1' is used by both chief and worker 0"
    ):
        ClusterSpec("c:1", ("p:1",), ("c:1",), source="mine")


def test_task_spec():
    assert TaskSpec("master") == TaskSpec("chief", 0)
    assert TaskSpec("worker", 3).index == 3
    with pytest.raises(ConfigError, match="unknown task type 'boss'"):
        TaskSpec("boss", 0)
    with pytest.raises(ConfigError, match="must be >= 0"):
        TaskSpec("ps", -2)
    with pytest.raises(ConfigError, match="must be an integer"):
        TaskSpec("ps", "1")


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("localhost:2222", ("localhost", 2222)),
        ("10.0.0.1:1", ("10.0.0.1", 1)),
        ("job-ps-0.ns.svc.cluster.local:65535", ("job-ps-0.ns.svc.cluster.local", 65535)),
        ("my_ps:80", ("my_ps", 80)),
        ("[::1]:2222", ("::1", 2222)),
    ],
)
def test_split_address(address, expected):
    assert split_address(address) == expected


# --- flags and --cluster ---------------------------------------------------------


def test_cluster_from_flags():
    spec = cluster_from_flags("a:1,b:2", " w:1, w:2 ,", "c:1", "e:1")
    assert spec == ClusterSpec("c:1", ("a:1", "b:2"), ("w:1", "w:2"), ("e:1",))
    assert cluster_from_flags("a:1", None, "c:1") == ClusterSpec("c:1", ("a:1",), ())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((None, "w:1", "c:1"), "--ps-hosts: missing; pass at least one ps address, e.g. host:2222"),
        (
            ("a:1", "w:1", None),
            "--chief-host: missing; zmqps needs a chief address, e.g. host:2222",
        ),
        (("a:1", "w:1", "c:1,c:2"), "--chief-host: takes one address, got 2"),
        (("a:1", "w:1,w", "c:1"), "--worker-hosts: 'w' is not host:port"),
        (("a:1;b:2", "w:1", "c:1"), "--ps-hosts: 'a:1;b:2' is not host:port"),
        (("a:1", "w:1", "c:1", "e:0"), "--evaluator-hosts: 'e:0': port 0 out of range 1..65535"),
        (("a:1,a:1", "w:1", "c:1"), "host flags: address 'a:1' is used by both ps 0 and ps 1"),
    ],
)
def test_cluster_from_flags_errors(args, message):
    with pytest.raises(ConfigError) as info:
        cluster_from_flags(*args)
    assert str(info.value) == message


def test_load_cluster_inline_json_and_file(tmp_path):
    spec, task = load_cluster_file_or_json(json.dumps(BASE))  # just the cluster part
    assert spec == ClusterSpec("c:1", ("p:1",), ("w:1", "w:2")) and task is None
    assert load_cluster_file_or_json(json.dumps(KUBEFLOW_CHIEF)) == parse_tf_config(
        json.dumps(KUBEFLOW_CHIEF)
    )
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(CLOUD_ML_EVALUATOR))
    assert load_cluster_file_or_json(str(path))[1] == TaskSpec("evaluator", 0)
    path.write_text(json.dumps({"master": ["m:1"], "ps": ["p:1"]}))
    assert load_cluster_file_or_json(str(path))[0].chief == "m:1"


def test_load_cluster_errors(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=r"^--cluster: no such file"):
        load_cluster_file_or_json(str(missing))
    with pytest.raises(ConfigError, match=r"^--cluster: empty"):
        load_cluster_file_or_json("  ")
    bad = tmp_path / "bad.json"
    bad.write_text('{"ps": ["p:1"]}')
    with pytest.raises(ConfigError, match=rf"^--cluster {bad}: cluster has no 'chief'"):
        load_cluster_file_or_json(str(bad))
    with pytest.raises(ConfigError, match=r"^--cluster: not valid JSON"):
        load_cluster_file_or_json("{oops")
    with pytest.raises(ConfigError, match=r"^--cluster: task index 2 out of range for 'worker'"):
        load_cluster_file_or_json(cfg(task={"type": "worker", "index": 2}))


# --- resolve: precedence ---------------------------------------------------------

ENV = {"TF_CONFIG": json.dumps(KUBEFLOW_CHIEF)}
NONE5 = (None, None, None, None, None)


def test_resolve_from_tf_config():
    cluster, task = resolve(*NONE5, None, None, ENV)
    assert cluster.num_ps == 2 and task == TaskSpec("worker", 1)


def test_resolve_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps(KUBEFLOW_MASTER))
    assert resolve(*NONE5, None, None)[1] == TaskSpec("chief", 0)
    monkeypatch.delenv("TF_CONFIG")
    with pytest.raises(ConfigError) as info:
        resolve(*NONE5, None, None)
    assert str(info.value) == NO_CLUSTER_MESSAGE


@pytest.mark.parametrize("environ", [{}, {"TF_CONFIG": ""}, {"TF_CONFIG": "  "}])
def test_resolve_without_any_cluster_spec(environ):
    with pytest.raises(ConfigError) as info:
        resolve(*NONE5, "worker", 0, environ)
    assert str(info.value) == (
        "no cluster spec: pass --cluster, --ps-hosts/--worker-hosts/--chief-host, set TF_CONFIG,"
        " or start the tasks with srun"
    )


def test_host_flags_win_over_tf_config():
    env = {"TF_CONFIG": "{broken"}  # never read when flags give the cluster
    cluster, task = resolve(None, "a:1", "w:1,w:2", "c:1", None, "worker", 1, env)
    assert cluster == ClusterSpec("c:1", ("a:1",), ("w:1", "w:2"))
    assert task == TaskSpec("worker", 1)


def test_cluster_flag_wins_over_tf_config_and_brings_its_task():
    cluster, task = resolve(json.dumps(CLOUD_ML_ENGINE), None, None, None, None, None, None, ENV)
    assert cluster.chief == "127.0.0.1:2222" and task == TaskSpec("ps", 0)


def test_role_and_index_flags_override_the_task():
    assert resolve(*NONE5, "ps", 1, ENV)[1] == TaskSpec("ps", 1)
    assert resolve(*NONE5, None, 0, ENV)[1] == TaskSpec("worker", 0)  # index only
    assert resolve(*NONE5, "worker", None, ENV)[1] == TaskSpec("worker", 1)  # same role: keep
    # another role of several tasks: which one must be said (two tasks started without
    # it would both be task 0, the second replacing the first)
    with pytest.raises(ConfigError, match=r"^--role ps: the cluster has 2 ps tasks; say which"):
        resolve(*NONE5, "ps", None, ENV)
    assert resolve(*NONE5, "master", None, ENV)[1] == TaskSpec("chief", 0)
    assert resolve(*NONE5, "evaluator", None, ENV)[1] == TaskSpec("evaluator", 0)


def test_resolve_role_errors():
    flags = (None, "a:1", "w:1", "c:1", None)
    with pytest.raises(ConfigError, match=r"^no role: pass --role"):
        resolve(*flags, None, 0, {})
    with pytest.raises(ConfigError, match=r"^no role"):
        resolve(None, None, None, None, None, None, None, {"TF_CONFIG": json.dumps(NO_TASK)})
    with pytest.raises(ConfigError, match=r"^--role: unknown role 'boss'"):
        resolve(*flags, "boss", 0, {})
    with pytest.raises(ConfigError) as info:
        resolve(*flags, "worker", 3, {})
    assert str(info.value) == "--role/--index: task index 3 out of range for 'worker' (1 task)"
    with pytest.raises(
        ConfigError, match=r"^--role/--index: task index 1 out of range for 'chief'"
    ):
        resolve(*flags, "chief", 1, {})


def test_task_without_index_is_an_error_unless_index_is_given():
    no_index = json.dumps({**NO_TASK, "task": {"type": "worker"}})
    message = (
        "TF_CONFIG: 'task' 'worker' has no 'index'; give it"
        ' (e.g. {"type": "worker", "index": 0}) or pass --index'
    )
    with pytest.raises(ConfigError) as info:
        parse_tf_config(no_index)
    assert str(info.value) == message
    with pytest.raises(ConfigError) as info:
        resolve(*NONE5, None, None, {"TF_CONFIG": no_index})
    assert str(info.value) == message
    with pytest.raises(ConfigError, match=r"^--cluster: 'task' 'worker' has no 'index'"):
        resolve(no_index, None, None, None, None, None, None, {})
    assert resolve(*NONE5, None, 0, {"TF_CONFIG": no_index})[1] == TaskSpec("worker", 0)
    assert resolve(no_index, None, None, None, None, "worker", 0, {})[1] == TaskSpec("worker", 0)


def test_default_role_needs_an_index_or_a_task():
    """zmqps-worker's default role: only with --index; no task at all is an error."""
    env = {"TF_CONFIG": json.dumps(NO_TASK)}
    with pytest.raises(ConfigError) as info:
        resolve(*NONE5, None, None, env, default_role="worker")
    assert str(info.value) == (
        "no role: pass --role (or --job-name) and --index, or give a 'task' in"
        " TF_CONFIG / --cluster"
    )
    flags = (None, "a:1", "w:1", "c:1", None)
    with pytest.raises(ConfigError, match=r"^no role"):
        resolve(*flags, None, None, {}, default_role="worker")
    assert resolve(*NONE5, None, 0, env, default_role="worker")[1] == TaskSpec("worker", 0)
    assert resolve(*flags, None, 0, {}, default_role="worker")[1] == TaskSpec("worker", 0)
    assert resolve(*NONE5, None, None, ENV, default_role="worker")[1] == TaskSpec("worker", 1)


def test_cluster_and_host_flags_are_exclusive():
    with pytest.raises(ConfigError, match="exclusive"):
        resolve(json.dumps(BASE), "a:1", None, None, None, "ps", 0, {})


def test_nonfinite_settings() -> None:
    import argparse

    from zmqps.cli.args import add_nonfinite_args, on_nonfinite_from_args
    from zmqps.roles.configs import ChiefConfig, WorkerConfig

    p = argparse.ArgumentParser()
    add_nonfinite_args(p)
    assert on_nonfinite_from_args(p.parse_args([])) == "skip"
    # no share allowed: zmqps launch's workers stop at the first one
    assert on_nonfinite_from_args(p.parse_args(["--max-nonfinite-share", "0"])) == "stop"
    given = ["--max-nonfinite-share", "0", "--on-nonfinite", "skip-silently"]
    assert on_nonfinite_from_args(p.parse_args(given)) == "skip-silently"
    with pytest.raises(SystemExit):
        p.parse_args(["--on-nonfinite", "ignore"])
    cluster = ClusterSpec(chief="127.0.0.1:1", ps=("127.0.0.1:2",), worker=("127.0.0.1:3",))
    for share in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="--max-nonfinite-share must be within"):
            ChiefConfig(bind="tcp://127.0.0.1:1", cluster=cluster, max_nonfinite_share=share)
    with pytest.raises(ConfigError, match="--on-nonfinite must be one of"):
        WorkerConfig(cluster=cluster, index=0, on_nonfinite="ignore")
