"""Which compiled (numba) conversion kernels this environment can load.

Owns the one rule for an optional kernel module: load it if numba is installed, else say
once, in the log, what runs instead. Must never choose between a kernel and its torch
reference for a given tensor (the callers do, by dtype and shape); both give the same bytes.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

log = logging.getLogger(__name__)


def compiled_kernel(module: str, without_it: str) -> ModuleType | None:
    """`engine_agent.precision.<module>`, or None when numba is missing (an environment
    installed before it joined the extra); `without_it` says, for the log, what runs then."""
    try:
        return importlib.import_module(f"engine_agent.precision.{module}")
    except ImportError:
        log.warning("numba is not installed: %s", without_it)
        return None
