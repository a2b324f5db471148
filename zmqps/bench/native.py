"""``python -m zmqps.bench.native``: the zmqps MLP trained by a plain PyTorch loop.

The baseline of :mod:`zmqps.bench.gpu`: what one device does with the model when no
parameter server is involved. The model is the one :class:`zmqps.models.MLP` builds
(``784 -> hidden... -> 10``, ReLU between, softmax cross-entropy averaged over the
batch, plain SGD), written the way a PyTorch user writes it: ``nn.Sequential`` of
``nn.Linear`` and ``nn.ReLU``, ``F.cross_entropy``, ``torch.optim.SGD``, float32.

Rules of this module:

* Synthetic data (4 batches made before timing, on the device, used in turn), as the
  zmqps workers of ``bench overlap`` / ``bench gpu`` train on.
* ``--warmup`` untimed steps first (kernel selection, allocator, lazy CUDA
  initialization), then ``--steps`` timed steps or ``--seconds``, whichever ends
  first; the device is synchronized before the clock starts and before it stops, so
  the figure is of finished work.
* The loss is not read on the host between steps (as an ordinary loop does) unless
  ``--read-loss``, which adds the per-step synchronization the zmqps loop has
  (it reads every step's loss as a float).
* float32 matmuls at full precision, as cupy computes them by default: TF32 off
  unless ``--tf32``.
* Output: one JSON line on stdout (an ``error`` key and exit code 1 on failure).
* torch is imported inside the functions only: ``import zmqps.bench.native`` works
  without it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from zmqps.bench.common import int_list

__all__ = ["mlp_flops_per_example", "mlp_parameters", "run_native"]

INPUT_DIM = 784
NUM_CLASSES = 10
#: distinct synthetic batches, used in turn
BATCHES = 4


def mlp_parameters(
    hidden: Sequence[int], inputs: int = INPUT_DIM, classes: int = NUM_CLASSES
) -> int:
    """Number of float parameters of the MLP (weights and biases)."""
    dims = (inputs, *hidden, classes)
    return sum(a * b + b for a, b in itertools.pairwise(dims))


def mlp_flops_per_example(
    hidden: Sequence[int], inputs: int = INPUT_DIM, classes: int = NUM_CLASSES
) -> int:
    """Matmul floating-point operations of one training example (forward + backward:
    ``2 * fan_in * fan_out`` per layer forward, twice that backward; the first layer
    computes no gradient of its input)."""
    dims = (inputs, *hidden, classes)
    layers = [2 * a * b for a, b in itertools.pairwise(dims)]
    return 3 * sum(layers) - layers[0]


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_native(
    device: str = "cuda",
    hidden: Sequence[int] = (4096, 4096),
    batch: int = 512,
    steps: int = 200,
    warmup: int = 20,
    seconds: float | None = None,
    lr: float = 0.01,
    threads: int | None = None,
    read_loss: bool = False,
    tf32: bool = False,
    seed: int = 0,
) -> dict[str, Any]:
    """Train the MLP for ``warmup`` + ``steps`` steps on ``device``; the timed figures."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    if threads is not None:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    torch.manual_seed(seed)
    dims = (INPUT_DIM, *hidden, NUM_CLASSES)
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(dims):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1]).to(dev)  # no ReLU after the output layer
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator(device=dev).manual_seed(seed)
    xs = [torch.rand((batch, INPUT_DIM), generator=gen, device=dev) for _ in range(BATCHES)]
    ys = [
        torch.randint(0, NUM_CLASSES, (batch,), generator=gen, device=dev) for _ in range(BATCHES)
    ]

    def step(i: int) -> Any:
        loss: Any = F.cross_entropy(model(xs[i % BATCHES]), ys[i % BATCHES])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for i in range(warmup):
        step(i)
    _sync(torch, dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    done = 0
    loss = None
    t0 = time.perf_counter()
    deadline = t0 + seconds if seconds else float("inf")
    while done < steps and time.perf_counter() < deadline:
        loss = step(warmup + done)
        if read_loss:
            loss.item()
        done += 1
    _sync(torch, dev)
    elapsed = time.perf_counter() - t0
    params = mlp_parameters(hidden)
    flops = mlp_flops_per_example(hidden) * batch * done
    rec: dict[str, Any] = {
        "bench": "native",
        "framework": "torch",
        "torch": torch.__version__,
        "device": str(dev),
        "hidden": list(hidden),
        "batch": batch,
        "parameters": params,
        "steps": done,
        "warmup": warmup,
        "seconds": round(elapsed, 6),
        "examples_per_second": batch * done / elapsed,
        "step_ms": 1000 * elapsed / max(1, done),
        "tflops": flops / elapsed / 1e12,
        "loss": None if loss is None else loss.item(),
        "read_loss": read_loss,
        "threads": torch.get_num_threads(),
    }
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        rec.update(
            gpu=props.name,
            cuda=torch.version.cuda,
            tf32=tf32,
            peak_memory_mb=torch.cuda.max_memory_allocated(dev) / 2**20,
        )
    return rec


def add_model_args(p: argparse.ArgumentParser, batch: int = 512) -> None:
    """The model's flags: ``--hidden`` (4096,4096) and ``--batch``."""
    p.add_argument(
        "--hidden",
        type=int_list,
        default=(4096, 4096),
        metavar="SIZES",
        help="hidden layer sizes, comma-separated (default: 4096,4096)",
    )
    p.add_argument("--batch", type=int, default=batch, help=f"examples per step (default: {batch})")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zmqps.bench.native",
        description="The zmqps MLP trained by a plain PyTorch loop on one device (no PS);"
        " prints one JSON line.",
        allow_abbrev=False,
    )
    p.add_argument("--device", default="cuda", help="torch device: cuda, cuda:N or cpu")
    add_model_args(p)
    p.add_argument("--steps", type=int, default=200, help="timed steps (default: 200)")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first (default: 20)")
    p.add_argument("--seconds", type=float, help="stop timing after this long, steps or not")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default: 0.01)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (cpu; default: torch's)")
    p.add_argument(
        "--read-loss",
        action="store_true",
        help="read the loss on the host every step (a synchronization, as zmqps' loop has)",
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (default: full fp32)")
    a = p.parse_args(argv)
    if a.batch < 1 or a.steps < 1 or a.warmup < 0 or (a.threads is not None and a.threads < 1):
        p.error("--batch, --steps, --threads must be >= 1 and --warmup >= 0")
    try:
        rec = run_native(
            a.device,
            a.hidden,
            a.batch,
            a.steps,
            a.warmup,
            seconds=a.seconds,
            lr=a.lr,
            threads=a.threads,
            read_loss=a.read_loss,
            tf32=a.tf32,
        )
    except Exception as exc:  # no torch, no such device, out of memory: one JSON line
        print(json.dumps({"bench": "native", "device": a.device, "error": repr(exc)}), flush=True)
        return 1
    print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
