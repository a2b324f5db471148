"""Side (c): the PyTorch RPC parameter-server pattern (``torch.distributed.rpc``).

Rules of this module:

* Default backend and options (TensorPipe, ``TensorPipeRpcBackendOptions``)
  but for ``init_method``; world = the PS ranks (``ps0``..) + the worker ranks
  (``worker0``..). TensorPipe and Gloo are pinned to the loopback interface
  (``TP_SOCKET_IFNAME=lo``, ``GLOO_SOCKET_IFNAME=lo``).
* Rendezvous goes through a file (``init_method=file://...`` in the case's run
  folder), not ``tcp://127.0.0.1:PORT``: c10d's TCPStore server listens on
  every interface whatever host the URL names, and nothing here may listen
  beyond 127.0.0.1. The rendezvous only exchanges addresses; the data path is
  TensorPipe's default either way.
* Each PS holds its shards as separate tensors (the zmqps placement); workers
  call ``get_params`` / ``apply_grads`` (SGD in place under ``torch.no_grad``),
  or ``get_rows`` / ``apply_rows`` (``index_select`` / ``index_add_``).
  ``rpc_sync`` with one PS; ``rpc_async`` to every PS, then wait, with several.
* Updates on a PS are serialized by a lock, as zmqps' PS applies one push at a
  time; reads return the live tensors (RPC serializes them), the usual idiom.
* torch is imported only in these child processes: the coordinator never needs it.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from zmqps.bench.common import (
    Child,
    Control,
    Side,
    SideContext,
    child_argv,
    child_env,
    serve_steps,
)
from zmqps.bench.workload import Workload

__all__ = [
    "apply_grads",
    "apply_rows",
    "available",
    "get_params",
    "get_rows",
    "ps_main",
    "push_and_get",
    "spawn",
    "worker_main",
]

#: set in each PS process: {"shards": {sid: tensor}, "order": [sid...], "lr": float, "lock": Lock}
_PS: dict[str, Any] = {}

TORCH_ENV = {"TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}


def available() -> str | None:
    """None when torch with RPC can be imported here, else why not (cheap: no import)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install 'zmqps[bench]')"
    return None


def spawn(wl: Workload, ctx: SideContext) -> Side:
    store = ctx.run_dir / "torch-rendezvous"
    store.unlink(missing_ok=True)
    active = wl.active_ps()
    world = len(active) + ctx.workers
    env = child_env(TORCH_ENV)
    # TensorPipe's threads keep ~2/3 of a core busy per process even when idle:
    # paused between its runs, the torch side leaves the CPU to the side measured.
    side = Side("torch", wl.units_per_step, ctx.timeout, pause_idle=ctx.pause_idle)
    common = {"workload": wl.to_json(), "store": str(store), "world": world, "ps": active}
    for rank, ps in enumerate(active):
        path = ctx.write_config(f"torch-ps{ps}", {**common, "rank": rank, "index": ps})
        side.servers.append(
            Child(f"torch-ps{ps}", child_argv("torch", "ps", path), ctx.run_dir, env)
        )
    for i in range(ctx.workers):
        config = {
            **common,
            "rank": len(active) + i,
            "index": i,
            "seed": ctx.seed,
            "timeout": ctx.timeout,
        }
        path = ctx.write_config(f"torch-worker{i}", config)
        side.workers.append(
            Child(
                f"torch-worker{i}",
                child_argv("torch", "worker", path),
                ctx.run_dir,
                env,
                control=True,
            )
        )
    return side


def _options(store: str) -> Any:
    from torch.distributed import rpc

    return rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}")


# ---------------------------------------------------------------------- PS functions


def get_params() -> list[Any]:
    shards = _PS["shards"]
    return [shards[sid] for sid in _PS["order"]]


def apply_grads(grads: list[Any]) -> None:
    import torch

    shards, lr = _PS["shards"], _PS["lr"]
    with _PS["lock"], torch.no_grad():
        for sid, g in zip(_PS["order"], grads, strict=True):
            shards[sid].add_(g, alpha=-lr)


def push_and_get(grads: list[Any]) -> list[Any]:
    apply_grads(grads)
    return get_params()


def get_rows(parts: list[tuple[int, Any]]) -> list[Any]:
    shards = _PS["shards"]
    return [shards[sid].index_select(0, ids) for sid, ids in parts]


def apply_rows(parts: list[tuple[int, Any, Any]]) -> None:
    import torch

    shards, lr = _PS["shards"], _PS["lr"]
    with _PS["lock"], torch.no_grad():
        for sid, ids, g in parts:
            shards[sid].index_add_(0, ids, g, alpha=-lr)


