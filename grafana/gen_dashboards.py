#!/usr/bin/env python3
"""Regenerate grafana/dashboards/*.json (the shipped JSON is the source of truth
that Grafana loads; this script is how it was written). Run from anywhere:

    python grafana/gen_dashboards.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
#: A query variable: name, label, label_values query, multi-select.
Var = tuple[str, str, str, bool]


def _templating(extra: list[Var] | None = None) -> dict[str, Any]:
    lst: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Prometheus",
            "type": "datasource",
            "query": "prometheus",
            "current": {"text": "zmqps Prometheus", "value": "zmqps-prometheus"},
            "hide": 0,
            "refresh": 1,
            "regex": "",
        }
    ]
    for name, label, query, multi in extra or []:
        lst.append(
            {
                "name": name,
                "label": label,
                "type": "query",
                "datasource": DS,
                "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "definition": None,
                "current": {"text": "All", "value": "$__all"},
                "includeAll": True,
                "allValue": ".*",
                "multi": multi,
                "refresh": 2,
                "sort": 1,
                "hide": 0,
            }
        )
    for v in lst:
        v.pop("definition", None)
    return {"list": lst}


class Builder:
    def __init__(self) -> None:
        self.panels: list[dict[str, Any]] = []
        self.next_id = 1
        self.x = 0
        self.y = 0
        self.row_h = 0

    def _pos(self, w: int, h: int) -> dict[str, Any]:
        if self.x + w > 24:
            self.x = 0
            self.y += self.row_h
            self.row_h = 0
        pos = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def row(self, title: str) -> None:
        if self.x:
            self.x = 0
            self.y += self.row_h
            self.row_h = 0
        self.panels.append(
            {
                "type": "row",
                "id": self.next_id,
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
            }
        )
        self.next_id += 1
        self.y += 1

    def panel(
        self,
        title: str,
        targets: list[tuple[str, str]],
        *,
        unit: str = "short",
        kind: str = "timeseries",
        w: int = 12,
        h: int = 8,
        description: str = "",
        fmt: str | None = None,
        thresholds: list[tuple[str, float | None]] | None = None,
        overrides: list[dict[str, Any]] | None = None,
    ) -> None:
        tg = []
        for i, (expr, legend) in enumerate(targets):
            t = {
                "refId": chr(ord("A") + i),
                "datasource": DS,
                "expr": expr,
                "legendFormat": legend,
                "range": kind != "stat",
                "instant": kind == "stat",
            }
            if fmt:
                t["format"] = fmt
            tg.append(t)
        defaults: dict[str, Any] = {"unit": unit}
        if thresholds:
            defaults["thresholds"] = {
                "mode": "absolute",
                "steps": [{"color": c, "value": v} for c, v in thresholds],
            }
        p: dict[str, Any] = {
            "type": kind,
            "id": self.next_id,
            "title": title,
            "datasource": DS,
            "gridPos": self._pos(w, h),
            "targets": tg,
            "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        }
        if description:
            p["description"] = description
        if kind == "timeseries":
            p["options"] = {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        elif kind == "stat":
            p["options"] = {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value",
                "graphMode": "area",
                "textMode": "auto",
            }
        elif kind == "heatmap":
            p["options"] = {
                "calculate": False,
                "cellGap": 1,
                "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                "yAxis": {"unit": unit},
                "tooltip": {"mode": "single", "yHistogram": True},
                "legend": {"show": True},
            }
        self.panels.append(p)
        self.next_id += 1


def dashboard(
    uid: str, title: str, desc: str, b: Builder, extra_vars: list[Var] | None = None
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": desc,
        "tags": ["zmqps"],
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s",
        "templating": _templating(extra_vars),
        "annotations": {"list": []},
        "links": [
            {
                "title": "zmqps",
                "type": "dashboards",
                "tags": ["zmqps"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "panels": b.panels,
    }


def overview() -> dict[str, Any]:
    b = Builder()
    b.row("Progress")
    b.panel("Global step", [('max(zmqps_global_step{job="chief"})', "step")], kind="stat", w=4, h=5)
    b.panel(
        "Step rate (steps/s)",
        [('max(deriv(zmqps_global_step{job="chief"}[$__rate_interval]))', "global step")],
        kind="stat",
        unit="ops",
        w=4,
        h=5,
    )
    b.panel(
        "Examples/s",
        [(f'sum(rate(zmqps_worker_examples_total{{job="worker"}}[{RI}]))', "examples/s")],
        kind="stat",
        unit="short",
        w=4,
        h=5,
    )
    b.panel(
        "Workers alive",
        [('max(zmqps_workers_alive{job="chief"})', "alive")],
        kind="stat",
        w=4,
        h=5,
        thresholds=[("red", None), ("green", 1)],
    )
    b.panel(
        "Sync tokens available",
        [('max(zmqps_sync_tokens_available{job="chief"})', "tokens")],
        kind="stat",
        w=4,
        h=5,
    )
    b.panel(
        "Last checkpoint step",
        [('max(zmqps_checkpoint_last_step{job="chief"})', "step")],
        kind="stat",
        w=4,
        h=5,
    )
    b.row("Throughput")
    b.panel(
        "Training throughput (examples/s)",
        [(f'sum(rate(zmqps_worker_examples_total{{job="worker"}}[{RI}]))', "all workers")],
        unit="short",
    )
    b.panel(
        "Step rate",
        [
            (f'max(deriv(zmqps_global_step{{job="chief"}}[{RI}]))', "global step/s (chief)"),
            (
                f'sum(rate(zmqps_updates_applied_total{{job="ps"}}[{RI}]))',
                "updates applied/s (all PS)",
            ),
        ],
        unit="ops",
        description="Global-step rate from the chief's gauge, and optimizer applications "
        "summed over every PS (one per variable shard per step).",
    )
    b.row("Staleness and dropped gradients")
    b.panel(
        "Gradient staleness quantiles (steps)",
        [
            (
                f"histogram_quantile({q}, sum by (le) "
                f'(rate(zmqps_gradient_staleness_bucket{{job="ps"}}[{RI}])))',
                f"p{int(q * 100)}",
            )
            for q in (0.5, 0.9, 0.99)
        ],
        unit="none",
    )
    b.panel(
        "Gradient staleness distribution",
        [(f'sum by (le) (rate(zmqps_gradient_staleness_bucket{{job="ps"}}[{RI}]))', "{{le}}")],
        kind="heatmap",
        unit="none",
        fmt="heatmap",
    )
    b.panel(
        "Dropped gradients by reason",
        [
            (
                f'sum by (reason) (rate(zmqps_gradients_dropped_total{{job="ps"}}[{RI}]))',
                "{{reason}}",
            ),
            (f'sum(rate(zmqps_gradients_dropped_total{{job="ps"}}[{RI}])) or vector(0)', "total"),
        ],
        unit="ops",
        description="Pushes a PS acknowledged or refused without applying (duplicate, stale, "
        "fenced, invalid, rolled_back: made before a restore, nonfinite: NaN or infinity). "
        "The per-reason series exist only once a push was dropped.",
    )
    b.panel(
        "Non-finite gradients refused",
        [
            (
                "sum by (instance) (increase(zmqps_gradients_dropped_total"
                f'{{job="ps", reason="nonfinite"}}[{RI}]))',
                "{{instance}}",
            ),
            (
                'sum(zmqps_gradients_dropped_total{job="ps", reason="nonfinite"}) or vector(0)',
                "total since start",
            ),
        ],
        unit="none",
        description="Pushes whose gradients held NaN or infinity, refused by each PS before "
        "anything changed (the workers skipped those steps; their logs name the step and its "
        "loss). Alert: NonFiniteGradients. A run ends failed when the share of such steps "
        "passes --max-nonfinite-share.",
    )
    b.panel(
        "Sync tokens and wait",
        [
            ('max(zmqps_sync_tokens_available{job="chief"})', "tokens available"),
            (
                f"histogram_quantile(0.99, sum by (le) "
                f'(rate(zmqps_sync_token_wait_seconds_bucket{{job="chief"}}[{RI}])))',
                "token wait p99 (s)",
            ),
        ],
        unit="short",
    )
    b.row("Model and cluster")
    b.panel(
        "Train loss",
        [
            ('avg(zmqps_train_loss{job="worker"})', "mean over workers"),
            ('min(zmqps_train_loss{job="worker"})', "min"),
            ('max(zmqps_train_loss{job="worker"})', "max"),
        ],
    )
    b.panel(
        "Workers alive / scrape targets up",
        [
            ('max(zmqps_workers_alive{job="chief"})', "workers alive (chief's view)"),
            ('sum by (job) (up{job=~"chief|ps|worker|evaluator"})', "targets up: {{job}}"),
            ('max(zmqps_ps_down{job="chief"})', "PS the chief cannot reach"),
        ],
    )
    checkpoints_and_evaluation(b)
    replication(b)
    elastic(b)
    return dashboard(
        "zmqps-overview",
        "zmqps / Overview",
        "Cluster-wide training progress, throughput, staleness and loss; checkpoints, "
        "recovery and evaluation; replication and elastic PS.",
        b,
    )


#: The evaluator's gauges read 0 until its first evaluation: keep them out until then.
EVALUATED = ' and on() max(zmqps_evaluations_total{job="evaluator"}) > 0'
#: A CTR job's evaluator sets zmqps_eval_auc (above 0) and leaves the accuracy at 0;
#: other jobs the reverse: each panel shows the one the job has.
EVAL_AUC = f'max(zmqps_eval_auc{{job="evaluator"}}) > 0{EVALUATED}'
EVAL_ACCURACY = (
    'max(zmqps_eval_accuracy{job="evaluator"})'
    f' unless on() max(zmqps_eval_auc{{job="evaluator"}}) > 0{EVALUATED}'
)


def auc_override(ref_id: str) -> list[dict[str, Any]]:
    """The AUC query (``ref_id``) as a plain number, next to an accuracy in percent."""
    return [
        {
            "matcher": {"id": "byFrameRefID", "options": ref_id},
            "properties": [{"id": "unit", "value": "none"}, {"id": "decimals", "value": 3}],
        }
    ]


def checkpoints_and_evaluation(b: Builder) -> None:
    b.row("Checkpoints, recovery and evaluation")
    b.panel(
        "Steps since last checkpoint",
        [
            (
                'max(zmqps_global_step{job="chief"})'
                ' - max(zmqps_checkpoint_last_step{job="chief"})',
                "steps",
            )
        ],
        kind="stat",
        w=4,
        h=5,
        description="Global steps a lost PS would cost (sync mode): the chief's global step "
        "minus the step of the last committed checkpoint.",
    )
    b.panel(
        "Generation (restores)",
        [('max(zmqps_generation{job="chief"})', "generation")],
        kind="stat",
        w=4,
        h=5,
        thresholds=[("green", None), ("orange", 1)],
        description="Cluster-wide restores of every shard to a committed checkpoint so far.",
    )
    b.panel(
        "Recoveries",
        [('max(zmqps_recovery_seconds_count{job="chief"})', "recoveries")],
        kind="stat",
        w=4,
        h=5,
        thresholds=[("green", None), ("orange", 1)],
        description="Lost PS the chief recovered from since it started.",
    )
    b.panel(
        "Evaluation accuracy / AUC",
        [(EVAL_ACCURACY, "accuracy"), (EVAL_AUC, "AUC")],
        kind="stat",
        unit="percentunit",
        w=4,
        h=5,
        overrides=auc_override("B"),
        description="Test accuracy of the last model the evaluator scored; for a CTR job "
        "(--model ctr) its AUC instead.",
    )
    b.panel(
        "Evaluated step",
        [('max(zmqps_eval_step{job="evaluator"})', "step")],
        kind="stat",
        w=4,
        h=5,
    )
    b.panel(
        "Evaluations",
        [('max(zmqps_evaluations_total{job="evaluator"})', "evaluations")],
        kind="stat",
        w=4,
        h=5,
    )
    b.panel(
        "Global, checkpoint and evaluated step",
        [
            ('max(zmqps_global_step{job="chief"})', "global step"),
            ('max(zmqps_checkpoint_last_step{job="chief"})', "last checkpoint"),
            (f'max(zmqps_eval_step{{job="evaluator"}}){EVALUATED}', "last evaluated"),
        ],
        description="How far the last committed checkpoint and the last evaluated model trail "
        "training. After a restore the global step (sync mode) drops back to the checkpoint's.",
    )
    b.panel(
        "Checkpoint duration",
        [
            (
                f"histogram_quantile({q}, sum by (le) "
                f'(rate(zmqps_checkpoint_duration_seconds_bucket{{job="chief"}}[{RI}])))',
                f"p{int(q * 100)}",
            )
            for q in (0.5, 0.9)
        ],
        unit="s",
        description="Time to write one checkpoint (snapshot on every PS to commit); "
        "empty while no checkpoint was written in the interval.",
    )
    b.panel(
        "Checkpoints committed / failed",
        [
            (
                f'sum by (status) (rate(zmqps_checkpoints_total{{job="chief"}}[{RI}])) * 60',
                "{{status}}",
            )
        ],
        unit="opm",
        w=8,
        description="Checkpoints per minute by status. A failed one leaves the previous "
        "committed checkpoint as the latest.",
    )
    b.panel(
        "Generation and restores",
        [
            ('max(zmqps_generation{job="chief"})', "generation"),
            ('sum by (reason) (zmqps_restores_total{job="chief"})', "restores: {{reason}}"),
        ],
        w=8,
        description="The cluster's generation (restores so far, kept across chief restarts) "
        "and this chief's restores by reason (start: resumed from a checkpoint; ps: a PS was "
        "lost; chief: the PS disagreed after a chief restart).",
    )
    b.panel(
        "Recovery time",
        [
            (
                'max(zmqps_recovery_seconds_sum{job="chief"}) '
                '/ max(zmqps_recovery_seconds_count{job="chief"})',
                "mean since chief start",
            ),
            (
                "histogram_quantile(0.9, sum by (le) "
                f'(rate(zmqps_recovery_seconds_bucket{{job="chief"}}[{RI}])))',
                "p90 (recent)",
            ),
        ],
        unit="s",
        w=8,
        description="From detecting a lost PS to training resumed on restored shards; "
        "empty until a recovery happened.",
    )
    b.panel(
        "Evaluation accuracy / AUC over time",
        [(EVAL_ACCURACY, "test accuracy"), (EVAL_AUC, "test AUC")],
        unit="percentunit",
        overrides=auc_override("B"),
        description="Test-split accuracy of each model the evaluator scored (a new committed "
        "checkpoint, or a snapshot of the PS), for a CTR job its AUC; the value holds until "
        "the next evaluation.",
    )
    b.panel(
        "Evaluation loss over time",
        [
            (f'max(zmqps_eval_loss{{job="evaluator"}}){EVALUATED}', "test loss"),
            ('avg(zmqps_train_loss{job="worker"})', "train loss (mean over workers)"),
        ],
        description="Test-split loss of the last evaluated model (a CTR job: the log loss), "
        "next to the workers' training loss.",
    )


def replication(b: Builder) -> None:
    """The chief's view of the copies of the PS states (``--replication R``)."""
    b.row("Replication")
    b.panel(
        "PS states short of copies",
        [('max(zmqps_states_under_replicated{job="chief"})', "states")],
        kind="stat",
        w=6,
        thresholds=[("green", None), ("red", 1)],
        description="PS states with fewer copies than --replication (after a fail-over, "
        "until a copy is made again): one more PS death there costs a restore.",
    )
    b.panel(
        "Fail-overs and promotions",
        [
            ('max(zmqps_failovers_total{job="chief"})', "fail-overs"),
            ('max(zmqps_promotions_total{job="chief"})', "copies promoted"),
        ],
        w=6,
        description="PS processes found dead or restarted whose states a copy took over "
        "(no restore), and the copies promoted to primary.",
    )
    b.panel(
        "Copies made again",
        [
            ('sum by (outcome) (zmqps_state_copies_total{job="chief"})', "{{outcome}}"),
            ('max(zmqps_state_copy_progress_ratio{job="chief"})', "copy under way (share sent)"),
        ],
        w=6,
        description="Copies of PS states made while training to bring each back to "
        "--replication copies, by outcome, and how far the copy under way is.",
    )
    b.panel(
        "Last fail-over duration",
        [('max(zmqps_failover_last_seconds{job="chief"})', "seconds")],
        unit="s",
        w=6,
        description="From the chief deciding a PS is gone to the new placement published "
        "(fence, promote); detection itself takes up to the heartbeat timeout.",
    )


