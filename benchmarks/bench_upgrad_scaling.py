"""UPGrad's solve time against K: its K dual-cone QPs solved together, vs MGDA's one QP.

Why: UPGrad projects each of K gradients onto the dual cone of all of them, K QPs of size
K. Solved one by one with the exact active-set solver that cost 4-30 s at K = 128 and
269-377 s at K = 256 (reliability probe 35, item 15), where instance-wise Grams make
K = 256 (the batch size) ordinary. UPGrad now solves them together on one factor of the
Gram (mogradient/_batched_cone.py) and leaves to the one-by-one solver only the QPs it
cannot certify. This measures both, and MGDA beside them, on four kinds of Gram:

* ``gaussian``: J = randn(K, 4K), full rank and well-conditioned;
* ``duplicates``: the same with every seventh row a copy of the one before (a minibatch
  that drew a sample twice): rank below K;
* ``ill_conditioned``: singular values of J log-spaced from 1 to 1e-4 (cosine
  eigenvalues down to ~1e-8);
* ``rank_half``: rank K / 2.

Each Gram is ``gram_matrix`` of the stack in float64 or float32 (the solve itself is in
float64 either way); the methods get ``gram=``, so only the solve is timed. "one by one" is
every QP of UPGrad solved alone with its own factorization, as UPGrad did before (the
fallback now); it runs up to K = 128 only (minutes beyond), like the two kinds whose QPs
mostly fall back. Medians over interleaved rounds, one thread for torch and BLAS (more
threads only add noise on a shared 2-core machine). The limit reported per kind is the
smallest K whose UPGrad median exceeds 1 s.

Run: ``python benchmarks/bench_upgrad_scaling.py [--quick] [--out DIR]``; ``--quick``
(K = 8 and 16, one round) prints and writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from common import (
    interleaved_times,
    machine_info,
    machine_markdown,
    markdown_table,
    publish,
    timing_summary,
)
from threadpoolctl import threadpool_limits

import mogradient._qp_cone as qp_cone
from mogradient.harmonizers import MGDA, UPGrad
from mogradient.harmonizers._upgrad import SLOW_SOLVE_SECONDS
from mogradient.qp import gram_matrix

NAME = "upgrad_scaling"
KINDS = ("gaussian", "duplicates", "ill_conditioned", "rank_half")
# Kinds whose QPs mostly fall back to the one-by-one solver, and that solver itself,
# run up to this K: at 256 one solve takes minutes.
FALLBACK_KINDS = ("ill_conditioned", "rank_half")
ONE_BY_ONE_LIMIT = 128
DTYPES = {"float64": torch.float64, "float32": torch.float32}
METHODS = ("UPGrad", "MGDA", "one by one")


def stack(kind: str, count: int, dtype: torch.dtype) -> torch.Tensor:
    """A K x 4K gradient stack of the given kind (see the module docstring)."""
    generator = torch.Generator().manual_seed(count)
    dim = 4 * count
    rows = torch.randn(count, dim, generator=generator, dtype=torch.float64)
    if kind == "duplicates":
        rows[1::7] = rows[0::7][: len(rows[1::7])]
    elif kind == "ill_conditioned":
        shape = {"generator": generator, "dtype": torch.float64}
        left = torch.linalg.qr(torch.randn(count, count, **shape))[0]
        right = torch.linalg.qr(torch.randn(dim, count, **shape))[0]
        rows = left @ torch.diag(torch.logspace(0, -4, count, dtype=torch.float64)) @ right.T
    elif kind == "rank_half":
        rank = max(1, count // 2)
        rows = rows[:, :rank] @ torch.randn(rank, dim, generator=generator, dtype=torch.float64)
    return rows.to(dtype)


def one_by_one(gram: torch.Tensor) -> None:
    """Each of UPGrad's QPs (lower bound e_i / K) by the exact one-by-one solver, alone."""
    norms = torch.sqrt(torch.diagonal(gram)).numpy()
    cosines = gram.numpy() / np.outer(norms, norms)
    sizes = norms / norms.max()
    for lower in np.eye(len(gram)) / len(gram):
        qp_cone._solve_builtin(cosines, sizes, lower)


