"""Fixed-seed tiny runs, their metrics without timings: proof that a refactor kept behaviour.

Run it before and after a change on the same machine, then compare:

    .venv/bin/python tools/fingerprint_runs.py --out /tmp/before.json
    .venv/bin/python tools/fingerprint_runs.py --out /tmp/after.json --compare /tmp/before.json

Floats are compared exactly: the same code on the same machine gives the same bits.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from mogradient_diffusion.cli import main as cli
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.metrics_log import read_metrics

STEP_OBJECTIVE = ["rollout.sampler=sde", "train.old_schedule=copy"]
RUNS: dict[str, list[str]] = {
    "marble_probe": ["run.conflict_probe=true"],
    "weighted_sum_accumulation": ["strategy.name=weighted_sum", "train.gradient_accumulation=2"],
    "pcgrad": ["strategy.name=pcgrad"],
    "flow_grpo": ["objective.name=flow_grpo", *STEP_OBJECTIVE],
    "sdpo": ["objective.name=sdpo", *STEP_OBJECTIVE],
}
UNTIMED = (keys.TIMING_PREFIX, "memory/")


def fingerprint(work: Path) -> dict[str, list[dict[str, Any]]]:
    """Each run's metrics.jsonl records with wall-clock and memory entries left out."""
    results = {}
    for name, overrides in RUNS.items():
        run = work / name
        arguments = ["train", "--preset", "tiny", f"run.directory={run}", "run.quiet=true"]
        if cli([*arguments, *overrides]) != 0:
            raise SystemExit(f"run {name} failed")
        results[name] = [_untimed(record) for record in read_metrics(run)]
    return results


def _untimed(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not str(k).startswith(UNTIMED)}
    if isinstance(value, list):
        return [_untimed(item) for item in value]
    return value


def differences(before: Any, after: Any, where: str = "") -> list[str]:
    """Every path at which two fingerprints differ (NaN equals NaN)."""
    if isinstance(before, dict) and isinstance(after, dict):
        keys = sorted(set(before) | set(after))
        return [d for k in keys for d in differences(before.get(k), after.get(k), f"{where}/{k}")]
    if isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        return [
            d
            for i, pair in enumerate(zip(before, after, strict=True))
            for d in differences(*pair, f"{where}[{i}]")
        ]
    both_nan = (
        isinstance(before, float)
        and isinstance(after, float)
        and math.isnan(before)
        and math.isnan(after)
    )
    return [] if before == after or both_nan else [f"{where}: {before!r} -> {after!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where to write the fingerprint")
    parser.add_argument("--compare", type=Path, help="an earlier fingerprint to compare with")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        result = fingerprint(Path(work))
    args.out.write_text(json.dumps(result, indent=1))
    if args.compare is None:
        return 0
    found = differences(json.loads(args.compare.read_text()), json.loads(args.out.read_text()))
    print("\n".join(found[:50]) or "identical metrics in every run", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
