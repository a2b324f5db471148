"""zmqps top: target files, quantiles, rates and the rendered view (one HTTP test)."""

from __future__ import annotations

import json
import math

import pytest

from zmqps.metrics import Metrics, MetricsServer
from zmqps.metrics.top import Sample, Target, _quantile, load_targets, render, scrape


def test_quantile_interpolates_like_histogram_quantile() -> None:
    buckets = [(1.0, 50.0), (2.0, 100.0), (math.inf, 100.0)]
    assert _quantile(0.5, buckets) == pytest.approx(1.0)
    assert _quantile(0.75, buckets) == pytest.approx(1.5)
    assert math.isnan(_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]))
    assert _quantile(0.99, [(1.0, 0.0), (math.inf, 10.0)]) == 1.0  # in the +Inf bucket


def test_load_targets_reads_file_sd_and_urls(tmp_path) -> None:
    f = tmp_path / "targets.json"
    f.write_text(
        json.dumps(
            [
                {"targets": ["127.0.0.1:9001"], "labels": {"job": "chief"}},
                {"targets": ["127.0.0.1:9002", "127.0.0.1:9003"], "labels": {"job": "ps"}},
            ]
        )
    )
    targets = load_targets([str(f), "http://127.0.0.1:9004/metrics"])
    assert [t.job for t in targets] == ["chief", "ps", "ps", "?"]
    assert targets[1].url == "http://127.0.0.1:9002/metrics"


def _sample(job: str, url: str, at: float, values: list) -> Sample:
    s = Sample(Target(job, url), at)
    for name, labels, v in values:
        s.values[(name, tuple(sorted(labels.items())))] = v
    return s


def test_render_derives_rates_between_two_scrapes() -> None:
    ps_url = "http://127.0.0.1:1/metrics"
    push = {"op": "push", "status": "ok"}
    le1 = {"variable": "w", "le": "1.0"}
    inf = {"variable": "w", "le": "+Inf"}
    before = {
        "c": _sample("chief", "c", 0.0, [("zmqps_global_step", {}, 100.0)]),
        ps_url: _sample(
            "ps",
            ps_url,
            0.0,
            [
                ("zmqps_requests_total", push, 10.0),
                ("zmqps_gradient_staleness_bucket", le1, 0.0),
                ("zmqps_gradient_staleness_bucket", inf, 0.0),
            ],
        ),
        "w": _sample("worker", "w", 0.0, [("zmqps_worker_examples_total", {}, 0.0)]),
    }
    now = [
        _sample(
            "chief", "c", 2.0, [("zmqps_global_step", {}, 300.0), ("zmqps_workers_alive", {}, 2.0)]
        ),
        _sample(
            "ps",
            ps_url,
            2.0,
            [
                ("zmqps_requests_total", push, 50.0),
                ("zmqps_gradient_staleness_bucket", le1, 10.0),
                ("zmqps_gradient_staleness_bucket", inf, 10.0),
            ],
        ),
        _sample(
            "worker",
            "w",
            2.0,
            [("zmqps_worker_examples_total", {}, 640.0), ("zmqps_train_loss", {}, 0.25)],
        ),
    ]
    text = render(now, before)
    assert "global step 300" in text and "step rate 100.0/s" in text
    assert "examples/s 320" in text and "0.2500" in text
    assert "20.0" in text  # 40 requests in 2 s on the PS
    assert "staleness p50 / p90 / p99 0.5 / 0.9 / 1.0 steps" in text


def test_scrape_reads_a_live_exporter() -> None:
    m = Metrics()
    m.set_info("ps", 0, "async")
    m.updates_applied.inc(7)
    server = MetricsServer(m, "127.0.0.1", 0)
    try:
        s = scrape(Target("?", f"http://{server.host}:{server.port}/metrics"))
        assert not s.error
        assert s.target.job == "ps"  # learned from zmqps_info
        assert s.total("zmqps_updates_applied_total") == 7.0
    finally:
        server.close()
