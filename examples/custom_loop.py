"""Your own numpy model on a zmqps cluster: linear regression y = X w + b.

Start a chief and the PS with zmqps-server (no --model: the chief only
coordinates), then one of these per worker:

    python examples/custom_loop.py --chief 127.0.0.1:2222 --index 0 --workers 2
"""

import argparse

import numpy as np

import zmqps


def main() -> None:
    p = argparse.ArgumentParser(description="linear regression on a zmqps cluster")
    p.add_argument("--chief", required=True, metavar="HOST:PORT", help="the chief's address")
    p.add_argument("--index", type=int, default=0, help="this worker's index")
    p.add_argument("--workers", type=int, default=1, help="number of workers")
    p.add_argument("--steps", type=int, default=300, help="steps of this worker")
    args = p.parse_args()

    # Every worker makes the same data (same seed) and trains on its own rows of it.
    rng = np.random.default_rng(0)
    true_w = rng.normal(size=(8, 1)).astype(np.float32)
    x = rng.normal(size=(4000, 8)).astype(np.float32)
    y = x @ true_w + 0.5 + 0.01 * rng.normal(size=(4000, 1)).astype(np.float32)
    x, y = x[args.index :: args.workers], y[args.index :: args.workers]

    with zmqps.Worker(args.chief, args.index) as worker:
        # Every worker declares the same variables; the first call creates them.
        worker.create_variables(
            [zmqps.VariableDef("w", (8, 1)), zmqps.VariableDef("b", (1,))],
            optimizer={"name": "sgd", "lr": 0.1},
        )
        # Steps go by the worker's position (the batches done so far): a PS lost and
        # restored from a checkpoint takes back the steps after it, take_rewind() puts
        # the position back there, and those batches (the same ones: each is drawn from
        # its position) are trained again. finish() waits for the run's end, and returns
        # a position to go on from when a restore took the last steps back.
        while True:
            while worker.position < args.steps:
                worker.begin_step()  # sync: take a token; ssp: wait for the staleness bound
                params = worker.pull()
                worker.take_rewind()
                at = np.random.default_rng((args.index, worker.position))
                i = at.integers(0, len(x), size=32)
                err = x[i] @ params["w"] + params["b"] - y[i]
                grads = {"w": 2 * x[i].T @ err / len(i), "b": 2 * err.mean(axis=0)}
                worker.push(grads, loss=float(np.mean(err**2)), examples=len(i))
            params = worker.pull()
            loss = float(np.mean((x @ params["w"] + params["b"] - y) ** 2))
            if worker.finish() is None:
                break
    print(f"worker {args.index}: final loss {loss:.6f} after {args.steps} steps")


if __name__ == "__main__":
    main()
