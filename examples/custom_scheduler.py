"""A custom scheduler registered at run time through the same hook a plugin package uses.

    python examples/custom_scheduler.py

For a distributable plugin put the hook in a module and declare it under
``[project.entry-points.dspark]`` (see plugins/dspark-budget).
"""

from __future__ import annotations

import torch
from attrs import frozen

import dspark
import dspark.plugins
from dspark.schedulers import summarise, survival


@frozen
class HalfScheduler:
    """Verify the first half of every draft (a stopping rule: it never reads confidences)."""

    name = "half"
    lossless = True

    def schedule(self, confidence, valid_lengths=None, cost_model=None) -> dspark.Schedule:
        R, gamma = confidence.shape
        valid = torch.full((R,), gamma) if valid_lengths is None else valid_lengths
        a = survival(confidence, valid)
        lengths = valid // 2
        tau, B, theta = summarise(a, lengths, cost_model)
        return dspark.Schedule(lengths, a, tau, B, theta)


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