def methods(gram: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The timed calls on one Gram: UPGrad, MGDA and (up to K = 128) one by one."""
    calls: dict[str, Callable[[], Any]] = {
        "UPGrad": lambda: UPGrad()(gram=gram),
        "MGDA": lambda: MGDA()(gram=gram),
    }
    if len(gram) <= ONE_BY_ONE_LIMIT:
        calls["one by one"] = lambda: one_by_one(gram)
    return calls


def fallbacks(gram: torch.Tensor) -> int:
    """How many of UPGrad's QPs the batched solver left to the one-by-one solver."""
    with mock.patch.object(qp_cone, "_solve_builtin", wraps=qp_cone._solve_builtin) as solve:
        UPGrad()(gram=gram)
    return solve.call_count


def measure(kind: str, dtype_name: str, count: int, rounds: int) -> dict[str, Any]:
    """Times (one warm-up call each, then ``rounds`` interleaved rounds) of one cell."""
    gram = gram_matrix(stack(kind, count, DTYPES[dtype_name]))
    calls = methods(gram)
    left = fallbacks(gram)  # also the warm-up of UPGrad
    calls["MGDA"]()
    times = interleaved_times(calls, rounds)
    return {
        "kind": kind,
        "dtype": dtype_name,
        "K": count,
        "rounds": rounds,
        "one_by_one_qps": left,
        "times": {name: timing_summary(samples) for name, samples in times.items()},
    }


def limits(cases: list[dict[str, Any]]) -> dict[str, dict[str, int | None]]:
    """Per kind and dtype, the smallest K whose UPGrad median exceeds 1 s (None: none)."""
    found: dict[str, dict[str, int | None]] = {}
    for case in cases:
        slow = case["times"]["UPGrad"]["median_ms"] > 1000 * SLOW_SOLVE_SECONDS
        current = found.setdefault(case["kind"], {}).get(case["dtype"])
        if slow and (current is None or case["K"] < current):
            found[case["kind"]][case["dtype"]] = case["K"]
        found[case["kind"]].setdefault(case["dtype"], None)
    return found


def cell(case: dict[str, Any], method: str) -> str:
    if method not in case["times"]:
        return "not run"
    return f"{case['times'][method]['median_ms']:.1f}"


def ratio(case: dict[str, Any]) -> str:
    value = case["times"]["UPGrad"]["median_ms"] / case["times"]["MGDA"]["median_ms"]
    return f"{value:.2g}x" if value < 10 else f"{value:.0f}x"


def render_markdown(payload: dict[str, Any]) -> str:
    lines = [
        "# UPGrad's solve time against K: batched dual-cone QPs vs one by one vs MGDA",
        "",
        machine_markdown(payload["machine"]),
        "",
        f"One thread (torch and BLAS); medians over {payload['rounds']} interleaved rounds "
        f"({payload['rounds_from_128']} from K = 128) after one warm-up call, on a Gram "
        "given with `gram=` (only the solve is timed). "
        "UPGrad: its K QPs solved together, the uncertified ones one by one (how many: "
        "last column). One by one: every QP alone, as UPGrad did before. Kinds: "
        "`gaussian` J = randn(K, 4K); `duplicates` every seventh row repeated; "
        "`ill_conditioned` singular values 1..1e-4; `rank_half` rank K / 2. Not run: "
        f"K > {ONE_BY_ONE_LIMIT} one by one and for {', '.join(FALLBACK_KINDS)} (minutes).",
        "",
    ]
    header = ["kind", "dtype", "K", "UPGrad ms", "MGDA ms", "one by one ms", "UPGrad / MGDA"]
    header.append("QPs one by one")
    body = [
        [
            case["kind"],
            case["dtype"],
            str(case["K"]),
            *(cell(case, method) for method in METHODS),
            ratio(case),
            f"{case['one_by_one_qps']} / {case['K']}",
        ]
        for case in payload["cases"]
    ]
    lines += [markdown_table(header, body), "", "## Limit: smallest K with a solve over 1 s", ""]
    largest = {case["kind"]: case["K"] for case in payload["cases"]}
    rows = [
        [kind, dtype, f"none up to {largest[kind]}" if limit is None else str(limit)]
        for kind, by_dtype in payload["limits"].items()
        for dtype, limit in by_dtype.items()
    ]
    lines.append(markdown_table(["kind", "dtype", "K"], rows))
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="K = 8 and 16, one round")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    counts = (8, 16) if args.quick else (8, 16, 32, 64, 128, 256)
    rounds, rounds_from_128 = (1, 1) if args.quick else (5, 3)
    started_load = os.getloadavg()
    cases = []
    with threadpool_limits(1), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SlowSolveWarning: the point here is to measure
        for kind in KINDS:
            for dtype_name in DTYPES:
                for count in counts:
                    if kind in FALLBACK_KINDS and count > ONE_BY_ONE_LIMIT:
                        continue
                    repeats = rounds if count < 128 else rounds_from_128
                    case = measure(kind, dtype_name, count, repeats)
                    cases.append(case)
                    print(kind, dtype_name, count, {m: cell(case, m) for m in METHODS}, flush=True)
    info = machine_info()
    info["torch_threads"] = 1
    info["loadavg_1_5_15_start"] = started_load
    payload = {
        "benchmark": NAME,
        "mode": "quick" if args.quick else "full",
        "machine": info,
        "rounds": rounds,
        "rounds_from_128": rounds_from_128,
        "cases": cases,
        "limits": limits(cases),
    }
    publish(NAME, payload, render_markdown(payload), args.out, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
