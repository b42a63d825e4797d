"""Precision conversion: canonical BF16 → FP8 128×128 block or NVFP4 (ModelOpt layout).

Public surface: `convert_checkpoint`, `convert_tensors`, `calibrate_input_scales`,
`read_input_scales`, `plan_quantization`, and the per-format math in `fp8` / `nvfp4`.
"""

from engine_agent.precision.calibration import calibrate_input_scales, read_input_scales
from engine_agent.precision.convert import ConversionStats, convert_checkpoint, convert_tensors
from engine_agent.precision.plan import PRECISIONS, QuantPlan, plan_quantization

__all__ = [
    "PRECISIONS",
    "ConversionStats",
    "QuantPlan",
    "calibrate_input_scales",
    "convert_checkpoint",
    "convert_tensors",
    "plan_quantization",
    "read_input_scales",
]
