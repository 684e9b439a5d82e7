"""The training LR schedule (``lr_at``) against transformers' warmup + cosine-to-minimum schedule.

After warmup the two agree at every step. During warmup ``lr_at`` is transformers' schedule one
step ahead: its first step trains at lr / W, where transformers' trains at 0 (a wasted batch), so
``lr_at`` is kept rather than replaced.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from dspark.training.trainer import TrainConfig, lr_at


def _transformers_lrs(cfg: TrainConfig, warm: int, n: int) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = transformers.get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=warm, num_training_steps=cfg.steps, min_lr_rate=cfg.min_lr_frac
    )
    lrs = []
    for _ in range(n):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize(
    "steps, warmup_frac, min_lr_frac", [(40, 0.1, 0.1), (25, 0.04, 0.0), (30, 0.25, 0.5), (12, 0.0, 0.2)]
)
def test_lr_at_is_transformers_cosine_with_min_lr_after_warmup(steps, warmup_frac, min_lr_frac):
    cfg = TrainConfig(steps=steps, lr=1e-3, warmup_frac=warmup_frac, min_lr_frac=min_lr_frac)
    warm = max(1, round(warmup_frac * steps))  # lr_at's W: at least one warmup step
    ref = _transformers_lrs(cfg, warm, steps + 1)
    ours = [lr_at(cfg, s) for s in range(steps)]
    for s in range(warm, steps):  # cosine from lr down to min_lr_frac · lr: equal
        assert ours[s] == pytest.approx(ref[s], rel=1e-12, abs=1e-15), s
    for s in range(warm):  # linear warmup: lr_at(s) = lr (s + 1) / W = transformers at s + 1
        assert ours[s] == pytest.approx(ref[s + 1], rel=1e-12), s
    assert ref[0] == 0.0 and ours[0] == pytest.approx(cfg.lr / warm)
