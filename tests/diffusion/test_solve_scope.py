"""MARBLE's solve scope in the trainer: a solve on the step's first micro-steps, in output
space, or when a cached step went stale; checked on tiny runs against independent
computations (K backward passes on a replay of the step) and before any model loads."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from mogradient.engines import combinable_gradients
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.trainer import Trainer
from mogradient_diffusion.training_config import ConfigError, load_config

CPU = World(rank=0, size=1, device=torch.device("cpu"))


def _config(run_dir: Path, *overrides: str):
    """Tiny preset, accumulation 2: 2 micro-batches x 2 noise levels = 4 micro-steps a step."""
    return load_config(
        preset="tiny",
        overrides=[
            f"run.directory={run_dir}",
            "run.quiet=true",
            "strategy.name=marble",
            "train.gradient_accumulation=2",
            *overrides,
        ],
    )


def _steps(run_dir: Path) -> list[dict]:
    return [s for record in read_metrics(run_dir) for s in record["optimizer_steps"]]


def test_a_partial_solve_sees_the_first_micro_steps_and_the_probe_the_whole_step(
    tmp_path: Path,
) -> None:
    config = _config(
        tmp_path,
        "train.epochs=3",
        "strategy.period=1",
        "strategy.solve_fraction=0.5",
        "run.conflict_probe=true",
    )
    trainer = Trainer(config, CPU)
    solved_on: list[torch.Tensor] = []
    expected: dict[int, torch.Tensor] = {}
    weigh = trainer.harmonized.weigh
    replay = trainer._replayer

    def recording_weigh(jacobian, count):
        if jacobian is not None:
            solved_on.append(jacobian.clone())
        return weigh(jacobian, count)

    def first_two_pieces(step, state):
        """The first 2 of the 4 pieces' K gradients, by K backward passes each (at the
        step's first replay: the solve's, before its engine runs)."""
        stream = replay(step, state)
        if trainer.optimizer_step not in expected:
            pieces = itertools.islice(stream(), 2)
            expected[trainer.optimizer_step] = sum(
                scale * combinable_gradients(loss, trainer.parameters) for scale, loss in pieces
            )
        return stream

    trainer.harmonized.weigh = recording_weigh
    trainer._replayer = first_two_pieces
    trainer.run()
    steps = _steps(tmp_path)
    assert [s["solve/pieces"] for s in steps] == [2] * len(steps)
    assert len(solved_on) == len(steps) == len(expected)
    for seen, reference in zip(solved_on, expected.values(), strict=True):
        scale = float(reference.abs().max())
        torch.testing.assert_close(seen.double(), reference.double(), rtol=1e-3, atol=1e-4 * scale)
    # the probe's cosines are the whole step's: a partial solve's own are not
    assert all("stale/cos_to_fresh" in s for s in steps)


def test_an_output_space_solve_runs_no_per_reward_backward(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        "train.epochs=2",
        "strategy.period=1",
        "strategy.solve_space=outputs",
        "run.conflict_probe=true",
    )
    trainer = Trainer(config, CPU)
    trainer.harmonized.engine.stack = _refuse  # only the probe may take K gradients
    probe = trainer._conflict_probe
    trainer._conflict_probe = lambda pieces, replay: _with_engine(trainer, probe, pieces, replay)
    trainer.run()
    steps = _steps(tmp_path)
    assert all(s["solved"] == 1 and s["engine"] == "outputs" for s in steps)
    # MGDA's min-norm point conflicts with no reward in the space it was solved in
    assert all(s["harmonize/output_cos_min"] > -1e-6 for s in steps)
    assert all("harmonize/cos_min" in s for s in steps)  # the probe, in parameter space


def _refuse(*args, **kwargs):
    raise AssertionError("an output-space solve took per-reward parameter gradients")


def _with_engine(trainer, probe, pieces, replay):
    """The probe with the engine's own stack back in place."""
    engine = trainer.harmonized.engine
    del engine.stack  # the instance attribute: the class's method again
    try:
        return probe(pieces, replay)
    finally:
        engine.stack = _refuse


def test_a_stale_cache_makes_the_next_step_a_solve_and_resumes(tmp_path: Path) -> None:
    overrides = ("strategy.period=50", "strategy.solve_when_stale=true")
    Trainer(_config(tmp_path, "train.epochs=8", *overrides), CPU).run()
    steps = _steps(tmp_path)
    assert steps[0]["solved"] == 1
    for before, after in itertools.pairwise(steps):
        if not before["solved"]:
            assert after["solved"] == int(before["harmonize/output_cos_min"] < 0)
        else:  # a period of 50: only staleness can make two solves this close
            assert after["solved"] == 0
    assert any(not s["solved"] and s["harmonize/output_cos_min"] < 0 for s in steps[:-1])
    # the flag is in the checkpoint: a resumed run solves where the uncut one would
    resumed = Trainer(_config(tmp_path, "train.epochs=9", *overrides), CPU)
    last = steps[-1]
    assert resumed.strategy.stale == (not last["solved"] and last["harmonize/output_cos_min"] < 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.solve_fraction=0"], r"solve_fraction must be in \(0, 1\]"),
        (["strategy.solve_fraction=1.5"], r"solve_fraction must be in \(0, 1\]"),
        (["strategy.solve_space=velocity"], "solve_space must be parameters"),
        (["strategy.solve_scope=micro_step", "strategy.solve_fraction=0.5"], "solve_scope step"),
        (["objective.name=flow_grpo", "strategy.solve_space=outputs"], "use objective nft"),
        (["objective.name=sdpo", "strategy.solve_when_stale=true"], "use objective nft"),
    ],
)
def test_scope_options_are_checked_before_the_model_loads(
    tmp_path: Path, overrides, message
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, *overrides)


def test_the_stale_flag_travels_in_the_strategy_state() -> None:
    from mogradient_diffusion.strategies import build_strategy
    from mogradient_diffusion.strategies.marble import MarbleSettings

    settings = MarbleSettings(solve_when_stale=True)
    stale = build_strategy("marble", settings, ["a", "b"], seed=0)
    stale.amortizer.full_step(torch.eye(2, dtype=torch.float64))
    stale.stale = True
    fresh = build_strategy("marble", settings, ["a", "b"], seed=0)
    fresh.load_state_dict(stale.state_dict())
    assert fresh.stale and fresh.needs_gradients()
    before = {"amortizer": stale.amortizer.state_dict()}  # a checkpoint from before the flag
    fresh.load_state_dict(before)
    assert not fresh.stale and not fresh.needs_gradients()
