"""The Grafana dashboard and Prometheus alert rules under deploy/observability/ name only
metrics the control plane exports, and the rules are valid (promtool when installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from tests.controlplane.conftest import ROOT, Api

FOLDER = ROOT / "deploy" / "observability"
METRIC = re.compile(r"\b(tether_[a-z0-9_]+)\b")
# Each rule file and its promtool unit tests.
RULE_FILES = {"alerts.yml": "alerts.test.yml", "convergence-slo.yml": "convergence-slo.test.yml"}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported_names(api: Api) -> set[str]:
    """Every series name the running app's registry can export, read from the registry."""
    registry = api.client.app.state.cp.metrics.registry
    names = set()
    for family in registry.collect():
        names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def dashboard_exprs() -> list[str]:
    board = json.loads((FOLDER / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    return exprs


def rules() -> list[dict]:
    docs = [yaml.safe_load((FOLDER / name).read_text()) for name in RULE_FILES]
    return [rule for doc in docs for group in doc["groups"] for rule in group["rules"]]


def test_every_metric_the_dashboard_and_rules_name_is_exported(api: Api) -> None:
    api.create_run("obs")  # a run, so the per-run series exist too
    api.settle()
    exported = exported_names(api)
    exprs = dashboard_exprs() + [r["expr"] for r in rules()]
    named = {m for e in exprs for m in METRIC.findall(e)}
    assert named, "the files name no tether metric at all"
    assert named <= exported, f"not exported by the control plane: {sorted(named - exported)}"
    # The five alerts are all there.
    alerts = {r["alert"] for r in rules()}
    assert {"TetherConvergenceSlow", "TetherLeaseLapses", "Tether409Storm",
            "TetherSamplerGapRising", "TetherEngineCommitFailures"} <= alerts  # fmt: skip
    # The convergence SLO's (issue 13).
    assert {"TetherConvergenceSLOMissed", "TetherRequestVersionLagHigh"} <= alerts


def test_the_grafana_dashboard_is_importable_json() -> None:
    board = json.loads((FOLDER / "grafana-dashboard.json").read_text())
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 30
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in board["panels"]:
        assert panel["targets"], panel["title"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        for target in panel["targets"]:
            assert METRIC.search(target["expr"]), target


@pytest.mark.parametrize("rule_file", sorted(RULE_FILES))
def test_the_alert_rules_have_the_shape_prometheus_loads(rule_file: str) -> None:
    doc = yaml.safe_load((FOLDER / rule_file).read_text())
    assert set(doc) == {"groups"}
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"} and group["name"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"])
            assert rule["labels"]["severity"] in {"warning", "critical"}
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            if "for" in rule:
                assert re.fullmatch(r"\d+[smhd]", rule["for"])


@pytest.mark.parametrize("rule_file", sorted(RULE_FILES))
def test_promtool_accepts_the_rules_and_their_unit_tests_pass(rule_file: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus); shape checked above")
    check = subprocess.run(
        [promtool, "check", "rules", str(FOLDER / rule_file)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(
        [promtool, "test", "rules", RULE_FILES[rule_file]],
        capture_output=True,
        text=True,
        cwd=FOLDER,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
