"""The demo's figures: ratios to the baseline oriented so that > 1 is better, and JSON rows
in the project's shared benchmark format."""
import json

import pytest

from kvtier.replay import FAILED, RunResult, Sample
from kvtier.demo_report import ratio, report, rows

BASE = RunResult("(a) base", (Sample(10.0, 0.2, 1000, 100, True),
                              Sample(20.0, 0.4, 1000, 300, True), FAILED), 10.0)
POOL = RunResult("(b) pool", (Sample(2.0, 0.1, 1000, 700, True),
                              Sample(4.0, 0.2, 1000, 800, True),
                              Sample(3.0, 0.1, 1000, 750, True)), 5.0)


def test_ratios_favour_shorter_times_and_higher_rates():
    assert ratio("s", 2.0, 10.0) == 5.0
    assert ratio("req/s", 0.6, 0.2) == pytest.approx(3.0)
    assert ratio("s", 0.0, 1.0) is None and ratio("ratio", 1.0, 0.0) is None


def test_failed_requests_count_in_no_figure():
    assert BASE.hit_ratio == pytest.approx(0.2) and BASE.rps == pytest.approx(0.2)
    assert BASE.pct("ttft_s", 0.5) == 20.0
    assert POOL.goodput(3.0) == pytest.approx(2 / 5.0)


def test_json_rows_follow_the_shared_format(tmp_path, capsys):
    path = tmp_path / "demo.json"
    report([BASE, POOL], 0.8, 5.0, str(path))
    doc = json.loads(path.read_text())
    assert doc["bench"] == "demo" and doc["machine"]["cpus"] >= 1
    by_case = {r["case"]: r for r in doc["results"]}
    ttft = by_case["TTFT p50 (b) pool"]
    assert (ttft["metric"], ttft["baseline"], ttft["baseline_value"]) == ("s", "(a) base", 20.0)
    assert ttft["ratio"] == pytest.approx(20.0 / 3.0)
    assert by_case["TTFT p50 (a) base"]["ratio"] is None
    assert by_case["prefix hit ratio bound (infinite cache)"]["value"] == 0.8
    assert all(set(r) == {"case", "metric", "value", "baseline", "baseline_value", "ratio"}
               for r in doc["results"])
    assert "best pooled: (b) pool: TTFT p50 6.67x" in capsys.readouterr().out
    assert len(rows([BASE, POOL], 0.8, 5.0)) == len(doc["results"])
