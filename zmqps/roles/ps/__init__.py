"""The parameter-server role.

service.py      PSService: the op table, generations, pushes planned then committed
modes.py        the consistency mode as a strategy: Apply (async, ssp), Accumulate (sync)
regions.py      shared-memory regions workers attached (same-host fast path)
checkpoints.py  snapshot, write and restore this PS's shards
slots.py        PSSlots: the PS states one process serves (its own, those it backs up)
replica.py      a state's copies: the primary ships what it applied, backups apply it
serve.py        the PS as a process (server, metrics, signals)
"""

from zmqps.roles.configs import PSConfig
from zmqps.roles.ps.serve import ps_slots, run_ps, serve_ps
from zmqps.roles.ps.service import PSService

__all__ = ["PSConfig", "PSService", "ps_slots", "run_ps", "serve_ps"]
