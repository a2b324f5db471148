"""Serve a registry's exposition at ``/metrics`` over HTTP, in a daemon thread.

A tiny IO adapter over :func:`prometheus_client.make_wsgi_app`: it binds where it
is told (loopback unless told otherwise), accepts port 0 and reports the bound
address, and can be closed (tests start many).
"""

from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

from zmqps.metrics.catalogue import Metrics

__all__ = ["POLL_S", "MetricsServer", "start_metrics_server"]

#: how often the serving thread looks for :meth:`MetricsServer.close` (socketserver's
#: default, 0.5 s, made every process end half a second late)
POLL_S = 0.05


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes every few seconds would flood stderr


class MetricsServer:
    """A running exporter; ``host``/``port`` are where it is bound."""

    def __init__(self, metrics: Metrics, host: str = "127.0.0.1", port: int = 0) -> None:
        app = make_wsgi_app(metrics.registry)
        self._httpd = make_server(host, port, app, _Server, handler_class=_QuietHandler)
        self.host: str = self._httpd.server_address[0]  # type: ignore[assignment]
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": POLL_S},
            name=f"zmqps-metrics-{self.port}",
            daemon=True,
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5.0)


def start_metrics_server(
    metrics: Metrics, host: str = "127.0.0.1", port: int = 0
) -> tuple[str, int]:
    """Serve ``metrics`` at ``http://host:port/metrics``; returns the bound (host, port).

    Use :class:`MetricsServer` directly to be able to stop it.
    """
    server = MetricsServer(metrics, host, port)
    return server.host, server.port
