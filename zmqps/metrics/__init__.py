"""Prometheus metrics of zmqps: the catalogue (declared once) and the /metrics exporter.

Layer map (this package depends on prometheus_client and nothing else of zmqps
except ``zmqps.version``; roles and the transport call into it, never the
other way round)::

    zmqps.metrics.catalogue   Metrics: every metric, declared once, on an
                              injectable CollectorRegistry (fresh per instance)
    zmqps.metrics.exporter    start_metrics_server: serve a registry over HTTP

Rules of this package:

* Names are prefixed ``zmqps_``, in base units (seconds, bytes); counters end
  in ``_total``; every metric has help text.
* Labels are bounded: ``op`` is one of the protocol's request ops, ``status``
  ``ok`` or an error code, ``variable`` a model variable name, ``phase`` one of
  pull / compute / push, ``reason`` one of :data:`DROP_REASONS`. Never ids,
  peers or worker incarnations.
* The global default registry is never used, so two nodes can live in one
  process and every test gets a fresh registry.
"""

from zmqps.metrics.catalogue import (
    AUTH_FAILURE_REASONS,
    DROP_REASONS,
    PHASES,
    SEAL_REFUSAL_REASONS,
    STALENESS_BUCKETS,
    Metrics,
)
from zmqps.metrics.exporter import MetricsServer, start_metrics_server

__all__ = [
    "AUTH_FAILURE_REASONS",
    "DROP_REASONS",
    "PHASES",
    "SEAL_REFUSAL_REASONS",
    "STALENESS_BUCKETS",
    "Metrics",
    "MetricsServer",
    "start_metrics_server",
]
