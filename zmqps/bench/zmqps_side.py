"""Side (a): zmqps itself — real daemons and workers on the public :class:`zmqps.Worker` API.

Rules of this module:

* The chief and the PS are the product's own processes (``python -m zmqps
  server``), with ``--model none`` and the partitioner flags of the workload;
  workers are benchmark children calling ``create_variables``, then per step
  ``pull`` + ``push`` (or ``push_pull``), or ``pull_rows`` + ``push_rows``.
* Each worker reports the placement it received, so the other sides can move
  exactly the same shards.
* ``zmqps-hash`` (sparse suite) is the same processes with the table declared
  hash-keyed (:func:`hashed_tables`): the same ids, spread over the int64 range,
  routed by their hash bucket; the pool's rows are created before timing, the
  ``fresh`` variant's ids are new every step (rows created, and evicted once the
  row budget is reached, inside the timed steps).
* ``zmqps-r2`` is zmqps-tcp with two copies of each PS state (``--replication 2``):
  what replication costs training; ``zmqps-hash-r2`` (sparse suite) is zmqps-hash
  with two copies (a hash-keyed table's pulls are replicated too: they create,
  sight and stamp rows).
* ``zmqps-bf16`` is zmqps-tcp with dense float32 variables travelling as bfloat16
  (``--wire-dtype bfloat16``): half the bytes of every pull and push.
* Leaving is the product's normal end: every worker closes with "done", the
  chief then shuts the PS down and every process exits 0.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zmqps.bench.common import (
    HOST,
    Child,
    Control,
    Side,
    SideContext,
    child_argv,
    child_env,
    serve_steps,
)
from zmqps.bench.workload import DEFAULT_ROW_BUDGET, Workload, hashed_ids
from zmqps.core.hashtable import DEFAULT_BUCKETS
from zmqps.core.variables import VariableDef
from zmqps.transport import free_ports

__all__ = ["hashed_tables", "spawn", "table_stats", "worker_main"]


def spawn(
    wl: Workload,
    ctx: SideContext,
    *,
    tcp_only: bool = False,
    metrics: bool = False,
    curve: bool = False,
    hashed: bool = False,
    replication: int = 1,
    wire: str | None = None,
) -> Side:
    """Chief, PS and workers; ``tcp_only`` turns the same-host fast path off;
    ``metrics`` serves Prometheus metrics on every process (to price them); ``curve``
    runs every socket on CURVE (keys made in the run folder); ``hashed`` (sparse
    suite) makes the table a hash-keyed one (:func:`hashed_tables`); ``replication``:
    copies of each PS state; ``wire``: the dense variables' wire dtype."""
    if wire is not None:
        name = "zmqps-bf16"
    elif replication > 1:
        name = f"zmqps-hash-r{replication}" if hashed else f"zmqps-r{replication}"
    elif hashed:
        name = "zmqps-hash"
    elif curve:
        name = "zmqps-curve"
    else:
        name = "zmqps-tcp" if tcp_only else ("zmqps-metrics" if metrics else "zmqps")
    ports = free_ports(1 + wl.num_ps + ctx.workers, HOST)
    cluster = {
        "chief": [f"{HOST}:{ports[0]}"],
        "ps": [f"{HOST}:{p}" for p in ports[1 : 1 + wl.num_ps]],
        "worker": [f"{HOST}:{p}" for p in ports[1 + wl.num_ps :]],
    }
    spec = json.dumps({"cluster": cluster})
    base = [sys.executable, "-m", "zmqps", "server", "--cluster", spec]
    parent = ["--parent-pid", str(os.getpid())]
    if metrics:
        parent += ["--metrics-port", "0"]
    keys = ""
    if curve:
        from zmqps.transport import keygen

        keys = str((ctx.run_dir / f"{name}-keys").resolve())
        keygen(keys, force=True)
        parent += ["--keys", keys]
    part = wl.partitioner
    chief = [
        *base,
        "--role",
        "chief",
        "--model",
        "none",
        "--optimizer",
        "sgd",
        "--lr",
        str(wl.lr),
        "--min-shard-bytes",
        str(part.min_shard_bytes),
        "--max-shard-bytes",
        str(part.max_shard_bytes),
        "--heartbeat-timeout",
        str(max(60.0, ctx.timeout)),
        "--startup-timeout",
        str(ctx.timeout),
        *parent,
    ]
    if part.num_shards:
        chief += ["--num-shards", str(part.num_shards)]
    if replication > 1:
        chief += ["--replication", str(replication)]
    if wire is not None:
        chief += ["--wire-dtype", wire]
    env = child_env(ctx.zmqps_env)
    side = Side(name, wl.units_per_step, ctx.timeout, ps_addresses=cluster["ps"])
    side.servers.append(Child(f"{name}-chief", chief, ctx.run_dir, env))
    for i in range(wl.num_ps):
        argv = [*base, "--role", "ps", "--index", str(i), *parent]
        side.servers.append(Child(f"{name}-ps{i}", argv, ctx.run_dir, env))
    for i in range(ctx.workers):
        config = {
            "workload": wl.to_json(),
            "chief": cluster["chief"][0],
            "index": i,
            "seed": ctx.seed,
            "timeout": ctx.timeout,
            "tcp_only": tcp_only,
            "metrics": metrics,
            "keys": keys,
            "hashed": hashed,
        }
        path = ctx.write_config(f"{name}-worker{i}", config)
        side.workers.append(
            Child(
                f"{name}-worker{i}",
                child_argv("zmqps", "worker", path),
                ctx.run_dir,
                env,
                control=True,
            )
        )
    return side


