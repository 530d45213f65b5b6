"""MARBLE as released (strategy.solve_scope=micro_step): the schedule, the alpha cache and
the mixed advantages against independent computations, and a tiny run that counts the
solves and what each solve saw."""

from __future__ import annotations

import itertools
from pathlib import Path

import cvxpy as cp
import numpy as np
import pytest
import torch

from mogradient.engines import combinable_gradients
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.strategies.release_marble import MicroStepMarble
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.trainer import Trainer
from mogradient_diffusion.training_config import ConfigError, load_config

REWARDS = ["a", "b", "c", "d"]


def _solved_steps(marble: MicroStepMarble, steps: int, micro_steps: int) -> list[int]:
    """How many micro-steps of each optimizer step solve, walking the release's rule."""
    rng = np.random.default_rng(0)
    counts = []
    for step in range(steps):
        solved = 0
        for _ in range(micro_steps):
            if marble.solves(step):
                marble.solve(torch.from_numpy(rng.standard_normal((4, 6))), step)
                solved += 1
        counts.append(solved)
    return counts


def test_the_schedule_is_the_releases() -> None:
    """Warm-up 1, period 10: step 0 solves on all its micro-steps (192 in the recipe),
    steps 10 and 20 on their first, every other step on none (train.py:1481-1493)."""
    counts = _solved_steps(MicroStepMarble(REWARDS), steps=25, micro_steps=6)
    assert counts == [6] + [0] * 9 + [1] + [0] * 9 + [1] + [0] * 4
    assert _solved_steps(MicroStepMarble(REWARDS, warmup_steps=0, period=3), 7, 4) == [
        1, 0, 0, 1, 0, 0, 1,
    ]  # fmt: skip
    assert _solved_steps(MicroStepMarble(REWARDS, equal_alpha=True), 12, 3) == [0] * 12


def _release_alpha(stack: np.ndarray, floor: float, weights: np.ndarray) -> np.ndarray:
    """The release's QP on its description, by cvxpy: min ||sum a_k w_k u_k||^2 over
    {sum a = 1, a >= floor}, u_k the unit gradients."""
    units = stack / np.linalg.norm(stack, axis=1, keepdims=True) * weights[:, None]
    alpha = cp.Variable(len(stack))
    problem = cp.Problem(
        cp.Minimize(cp.sum_squares(units.T @ alpha)), [cp.sum(alpha) == 1, alpha >= floor]
    )
    problem.solve(solver=cp.CLARABEL, tol_gap_abs=1e-12, tol_gap_rel=1e-12, tol_feas=1e-12)
    return np.asarray(alpha.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("floor", "weights"), [(0.0, None), (0.1, [1.0, 2.0, 0.5, 1.0])])
def test_a_solve_is_the_releases_qp_and_direction(dtype, floor, weights) -> None:
    """alpha from the exact QP on (weighted) unit gradients; the fresh direction is
    mean raw norm x sum alpha_k w_k u_k (balancer.py:43-82)."""
    rng = np.random.default_rng(1)
    stack = rng.standard_normal((4, 50)) * np.array([[1.0], [30.0], [0.01], [3.0]])
    stack[1] -= 0.8 * stack[0] * 30  # a conflict, so the floor binds
    marble = MicroStepMarble(REWARDS, alpha_lower_bound=floor, unit_weights=weights)
    raw_weights, record = marble.solve(torch.from_numpy(stack).to(dtype), step=0)
    v = np.ones(4) if weights is None else np.array(weights)
    expected = _release_alpha(stack, floor, v)
    # cvxpy's own accuracy (1e-8 on alpha) bounds the comparison; the input's precision
    # adds its round-off.
    tolerance = 1e-6 + 10 * torch.finfo(dtype).eps ** 0.5 * (dtype == torch.float32)
    np.testing.assert_allclose(record["fresh_alpha"], expected, atol=tolerance)
    norms = np.linalg.norm(stack, axis=1)
    direction = raw_weights.numpy() @ stack
    wanted = norms.mean() * (np.array(record["fresh_alpha"]) * v) @ (stack / norms[:, None])
    np.testing.assert_allclose(direction, wanted, rtol=1e-5 if dtype == torch.float32 else 1e-9)


