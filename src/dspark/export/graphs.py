"""Moved: the graphs now live in :mod:`dspark.drafters.graphs`, where the PyTorch drafters run them
too (one drafting loop for every runner). This module keeps the old import path working
(``from dspark.export.graphs import graph_specs``) for callers written against it."""

from dspark.drafters.graphs import (  # noqa: F401
    BackboneGraph,
    BlockContextGraph,
    Eagle3ContextGraph,
    Eagle3FuseGraph,
    Eagle3StepGraph,
    GraphSpec,
    HeadStepGraph,
    graph_specs,
)

__all__ = ["GraphSpec", "graph_specs"]
