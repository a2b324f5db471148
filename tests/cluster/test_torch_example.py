"""examples/torch_mlp.py (a PyTorch nn.Module through zmqps.adapters.torch) on a real cluster."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from helpers import Reaper, addresses, read_json, script

pytest.importorskip("torch", reason="PyTorch is not installed (pip install zmqps[torch])")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch_mlp.py"
EPOCHS = 10


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_torch_mlp_example(procs: Reaper, tmp_path: Path, mode: str) -> None:
    chief, ps, w0, w1 = addresses(4)
    cluster = {"chief": [chief], "ps": [ps], "worker": [w0, w1]}
    summary = tmp_path / "summary.json"

    def tf_config(task_type: str) -> dict[str, str]:
        return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type}})}

    server = script("zmqps-server")
    chief_p = procs.spawn(
        [server, "--mode", mode, "--summary", str(summary)], name="chief", env=tf_config("chief")
    )
    ps_p = procs.spawn([server], name="ps0", env=tf_config("ps"))
    argv = [sys.executable, str(EXAMPLE), "--chief", chief, "--workers", "2"]
    workers = [
        procs.spawn([*argv, "--index", str(i), "--epochs", str(EPOCHS)], name=f"worker{i}")
        for i in (0, 1)
    ]
    steps = []
    for w in workers:
        w.expect_exit(0, timeout=80)
        found = re.search(r"worker \d: test accuracy (\S+) after (\d+) steps", w.stdout)
        assert found, w.tail()
        assert float(found[1]) >= 0.85, w.stdout  # about 0.95; async runs vary
        steps.append(int(found[2]))
    chief_p.expect_exit(0, timeout=30)
    ps_p.expect_exit(0, timeout=30)
    result = read_json(summary)
    # 1438 training digits, halved: 719 each, 23 batches of 32 an epoch
    assert steps == [23 * EPOCHS, 23 * EPOCHS]
    assert result["examples"] == 1438 * EPOCHS
    if mode == "async":
        assert result["global_step"] == sum(steps)
    else:
        assert result["global_step"] == 23 * EPOCHS  # one update per step of both


@pytest.mark.timeout(60)
def test_sync_workers_in_threads_match_single_process_sgd(procs: Reaper, tmp_path: Path) -> None:
    """The oracle of tests/unit/test_torch_adapter.py with real Workers over TCP."""
    import threading

    import numpy as np
    import torch

    import zmqps
    from zmqps.adapters.torch import TorchModel, variables_of
    from zmqps.core.initializers import initialize

    chief, ps, w0, w1 = addresses(4)
    cluster = {"chief": [chief], "ps": [ps], "worker": [w0, w1]}

    def tf_config(task_type: str) -> dict[str, str]:
        return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type}})}

    server = script("zmqps-server")
    chief_p = procs.spawn([server, "--mode", "sync"], name="chief", env=tf_config("chief"))
    ps_p = procs.spawn([server], name="ps0", env=tf_config("ps"))

    steps, lr = 20, 0.5
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.normal(size=(32, 64)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, size=32))

    def mlp() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)
        )

    finals: dict[int, dict[str, np.ndarray]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            net = mlp()
            with zmqps.Worker(chief, i, steps_planned=steps) as worker:
                model = TorchModel(net, worker)
                model.create({"name": "sgd", "lr": lr})
                for step in range(steps):
                    assert model.begin_step() == step
                    xi, yi = x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16]
                    torch.nn.functional.cross_entropy(net(xi), yi).backward()
                    assert model.push(examples=len(xi))
                while worker.global_step < steps:  # sync: wait until the last step is applied
                    worker.begin_step(poll=1.0)
                model.pull()
                finals[i] = {n: p.detach().numpy().copy() for n, p in net.named_parameters()}
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors, errors

    reference = mlp()
    with torch.no_grad():
        for v in variables_of(reference):
            init = initialize(v.init, v.name, v.shape, v.dtype, 0, v.shape[0])
            reference.get_parameter(v.name).copy_(torch.from_numpy(init))
    sgd = torch.optim.SGD(reference.parameters(), lr=lr)
    for _ in range(steps):
        sgd.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        sgd.step()
    for i in (0, 1):
        for n, p in reference.named_parameters():
            np.testing.assert_allclose(finals[i][n], p.detach().numpy(), rtol=1e-5, atol=1e-6)
    chief_p.expect_exit(0, timeout=30)
    ps_p.expect_exit(0, timeout=30)