def ps_main(config: dict[str, Any], ctl: Control | None) -> None:
    import torch
    from torch.distributed import rpc

    wl = Workload.from_json(config["workload"])
    ps = int(config["index"])
    mine = wl.shards_on(ps)
    _PS.update(
        shards={s.id: torch.zeros(wl.shard_shape(s), dtype=torch.float32) for s in mine},
        order=[s.id for s in mine],
        lr=wl.lr,
        lock=threading.Lock(),
    )
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        f"ps{ps}",
        rank=int(config["rank"]),
        world_size=int(config["world"]),
        rpc_backend_options=_options(config["store"]),
    )
    rpc.shutdown()  # serves until every worker has shut down too


# ---------------------------------------------------------------------- worker


def _call_all(fn: Any, args_by_ps: dict[int, tuple[Any, ...]]) -> list[Any]:
    """``fn`` on every PS: ``rpc_sync`` with one, ``rpc_async`` + wait with several."""
    from torch.distributed import rpc

    if len(args_by_ps) == 1:
        ((ps, args),) = args_by_ps.items()
        return [rpc.rpc_sync(f"ps{ps}", fn, args=args)]
    futs = [rpc.rpc_async(f"ps{ps}", fn, args=args) for ps, args in args_by_ps.items()]
    return [f.wait() for f in futs]


def _dense_steps(wl: Workload) -> dict[str, Callable[[], object]]:
    import torch

    grads = {
        ps: ([torch.full(wl.shard_shape(s), 1e-6) for s in wl.shards_on(ps)],)
        for ps in wl.active_ps()
    }
    none: dict[int, tuple[Any, ...]] = {ps: () for ps in wl.active_ps()}

    def pull_push() -> None:
        _call_all(get_params, none)
        _call_all(apply_grads, grads)

    def push_pull() -> None:
        _call_all(push_and_get, grads)

    return {"pull+push": pull_push, "push_pull": push_pull}


def _sparse_steps(wl: Workload, seed: int, index: int) -> dict[str, Callable[[], object]]:
    import torch

    var = wl.variables[0]
    shards = sorted(wl.shards, key=lambda s: s.row_start)
    starts = np.array([s.row_start for s in shards], dtype=np.int64)
    grads = torch.full((wl.batch_rows, *var.shape[1:]), 1e-3)
    out = torch.empty((wl.batch_rows, *var.shape[1:]))

    def rows(ids: Any) -> None:
        which = np.searchsorted(starts, ids, side="right") - 1
        pulls: dict[int, list[tuple[int, Any]]] = {}
        pushes: dict[int, list[tuple[int, Any, Any]]] = {}
        where = []
        for k, s in enumerate(shards):
            pos = np.flatnonzero(which == k)
            if not pos.size:
                continue
            local = torch.from_numpy(ids[pos] - s.row_start)
            tpos = torch.from_numpy(pos)
            pulls.setdefault(s.ps, []).append((s.id, local))
            pushes.setdefault(s.ps, []).append((s.id, local, grads[tpos]))
            where.append((s.ps, tpos))
        got = dict(
            zip(pulls, _call_all(get_rows, {p: (v,) for p, v in pulls.items()}), strict=True)
        )
        taken = dict.fromkeys(got, 0)
        for ps, tpos in where:  # rows back into the batch's order
            out[tpos] = got[ps][taken[ps]]
            taken[ps] += 1
        _call_all(apply_rows, {p: (v,) for p, v in pushes.items()})

    batches = itertools.cycle(wl.id_pool(seed, index))
    fresh = wl.fresh_ids(seed, index)
    return {"rows": lambda: rows(next(batches)), "fresh": lambda: rows(next(fresh))}


def worker_main(config: dict[str, Any], ctl: Control | None) -> None:
    from torch.distributed import rpc

    assert ctl is not None
    wl = Workload.from_json(config["workload"])
    index = int(config["index"])
    rpc.init_rpc(  # type: ignore[no-untyped-call]
        f"worker{index}",
        rank=int(config["rank"]),
        world_size=int(config["world"]),
        rpc_backend_options=_options(config["store"]),
    )
    if wl.suite == "sparse":
        steps = _sparse_steps(wl, int(config["seed"]), index)
    else:
        steps = _dense_steps(wl)
    serve_steps(ctl, steps, {"pid": os.getpid()})
    # Graceful: waits for every rank. After an error the child exits without it
    # (a graceful shutdown could wait forever) and the coordinator stops the rest.
    rpc.shutdown()
