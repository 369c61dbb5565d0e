"""The job: the functional middle layer between the device core and the facade.

`EmbeddingJob` (planning, batch preparation, the step programs and their schedule,
the checks and shapes around the core), `JobSpec` (the declared options), `Feed` (the
host side's state between batches) and `Schedule` (the steps' state between calls).
The facade and the flax modules reach the layers below through this package only.
"""

from embedmesh.device.core import ID_STATS, EmbeddingCore, EmbeddingState
from embedmesh.host.preprocess import PreprocessStats, preprocess_features
from embedmesh.job.base import EmbeddingJob
from embedmesh.job.batches import Feed, peek, prefetched, split_item
from embedmesh.job.spec import (
    JobSpec,
    check_enqueue_device,
    check_not_traced,
    default_mesh,
    read_only,
    refuse_missing_batch,
)
from embedmesh.job.steps import Schedule, program_attributes
from embedmesh.layout.stacking import StackingPlan

__all__ = [
    "ID_STATS",
    "EmbeddingCore",
    "EmbeddingJob",
    "EmbeddingState",
    "Feed",
    "JobSpec",
    "PreprocessStats",
    "Schedule",
    "StackingPlan",
    "check_enqueue_device",
    "check_not_traced",
    "default_mesh",
    "peek",
    "prefetched",
    "read_only",
    "refuse_missing_batch",
    "split_item",
    "preprocess_features",
    "program_attributes",
]
