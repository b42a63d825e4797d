"""Which compiled (numba) conversion kernels this environment can load, and the form they
read weights in.

Owns the one rule for an optional kernel module (load it if numba is installed, else say
once, in the log, what runs instead) and `bf16_bits`, a BF16 tensor as the kernels take it.
Must never choose between a kernel and its torch reference for a given tensor (the callers
do, by dtype and shape); both give the same bytes.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import numpy as np
import torch

log = logging.getLogger(__name__)


def compiled_kernel(module: str, without_it: str) -> ModuleType | None:
    """`engine_agent.precision.<module>`, or None when numba is missing (an environment
    installed before it joined the extra); `without_it` says, for the log, what runs then."""
    try:
        return importlib.import_module(f"engine_agent.precision.{module}")
    except ImportError:
        log.warning("numba is not installed: %s", without_it)
        return None


def bf16_bits(weight: torch.Tensor) -> np.ndarray:
    """A BF16 tensor's elements as a flat uint16 array (a view when it is contiguous)."""
    return weight.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1)
