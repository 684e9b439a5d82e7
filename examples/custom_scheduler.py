"""A custom scheduler registered at run time through the same hook a plugin package uses.

    python examples/custom_scheduler.py

For a distributable plugin put the hook in a module and declare it under
``[project.entry-points.dspark]`` (see examples/plugins/dspark-budget).
"""

from __future__ import annotations

import torch
from attrs import frozen

import dspark
import dspark.plugins
from dspark.schedulers import SchedulerBase


@frozen
class HalfScheduler(SchedulerBase):
    """Verify the first half of every draft (a stopping rule: it never reads confidences).

    A scheduler only chooses the lengths ℓ [R]; dspark checks them and builds the Schedule
    (τ, B, Θ). SchedulerBase adds ``schedule(confidence, valid_lengths, cost_model)``.
    """

    name = "half"
    lossless = True

    def lengths(self, confidence, valid_lengths, cost_model=None) -> torch.Tensor:
        return valid_lengths // 2  # [R]


class Plugin:
    @dspark.hookimpl
    def register_schedulers(self, register):
        register("half", HalfScheduler)


def main() -> list[int]:
    plugin = Plugin()
    dspark.plugins.register(plugin, name="example-half")
    try:
        sched = dspark.get_scheduler("half")
        plan = sched.schedule(torch.rand(3, 7), torch.tensor([7, 4, 1]))
        print("lengths:", plan.lengths.tolist())
        return plan.lengths.tolist()
    finally:
        dspark.plugins.unregister(plugin)


if __name__ == "__main__":
    main()