def test_the_cache_is_the_releases_ema() -> None:
    """cache <- 0.7 cache + 0.3 alpha on every solve, the first solve sets it, fallbacks
    fold in (an all-zero stack folds zeros), no renormalization (train.py:1715-1726)."""
    rng = np.random.default_rng(2)
    marble = MicroStepMarble(REWARDS)
    expected = None
    stacks = [rng.standard_normal((4, 8)) for _ in range(3)] + [np.zeros((4, 8))]
    stacks.append(np.stack([rng.standard_normal(8), *np.zeros((3, 8))]))  # one usable
    for step, stack in enumerate(stacks):
        _, record = marble.solve(torch.from_numpy(stack), step)
        fresh = np.array(record["fresh_alpha"])
        expected = fresh if expected is None else 0.7 * expected + 0.3 * fresh
        np.testing.assert_allclose(marble.alpha.numpy(), expected, rtol=1e-12)
    assert record["fresh_alpha"] == [1.0, 0.0, 0.0, 0.0]  # single valid: one-hot
    # the all-zero solve's zeros stay in (its sum 0.7), then 0.7 x 0.7 + 0.3: not renormalized
    assert float(marble.alpha.sum()) == pytest.approx(0.79, rel=1e-12)


def test_groups_solve_their_mean_gradient_and_split_alpha() -> None:
    """A group is one objective, its gradient the members' mean; cached, each member's
    advantage gets the group's alpha / its size (train.py:817-845, 1528-1529)."""
    rng = np.random.default_rng(3)
    stack = rng.standard_normal((4, 10))
    marble = MicroStepMarble(REWARDS, groups=[["b", "d"]])
    assert marble.objective_names == ["b+d", "a", "c"]
    _, record = marble.solve(torch.from_numpy(stack), 0)
    objectives = np.stack([stack[[1, 3]].mean(axis=0), stack[0], stack[2]])
    np.testing.assert_allclose(
        record["fresh_alpha"], _release_alpha(objectives, 0.0, np.ones(3)), atol=1e-6
    )
    alpha = marble.alpha.numpy()
    advantages = torch.tensor([[1.0, float("nan"), -2.0, 3.0], [0.5, 4.0, float("nan"), -1.0]])
    expected = [
        alpha[1] * 1.0 + alpha[0] / 2 * 0.0 + alpha[2] * -2.0 + alpha[0] / 2 * 3.0,
        alpha[1] * 0.5 + alpha[0] / 2 * 4.0 + alpha[2] * 0.0 + alpha[0] / 2 * -1.0,
    ]
    mixed = marble.mixed(advantages)
    assert mixed.shape == (2, 1)
    np.testing.assert_allclose(mixed[:, 0].numpy(), expected, rtol=1e-6)


def test_equal_alpha_mixes_one_over_k_and_never_solves() -> None:
    marble = MicroStepMarble(REWARDS[:2], equal_alpha=True)
    assert marble.plan(0) == "none"
    mixed = marble.mixed(torch.tensor([[2.0, float("nan")], [1.0, 3.0]]))
    assert mixed[:, 0].tolist() == [1.0, 2.0]


# ------------------------------------------------------------------ a tiny run


def _config(run_dir: Path, *overrides: str):
    return load_config(
        preset="tiny",
        overrides=[
            f"run.directory={run_dir}",
            "run.quiet=true",
            "strategy.solve_scope=micro_step",
            "strategy.period=2",
            *overrides,
        ],
    )


