"""Exceptions of the sandboxes package, named by who has to act on them.

`InvalidTask` and `InvalidPatch` are the caller's input errors. `IsolationUnavailable`,
`ModalUnavailable`, `ModalCredentialsMissing` and `SandboxFailure` are infrastructure: the
environment failed, so nothing was learned about the patch. This module never maps an
infrastructure failure to a reward; that decision belongs to `sandboxes.scoring`.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every error raised by `sandboxes`."""


class InvalidTask(SandboxError):
    """The task description cannot be scored as written (fix the task file)."""


class IsolationUnavailable(SandboxError):
    """The local backend cannot isolate commands here and was not told to run unisolated."""


class SandboxFailure(SandboxError):
    """The sandbox itself failed (could not start, transport broke, file I/O failed)."""


class ModalUnavailable(SandboxError):
    """The `modal` package is not installed (`pip install 'tether[modal]'`)."""


class ModalCredentialsMissing(SandboxError):
    """No Modal token is configured (MODAL_TOKEN_ID/MODAL_TOKEN_SECRET or ~/.modal.toml)."""