def table_stats(side: Side) -> dict[str, dict[str, int]]:
    """Rows, creations and evictions of each of the side's hash-keyed tables, summed
    over its PS (read from each PS's ``status``): ``{table: {figure: n}}``."""
    from zmqps.roles.status import fetch_status

    out: dict[str, dict[str, int]] = {}
    for address in side.ps_addresses:
        status = asyncio.run(fetch_status(address, timeout=side.timeout))
        for var, shards in status.get("tables", {}).items():
            total = out.setdefault(var, {})
            for t in shards:
                figures = {k: t[k] for k in ("rows", "capacity", "created")}
                figures.update({f"evicted_{why}": n for why, n in t["evicted"].items()})
                for key, n in figures.items():
                    total[key] = total.get(key, 0) + int(n)
    return out


def _dense_steps(w: Any, wl: Workload) -> dict[str, Callable[[], object]]:
    grads = {v.name: np.full(v.shape, 1e-6, dtype=v.dtype) for v in wl.variables}

    def pull_push() -> None:
        w.pull()
        w.push(grads)

    def push_pull() -> None:
        w.push_pull(grads)

    return {"pull+push": pull_push, "push_pull": push_pull}


def hashed_tables(wl: Workload) -> list[VariableDef]:
    """The sparse workload's table as hash-keyed ones: the same row width and dtype,
    :data:`DEFAULT_BUCKETS` buckets (one shard per PS), the workload's row budget;
    one for the ``rows`` variant and one (``<name>_fresh``) for the ``fresh`` one,
    so the rows the fresh ids push out are never the pool's."""
    v = wl.variables[0]
    budget = int(wl.extra.get("row_budget", DEFAULT_ROW_BUDGET))
    return [
        VariableDef(
            name,
            (DEFAULT_BUCKETS, *v.shape[1:]),
            v.dtype,
            sparse=True,
            table={"row_budget": budget},
        )
        for name in (v.name, f"{v.name}_fresh")
    ]