def test_a_run_solves_on_the_micro_steps_the_release_solves_on(tmp_path: Path) -> None:
    """Tiny preset with accumulation 2: 2 micro-batches x 2 noise levels = 4 micro-steps
    per optimizer step, one step per epoch. Step 0 solves on its 4 micro-steps, steps 2
    and 4 on their first, each solve on that micro-step's own K gradients (not the whole
    step's)."""
    config = _config(
        tmp_path, "train.epochs=5", "train.gradient_accumulation=2", "run.conflict_probe=true"
    )
    trainer = Trainer(config, World(rank=0, size=1, device=torch.device("cpu")))
    seen: list[tuple[int, torch.Tensor]] = []
    solve = trainer.strategy.micro_step.solve

    def recording_solve(stack: torch.Tensor, step: int):
        seen.append((step, stack.clone()))
        return solve(stack, step)

    trainer.strategy.micro_step.solve = recording_solve
    first_pieces: dict[int, torch.Tensor] = {}
    replay = trainer._replayer

    def capture_first_piece(step, state):
        """Piece 0's K gradients, independently (K backward passes), at each solve step."""
        stream = replay(step, state)
        if trainer.optimizer_step not in first_pieces:
            pieces = list(itertools.islice(stream(), 1))
            stack = torch.stack(
                [
                    combinable_gradients(loss, trainer.parameters).mul(scale)
                    for scale, loss in pieces
                ]
            )[0]
            first_pieces[trainer.optimizer_step] = stack
        return stream

    trainer._replayer = capture_first_piece
    grad_modes: list[bool] = []
    loss = trainer.objective._loss

    def noting_loss(*args, **kwargs):
        grad_modes.append(torch.is_grad_enabled())
        return loss(*args, **kwargs)

    trainer.objective._loss = noting_loss
    trainer.run()
    # A solve step's mixed stream skips its solved micro-step with a no-grad forward. With
    # grad, the stream holds the skipped piece's graph through the next forward: on the
    # H100 the released row's first step peaked at 48.9 GiB against 29.7 for the others,
    # about one forward's activations more (the likely cause; not re-measured there).
    assert grad_modes.count(False) == 2  # steps 2 and 4
    steps = [s for r in read_metrics(tmp_path) for s in r["optimizer_steps"]]
    assert [s["solved_micro_steps"] for s in steps] == [4, 0, 1, 0, 1]
    assert [step for step, _ in seen] == [0, 0, 0, 0, 2, 4]
    for step, stack in seen:
        if step in (2, 4):
            torch.testing.assert_close(stack.float(), first_pieces[step], rtol=1e-4, atol=1e-7)
    # the probe measures every step over the whole step, solve steps too (1 fresh piece)
    assert all("harmonize/cos_min" in s and "stale/cos_to_fresh" in s for s in steps), steps
    cached = [s for s in steps if not s["solved"]]
    assert all(s["weights"] == s["release/alpha"] for s in cached)  # K = G: no groups


def test_a_resumed_run_keeps_the_cache(tmp_path: Path) -> None:
    device = World(rank=0, size=1, device=torch.device("cpu"))
    first = Trainer(_config(tmp_path, "train.epochs=1", "strategy.period=10"), device)
    first.run()
    cache = first.strategy.micro_step.state_dict()
    Trainer(_config(tmp_path, "train.epochs=2", "strategy.period=10"), device).run()
    records = list(read_metrics(tmp_path))
    assert len(records) == 2
    (step,) = records[1]["optimizer_steps"][:1]
    # the cache came back: the step after the solve took it (a lost cache would solve)
    assert step["solved"] == 0 and step["stale/steps_since_solve"] == 2.0
    assert step["release/alpha"] == cache["alpha"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.solve_scope=whole"], "solve_scope must be step"),
        (["objective.name=flow_grpo"], "use objective nft"),
        (["strategy.smooth_solve_steps=true"], "options of solve_scope step"),
        (["strategy.normalize=false"], "options of solve_scope step"),
        (["strategy.reward_groups=[[color_match, nope]]"], "unknown"),
        (["strategy.unit_weights=[1.0]"], "one finite number > 0 per MARBLE objective"),
        (["strategy.fixed_alpha=true", "strategy.alpha_lower_bound=0.1"], "fixes alpha"),
    ],
)
def test_release_options_are_checked_before_the_model_loads(
    tmp_path: Path, overrides, message
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, *overrides)


def test_reward_groups_need_the_micro_step_scope(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"set strategy\.solve_scope=micro_step"):
        load_config(
            preset="tiny",
            overrides=[
                f"run.directory={tmp_path}",
                "strategy.reward_groups=[[color_match, jpeg_incompressibility]]",
            ],
        )
