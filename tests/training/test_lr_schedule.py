"""The learning-rate schedule across a resume: the same schedule when ``--max-steps`` is the
same, and, when a finished or stopped run is resumed with more steps, a rate that continues
from where it stopped (no jump from the cosine floor at the old end, none a step late)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from training.config import PRESETS, TrainConfig
from training.prepare import continue_schedule, cosine_schedule


def _config(max_steps: int) -> TrainConfig:
    return TrainConfig(**{**PRESETS["tiny-cpu"], "preset": "tiny-cpu", "storage_path": "/tmp/x", "max_steps": max_steps,
                          "warmup_steps": 3})


def _worker(config: TrainConfig):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    return SimpleNamespace(config=config, optimizer=optimizer, lr_anchor=None,
                           scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(config)))


def _rates(worker, steps: range) -> list[float]:
    """The rate each step uses (as train_one_step reads it), stepping the scheduler after."""
    rates = []
    for _ in steps:
        rates.append(worker.scheduler.get_last_lr()[0])
        worker.optimizer.step()
        worker.scheduler.step()
    return rates


def _resume(stopped_at: int, old_max: int, new_max: int) -> tuple[list[float], list[float]]:
    first = _worker(_config(old_max))
    before = _rates(first, range(stopped_at))
    state = {"step": stopped_at, "lr_schedule": {"max_steps": old_max, "anchor": None}}
    second = _worker(_config(new_max))
    second.scheduler.load_state_dict(first.scheduler.state_dict())
    continue_schedule(second, state)
    return before, _rates(second, range(stopped_at, new_max))


def test_a_run_resumed_with_the_same_max_steps_keeps_its_schedule():
    before, after = _resume(12, 30, 30)
    uninterrupted = _rates(_worker(_config(30)), range(30))
    assert before + after == pytest.approx(uninterrupted, rel=1e-12)


@pytest.mark.parametrize(("stopped_at", "old_max", "new_max"), [(30, 30, 40), (20, 30, 40), (10, 30, 60)])
def test_a_run_extended_at_resume_continues_from_the_rate_it_reached(stopped_at, old_max, new_max):
    before, after = _resume(stopped_at, old_max, new_max)
    peak, floor = 1e-3, 1e-3 * _config(new_max).min_lr_ratio
    reached = 1e-3 * cosine_schedule(_config(old_max))(stopped_at)
    # The first step after the resume uses the rate the old schedule had reached there (not the
    # old one's, one step late, nor the new one's, a jump), then decays to the floor at the end.
    assert after[0] == pytest.approx(reached, rel=1e-9)
    assert all(a >= b - 1e-15 for a, b in zip(after, after[1:]))
    assert after[-1] >= floor and _worker(_config(new_max)).scheduler.lr_lambdas[0](new_max) * peak == pytest.approx(floor)
    # No jump at the resume step: the first change after it is no larger than the last before it.
    assert abs(after[1] - after[0]) <= abs(after[0] - before[-1]) + 1e-15


def test_the_schedule_without_an_anchor_would_jump_at_the_demos_resume():
    # docs/curves.png before: the demo resumed from 30 to 40 steps went from the cosine floor to
    # more than twice it at step 32 (the new schedule at step 31), one step late.
    old, new = cosine_schedule(_config(30)), cosine_schedule(_config(40))
    assert new(31) > 2 * old(30)
    _, after = _resume(30, 30, 40)
    assert max(after) == pytest.approx(1e-3 * old(30))
