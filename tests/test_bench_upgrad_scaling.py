"""benchmarks/bench_upgrad_scaling.py --quick end to end: every kind, dtype and method
timed at K = 8 and 16, the QPs left to the one-by-one solver counted, and results written
only where ``--out`` says (a smoke run never replaces the committed results)."""

from __future__ import annotations

import json
from pathlib import Path

from test_benchmarks_quick import _run_quick

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_upgrad_scaling.py"
RESULTS = ROOT / "benchmarks" / "results"


def test_quick_times_every_kind_and_method(tmp_path: Path) -> None:
    result = _run_quick(SCRIPT, "--out", str(tmp_path))
    payload = json.loads((tmp_path / "upgrad_scaling.json").read_text())
    markdown = (tmp_path / "upgrad_scaling.md").read_text()
    assert payload["mode"] == "quick"
    cells = {(case["kind"], case["dtype"], case["K"]) for case in payload["cases"]}
    kinds = ("gaussian", "duplicates", "ill_conditioned", "rank_half")
    assert cells == {
        (kind, dtype, count)
        for kind in kinds
        for dtype in ("float64", "float32")
        for count in (8, 16)
    }
    for case in payload["cases"]:
        assert set(case["times"]) == {"UPGrad", "MGDA", "one by one"}
        assert all(times["median_ms"] > 0 for times in case["times"].values())
        assert 0 <= case["one_by_one_qps"] <= case["K"]
    # Well-conditioned Grams: every QP certified by the batched solver.
    assert all(c["one_by_one_qps"] == 0 for c in payload["cases"] if c["kind"] == "gaussian")
    assert set(payload["limits"]) == set(kinds)
    assert "| kind | dtype | K | UPGrad ms |" in markdown
    assert markdown in result.stdout + "\n"


def test_quick_without_out_writes_nothing() -> None:
    before = {path: path.stat().st_mtime_ns for path in RESULTS.glob("upgrad_scaling.*")}
    result = _run_quick(SCRIPT)
    assert "wrote " not in result.stdout
    after = {path: path.stat().st_mtime_ns for path in RESULTS.glob("upgrad_scaling.*")}
    assert after == before
