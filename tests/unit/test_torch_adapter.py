"""zmqps.adapters.torch against in-memory clusters (FakeNetwork + real PS and chief code).

The adapter talks to anything shaped like :class:`zmqps.Worker`; here :class:`MemWorker`
plays one over a :class:`ParameterClient` on one persistent event loop (async mode: the
in-memory PS of test_ps_client; sync mode: the chief's real sync driver of test_sync).

The oracle: 2 workers in sync mode, each computing the gradient of the mean loss over
its half of a global batch, train exactly like single-process ``torch.optim.SGD`` on
the whole global batch (the PS applies the mean of the two gradients).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch is not installed (pip install zmqps[torch])")

from test_ps_client import Cluster, initial, make_cluster  # noqa: E402
from test_sync import SyncJob, sync_job  # noqa: E402

from zmqps.adapters.torch import (  # noqa: E402
    DLPackBridge,
    TorchModel,
    grads_of,
    pull_into,
    push_grads,
    variables_of,
)
from zmqps.core.variables import Placement, VariableDef  # noqa: E402
from zmqps.roles.client import ParameterClient  # noqa: E402

T = TypeVar("T")
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu)"),
]
LR = 0.5
SGD = {"name": "sgd", "lr": LR}


class MemWorker:
    """The Worker API over an in-memory cluster, driven from synchronous code."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: ParameterClient,
        *,
        job: SyncJob | None = None,
        index: int = 0,
    ) -> None:
        self.loop, self.client, self.job, self.index = loop, client, job, index
        self.mode = "async" if job is None else "sync"
        self.token: int | None = None
        self.pushes: list[tuple[float | None, int | None]] = []

    def _run(self, coro: Awaitable[T]) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 10.0))

    def create_variables(
        self, variables: Sequence[VariableDef], optimizer: Mapping[str, Any] | None = None
    ) -> Placement:
        assert [v.name for v in variables] == [v.name for v in self.client.placement.variables]
        return self.client.placement

    def begin_step(self, poll: float = 10.0) -> int:
        if self.job is None:
            return len(self.pushes)
        self.token = self._run(self.job.token(self.index, wait=poll))
        return self.token

    def pull(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        return self._run(self.client.pull(names))

    def push(
        self, grads: Mapping[str, Any], *, loss: float | None = None, examples: int | None = None
    ) -> bool:
        self.pushes.append((loss, examples))
        return self._run(self.client.push(grads, step=self.token))

    def push_pull(
        self, grads: Mapping[str, Any], *, loss: float | None = None, examples: int | None = None
    ) -> dict[str, np.ndarray]:
        self.pushes.append((loss, examples))
        self._run(self.client.push(grads, pull=True, step=self.token))
        return self.client.params


@pytest.fixture
def loop() -> Any:
    lp = asyncio.new_event_loop()
    yield lp
    lp.run_until_complete(asyncio.sleep(0))
    lp.close()


def mlp(seed: int = 0, dtype: Any = None) -> Any:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    return net if dtype is None else net.to(dtype)


def values(net: Any) -> dict[str, np.ndarray]:
    return {n: p.detach().cpu().numpy().copy() for n, p in net.named_parameters()}


def global_batch(n: int = 32) -> tuple[Any, Any]:
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.normal(size=(n, 64)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, size=n))
    return x, y


# ---------------------------------------------------------------- variables


def test_variables_of_names_shapes_dtypes_and_torch_like_inits() -> None:
    net = torch.nn.Sequential(
        torch.nn.Embedding(50, 8),
        torch.nn.Conv1d(8, 4, 3),
        torch.nn.LayerNorm(4),
        torch.nn.Linear(4, 2),
    )
    net.register_parameter("scale", torch.nn.Parameter(torch.tensor(2.5)))
    vs = {v.name: v for v in variables_of(net, prefix="m/", seed=3)}
    assert list(vs) == [
        "m/scale",
        "m/0.weight",
        "m/1.weight",
        "m/1.bias",
        "m/2.weight",
        "m/2.bias",
        "m/3.weight",
        "m/3.bias",
    ]
    assert vs["m/0.weight"].shape == (50, 8) and vs["m/1.weight"].shape == (4, 8, 3)
    assert vs["m/scale"].shape == (1,)
    assert {v.dtype for v in vs.values()} == {"float32"}
    assert vs["m/0.weight"].init == {"name": "normal", "mean": 0.0, "stddev": 1.0, "seed": 3}
    conv = 1 / np.sqrt(8 * 3)  # PyTorch's fan_in of a (out, in, k) weight: in * k
    for n in ("m/1.weight", "m/1.bias"):
        assert vs[n].init == {"name": "uniform", "low": -conv, "high": conv, "seed": 3}
    assert vs["m/2.weight"].init == {"name": "constant", "value": 1.0}
    assert vs["m/2.bias"].init == {"name": "constant", "value": 0.0}
    lin = 1 / np.sqrt(4)
    assert vs["m/3.bias"].init == {"name": "uniform", "low": -lin, "high": lin, "seed": 3}
    assert vs["m/scale"].init == {"name": "constant", "value": 2.5}
    # PyTorch's own init lies within the bounds zmqps draws from
    assert float(net[3].weight.detach().abs().max()) <= lin
    assert float(net[1].bias.detach().abs().max()) <= conv


