"""The alert rules: valid for promtool, unit-tested by promtool, written to the project's conventions."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prom import CONTRACT_METRICS, RULE_TESTS, RULES, alert_rules, metric_names, split_threshold
from tools import tool

REQUIRED_ANNOTATIONS = {"summary", "description", "runbook"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run promtool; its verdict is in returncode, its explanation in stdout + stderr."""
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_quiet() -> None:
    """Each alert has a case where it fires and one where it must not."""
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    for rule in alert_rules():
        mine = [case for case in cases if case["alertname"] == rule["alert"]]
        assert any(case["exp_alerts"] for case in mine), f"{rule['alert']} never fires in the unit tests"
        assert any(not case["exp_alerts"] for case in mine), f"{rule['alert']} has no case where it stays quiet"


def test_unit_tests_catch_a_changed_threshold(tmp_path: Path) -> None:
    """The promtool tests can fail: the backlog alert with a threshold above the tested depth must break them."""
    rules = RULES.read_text()
    assert "(imgserve_queue_depth) > 16" in rules
    (tmp_path / RULES.name).write_text(rules.replace("(imgserve_queue_depth) > 16", "(imgserve_queue_depth) > 32"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = promtool("test", "rules", str(tmp_path / RULE_TESTS.name))
    assert result.returncode != 0
    assert "ImgserveQueueBacklog" in result.stdout + result.stderr


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_alert_conventions(rule: dict) -> None:
    """Runbook-style annotations, a severity, contract metrics only, and `<signal> <comparison> <number>`."""
    assert rule["alert"].startswith("Imgserve")
    assert set(rule["annotations"]) >= REQUIRED_ANNOTATIONS, rule["annotations"].keys()
    assert rule["labels"]["severity"] in {"warning", "critical"}
    names = metric_names(rule["expr"])
    assert names, "the alert queries no imgserve, DCGM or kube-state-metrics series"
    assert names <= CONTRACT_METRICS, names - CONTRACT_METRICS
    signal, _, threshold = split_threshold(rule["expr"])
    assert signal and threshold >= 0


def test_split_threshold_ignores_matchers_and_nested_comparisons() -> None:
    expr = 'sum(rate(x{code!="503",le=~"<1"}[5m])) / sum(y > 0) >= bool 0.5'
    assert split_threshold(expr) == ('sum(rate(x{code!="503",le=~"<1"}[5m])) / sum(y > 0)', ">=", 0.5)
    with pytest.raises(ValueError):
        split_threshold("sum(x > 1)")
    with pytest.raises(ValueError):
        split_threshold("x > y")