def elastic(b: Builder) -> None:
    """The chief's view of the PS states moving between PS processes (``zmqps scale``,
    ``zmqps launch --ps-schedule``)."""
    b.row("Elastic PS")
    b.panel(
        "PS serving / asked for",
        [
            ('max(zmqps_ps_serving{job="chief"})', "PS serving states"),
            ('max(zmqps_ps_asked{job="chief"})', "PS asked for"),
            ('max(zmqps_ps_drained{job="chief"})', "PS drained"),
        ],
        w=6,
        description="PS processes serving the PS states, the number asked for (zmqps "
        "scale --ps N; as started: those serving) and those drained (left without "
        "states, told to shut down). Serving differs from asked while states move, or "
        "while a PS asked for is not up.",
    )
    b.panel(
        "Move under way",
        [
            ('max(zmqps_ps_move_in_progress{job="chief"})', "a state moving"),
            ('max(zmqps_ps_move_progress_ratio{job="chief"})', "its copy (share sent)"),
        ],
        unit="percentunit",
        w=6,
        description="1 (100%) while a PS state moves between PS processes (one at a "
        "time), and how much of its copy was sent; the hand-over follows once the copy "
        "is in sync.",
    )
    b.panel(
        "Moves and bytes moved",
        [
            ('sum by (outcome) (zmqps_ps_moves_total{job="chief"})', "moves {{outcome}}"),
            ('max(zmqps_ps_moved_bytes_total{job="chief"})', "bytes moved"),
        ],
        w=6,
        overrides=[
            {
                "matcher": {"id": "byFrameRefID", "options": "B"},
                "properties": [
                    {"id": "unit", "value": "bytes"},
                    {"id": "custom.axisPlacement", "value": "right"},
                ],
            }
        ],
        description="Moves of PS states since the chief started, by outcome (failed: "
        "given up, the state stays where it was), and the bytes of the states' copies "
        "sent to their new processes.",
    )
    b.panel(
        "Placement epoch",
        [('max(zmqps_placement_epoch{job="chief"})', "epoch")],
        w=6,
        description="The placement's epoch: it rises with each change of the processes "
        "serving the PS states (a move, a fail-over, a copy made); workers follow it "
        "through their heartbeats.",
    )


