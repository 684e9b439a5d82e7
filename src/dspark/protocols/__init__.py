"""The extension points of dspark, one ``typing.Protocol`` per module.

Every built-in and every third-party implementation satisfies one of these; the plugin manager
checks it at registration (see :mod:`dspark.plugins`).
"""

from dspark.protocols.calibrator import Calibrator
from dspark.protocols.confidence import ConfidenceModel
from dspark.protocols.cost_model import ContextAwareCostModel, CostModel
from dspark.protocols.drafter import DraftContext, Drafter, TargetFeatures
from dspark.protocols.drafter_kind import DrafterKind
from dspark.protocols.scheduler import Scheduler
from dspark.protocols.sequential_head import SequentialHead, TargetBoundHead
from dspark.protocols.target import TargetModel, TargetOutput

__all__ = [
    "Calibrator",
    "ConfidenceModel",
    "ContextAwareCostModel",
    "CostModel",
    "DraftContext",
    "Drafter",
    "DrafterKind",
    "Scheduler",
    "SequentialHead",
    "TargetBoundHead",
    "TargetFeatures",
    "TargetModel",
    "TargetOutput",
]
