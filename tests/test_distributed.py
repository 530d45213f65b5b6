"""The DDP engine with two gloo processes: identical weights, harmonized rank average applied."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mogradient import CombinableLoss
from mogradient.combinable import RowValues
from mogradient.engines import (
    RowGradients,
    combinable_gradients,
    distributed_objective_gradients,
    objective_gradients,
)
from mogradient.harmonizers import MGDA, TrimmedMean
from mogradient.step import apply_harmonized, apply_weights

WORLD_SIZE = 2


def _losses(model: nn.Module, inputs: torch.Tensor) -> list[torch.Tensor]:
    output = model(inputs)
    return [output[:, 0].pow(2).mean(), (output[:, 1] - 1).pow(2).mean(), -output[:, 2].mean()]


def _worker(rank: int, rendezvous: str, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD_SIZE
    )
    _compute_and_save(rank, out_dir)
    # Tear down in order: every rank done, the DDP reducer (which holds the group) gone with
    # the helper's frame, then the group. Left to interpreter exit, gloo's threads can abort
    # the process (SIGABRT, seen once in CI).
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def _compute_and_save(rank: int, out_dir: str) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    model.module.load_state_dict(plain.state_dict())
    inputs = torch.randn(6, 4, generator=torch.Generator().manual_seed(100 + rank))
    parameters = list(model.parameters())

    stack = distributed_objective_gradients(model, lambda: _losses(model, inputs), parameters)
    harmonization = apply_harmonized(parameters, stack, MGDA())
    applied = torch.cat([p.grad.reshape(-1) for p in parameters])

    # Independent reference: local gradients of a plain copy, gathered and averaged by hand.
    local = objective_gradients(_losses(plain, inputs), list(plain.parameters()))
    gathered = [torch.zeros_like(local) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, local)
    reference = MGDA()(torch.stack(gathered).mean(dim=0))

    # The per-row engine through DDP: local stacks from one backward per row value, the
    # same single all-reduce; against the gathered local K-backward stacks.
    def combinable(network: nn.Module) -> CombinableLoss:
        terms = network(inputs).T.pow(2)  # (3 terms, 6 rows), term column b is row b
        coefficients = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(7))
        return CombinableLoss(terms, coefficients, rows=RowValues(terms))

    engine = RowGradients(model.module, parameters)
    row_stack = distributed_objective_gradients(
        model, lambda: combinable(model), parameters, rows=engine
    )
    local_rows = combinable_gradients(combinable(plain), list(plain.parameters()))
    gathered_rows = [torch.zeros_like(local_rows) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered_rows, local_rows)
    row_reference = torch.stack(gathered_rows).mean(dim=0)

    # A later ordinary synced backward (an amortized step) must still work under DDP.
    model.zero_grad()
    sum(
        w * loss
        for w, loss in zip(harmonization.weights.tolist(), _losses(model, inputs), strict=True)
    ).backward()
    synced = torch.cat([p.grad.reshape(-1) for p in parameters])
    torch.save(
        {
            "weights": harmonization.weights,
            "applied": applied,
            "reference": reference.direction,
            "synced": synced,
            "row_stack": row_stack,
            "row_reference": row_reference,
        },
        Path(out_dir) / f"rank{rank}.pt",
    )


def test_two_process_gloo(tmp_path: Path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(
        _worker, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=WORLD_SIZE, join=True
    )
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    torch.testing.assert_close(results[0]["weights"], results[1]["weights"], rtol=0, atol=0)
    for result in results:
        torch.testing.assert_close(result["applied"], result["reference"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(results[0]["synced"], results[1]["synced"])
    for result in results:  # float32 sums in two orders over 6 rows x 2 ranks
        torch.testing.assert_close(
            result["row_stack"], result["row_reference"], rtol=1e-5, atol=1e-7
        )
    assert not torch.equal(results[0]["applied"], torch.zeros_like(results[0]["applied"]))


def test_apply_weights_adds_the_weighted_sum_to_the_gradient_already_there() -> None:
    """Without a process group: .grad (a KL term, say) + sum_k w_k g_k, rows written out."""
    model = nn.Linear(2, 2)
    parameters = list(model.parameters())
    model.weight.grad = torch.full((2, 2), 0.5)
    jacobian = torch.arange(12, dtype=torch.float32).reshape(2, 6)
    weights = torch.tensor([2.0, -1.0], dtype=torch.float64)
    applied, direction = apply_weights(parameters, jacobian, weights, accumulate=True)
    expected = 2.0 * jacobian[0] - jacobian[1]  # small integers: exact in float32
    assert torch.equal(applied, weights) and torch.equal(direction, expected)
    gradient = torch.cat([p.grad.reshape(-1) for p in parameters])
    assert torch.equal(gradient, expected + torch.tensor([0.5] * 4 + [0.0] * 2))


def test_a_coordinatewise_direction_is_written_as_it_is() -> None:
    """TrimmedMean's direction is not sum_k w_k g_k of its (least-squares) weights: the
    direction itself reaches .grad, equal to a numpy sort-and-trim of the stack."""
    parameters = [nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))]
    stack = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    harmonization = apply_harmonized(parameters, stack, TrimmedMean(trim_number=1))
    expected = torch.sort(stack, dim=0).values[1:-1].mean(dim=0)
    torch.testing.assert_close(parameters[0].grad.flatten(), expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(harmonization.direction, expected, rtol=0, atol=1e-15)
