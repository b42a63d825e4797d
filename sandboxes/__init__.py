"""Isolated execution and coding-agent rewards. Imports nothing else of Tether.

`Sandbox` (base.py) is the port; `LocalSandbox` (local.py, bubblewrap) and `ModalSandbox`
(modal_backend.py) are its adapters; `score` (scoring.py) turns a task and a patch into a
reward of 1 or 0, or an infrastructure error that carries no reward.
"""

from sandboxes.base import ExecResult, Sandbox, SandboxSpec
from sandboxes.limits import Limits
from sandboxes.scoring import ScoreResult, ScoreStatus, score
from sandboxes.task import Task, load_task

__all__ = [
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxSpec",
    "ScoreResult",
    "ScoreStatus",
    "Task",
    "load_task",
    "score",
]
