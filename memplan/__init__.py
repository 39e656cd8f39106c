"""memplan: a memory planner for PyTorch models.

>>> import memplan, torch
>>> a = memplan.analyze(torch.nn.Linear(128, 128), torch.randn(32, 128), train=False)
>>> memplan.format_bytes(a.peak)
'16.00 KiB'
"""

from memplan import ops as _ops  # noqa: F401  (registers torch.ops.memplan, which plans and reproducers may hold)
from memplan import distributed, errors, steps, testing  # noqa: F401  (memplan.steps.step_fn, memplan.errors.*, memplan.distributed.check_plans, without an import of their own)
from memplan.analyze import MemoryAnalysis, analyze
from memplan.api import OptimizedModule, Plan, optimize
from memplan.capture import CapturedGraph
from memplan.errors import (
    AutocastBackwardError,
    CaptureError,
    HigherOrderGradientError,
    OutputGradientHookError,
    InfeasibleBudgetError,
    MemplanError,
    PassError,
    PassRolledBackWarning,
    TargetDeviceError,
    UnsupportedInputError,
    UnsupportedNodeError,
    VerificationWarning,
    CompileFallbackWarning,
)
from memplan.measure import Measurement, format_bytes, measure

__version__ = "0.1.0"

__all__ = [
    "optimize",
    "analyze",
    "measure",
    "format_bytes",
    "OptimizedModule",
    "Plan",
    "MemoryAnalysis",
    "CapturedGraph",
    "Measurement",
    "MemplanError",
    "AutocastBackwardError",
    "CaptureError",
    "HigherOrderGradientError",
    "OutputGradientHookError",
    "UnsupportedInputError",
    "UnsupportedNodeError",
    "InfeasibleBudgetError",
    "PassError",
    "PassRolledBackWarning",
    "TargetDeviceError",
    "VerificationWarning",
    "CompileFallbackWarning",
]