def test_variables_of_dtypes_and_custom_init() -> None:
    net = mlp(dtype=torch.float64)
    vs = variables_of(net, init=lambda name, p: {"name": "zeros"} if "bias" in name else None)
    assert {v.dtype for v in vs} == {"float64"}
    assert [v.init["name"] for v in vs] == ["uniform", "zeros", "uniform", "zeros"]
    with pytest.raises(TypeError, match="not supported"):
        variables_of(torch.nn.Linear(2, 2).to(torch.bfloat16))


# ---------------------------------------------------------------- async round trip


def test_pull_into_and_push_grads_round_trip(loop: asyncio.AbstractEventLoop) -> None:
    net = mlp()
    variables = variables_of(net)
    cluster: Cluster = loop.run_until_complete(
        make_cluster(variables, num_ps=2, num_shards=3, optimizer=SGD)
    )
    worker = MemWorker(loop, cluster.client())
    pull_into(net, worker)
    arrays = worker.client.params
    for v in variables:
        p = net.get_parameter(v.name)
        np.testing.assert_array_equal(p.detach().numpy(), initial(v))
        assert p.data_ptr() == arrays[v.name].ctypes.data  # zero-copy: the worker's buffer

    x, y = global_batch()
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in net.named_parameters()}
    sent = grads_of(net)
    for n, p in net.named_parameters():
        assert sent[n].ctypes.data == p.grad.data_ptr()  # pushed as views, no copy
    assert push_grads(net, worker, loss=loss, examples=len(x), pull=True)
    assert worker.pushes == [(pytest.approx(loss.item()), len(x))]
    for v in variables:
        expected = initial(v) - LR * grads[v.name]
        np.testing.assert_allclose(cluster.shard_values(v.name), expected, rtol=1e-6)
        p = net.get_parameter(v.name)
        np.testing.assert_array_equal(p.detach().numpy(), cluster.shard_values(v.name))
        assert p.grad is None
        assert p.data_ptr() == worker.client.params[v.name].ctypes.data

    # a later pull refreshes the very same storage: the module sees it with no rebinding
    cluster.services[0].store.get(0).values[...] += 1.0
    before = {n: p.data_ptr() for n, p in net.named_parameters()}
    pull_into(net, worker)
    assert {n: p.data_ptr() for n, p in net.named_parameters()} == before
    first = cluster.placement.shards[0]
    np.testing.assert_array_equal(
        net.get_parameter(first.var).detach().numpy(), cluster.shard_values(first.var)
    )


def test_copy_mode_unused_parameters_and_float64(loop: asyncio.AbstractEventLoop) -> None:
    net = mlp(dtype=torch.float64)
    net.add_module("unused", torch.nn.Linear(3, 2).double())
    variables = variables_of(net)
    cluster: Cluster = loop.run_until_complete(make_cluster(variables, num_ps=1, optimizer=SGD))
    worker = MemWorker(loop, cluster.client())
    model = TorchModel(net, worker, zero_copy=False)
    model.create(SGD)
    for v in variables:
        p = net.get_parameter(v.name)
        assert p.dtype == torch.float64
        assert p.data_ptr() != worker.client.params[v.name].ctypes.data  # a copy
        np.testing.assert_array_equal(p.detach().numpy(), initial(v))
    x, _ = global_batch()
    model.begin_step()
    net[:3](x.double()).logsumexp(1).mean().backward()  # not through unused
    assert net.unused.weight.grad is None
    assert model.push(loss=1.5, examples=3)
    assert worker.pushes == [(1.5, 3)]
    np.testing.assert_array_equal(
        cluster.shard_values("unused.weight"), initial(variables[-2])
    )  # a zero gradient for a parameter the step did not use
    for v in variables:
        np.testing.assert_array_equal(
            net.get_parameter(v.name).detach().numpy(), cluster.shard_values(v.name)
        )