def ps() -> dict[str, Any]:
    sel = 'job="ps", instance=~"$instance"'
    b = Builder()
    b.row("Requests")
    b.panel(
        "Request rate by op",
        [
            (
                f"sum by (instance, op) (rate(zmqps_requests_total{{{sel}}}[{RI}]))",
                "{{instance}} {{op}}",
            )
        ],
        unit="reqps",
    )
    b.panel(
        "Requests by op and status",
        [
            (
                f"sum by (instance, op, status) (rate(zmqps_requests_total{{{sel}}}[{RI}]))",
                "{{instance}} {{op}} {{status}}",
            )
        ],
        unit="reqps",
        description="status is ok or the error code the PS answered with.",
    )
    b.panel(
        "Latency p50 by op",
        [
            (
                f"histogram_quantile(0.5, sum by (instance, op, le) "
                f"(rate(zmqps_request_duration_seconds_bucket{{{sel}}}[{RI}])))",
                "{{instance}} {{op}}",
            )
        ],
        unit="s",
    )
    b.panel(
        "Latency p99 by op",
        [
            (
                f"histogram_quantile(0.99, sum by (instance, op, le) "
                f"(rate(zmqps_request_duration_seconds_bucket{{{sel}}}[{RI}])))",
                "{{instance}} {{op}}",
            )
        ],
        unit="s",
    )
    b.row("Traffic and updates")
    b.panel(
        "Bytes in / out",
        [
            (
                f"sum by (instance) (rate(zmqps_bytes_received_total{{{sel}}}[{RI}]))",
                "{{instance}} in",
            ),
            (
                f"sum by (instance) (rate(zmqps_bytes_sent_total{{{sel}}}[{RI}]))",
                "{{instance}} out",
            ),
        ],
        unit="Bps",
    )
    b.panel(
        "Updates applied/s",
        [(f"sum by (instance) (rate(zmqps_updates_applied_total{{{sel}}}[{RI}]))", "{{instance}}")],
        unit="ops",
    )
    b.row("Memory")
    b.panel(
        "Shard bytes / resident memory",
        [
            (f"sum by (instance) (zmqps_shard_bytes{{{sel}}})", "{{instance}} shards"),
            (f"process_resident_memory_bytes{{{sel}}}", "{{instance}} RSS"),
        ],
        unit="bytes",
        w=24,
        description="Bytes held by each PS's shards (values and optimizer slots) and, when "
        "the process collector is exported, the process's resident memory.",
    )
    b.row("Replication")
    b.panel(
        "Replication lag (seconds)",
        [
            (
                f"max by (instance, state) (zmqps_replication_lag_seconds{{{sel}}})",
                "{{instance}} state {{state}}",
            )
        ],
        unit="s",
        description="Per PS state this process is the primary of: how long the oldest update "
        "not yet on every in-sync backup has waited (its push is answered once they have "
        "it). 0 when every copy has everything.",
    )
    b.panel(
        "Replication lag (updates) / states served",
        [
            (
                f"max by (instance, state, backup) (zmqps_replication_lag_updates{{{sel}}})",
                "{{instance}} state {{state}} -> ps {{backup}}",
            ),
            (f"sum by (instance) (zmqps_state_primary{{{sel}}})", "{{instance}} primary of"),
        ],
        description="Updates each backup has not acknowledged yet (a copy joining catches "
        "up from its copy's point), and how many PS states each process serves as primary "
        "(more than one after a fail-over).",
    )
    b.row("Staleness")
    b.panel(
        "Staleness p99 by variable (steps)",
        [
            (
                f"histogram_quantile(0.99, sum by (variable, le) "
                f'(rate(zmqps_gradient_staleness_bucket{{{sel}, variable=~"$variable"}}[{RI}])))',
                "{{variable}}",
            )
        ],
        unit="none",
    )
    b.panel(
        "Dropped gradients by reason",
        [
            (
                f"sum by (instance, reason) (rate(zmqps_gradients_dropped_total{{{sel}}}[{RI}]))",
                "{{instance}} {{reason}}",
            ),
            (f"sum(rate(zmqps_gradients_dropped_total{{{sel}}}[{RI}])) or vector(0)", "total"),
        ],
        unit="ops",
    )
    return dashboard(
        "zmqps-ps",
        "zmqps / Parameter servers",
        "Per-PS load: request rate and latency by op, traffic, updates, memory, staleness.",
        b,
        extra_vars=[
            (
                "instance",
                "PS instance",
                'label_values(zmqps_requests_total{job="ps"}, instance)',
                True,
            ),
            (
                "variable",
                "Variable",
                'label_values(zmqps_gradient_staleness_bucket{job="ps"}, variable)',
                True,
            ),
        ],
    )


