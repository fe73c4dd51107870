"""KV cost of a request: prompt tokens (exact where counted, else estimated) plus every
token it may generate.

- `basis`: what a body is made of, measured once (`CostBasis`), and an exact count of its
  prompts made outside the core (`PromptCount`);
- `ratios`: characters per token, learned per model, for text nothing counted;
- `estimator`: `CostEstimator`, which prices a basis and learns from the engines' counts.
"""

from kvgate.core.cost.basis import (
    MEDIA_PART_CHARS,
    MESSAGE_OVERHEAD_CHARS,
    CostBasis,
    CostError,
    PromptCount,
    Source,
    measure,
)
from kvgate.core.cost.estimator import TYPICAL_CHARS_PER_TOKEN, CostEstimator
from kvgate.core.cost.ratios import CharRatios

__all__ = [
    "MEDIA_PART_CHARS",
    "MESSAGE_OVERHEAD_CHARS",
    "TYPICAL_CHARS_PER_TOKEN",
    "CharRatios",
    "CostBasis",
    "CostError",
    "CostEstimator",
    "PromptCount",
    "Source",
    "measure",
]
