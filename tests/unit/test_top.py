"""zmqps top: target files, quantiles, rates and the rendered view (one HTTP test)."""

from __future__ import annotations

import itertools
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


@pytest.mark.parametrize("page", [b"<!DOCTYPE HTML><html></html>", b"\xff\xfe not text"])
def test_scrape_of_a_page_that_is_not_metrics_says_so(page: bytes) -> None:
    """``zmqps top`` pointed at a web page (Grafana, Prometheus's UI) ended in a
    traceback: ``ValueError: invalid metric name:<!DOCTYPE HTML>``."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        s = scrape(Target("?", f"http://127.0.0.1:{server.server_port}/"))
        assert s.error.startswith("not Prometheus metrics"), s.error
        assert "/metrics" in s.error and not s.values
    finally:
        server.shutdown()
        server.server_close()


def _spans(line: str) -> list[tuple[int, int]]:
    """(start, end) offsets of the whitespace-separated words of ``line``, where a word
    may hold single spaces ("MB/s in"): columns are two spaces or more apart."""
    import re

    return [(m.start(), m.end()) for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_ps_table_header_lines_up_with_its_columns() -> None:
    """The header was written by hand and drifted off its columns; now each label spans
    the same offsets as its column: the address column starts with it, every number
    column ends with it (right-aligned), whatever the widths of the numbers."""
    urls = ["http://127.0.0.1:1/metrics", "http://10.0.0.100:65535/metrics"]
    before = {u: _sample("ps", u, 0.0, [("zmqps_requests_total", {}, 0.0)]) for u in urls}
    now = [
        _sample(
            "ps",
            urls[0],
            1.0,
            [("zmqps_requests_total", {}, 123456.0), ("zmqps_shard_bytes", {}, 5e9)],
        ),
        _sample("ps", urls[1], 1.0, [("zmqps_requests_total", {}, 3.0)]),
    ]
    lines = render(now, before).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("ps "))
    header, rows = lines[at], lines[at + 1 : at + 3]
    assert len(rows) == 2 and rows[0].startswith("10.0.0.100:65535")
    head = _spans(header)
    assert [header[a:b] for a, b in head] == [
        "ps",
        "requests/s",
        "MB/s in",
        "MB/s out",
        "updates/s",
        "shard MB",
    ]
    for row in rows:
        cells = _spans(row)
        assert len(cells) == len(head), row
        assert cells[0][0] == head[0][0]  # text column: same start
        for (_, h_end), (_, c_end) in zip(head[1:], cells[1:], strict=True):
            assert c_end == h_end, (header, row)  # number columns: same end
        for (_, prev_end), (start, _) in itertools.pairwise(cells):
            assert start >= prev_end + 2, row  # never run into the next column
    assert "123456.0" in rows[1] and "5000.0" in rows[1]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _run_top(answers: list[bool], interval: float = 1.0, iterations: int = 0):
    """zmqps top against one target whose scrapes succeed or fail as ``answers`` say
    (then fail for ever): (exit code, stdout, stderr, redraws)."""
    import io

    from zmqps.metrics.top import top

    target = Target("chief", "http://127.0.0.1:9/metrics")
    clock = _Clock()
    script = iter(answers)

    def fake_scrape(t: Target) -> Sample:
        s = Sample(t, clock.now)
        if not next(script, False):
            s.error = "[Errno 111] Connection refused"
        return s

    out, err = io.StringIO(), io.StringIO()
    code = top(
        [target],
        interval,
        iterations,
        scrape_one=fake_scrape,
        sleep=clock.sleep,
        clock=clock,
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue(), out.getvalue().count("zmqps top  ")


def test_top_ends_when_the_cluster_is_gone() -> None:
    """It redrew "Connection refused" for ever after the run ended."""
    code, out, err, redraws = _run_top([True, True, True])
    assert code == 0 and err == ""
    assert out.splitlines()[-1] == (
        "zmqps top: the cluster is gone: none of its 1 target answered for 5s"
        " (http://127.0.0.1:9/metrics: [Errno 111] Connection refused)"
    )
    # 2 redraws with answers, then failed ones: the one 5 s after the first failure ends it
    assert redraws == 2 + 5


def test_top_fails_when_nothing_ever_answered() -> None:
    code, _, err, redraws = _run_top([], interval=2.0)
    assert code == 1 and redraws == 2
    assert err == (
        "zmqps: error: top: none of the 1 target ever answered (6s;"
        " http://127.0.0.1:9/metrics: [Errno 111] Connection refused)\n"
    )


def test_top_waits_out_a_short_outage_and_honours_iterations() -> None:
    answers = [True, False, False, True] + [True] * 10
    code, out, err, redraws = _run_top(answers, iterations=8)
    assert (code, err, redraws) == (0, "", 8)
    assert "gone" not in out


def test_load_targets_takes_host_port_and_says_what_it_expects(tmp_path) -> None:
    import pytest

    from zmqps.wire.errors import ConfigError

    assert load_targets(["127.0.0.1:23461"]) == [Target("?", "http://127.0.0.1:23461/metrics")]
    with pytest.raises(ConfigError, match="expected a /metrics URL, HOST:PORT"):
        load_targets([str(tmp_path / "missing.json")])
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a Prometheus file_sd JSON"):
        load_targets([str(bad)])


def test_top_fails_when_iterations_end_before_any_answer() -> None:
    """--iterations 2 against targets that never answered exited 0."""
    code, _, err, redraws = _run_top([], iterations=2)
    assert (code, redraws) == (1, 2)
    assert err.startswith("zmqps: error: top: none of the 1 target ever answered")


def test_top_given_the_chief_alone_shows_the_workers_throughput_and_loss() -> None:
    """``zmqps top CHIEF_URL`` (the README's by-hand step) said "examples/s 0" and loss
    "-" while the run trained: examples were read from the workers' endpoints only.
    The chief exports what the workers' heartbeats said, and top reads it over a
    window of 5 s (each worker's count moves once per heartbeat: a rate over one
    redraw said 0, or twice the truth)."""
    import io

    from zmqps.metrics.top import top

    clock = _Clock()
    per_s = 6400.0  # two workers, 100 steps/s of 32 examples each

    def fake_scrape(t: Target) -> Sample:
        # the chief's count moves once per heartbeat round (every 2 s here)
        beats = int(clock.now // 2.0)
        return _sample(
            "chief",
            t.url,
            clock.now,
            [
                ("zmqps_global_step", {}, 200.0 * clock.now),
                ("zmqps_cluster_examples", {}, per_s * 2.0 * beats),
                ("zmqps_cluster_loss", {}, 0.125),
                ("zmqps_worker_examples_total", {}, 0.0),  # the chief's own: none
            ],
        )

    out = io.StringIO()
    code = top(
        [Target("?", "http://127.0.0.1:9/metrics")],
        1.0,
        12,
        scrape_one=fake_scrape,
        sleep=clock.sleep,
        clock=clock,
        out=out,
        err=io.StringIO(),
    )
    assert code == 0
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("examples/s")]
    assert len(lines) == 12
    rates = [float(ln.split()[1].replace(",", "")) for ln in lines]
    # once 5 s of samples are kept, every redraw is within a heartbeat of the truth
    assert all(abs(r - per_s) <= per_s * 2 / 5 for r in rates[5:]), rates
    assert all(r > 0 for r in rates[1:]), rates
    assert "loss (mean of workers) 0.1250   (from the chief: the workers' heartbeats)" in lines[-1]


def test_worker_endpoints_win_over_the_chiefs_count() -> None:
    chief = {
        "c": _sample("chief", "c", 0.0, [("zmqps_cluster_examples", {}, 0.0)]),
        "w": _sample("worker", "w", 0.0, [("zmqps_worker_examples_total", {}, 0.0)]),
    }
    now = [
        _sample("chief", "c", 1.0, [("zmqps_cluster_examples", {}, 999.0)]),
        _sample("worker", "w", 1.0, [("zmqps_worker_examples_total", {}, 320.0)]),
    ]
    text = render(now, chief)
    assert "examples/s 320" in text and "from the chief" not in text
    # no worker answered: the chief's count, said so
    text = render([now[0], Sample(Target("worker", "w"), 1.0, error="refused")], chief)
    assert "examples/s 999" in text and "(from the chief" in text