def worker() -> dict[str, Any]:
    sel = 'job="worker", instance=~"$instance"'
    b = Builder()
    b.row("Step time")
    for q in (0.5, 0.99):
        b.panel(
            f"Step time p{int(q * 100)} by phase",
            [
                (
                    f"histogram_quantile({q}, sum by (phase, le) "
                    f"(rate(zmqps_worker_step_seconds_bucket{{{sel}}}[{RI}])))",
                    "{{phase}}",
                )
            ],
            unit="s",
        )
    b.panel(
        "Mean step time by phase (stacked)",
        [
            (
                f"sum by (phase) (rate(zmqps_worker_step_seconds_sum{{{sel}}}[{RI}])) / "
                f"sum by (phase) (rate(zmqps_worker_step_seconds_count{{{sel}}}[{RI}]))",
                "{{phase}}",
            )
        ],
        unit="s",
    )
    b.panel(
        "Communication hidden behind compute",
        [(f"zmqps_worker_overlap_ratio{{{sel}}}", "{{instance}}")],
        unit="percentunit",
    )
    b.row("Throughput and loss")
    b.panel(
        "Examples/s per worker",
        [(f"sum by (instance) (rate(zmqps_worker_examples_total{{{sel}}}[{RI}]))", "{{instance}}")],
        unit="short",
    )
    b.panel("Loss per worker", [(f"zmqps_train_loss{{{sel}}}", "{{instance}}")])
    b.panel(
        "Steps/s per worker",
        [
            (
                f"sum by (instance) "
                f'(rate(zmqps_worker_step_seconds_count{{{sel}, phase="compute"}}[{RI}]))',
                "{{instance}}",
            )
        ],
        unit="ops",
        w=24,
    )
    return dashboard(
        "zmqps-worker",
        "zmqps / Workers",
        "Per-worker step time by phase (pull / h2d / compute / d2h / push), overlap,"
        " throughput and loss.",
        b,
        extra_vars=[
            (
                "instance",
                "Worker instance",
                'label_values(zmqps_worker_examples_total{job="worker"}, instance)',
                True,
            )
        ],
    )


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, fn in (("zmqps-overview", overview), ("zmqps-ps", ps), ("zmqps-worker", worker)):
        (OUT / f"{name}.json").write_text(json.dumps(fn(), indent=2) + "\n")


if __name__ == "__main__":
    main()
