"""``zmqps bench``: zmqps against raw pyzmq and the PyTorch RPC parameter server.

Layer map (this package sits below cli/, which runs it, and above coordinator/
and roles/, which it measures; it starts PS and chief as ``zmqps server``)::

    suites.py      argument parsing, the coordinator, tables and JSON       (parent)
      │
    common.py      stats, machine info, child processes and their control
      │            pipe (JSON lines), the start barrier, cleanup
      ├── zmqps_side.py  chief + PS daemons (``python -m zmqps server``) and
      │                  workers on :class:`zmqps.Worker`
      ├── raw_zmq.py     blocking pyzmq ROUTER servers / DEALER clients moving
      │                  the same frames (the transport limit)
      └── torch_rpc.py   ``torch.distributed.rpc`` PS pattern (optional: torch)
    workload.py    the suites' workloads, shard layout and frame sizes (pure)
    child.py       ``python -m zmqps.bench.child SIDE ROLE CONFIG``: the entry
                   point of every benchmark child process

Rules of this package:

* Every side runs the same workload in separate OS processes on 127.0.0.1 only.
* The coordinator never measures: workers time their own steps between a
  shared start instant (CLOCK_MONOTONIC is system-wide on Linux) and report
  ``t0``/``t1``; aggregate throughput is total work / (last t1 - first t0).
* Nothing here imports torch unless the torch side runs; nothing here changes
  zmqps' data path.
"""

__all__: list[str] = []