# ---------------------------------------------------------------- the sync oracle


def _cross_entropy(net: Any, x: Any, y: Any) -> Any:
    return torch.nn.functional.cross_entropy(net(x), y)


@pytest.mark.parametrize(
    "towers",
    [
        pytest.param([], id="one-device"),
        pytest.param(["cpu", "cpu"], id="towers-cpu"),
        pytest.param(["cpu"] * 3, id="towers-uneven"),
        pytest.param(["cuda:0", "cuda:0"], id="towers-cuda", marks=GPU),
    ],
)
def test_two_sync_workers_match_single_process_sgd_on_the_global_batch(
    loop: asyncio.AbstractEventLoop, towers: list[str]
) -> None:
    """With towers, each worker's half of the global batch is cut again, one slice
    per replica: still single-process SGD on the global batch."""
    steps, n = 20, 2
    net = mlp(seed=1)
    variables = variables_of(net, seed=5)
    job: SyncJob = loop.run_until_complete(
        sync_job(n, 2, variables=variables, optimizer=SGD, num_shards=2)
    )
    models = [
        TorchModel(
            mlp(seed=10 + i),
            MemWorker(loop, job.workers[i], job=job, index=i),
            seed=5,
            devices=towers or None,
        )
        for i in range(n)
    ]
    assert all(len(m.replicas) == max(1, len(towers)) for m in models)
    for m in models:
        m.create(SGD)

    # the single-process reference starts from the same (seeded) initial values
    reference = copy.deepcopy(net)
    with torch.no_grad():
        for v in variables:
            reference.get_parameter(v.name).copy_(torch.from_numpy(initial(v)))
    sgd = torch.optim.SGD(reference.parameters(), lr=LR)
    x, y = global_batch(32)
    half = len(x) // n

    for step in range(steps):
        for i, m in enumerate(models):
            assert m.begin_step(poll=5.0) == step
            xi, yi = x[i * half : (i + 1) * half], y[i * half : (i + 1) * half]
            if towers:
                loss = m.forward_backward(_cross_entropy, xi, yi)
                assert all(p.grad is None for r in m.replicas[1:] for p in r.parameters())
            else:
                loss = _cross_entropy(m.module, xi, yi)
                loss.backward()
            assert m.push(loss=loss, examples=len(xi))
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        sgd.step()
    loop.run_until_complete(asyncio.sleep(0.05))

    expected = values(reference)
    assert job.step == steps
    for name, want in expected.items():
        np.testing.assert_allclose(job.values(name), want, rtol=1e-5, atol=1e-6)
    models[0].pull()
    for replica in models[0].replicas:  # the pull reached every tower
        for name, got in values(replica).items():
            np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=1e-6)
    moved = max(float(np.abs(expected[v.name] - initial(v)).max()) for v in variables)
    assert moved > 0.05  # the steps did move the model
    loop.run_until_complete(job.close())


def test_dlpack_bridge_shares_memory_both_ways() -> None:
    """The bridge a GPU worker uses, run on the host device: no copies either way."""
    from zmqps.device import Device

    bridge = DLPackBridge(Device())
    grad = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    a = bridge.to_push(grad)
    assert isinstance(a, np.ndarray) and a.shape == (2, 3)
    assert a.ctypes.data == grad.data_ptr()  # a view of the gradient
    assert bridge.to_push(torch.tensor(2.5)).shape == (1,)  # scalars travel as (1,)
    # a transposed gradient is made contiguous first (the wire sends C order)
    np.testing.assert_array_equal(bridge.to_push(grad.t()), grad.t().numpy())

    param = torch.nn.Parameter(torch.zeros(2, 3))
    pulled = np.full((2, 3), 1.5, np.float32)
    bridge.load(param, pulled)
    assert param.data.data_ptr() == pulled.ctypes.data  # the pulled array is its storage
    pulled[...] = 4.0  # a later pull refreshes it in place
    assert float(param.data.sum()) == 24.0
    other = np.full((2, 3), 7.0, np.float64)  # another dtype: copied in
    bridge.load(param, other)
    assert param.dtype == torch.float32 and float(param.data.sum()) == 42.0
