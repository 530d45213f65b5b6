"""FSDP2 with the frozen weights sharded, two gloo processes, against the unsharded model.

Each rank shards a float64 copy of a small residual network with low-rank adapters
(frozen base, trainable A and B) and computes its rank-averaged K x D stack with both
engines; the reference is the same network unsharded, differentiated on the
concatenation of both ranks' batches in one process: the gradient of the global mean.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from mogradient import CombinableLoss
from mogradient.combinable import RowValues
from mogradient.engines import (
    RowGradients,
    combinable_gradients,
    distributed_objective_gradients,
    is_shard,
    objective_gradients,
    shard_frozen,
)

WORLD_SIZE = 2
ROWS_PER_RANK = 3
WIDTH = 6


class Adapted(nn.Module):
    """A frozen Linear plus a trainable low-rank branch (LoRA's shape, without peft)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH).requires_grad_(False)
        self.down = nn.Linear(WIDTH, 2, bias=False)
        self.up = nn.Linear(2, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Adapted(), Adapted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.second(torch.tanh(self.first(x)))


class Network(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 3).requires_grad_(False)
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:  # as diffusers checkpoints: the block's __call__
            x = (
                checkpoint(block.__call__, x, use_reentrant=False)
                if self.checkpointed
                else block(x)
            )
        return self.head(x)


def _network(checkpointed: bool) -> Network:
    torch.manual_seed(0)
    network = Network(checkpointed).double()
    for name, parameter in network.named_parameters():
        if name.endswith("up.weight"):  # LoRA starts B at zero; nonzero makes A's gradient too
            nn.init.normal_(parameter, std=0.3)
    return network


def _losses(network: nn.Module, inputs: torch.Tensor) -> list[torch.Tensor]:
    out = network(inputs)
    return [out[:, 0].pow(2).mean(), (out[:, 1] - 1).pow(2).mean(), -out[:, 2].mean()]


def _combinable(network: nn.Module, inputs: torch.Tensor) -> CombinableLoss:
    terms = network(inputs).T.pow(2)  # 3 terms x rows; term column b is row b
    coefficients = torch.randn(
        4, 3, len(inputs), dtype=torch.float64, generator=torch.Generator().manual_seed(7)
    )
    return CombinableLoss(terms / len(inputs), coefficients, rows=RowValues(terms))


def _inputs(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(ROWS_PER_RANK, WIDTH, dtype=torch.float64, generator=generator)


def _worker(rank: int, rendezvous: str, out_dir: str, checkpointed: bool) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD_SIZE
    )
    network = _network(checkpointed)
    trained = [p for p in network.parameters() if p.requires_grad]
    shard_frozen(network)
    inputs = _inputs(rank)
    batched = distributed_objective_gradients(
        network, lambda: _losses(network, inputs), trained, method="batched"
    )
    engine = RowGradients(network, trained)
    rows = distributed_objective_gradients(
        network, lambda: _combinable(network, inputs), trained, rows=engine
    )
    # The coefficients are seeded alike on every rank, so the rank average of the local
    # combinable stacks is the stack of the global mean loss.
    network.zero_grad()
    sum(_losses(network, inputs)).backward()  # an ordinary (combined) step
    combined = torch.cat([p.grad.reshape(-1) for p in trained])
    dist.all_reduce(combined)
    frozen = [p for p in network.parameters() if not p.requires_grad]
    everything_sharded = _network(checkpointed)
    fully_shard(everything_sharded)  # the trained parameters too: autograd cannot reach them
    shards = [p for p in everything_sharded.parameters() if p.requires_grad]
    try:
        objective_gradients(_losses(everything_sharded, inputs), shards)
        refusal = ""
    except ValueError as error:
        refusal = str(error)
    torch.save(
        {
            "batched": batched,
            "rows": rows,
            "combined": combined / WORLD_SIZE,
            "frozen_sharded": all(is_shard(p) for p in frozen),
            "trained_plain": not any(is_shard(p) for p in trained),
            "local_fraction": sum(p.to_local().numel() for p in frozen)
            / sum(p.numel() for p in frozen),
            "refusal": refusal,
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_sharded_per_objective_gradients_equal_the_unsharded_ones(
    tmp_path: Path, checkpointed: bool
) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(
        _worker,
        args=(str(tmp_path / "rendezvous"), str(tmp_path), checkpointed),
        nprocs=WORLD_SIZE,
        join=True,
    )
    network = _network(checkpointed=False)
    trained = [p for p in network.parameters() if p.requires_grad]
    everything = torch.cat([_inputs(rank) for rank in range(WORLD_SIZE)])
    expected = objective_gradients(_losses(network, everything), trained)
    expected_combined = expected.sum(dim=0)
    # The global mean of the combinable loss: each rank's terms averaged over its rows,
    # then over ranks, which for equal rank sizes is the global mean over rows.
    per_rank = [
        combinable_gradients(_combinable(network, _inputs(rank)), trained)
        for rank in range(WORLD_SIZE)
    ]
    expected_rows = torch.stack(per_rank).mean(dim=0)
    for rank in range(WORLD_SIZE):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["frozen_sharded"] and result["trained_plain"]
        assert result["local_fraction"] < 0.7  # each rank holds about half the frozen weights
        # float64 sums in another order: round-off of a few ulps of the largest entry
        torch.testing.assert_close(result["batched"], expected, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(result["rows"], expected_rows, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(result["combined"], expected_combined, rtol=1e-12, atol=1e-14)
        assert "FSDP2 shards (DTensor)" in result["refusal"]
        assert "shard_frozen" in result["refusal"]
    assert (expected.abs().amax(dim=1) > 1e-3).all()  # no objective's gradient is zero


def test_sharding_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard_frozen(_network(checkpointed=False))