def _sparse_steps(
    w: Any, wl: Workload, seed: int, index: int, hashed: bool
) -> dict[str, Callable[[], object]]:
    pool = list(wl.id_pool(seed, index))
    if hashed:
        pool = [hashed_ids(ids) for ids in pool]
    name = wl.variables[0].name
    grads = np.full((wl.batch_rows, *wl.variables[0].shape[1:]), 1e-3, dtype=np.float32)
    if hashed:  # every row of the pool exists before timing, as in a fixed-size table
        for ids in pool:
            w.pull_rows(name, ids)

    waits = bool(wl.extra.get("rows_wait"))
    overlap = hasattr(w, "push_rows_async") and not waits
    # one request a step: the last step's push and this step's pull in one message
    # (--rows-two / --rows-wait: the pull and the push as two requests)
    one = hasattr(w, "push_pull_rows") and not waits and not wl.extra.get("rows_two")

    def step(table: str, batches: Iterator[Any]) -> Callable[[], None]:
        pushing: list[Any] = []  # the push still on its way (overlap)
        pending: list[Any] = []  # one: the ids whose gradients the next step pushes

        def rows() -> None:
            ids = next(batches)
            if one:
                if pending:  # the last step's push, then this step's pull
                    w.push_pull_rows(table, pending.pop(), grads, ids)
                else:
                    w.pull_rows(table, ids)
                pending.append(ids)
                return
            w.pull_rows(table, ids)  # reads the previous step's push: sent before it
            if not overlap:
                w.push_rows(table, ids, grads)
                return
            if pushing:
                pushing.pop().result()  # one push in flight, as push_rows keeps it
            pushing.append(w.push_rows_async(table, ids, grads))

        def finish() -> None:
            while pushing:
                pushing.pop().result()
            while pending:  # the last step's push, waited for inside the timed run
                w.push_rows(table, pending.pop(), grads)

        rows.finish = finish  # type: ignore[attr-defined]
        return rows

    return {
        "rows": step(name, itertools.cycle(pool)),
        "fresh": step(
            f"{name}_fresh" if hashed else name, wl.fresh_ids(seed, index, hashed=hashed)
        ),
    }


def _transports(w: Any) -> list[str]:
    """How dense tensors travel to each PS ("shm" or "tcp"), when this zmqps says."""
    client = w.client
    if not hasattr(client, "transport_of"):
        return []
    return [str(client.transport_of(ps)) for ps in range(len(client.ps))]


def worker_main(config: dict[str, Any], ctl: Control | None) -> None:
    from zmqps import Worker
    from zmqps.malloc import tune_malloc

    assert ctl is not None
    tune_malloc()  # as zmqps-worker does
    wl = Workload.from_json(config["workload"])
    timeout = float(config["timeout"])
    index = int(config["index"])
    kwargs: dict[str, Any] = {}
    if config.get("tcp_only"):
        if "shared_memory" not in inspect.signature(Worker).parameters:
            raise RuntimeError("this zmqps has no shared_memory switch: nothing to turn off")
        kwargs["shared_memory"] = False
    if config.get("metrics"):
        from zmqps.metrics import Metrics, start_metrics_server

        kwargs["metrics"] = Metrics()
        start_metrics_server(kwargs["metrics"], "127.0.0.1", 0)
    if config.get("keys"):
        from zmqps.transport import SocketOptions, load_keys

        curve = load_keys(config["keys"], "worker", index, serve=False, connect=True)
        kwargs["options"] = SocketOptions(curve=curve)
    w = Worker(config["chief"], index=index, timeout=timeout, connect_timeout=timeout, **kwargs)
    try:
        hashed = bool(config.get("hashed"))
        variables = hashed_tables(wl) if hashed else list(wl.variables)
        placement = w.create_variables(variables, optimizer=wl.optimizer)
        if wl.suite == "sparse":
            steps = _sparse_steps(w, wl, int(config["seed"]), index, hashed)
        else:
            w.pull()  # sets up the data path before any timing
            steps = _dense_steps(w, wl)
        info = {"shards": [s.to_wire() for s in placement.shards], "transport": _transports(w)}
        serve_steps(ctl, steps, info)
    except BaseException:
        w.close("error")
        raise
    w.close("done")
