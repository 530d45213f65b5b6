"""The Gram of per-sample gradients (instance-wise risk minimization): ours vs TorchJD.

Why: TorchJD 0.18's ``autogram.Engine`` computes the B x B Gramian of per-instance losses
with module hooks, one extra backward and a re-forward of each hooked module. The per-row
engine (``mogradient.engines.RowGradients.gram`` on
``CombinableLoss.instance_wise(losses)``) needs one backward to the trainable Linears'
outputs and, where few positions per row make it cheaper, the factored per-layer Gram
(d d^T) o (x x^T) without forming any per-sample gradient. Both run on the same models
and batches, side by side:

* an MLP 784-256-256-10 (cross-entropy on random classes);
* a small transformer made of Linears (patch embedding, per-head q/k/v/out, MLP, head;
  parameter-free LayerNorms), 16 tokens of width 64, 2 blocks.

Time: forward + Gram, medians over interleaved rounds (forward + one ordinary backward
for scale). Exactness: the largest entry difference from the Gram of the full per-sample
Jacobian (``torch.func``, float64), relative to the largest entry. Memory: each method in
its own process: the resident-set high-water mark during 5 calls above the resident set
before them (``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs``), with
glibc told to map blocks of 64 KiB and more and return them on free, so that the mark
follows live memory rather than what the allocator keeps.

Run: ``python benchmarks/bench_instance_gram.py [--quick] [--out DIR]``; ``--quick`` (one
batch size, few rounds) prints and writes nothing unless ``--out`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import (
    MEASURING_CHILD_ENV,
    machine_info,
    machine_markdown,
    markdown_table,
    publish,
    status_kib,
)
from torch import nn

from mogradient.combinable import CombinableLoss
from mogradient.engines import RowGradients

NAME = "instance_gram"
CLASSES = 10


class Block(nn.Module):
    """Pre-norm attention and MLP; every trainable parameter in a Linear."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width, elementwise_affine=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, tokens, width = x.shape
        h = self.norm(x)
        q, k, v = (
            f(h).view(rows, tokens, self.heads, -1).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        attended = nn.functional.scaled_dot_product_attention(q, k, v)
        x = x + self.out(attended.transpose(1, 2).reshape(rows, tokens, width))
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class SmallTransformer(nn.Module):
    def __init__(self, tokens: int = 16, patch: int = 49, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.tokens, self.patch = tokens, patch
        self.embed = nn.Linear(patch, width)
        self.blocks = nn.Sequential(*(Block(width, 4) for _ in range(depth)))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.embed(x.view(len(x), self.tokens, self.patch)))
        return self.head(h.mean(dim=1))


def build(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    if model_name == "mlp":
        return nn.Sequential(
            nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, CLASSES)
        )
    return SmallTransformer()


def data(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 784, generator=generator), torch.randint(
        CLASSES, (batch,), generator=generator
    )


def methods(model: nn.Module) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """name -> gram(x, y); each call runs its own forward, each method on its own copy of
    ``model`` (TorchJD's hooks stay on the modules it was given and fire on every forward)."""
    from torchjd.autogram import Engine

    criterion = nn.CrossEntropyLoss(reduction="none")
    ours_model, theirs_model, plain_model = (build_like(model) for _ in range(3))
    ours = RowGradients(ours_model, list(ours_model.parameters()))
    theirs = Engine(theirs_model, batch_dim=0)

    def mogradient(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with ours.recording():
            losses = criterion(ours_model(x), y)
        return ours.gram(CombinableLoss.instance_wise(losses))

    def torchjd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return theirs.compute_gramian(criterion(theirs_model(x), y))

    def one_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = criterion(plain_model(x), y).sum()
        return torch.autograd.grad(loss, list(plain_model.parameters()))[0]

    return {"mogradient": mogradient, "torchjd": torchjd, "forward + backward": one_backward}


def exact_gram(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The Gram of the full per-sample Jacobian in float64, by torch.func."""
    model64 = build_like(model).double()
    params = {name: p.detach() for name, p in model64.named_parameters()}

    def loss(p: dict, xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = torch.func.functional_call(model64, p, (xi[None],))
        return nn.functional.cross_entropy(out, yi[None])

    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x.double(), y)
    jacobian = torch.cat([g.reshape(len(x), -1) for g in grads.values()], dim=1)
    return jacobian @ jacobian.T


def build_like(model: nn.Module) -> nn.Module:
    copy = build("mlp" if isinstance(model, nn.Sequential) else "transformer")
    copy.load_state_dict(model.state_dict())
    return copy


def time_methods(model_name: str, batch: int, rounds: int) -> dict[str, Any]:
    model = build(model_name)
    x, y = data(batch)
    functions = methods(model)
    truth = exact_gram(model, x, y)
    errors = {
        name: float((fn(x, y).double() - truth).abs().max() / truth.abs().max())
        for name, fn in functions.items()
        if name != "forward + backward"
    }
    samples: dict[str, list[float]] = {name: [] for name in functions}
    names = list(functions)
    for round_index in range(rounds + 1):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            functions[name](x, y)
            if round_index:  # the first round warms up
                samples[name].append(time.perf_counter() - started)
    return {
        "median_ms": {n: 1000 * statistics.median(v) for n, v in samples.items()},
        "relative_error": errors,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def child(model_name: str, batch: int, method: str) -> int:
    """Peak resident-set growth (KiB) of 5 calls of one method, printed as JSON."""
    torch.set_num_threads(1)
    model = build(model_name)
    x, y = data(batch)
    function = methods(model)[method]
    for _ in range(2):
        function(x, y)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = status_kib("VmRSS")
    for _ in range(5):
        function(x, y)
    print(json.dumps({"peak_growth_kib": status_kib("VmHWM") - before}))
    return 0


def peak_growth_mib(model_name: str, batch: int, method: str) -> float:
    command = [sys.executable, __file__, "--child", model_name, str(batch), method]
    env = os.environ | MEASURING_CHILD_ENV
    output = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(output.stdout.strip().splitlines()[-1])["peak_growth_kib"] / 1024


def render_markdown(payload: dict[str, Any]) -> str:
    lines = [
        "# Per-sample Gram (IWRM): mogradient's per-row engine vs TorchJD's autogram",
        "",
        machine_markdown(payload["machine"]),
        "",
        f"One thread; medians over {payload['rounds']} interleaved rounds. Error: largest "
        "entry difference from the float64 Gram of the full per-sample Jacobian, relative "
        "to its largest entry (the methods compute in float32). Memory: resident-set "
        "high-water mark above the resident set before the calls, each method in its own "
        "process (glibc maps blocks of 64 KiB and more and returns them on free).",
        "",
    ]
    header = [
        "model",
        "batch",
        "mogradient ms",
        "TorchJD ms",
        "time ratio",
        "fwd + bwd ms",
        "mogradient peak MiB",
        "TorchJD peak MiB",
        "mogradient error",
        "TorchJD error",
    ]
    body = []
    for case in payload["cases"]:
        times, memory = case["median_ms"], case["peak_growth_mib"]
        body.append(
            [
                case["model"],
                str(case["batch"]),
                f"{times['mogradient']:.2f}",
                f"{times['torchjd']:.2f}",
                f"{times['mogradient'] / times['torchjd']:.3f}x",
                f"{times['forward + backward']:.2f}",
                f"{memory['mogradient']:.1f}",
                f"{memory['torchjd']:.1f}",
                f"{case['relative_error']['mogradient']:.1e}",
                f"{case['relative_error']['torchjd']:.1e}",
            ]
        )
    return "\n".join([*lines, markdown_table(header, body), ""])


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="one batch size, 3 rounds")
    parser.add_argument("--out", type=Path, help="results folder (default: benchmarks/results)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds = 3 if args.quick else 25
    batches = (32,) if args.quick else (32, 128)
    cases = []
    for model_name in ("mlp", "transformer"):
        for batch in batches:
            case = {"model": model_name, "batch": batch, **time_methods(model_name, batch, rounds)}
            case["peak_growth_mib"] = {
                method: peak_growth_mib(model_name, batch, method)
                for method in ("mogradient", "torchjd")
            }
            cases.append(case)
            print(json.dumps(case), flush=True)
    info = machine_info()
    info["torch_threads"] = 1
    payload = {"benchmark": NAME, "machine": info, "rounds": rounds, "cases": cases}
    publish(NAME, payload, render_markdown(payload), args.out, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
