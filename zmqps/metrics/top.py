"""``zmqps top``: a live terminal view of a running cluster, from its /metrics endpoints.

For users without Grafana: it reads the same expositions Prometheus scrapes
(every ``--interval`` seconds), derives rates from the difference of two
scrapes, and prints step rate, examples/s, staleness quantiles, drops, and the
load of every PS. Targets are URLs, or the Prometheus file_sd JSON that
``zmqps launch --prometheus-targets FILE`` writes (labels ``job``: chief, ps,
worker). Plain text: the screen is redrawn only when stdout is a terminal. When no
target has answered for a while (:data:`GONE_REDRAWS` redraws and
:data:`GONE_SECONDS` seconds) it ends with one line: exit 0 when the cluster
answered before (its run is over), 1 when nothing ever answered.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from prometheus_client.parser import text_string_to_metric_families

from zmqps.wire.errors import ConfigError

__all__ = ["Sample", "Target", "load_targets", "render", "scrape", "table", "top"]


@dataclass(frozen=True)
class Target:
    job: str
    url: str


@dataclass
class Sample:
    """One scrape of one target: ``values[(name, labels)] = value``."""

    target: Target
    at: float
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    error: str = ""

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)

    def total(self, name: str, **match: str) -> float:
        """Sum of ``name`` over every label set containing ``match``."""
        return sum(
            v
            for (n, labels), v in self.values.items()
            if n == name and all((k, val) in labels for k, val in match.items())
        )


#: HOST:PORT, a target given as Prometheus writes it (``zmqps top 127.0.0.1:9100``)
_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def load_targets(items: Sequence[str]) -> list[Target]:
    """URLs (job guessed as "?"), HOST:PORT (its ``http://HOST:PORT/metrics``), or
    file_sd JSON files written by ``zmqps launch``; anything else is a
    :class:`ConfigError` that says what was expected."""
    out: list[Target] = []
    for item in items:
        if item.startswith(("http://", "https://")):
            out.append(Target("?", item))
            continue
        path = Path(item)
        if not path.exists() and _HOST_PORT.match(item):
            out.append(Target("?", f"http://{item}/metrics"))
            continue
        try:
            groups = json.loads(path.read_text())
            for group in groups:
                job = group.get("labels", {}).get("job", "?")
                for addr in group["targets"]:
                    out.append(Target(job, f"http://{addr}/metrics"))
        except OSError as exc:
            raise ConfigError(
                f"top: {item}: {exc.strerror or exc} (expected a /metrics URL, HOST:PORT, or"
                " the file_sd JSON of zmqps launch --prometheus-targets)"
            ) from None
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ConfigError(
                f"top: {item}: not a Prometheus file_sd JSON file (a list of"
                ' {"targets": [...], "labels": {...}})'
            ) from None
    return out


#: the most of a page read (a zmqps exporter's is a few hundred KB at most)
MAX_PAGE_BYTES = 32 << 20


def scrape(target: Target, timeout: float = 2.0) -> Sample:
    sample = Sample(target, time.monotonic())
    try:
        with urllib.request.urlopen(target.url, timeout=timeout) as resp:
            text = resp.read(MAX_PAGE_BYTES + 1)
    except (OSError, ValueError) as exc:
        # urllib's URLError wraps the socket error: "[Errno 111] Connection refused"
        sample.error = str(getattr(exc, "reason", None) or exc)
        return sample
    try:
        if len(text) > MAX_PAGE_BYTES:
            raise ValueError(f"a page of more than {MAX_PAGE_BYTES} bytes")
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                sample.values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    except (ValueError, TypeError, IndexError) as exc:  # a web page, not an exporter's
        sample.values.clear()
        sample.error = (
            f"not Prometheus metrics ({str(exc)[:80]}): point zmqps top at a task's"
            " /metrics, e.g. http://127.0.0.1:9100/metrics"
        )
        return sample
    if target.job == "?":
        for (name, labels), _ in sample.values.items():
            if name == "zmqps_info":
                role = dict(labels).get("role")
                if role:
                    sample.target = Target(role, target.url)
                break
    return sample


def _rate(now: Sample, before: Sample | None, name: str, **match: str) -> float:
    if before is None or now.at <= before.at:
        return 0.0
    return max(0.0, now.total(name, **match) - before.total(name, **match)) / (now.at - before.at)


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus-style histogram_quantile over (le, cumulative count) pairs."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _staleness_buckets(
    now: Iterable[Sample], before: dict[str, Sample]
) -> list[tuple[float, float]]:
    """Bucket counts of staleness observed between the two scrapes, over every PS."""
    acc: dict[float, float] = {}
    for s in now:
        old = before.get(s.target.url)
        for (name, labels), v in s.values.items():
            if name != "zmqps_gradient_staleness_bucket":
                continue
            le = float(dict(labels)["le"])
            prev = old.values.get((name, labels), 0.0) if old else 0.0
            acc[le] = acc.get(le, 0.0) + max(0.0, v - prev)
    return sorted(acc.items())


#: seconds a rate from the chief's heartbeat-fed counts spans at least: each worker's
#: count moves once per heartbeat (1 s), so a rate over one redraw said 0 or twice it
CHIEF_RATE_WINDOW_S = 5.0


def render(
    now: list[Sample], before: dict[str, Sample], older: dict[str, Sample] | None = None
) -> str:
    """The view of ``now``, with rates since ``before`` (the last redraw's samples);
    ``older``: samples of up to :data:`CHIEF_RATE_WINDOW_S` ago (default ``before``),
    for the figures the chief has from heartbeats."""
    older = before if older is None else older
    by_job: dict[str, list[Sample]] = {}
    for s in now:
        by_job.setdefault(s.target.job, []).append(s)

    def prev(s: Sample) -> Sample | None:
        return before.get(s.target.url)

    chiefs = by_job.get("chief", [])
    chief = chiefs[0] if chiefs else None
    lines = [f"zmqps top  {time.strftime('%H:%M:%S')}  ({len(now)} targets)"]
    if chief is not None and not chief.error:
        lines.append(
            f"global step {chief.get('zmqps_global_step'):.0f}"
            f"   step rate {_rate(chief, prev(chief), 'zmqps_global_step'):.1f}/s"
            f"   workers alive {chief.get('zmqps_workers_alive'):.0f}"
            f"   tokens {chief.get('zmqps_sync_tokens_available'):.0f}"
        )
    workers = [s for s in by_job.get("worker", []) if not s.error]
    examples = sum(_rate(s, prev(s), "zmqps_worker_examples_total") for s in workers)
    losses = [s.get("zmqps_train_loss") for s in workers]
    loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
    source = ""
    if not workers and chief is not None and not chief.error:
        # no worker's endpoint among the targets (zmqps top CHIEF_URL): what the
        # workers' heartbeats told the chief
        examples = _rate(chief, older.get(chief.target.url), "zmqps_cluster_examples")
        mean = chief.values.get(("zmqps_cluster_loss", ()), math.nan)
        loss = "-" if math.isnan(mean) else f"{mean:.4f}"
        source = "   (from the chief: the workers' heartbeats)"
    lines.append(f"examples/s {examples:,.0f}   loss (mean of workers) {loss}{source}")
    pss = [s for s in by_job.get("ps", []) if not s.error]
    buckets = _staleness_buckets(pss, before)
    q = [_quantile(x, buckets) for x in (0.5, 0.9, 0.99)]
    stale = " / ".join("-" if math.isnan(v) else f"{v:.1f}" for v in q)
    drops = sum(_rate(s, prev(s), "zmqps_gradients_dropped_total") for s in pss)
    lines.append(f"staleness p50 / p90 / p99 {stale} steps   dropped {drops:.1f}/s")
    rows = []
    for s in sorted(pss, key=lambda s: s.target.url):
        p = prev(s)
        rows.append(
            [
                s.target.url.split("//")[1].split("/")[0],
                f"{_rate(s, p, 'zmqps_requests_total'):.1f}",
                f"{_rate(s, p, 'zmqps_bytes_received_total') / 1e6:.1f}",
                f"{_rate(s, p, 'zmqps_bytes_sent_total') / 1e6:.1f}",
                f"{_rate(s, p, 'zmqps_updates_applied_total'):.1f}",
                f"{s.get('zmqps_shard_bytes') / 1e6:.1f}",
            ]
        )
    lines += table(PS_COLUMNS, rows)
    for s in now:
        if s.error:
            lines.append(f"{s.target.job} {s.target.url}: {s.error}")
    return "\n".join(lines)


#: The PS table's header; the first column is text (left-aligned), the others numbers.
PS_COLUMNS = ("ps", "requests/s", "MB/s in", "MB/s out", "updates/s", "shard MB")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Header and rows in columns two spaces apart, each as wide as its widest cell:
    the first column left-aligned, the others (numbers) right-aligned, header included,
    so every header label spans the same offsets as the cells under it."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    return [line(header), *(line(r) for r in rows)]


#: ``zmqps top`` ends when no target has answered for this many redraws AND seconds.
GONE_REDRAWS = 3
GONE_SECONDS = 5.0


def top(
    targets: list[Target],
    interval: float = 1.0,
    iterations: int = 0,
    *,
    scrape_one: Callable[[Target], Sample] = scrape,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Redraw every ``interval`` seconds; ``iterations`` > 0 stops after that many.

    When no target has answered for :data:`GONE_REDRAWS` redraws and
    :data:`GONE_SECONDS` seconds, it stops with one line instead of redrawing the
    errors for ever: exit 0 when the cluster answered before (the run is over),
    1 when no target ever answered (a wrong address, or nothing running)."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    first = [scrape_one(t) for t in targets]
    before: dict[str, Sample] = {s.target.url: s for s in first}
    # each target's answered samples of the last CHIEF_RATE_WINDOW_S, oldest first
    history: dict[str, list[Sample]] = {s.target.url: [s] for s in first if not s.error}
    reached = any(not s.error for s in first)
    down_since: float | None = None if reached else clock()
    down_redraws = 0
    tty = out.isatty()
    n = 0
    while iterations <= 0 or n < iterations:
        sleep(interval)
        now = [scrape_one(t) for t in targets]
        if any(not s.error for s in now):
            reached, down_since, down_redraws = True, None, 0
        else:
            down_since = clock() if down_since is None else down_since
            down_redraws += 1
            gone_for = clock() - down_since
            if down_redraws >= GONE_REDRAWS and gone_for >= GONE_SECONDS:
                return _gone(now, reached, gone_for, out, err)
        text = render(now, before, _window_starts(history, now))
        print(("\033[H\033[J" if tty else "") + text + ("" if tty else "\n"), file=out, flush=True)
        before = {s.target.url: s for s in now}
        n += 1
    if not reached:  # --iterations ran out before any target ever answered
        return _gone(list(before.values()), reached, clock() - (down_since or clock()), out, err)
    return 0


def _window_starts(history: dict[str, list[Sample]], now: list[Sample]) -> dict[str, Sample]:
    """Each target's sample that a rate over the last :data:`CHIEF_RATE_WINDOW_S` starts
    from (the oldest kept, at most that old), with ``now`` added to ``history``."""
    starts: dict[str, Sample] = {}
    for s in now:
        kept = history.setdefault(s.target.url, [])
        if s.error:
            continue
        while len(kept) > 1 and s.at - kept[1].at >= CHIEF_RATE_WINDOW_S:
            kept.pop(0)
        if kept:
            starts[s.target.url] = kept[0]
        kept.append(s)
    return starts


def _gone(now: list[Sample], reached: bool, seconds: float, out: TextIO, err: TextIO) -> int:
    n = len(now)
    targets = f"{n} target{'s' * (n != 1)}"
    if reached:
        print(
            f"zmqps top: the cluster is gone: none of its {targets} answered for {seconds:.0f}s"
            f" ({now[0].target.url}: {now[0].error})",
            file=out,
            flush=True,
        )
        return 0
    print(
        f"zmqps: error: top: none of the {targets} ever answered ({seconds:.0f}s;"
        f" {now[0].target.url}: {now[0].error})",
        file=err,
        flush=True,
    )
    return 1


def main_args(args: Any) -> int:
    targets = load_targets(args.targets)
    if not targets:
        raise SystemExit("zmqps top: no targets")
    return top(targets, args.interval, args.iterations)
