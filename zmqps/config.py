"""Cluster configuration: the ONE place zmqps reads the environment.

Rules of this module:

* Only :func:`resolve` / :func:`resolve_source` (``TF_CONFIG``, Slurm's ``SLURM_*``
  through :mod:`zmqps.slurm`) and :func:`keys_dir` (``ZMQPS_KEYS``) read the
  environment, through an injectable mapping (``os.environ`` by default);
  everything else is a pure function of its arguments.
* Results are frozen dataclasses (:class:`ClusterSpec`, :class:`TaskSpec`),
  validated when built; nothing downstream re-checks addresses or role names.
* Precedence: CLI flags (``--cluster FILE|JSON`` or the host flags), then
  ``TF_CONFIG``, then a Slurm job step (``SLURM_PROCID`` set); the first one given
  is the cluster, the sources are never mixed, and the resolution says which one it
  used and which it ignored. ``--role`` / ``--index`` win over the task of
  whichever spec is used.
* Every problem raises :class:`~zmqps.wire.errors.ConfigError` with ONE line that
  starts with its source, e.g. ``TF_CONFIG: task index 3 out of range for
  'worker' (2 tasks)``.
* Every TF_CONFIG shape users meet is accepted: ``chief`` or legacy ``master``;
  ``evaluator`` inside ``cluster`` or only as the task type; extra keys
  (``environment``, ``job``, ``rpc_layer``, task ``trial`` / ``cloud``) ignored;
  task index as an int or a numeric string (a task without one is an error, never a
  silent 0). Roles are canonical after parsing
  (``master`` becomes ``chief``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import KW_ONLY, InitVar, dataclass
from pathlib import Path
from typing import Any

from zmqps.slurm import DEFAULT_PORT_BASE, in_slurm_step, slurm_layout
from zmqps.wire.errors import ConfigError, did_you_mean

__all__ = [
    "KEYS_ENV",
    "NO_CLUSTER_MESSAGE",
    "ROLES",
    "SEAL_ENV",
    "SOURCES",
    "ClusterSpec",
    "Resolution",
    "TaskSpec",
    "bind_address",
    "cluster_from_flags",
    "keys_dir",
    "load_cluster_file_or_json",
    "parse_tf_config",
    "resolve",
    "resolve_source",
    "seal_bulk",
    "split_address",
]

#: Canonical role names, in the order they appear in a cluster spec.
ROLES = ("chief", "ps", "worker", "evaluator")
_ALIASES = {"master": "chief"}
_CLUSTER_KEYS = ("chief", "master", "ps", "worker", "evaluator")
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_INDEX_RE = re.compile(r"-?[0-9]+")

NO_CLUSTER_MESSAGE = (
    "no cluster spec: pass --cluster, --ps-hosts/--worker-hosts/--chief-host, set TF_CONFIG,"
    " or start the tasks with srun"
)
#: Where a cluster can come from, in order of precedence.
SOURCES = ("flags", "tf_config", "slurm")


def _json_type(value: object) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _n_tasks(n: int) -> str:
    return f"{n} task" if n == 1 else f"{n} tasks"


def _canonical_role(name: object, source: str, what: str = "task type") -> str:
    role = _ALIASES.get(name, name) if isinstance(name, str) else name
    if role not in ROLES:
        hint = did_you_mean(name, (*ROLES, *_ALIASES), quote=True) if isinstance(name, str) else ""
        raise ConfigError(
            f"{source}: unknown {what} {name!r} (expected chief, master, ps, worker or"
            f" evaluator{hint})"
        )
    assert isinstance(role, str)
    return role


def _address_problem(address: object, allow_port_zero: bool) -> str | None:
    """Why ``address`` is not a valid ``host:port`` / ``[ipv6]:port``, or None."""
    if not isinstance(address, str):
        return f"address must be a 'host:port' string, got {address!r}"
    if "://" in address:
        return f"{address!r}: give host:port without a scheme"
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            return f"{address!r} is not [ipv6]:port"
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return f"{address!r}: {host!r} is not an IPv6 address"
    else:
        host, sep, port = address.rpartition(":")
        if not sep:
            return f"{address!r} is not host:port"
        if ":" in host:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                return f"{address!r} is not host:port"
            return f"{address!r}: write IPv6 hosts in brackets, e.g. [::1]:2222"
        if not host:
            return f"{address!r}: empty host"
        if not _HOST_RE.fullmatch(host):
            return f"{address!r}: bad host name {host!r}"
    if not (port.isascii() and port.isdigit()):
        return f"{address!r}: port {port!r} is not a number"
    low = 0 if allow_port_zero else 1
    if not low <= int(port) <= 65535:
        return f"{address!r}: port {int(port)} out of range {low}..65535"
    return None


def split_address(address: str, *, allow_port_zero: bool = False) -> tuple[str, int]:
    """``(host, port)`` of ``host:port`` or ``[ipv6]:port`` (host without brackets)."""
    problem = _address_problem(address, allow_port_zero)
    if problem is not None:
        raise ConfigError(f"bad address: {problem}")
    host, _, port = address.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def bind_address(address: str) -> str:
    """Where a server binds for its advertised ``address``.

    IP literals and localhost are bound as given; a host name (a Kubernetes pod
    or service name, say) binds every interface, as TensorFlow's servers do.
    """
    host, port = split_address(address)
    bare = host.strip("[]")
    if bare == "localhost":
        return f"127.0.0.1:{port}"
    try:
        ipaddress.ip_address(bare)
        return address
    except ValueError:
        return f"*:{port}"


@dataclass(frozen=True)
class TaskSpec:
    """This process' task: ``role`` in :data:`ROLES` (``master`` is read as ``chief``)
    and its ``index`` within that role (0 for chief and evaluator)."""

    role: str
    index: int = 0
    _: KW_ONLY
    source: InitVar[str] = "task"

    def __post_init__(self, source: str) -> None:
        object.__setattr__(self, "role", _canonical_role(self.role, source))
        if isinstance(self.index, bool) or not isinstance(self.index, int):
            raise ConfigError(f"{source}: task index must be an integer, got {self.index!r}")
        if self.index < 0:
            raise ConfigError(f"{source}: task index must be >= 0, got {self.index}")
        if self.role in ("chief", "evaluator") and self.index != 0:
            raise ConfigError(
                f"{source}: task index {self.index} out of range for {self.role!r}"
                f" (there is only one {self.role}, index 0)"
            )


@dataclass(frozen=True)
class ClusterSpec:
    """Addresses (``host:port``) of every task, by role.

    Valid by construction: one chief, at least one ps, at most one evaluator,
    well-formed distinct addresses (port 0, allowed with ``allow_port_zero``
    for "pick a free port", may repeat). ``source`` prefixes error messages.

    The one exception is TF2's side-car evaluation job: a cluster that holds only an
    evaluator (:attr:`evaluator_only`; no chief, ps or workers), for a lone evaluator
    that works from checkpoints alone. Only an evaluator task may run in it.
    """

    chief: str
    ps: tuple[str, ...]
    worker: tuple[str, ...]
    evaluator: tuple[str, ...] = ()
    _: KW_ONLY
    allow_port_zero: InitVar[bool] = False
    source: InitVar[str] = "cluster spec"

    def __post_init__(self, allow_port_zero: bool, source: str) -> None:
        for role in ("ps", "worker", "evaluator"):
            value = getattr(self, role)
            if isinstance(value, str):
                raise ConfigError(f"{source}: {role!r} must be a list of addresses, not a string")
            object.__setattr__(self, role, tuple(value))
        problem = self._problem(allow_port_zero)
        if problem is not None:
            raise ConfigError(f"{source}: {problem}")

    @property
    def evaluator_only(self) -> bool:
        """A cluster of one evaluator and nothing else (TF2's side-car evaluation job)."""
        return not self.chief and not self.ps and not self.worker and len(self.evaluator) == 1

    def _problem(self, allow_port_zero: bool) -> str | None:
        if self.evaluator_only:
            return _address_problem(self.evaluator[0], allow_port_zero)
        if not self.chief:
            return "cluster has no 'chief' (or 'master') task; zmqps needs one"
        if not self.ps:
            return "cluster has no 'ps' tasks; at least one is needed"
        if len(self.evaluator) > 1:
            return f"at most one 'evaluator' task is supported, got {len(self.evaluator)}"
        used: dict[str, str] = {}
        for role, index, address in self.tasks():
            label = "chief" if role == "chief" else f"{role} {index}"
            problem = _address_problem(address, allow_port_zero)
            if problem is not None:
                return f"{label}: {problem}"
            if split_address(address, allow_port_zero=True)[1] == 0:  # each picks a free port
                continue
            if address in used:
                return f"address {address!r} is used by both {used[address]} and {label}"
            used[address] = label
        return None

    @property
    def num_ps(self) -> int:
        return len(self.ps)

    @property
    def num_workers(self) -> int:
        return len(self.worker)

    def addresses(self, role: str) -> tuple[str, ...]:
        """The addresses of every task of ``role`` (``master`` means chief)."""
        role = _canonical_role(role, "cluster spec", "role")
        return (self.chief,) if role == "chief" else tuple(getattr(self, role))

    def tasks(self) -> Iterator[tuple[str, int, str]]:
        """``(role, index, address)`` of every task, chief first."""
        for role in ROLES:
            for index, address in enumerate(self.addresses(role)):
                yield role, index, address

    def address(self, role: str, index: int = 0) -> str:
        """The address of task ``index`` of ``role``."""
        role = _canonical_role(role, "cluster spec", "role")
        found = self.addresses(role)
        if role == "evaluator" and not found:
            raise ConfigError("cluster spec: the evaluator is not in the cluster; no address")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(found):
            raise ConfigError(
                f"cluster spec: task index {index!r} out of range for {role!r}"
                f" ({_n_tasks(len(found))})"
            )
        return found[index]

    def check_task(self, task: TaskSpec, *, source: str = "cluster spec") -> None:
        """Raise :class:`ConfigError` unless ``task`` exists in this cluster.

        An evaluator absent from the cluster is allowed (its address is unknown;
        it only connects to others).
        """
        if task.role == "evaluator" and not self.evaluator:
            return
        n = len(self.addresses(task.role))
        if task.index >= n:
            raise ConfigError(
                f"{source}: task index {task.index} out of range for {task.role!r} ({_n_tasks(n)})"
            )

    def to_dict(self) -> dict[str, list[str]]:
        """The ``cluster`` part of a TF_CONFIG (no ``evaluator`` key when there is none)."""
        out = {"chief": [self.chief], "ps": list(self.ps), "worker": list(self.worker)}
        if self.evaluator:
            out["evaluator"] = list(self.evaluator)
        return out

    def to_tf_config(self, task_type: str, index: int = 0) -> str:
        """A TF_CONFIG JSON string for task ``index`` of ``task_type`` in this cluster."""
        task = TaskSpec(task_type, index, source="to_tf_config")
        self.check_task(task, source="to_tf_config")
        return json.dumps(
            {"cluster": self.to_dict(), "task": {"type": task.role, "index": task.index}}
        )


# --- TF_CONFIG --------------------------------------------------------------------


def _loads(text: str, source: str) -> dict[str, Any]:
    if not text.strip():
        raise ConfigError(f"{source}: empty; expected a JSON object")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{source}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{source}: must be a JSON object, got {_json_type(obj)}")
    return obj


def _job_addresses(value: object, job: str, source: str) -> list[Any]:
    """A job's task list: a list, a single address string, or ``{"0": addr, ...}``."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    if isinstance(value, dict):
        try:
            by_index = {int(k): v for k, v in value.items()}
        except ValueError:
            by_index = {}
        if sorted(by_index) != list(range(len(value))):
            raise ConfigError(
                f"{source}: {job!r} tasks given by index must be numbered 0..{len(value) - 1},"
                f" got {sorted(value)}"
            )
        return [by_index[i] for i in range(len(value))]
    raise ConfigError(
        f"{source}: {job!r} must be a list of 'host:port' addresses, got {_json_type(value)}"
    )


def _cluster_from_obj(obj: object, source: str, allow_port_zero: bool) -> ClusterSpec:
    if not isinstance(obj, dict):
        raise ConfigError(f"{source}: 'cluster' must be an object, got {_json_type(obj)}")
    unknown = sorted(set(obj) - set(_CLUSTER_KEYS))
    if unknown:
        hint = did_you_mean(str(unknown[0]), _CLUSTER_KEYS, quote=True)
        raise ConfigError(
            f"{source}: unknown job {unknown[0]!r} in cluster"
            f" (expected chief, master, ps, worker or evaluator{hint})"
        )
    if "chief" in obj and "master" in obj:
        raise ConfigError(
            f"{source}: cluster has both 'chief' and 'master' (master is the legacy name"
            " of chief); keep one"
        )
    jobs = {job: _job_addresses(value, job, source) for job, value in obj.items()}
    chief_key = "master" if "master" in jobs else "chief"
    chiefs = jobs.get(chief_key, [])
    if (
        not chiefs
        and len(jobs.get("evaluator", [])) == 1
        and not any(jobs.get(j) for j in ("ps", "worker"))
    ):
        # TF2's side-car evaluation job: only an evaluator task may run in it (_pick_task)
        return ClusterSpec("", (), (), tuple(jobs["evaluator"]), source=source)
    if not chiefs:
        raise ConfigError(f"{source}: cluster has no 'chief' (or 'master') task; zmqps needs one")
    if len(chiefs) > 1:
        raise ConfigError(
            f"{source}: cluster lists {len(chiefs)} {chief_key!r} tasks; exactly one is allowed"
        )
    return ClusterSpec(
        chiefs[0],
        tuple(jobs.get("ps", ())),
        tuple(jobs.get("worker", ())),
        tuple(jobs.get("evaluator", ())),
        allow_port_zero=allow_port_zero,
        source=source,
    )


def _task_index(value: object, source: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and _INDEX_RE.fullmatch(value.strip()):
        return int(value)
    raise ConfigError(f"{source}: task index {value!r} is not an integer")


def _task_from_obj(obj: object, source: str, index_flag: int | None) -> TaskSpec | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ConfigError(f"{source}: 'task' must be an object, got {_json_type(obj)}")
    task_type = obj.get("type")
    if task_type in (None, ""):
        if "index" in obj:
            raise ConfigError(f"{source}: 'task' has an index but no type")
        return None  # no task: the role must come from the command line
    role = _canonical_role(task_type, source)
    if "index" not in obj:
        if index_flag is None:
            raise ConfigError(
                f"{source}: 'task' {task_type!r} has no 'index'; give it"
                f' (e.g. {{"type": "{task_type}", "index": 0}}) or pass --index'
            )
        return TaskSpec(role, index_flag, source="--index")  # --index completes the task
    return TaskSpec(role, _task_index(obj["index"], source), source=source)


def _from_tf_config(
    obj: Mapping[str, Any], source: str, allow_port_zero: bool, index_flag: int | None = None
) -> tuple[ClusterSpec, TaskSpec | None]:
    if "cluster" not in obj:
        raise ConfigError(f"{source}: no 'cluster' key")
    cluster = _cluster_from_obj(obj["cluster"], source, allow_port_zero)
    task = _task_from_obj(obj.get("task"), source, index_flag)
    if task is not None:
        cluster.check_task(task, source=source)
    return cluster, task


def parse_tf_config(
    text: str,
    *,
    source: str = "TF_CONFIG",
    allow_port_zero: bool = False,
    index_flag: int | None = None,
) -> tuple[ClusterSpec, TaskSpec | None]:
    """The cluster and task (None when it names no task) of a TF_CONFIG JSON string.

    A task with a type but no index is an error unless ``index_flag`` (``--index``)
    gives the index."""
    return _from_tf_config(_loads(text, source), source, allow_port_zero, index_flag)


# --- command-line forms -----------------------------------------------------------


def _split_hosts(value: str | None, flag: str, allow_port_zero: bool) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in (value or "").split(",") if h.strip())
    for h in hosts:
        problem = _address_problem(h, allow_port_zero)
        if problem is not None:
            raise ConfigError(f"{flag}: {problem}")
    return hosts


def cluster_from_flags(
    ps_hosts: str | None,
    worker_hosts: str | None,
    chief_host: str | None,
    evaluator_hosts: str | None = None,
    *,
    allow_port_zero: bool = False,
) -> ClusterSpec:
    """The cluster of classic comma-separated flags (``--ps-hosts a:1,b:2`` ...)."""
    ps = _split_hosts(ps_hosts, "--ps-hosts", allow_port_zero)
    worker = _split_hosts(worker_hosts, "--worker-hosts", allow_port_zero)
    chief = _split_hosts(chief_host, "--chief-host", allow_port_zero)
    evaluator = _split_hosts(evaluator_hosts, "--evaluator-hosts", allow_port_zero)
    if not chief:
        raise ConfigError("--chief-host: missing; zmqps needs a chief address, e.g. host:2222")
    if len(chief) > 1:
        raise ConfigError(f"--chief-host: takes one address, got {len(chief)}")
    if not ps:
        raise ConfigError("--ps-hosts: missing; pass at least one ps address, e.g. host:2222")
    return ClusterSpec(
        chief[0], ps, worker, evaluator, allow_port_zero=allow_port_zero, source="host flags"
    )


def load_cluster_file_or_json(
    value: str, *, allow_port_zero: bool = False, index_flag: int | None = None
) -> tuple[ClusterSpec, TaskSpec | None]:
    """``--cluster FILE|JSON``: a TF_CONFIG-shaped object, or just its ``cluster`` part.

    A value starting with ``{`` is JSON text; anything else is a file path.
    """
    if value.lstrip().startswith("{"):
        source, text = "--cluster", value
    else:
        if not value.strip():
            raise ConfigError("--cluster: empty; pass a file or a JSON object")
        source = f"--cluster {value}"
        try:
            text = Path(value).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(
                f"--cluster: no such file {value!r} (pass a file or a JSON object)"
            ) from None
        except OSError as e:
            raise ConfigError(f"--cluster: cannot read {value!r}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--cluster: {value!r} is not UTF-8 text") from None
    obj = _loads(text, source)
    if "cluster" not in obj and "task" not in obj:
        obj = {"cluster": obj}  # just the cluster part
    return _from_tf_config(obj, source, allow_port_zero, index_flag)


def _pick_task(
    cluster: ClusterSpec, task: TaskSpec | None, role: str | None, index: int | None
) -> TaskSpec:
    picked = _pick(cluster, task, role, index)
    if cluster.evaluator_only and picked.role != "evaluator":
        raise ConfigError(
            f"cluster spec: cluster has no 'chief' (or 'master') task; zmqps needs one"
            f" (a cluster of only an evaluator runs the evaluator, not a {picked.role})"
        )
    return picked


def _pick(
    cluster: ClusterSpec, task: TaskSpec | None, role: str | None, index: int | None
) -> TaskSpec:
    if role is None:
        if task is None:
            raise ConfigError(
                "no role: pass --role (or --job-name) and --index, or give a 'task' in"
                " TF_CONFIG / --cluster"
            )
        if index is None:
            return task
        role = task.role
    else:
        role = _canonical_role(role, "--role", "role")
    if index is None:
        if task is not None and task.role == role:
            index = task.index
        elif role != "evaluator" and len(cluster.addresses(role)) > 1:
            # two tasks started without it would both be task 0 (the second replaces
            # the first): which one this is must be said
            raise ConfigError(
                f"--role {role}: the cluster has {len(cluster.addresses(role))} {role} tasks;"
                " say which one this is with --index (or --task-id / --task-index)"
            )
        else:
            index = 0
    picked = TaskSpec(role, index, source="--role/--index")
    cluster.check_task(picked, source="--role/--index")
    return picked


#: The environment variable naming the CURVE keys folder when ``--keys`` is not given.
KEYS_ENV = "ZMQPS_KEYS"


def keys_dir(flag: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The CURVE keys folder: ``--keys``, else ``ZMQPS_KEYS`` (empty: none), else None."""
    if flag:
        return flag
    value = (os.environ if environ is None else environ).get(KEYS_ENV, "")
    return value or None


#: Set to ``off`` (or ``0``), bulk tensors under CURVE go through CURVE too, not sealed
#: on a data connection (``transport/seal.py``).
SEAL_ENV = "ZMQPS_SEAL"


def seal_bulk(environ: Mapping[str, str] | None = None) -> bool:
    """Whether bulk tensors under CURVE go sealed on a data connection (``ZMQPS_SEAL``:
    ``off``, ``0``, ``no`` or ``false`` say no; anything else, or nothing, says yes)."""
    value = (os.environ if environ is None else environ).get(SEAL_ENV, "")
    return value.strip().lower() not in ("off", "0", "no", "false")


@dataclass(frozen=True)
class Resolution:
    """This process' cluster and task, and where they came from."""

    cluster: ClusterSpec
    task: TaskSpec
    #: one of :data:`SOURCES`
    source: str
    #: the other sources this environment holds, ignored (lower precedence)
    ignored: tuple[str, ...] = ()
    #: Slurm: this task's rank in the step and its place on its node (else None)
    rank: int | None = None
    local_id: int | None = None


def resolve(*args: Any, **kwargs: Any) -> tuple[ClusterSpec, TaskSpec]:
    """:func:`resolve_source`'s cluster and task (it takes the same arguments)."""
    got = resolve_source(*args, **kwargs)
    return got.cluster, got.task


def resolve_source(
    args_cluster: str | None,
    ps_hosts: str | None,
    worker_hosts: str | None,
    chief_host: str | None,
    evaluator_hosts: str | None,
    role: str | None,
    index: int | None,
    environ: Mapping[str, str] | None = None,
    *,
    allow_port_zero: bool = False,
    default_role: str | None = None,
    slurm_counts: Mapping[str, int] | None = None,
    port_base: int = DEFAULT_PORT_BASE,
) -> Resolution:
    """This process' cluster and task, from flags, else ``TF_CONFIG``, else Slurm.

    The cluster (and its task, if any) comes from ``--cluster``, else from the
    host flags, else from ``TF_CONFIG`` in ``environ`` (``os.environ`` when None),
    else from the Slurm job step this task belongs to (``slurm_counts``: the chief,
    PS and evaluator counts, the other tasks being workers; ``port_base``: each
    node's first port); the sources are never mixed. ``role`` / ``index``
    (``--role`` / ``--index``, or the classic ``--job-name`` / ``--task-id``)
    override that task; an index defaults to the task's when the role matches it,
    else to 0. ``default_role`` applies only when neither ``role`` nor the spec
    names a task and ``index`` is given: with no task from either, it is an error
    (never a silent task 0). A spec's task without an index is an error unless
    ``index`` gives it.
    """
    env = os.environ if environ is None else environ
    present = {
        "tf_config": bool(env.get("TF_CONFIG", "").strip()),
        "slurm": in_slurm_step(env),
    }
    host_flags = (ps_hosts, worker_hosts, chief_host, evaluator_hosts)
    given = any(v is not None for v in host_flags)
    if args_cluster is not None and given:
        raise ConfigError(
            "--cluster and --ps-hosts/--worker-hosts/--chief-host/--evaluator-hosts"
            " are exclusive; pass one"
        )
    task: TaskSpec | None
    rank = local_id = None
    if args_cluster is not None:
        source = "flags"
        cluster, task = load_cluster_file_or_json(
            args_cluster, allow_port_zero=allow_port_zero, index_flag=index
        )
    elif given:
        source = "flags"
        cluster, task = cluster_from_flags(*host_flags, allow_port_zero=allow_port_zero), None
    elif present["tf_config"]:
        source = "tf_config"
        cluster, task = parse_tf_config(
            env["TF_CONFIG"], allow_port_zero=allow_port_zero, index_flag=index
        )
    elif present["slurm"]:
        source = "slurm"
        layout = slurm_layout(env, slurm_counts or {}, port_base)
        cluster = ClusterSpec(
            layout.cluster["chief"][0],
            layout.cluster.get("ps", ()),
            layout.cluster["worker"],
            layout.cluster.get("evaluator", ()),
            source="Slurm",
        )
        task = TaskSpec(layout.role, layout.index, source="Slurm")
        rank, local_id = layout.rank, layout.local_id
    else:
        raise ConfigError(NO_CLUSTER_MESSAGE)
    if role is None and task is None and index is not None:
        role = default_role
    ignored = tuple(s for s in SOURCES[SOURCES.index(source) + 1 :] if present.get(s))
    picked = _pick_task(cluster, task, role, index)
    return Resolution(cluster, picked, source, ignored, rank, local_id)
