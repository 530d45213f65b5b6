"""Gradient engines: the K x D stack of per-objective gradients, by the cheapest exact path.

- [`objective_gradients`][mogradient.engines.objective_gradients]: K losses, K backward passes
  (sequential or one vmapped pass).
- [`combinable_gradients`][mogradient.engines.combinable_gradients]: a
  [`CombinableLoss`][mogradient.combinable.CombinableLoss]'s K gradients;
  [`accumulate_gradients`][mogradient.engines.accumulate_gradients] sums them over a stream of
  micro-batches.
- [`RowGradients`][mogradient.engines.RowGradients]: one backward pass per row value of a loss that
  says where it meets the network row by row, for every K.
- [`GradientEngine`][mogradient.engines.GradientEngine]: the per-row engine where it applies,
  checked once against K backward passes, else K backward passes: what a training loop uses.
- [`output_gram`][mogradient.engines.output_gram]: the Gram of the gradients with respect to the
  network's output (``CombinableLoss.outputs``), for no backward through the network.
- [`mtl_backward`][mogradient.engines.mtl_backward]: a shared trunk's harmonized gradient from the
  gradients with respect to its output (one backward per objective through the heads only).
- Across processes:
  [`distributed_objective_gradients`][mogradient.engines.distributed_objective_gradients] (DDP, or
  FSDP2 with the frozen weights sharded by [`shard_frozen`][mogradient.engines.shard_frozen]);
  [`mogradient.step`][mogradient.step] applies the rank-averaged stack.
- Writing and reading ``.grad``: [`write_gradient`][mogradient.engines.write_gradient],
  [`flat_gradient`][mogradient.engines.flat_gradient];
  [`select_parameters`][mogradient.engines.select_parameters] picks the trained parameters.
"""

from mogradient._finite import all_finite
from mogradient.engines._checked import ENGINES, GradientEngine, LossStream
from mogradient.engines._distributed import distributed_objective_gradients
from mogradient.engines._outputs import gram_factor, output_cosines, output_gram, output_stack
from mogradient.engines._representation import mtl_backward
from mogradient.engines._rows import RowGradientError, RowGradients, check_close
from mogradient.engines._sharding import default_blocks, is_shard, shard_frozen
from mogradient.engines._stack import (
    accumulate_gradients,
    combinable_gradients,
    flat_gradient,
    objective_gradients,
    select_parameters,
    write_gradient,
)

__all__ = [
    "ENGINES",
    "GradientEngine",
    "LossStream",
    "RowGradientError",
    "RowGradients",
    "accumulate_gradients",
    "all_finite",
    "check_close",
    "combinable_gradients",
    "default_blocks",
    "distributed_objective_gradients",
    "flat_gradient",
    "gram_factor",
    "is_shard",
    "mtl_backward",
    "objective_gradients",
    "output_cosines",
    "output_gram",
    "output_stack",
    "select_parameters",
    "shard_frozen",
    "write_gradient",
]
