"""A PyTorch nn.Module trained on a zmqps cluster: an MLP on the digits.

Start a chief and the PS with zmqps-server (no --model: the chief only
coordinates; add --mode sync or --mode ssp to the chief for those modes), then
one of these per worker:

    python examples/torch_mlp.py --chief 127.0.0.1:2222 --index 0 --workers 2

The loop is the same in every mode. The module's parameters are the PS's values:
they are pulled into it (as views of the worker's arrays, no copy), and its
gradients are pushed from ``p.grad``; the PS runs the optimizer. ``--device cuda``
trains on the GPU: the worker keeps the values on it (cupy, pip install
'zmqps[gpu]') and the module's CUDA parameters share that memory (DLPack).
``--devices cuda:0,cuda:1`` trains towers: one replica of the module per GPU, each
on --batch-size examples of the step, gradients summed on the first GPU and pushed
once (the worker is one replica with a larger batch).
"""

import argparse
import sys
from typing import Any

try:
    import torch
except ImportError:  # the quick start installs zmqps only
    sys.exit(
        "examples/torch_mlp.py needs PyTorch, which zmqps does not install: .venv/bin/pip"
        " install torch (a CPU build: add --index-url https://download.pytorch.org/whl/cpu)"
    )

import zmqps
from zmqps.adapters.torch import TorchModel
from zmqps.data import batches, load_digits, shard

#: The PS's optimizer. Momentum 0.5, not the usual 0.9: in async mode every gradient
#: is computed on values one or more updates old, and that staleness acts as extra
#: momentum (Mitliagkas et al. 2016, "Asynchrony begets momentum"). With 0.9 and
#: lr 0.1, two async workers make the model swing from update to update through the
#: second half of training (test accuracy anywhere from about 0.4 to 0.95), so a
#: worker that finishes while another still trains (one started later, or was slowed
#: by a busy machine) evaluates wherever the swing happens to be. With 0.5 every model
#: of the second half stays near 0.9 (tests/cluster/test_torch_example.py).
LR = 0.1
MOMENTUM = 0.5


def optimizer(lr: float = LR, momentum: float = MOMENTUM) -> dict[str, Any]:
    return {"name": "momentum", "lr": lr, "momentum": momentum}


def make_net(num_features: int, num_classes: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Linear(num_features, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, num_classes),
    )


def cross_entropy(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(net(x), y)


def main() -> None:
    p = argparse.ArgumentParser(description="a PyTorch MLP on a zmqps cluster")
    p.add_argument("--chief", required=True, metavar="HOST:PORT", help="the chief's address")
    p.add_argument("--index", type=int, default=0, help="this worker's index")
    p.add_argument("--workers", type=int, default=1, help="number of workers")
    p.add_argument("--epochs", type=int, default=10, help="passes over this worker's data")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=LR, help="the PS's learning rate")
    p.add_argument(
        "--momentum", type=float, default=MOMENTUM, help="the PS's momentum (see MOMENTUM)"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--devices", help="towers: one module replica per device, e.g. cuda:0,cuda:1")
    args = p.parse_args()
    towers = args.devices.split(",") if args.devices else None
    device = towers[0] if towers else args.device
    torch.set_num_threads(1)  # small batches: threads cost more than they bring

    train = shard(load_digits("train"), args.index, args.workers)
    test = load_digits("test")
    net = make_net(train.num_features, train.num_classes).to(device)

    with zmqps.Worker(args.chief, args.index, device=device) as worker:
        model = TorchModel(net, worker, devices=towers)
        batch_size = args.batch_size * len(model.replicas)
        # Every worker declares the same variables; the first call creates them.
        model.create(optimizer=optimizer(args.lr, args.momentum))
        for epoch in range(args.epochs):
            for x, y in batches(train, batch_size, epoch, seed=args.index):
                model.begin_step()  # sync: take a token; ssp: wait; then the step's values
                x_t, y_t = torch.from_numpy(x), torch.from_numpy(y)
                if towers:  # each replica on its slice, gradients summed into net's
                    loss = model.forward_backward(cross_entropy, x_t, y_t)
                else:
                    loss = cross_entropy(net, x_t.to(device), y_t.to(device))
                    loss.backward()
                model.push(loss=loss, examples=len(x))
        model.pull()  # the final values
        with torch.no_grad():
            predicted = net(torch.from_numpy(test.x).to(device)).argmax(dim=1).cpu().numpy()
        steps, updates = worker.step, worker.global_step
    accuracy = float((predicted == test.y).mean())
    print(
        f"worker {args.index}: test accuracy {accuracy:.4f} after {steps} steps"
        f" (global step {updates})"
    )


if __name__ == "__main__":
    main()
