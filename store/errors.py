"""Errors of the store, named by what the caller should do about them.

Every error says what was expected, what was found and what to do. None of them is raised
after a partial write that a reader could observe: the pointer moves last.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class for every error the store raises."""


class InvalidName(StoreError, ValueError):
    """A run id, tensor name or object key is not allowed (e.g. `..`, absolute, empty)."""


class InvalidVersion(StoreError, ValueError):
    """A version number or constraint is malformed (negative, not an int, inconsistent)."""


class UnknownCodec(StoreError, ValueError):
    """A codec name that Tether does not implement."""


class PointerConflict(StoreError):
    """Lost a compare-and-swap race: another writer moved the pointer first.

    Recovery: re-read the pointer and decide again; never retry blindly with the same
    expectation.
    """


class PointerRewind(StoreError):
    """The pointer would move backwards (or stay put) within a run. Versions only go forward."""


class VersionNotFound(StoreError, LookupError):
    """A run or version that the store does not hold (or holds incompletely)."""


class CorruptPayload(StoreError):
    """Stored bytes failed to decode, were truncated, or do not match their checksum.

    The base the payload would apply to is left untouched.
    """


class ChecksumMismatch(CorruptPayload):
    """Decoded bytes do not hash to the checksum recorded for the target."""


class TensorMismatch(StoreError, ValueError):
    """Base and target disagree on tensor names, shapes or dtypes."""


class AlreadyExists(StoreError, ValueError):
    """A run or version already exists with different content; both are immutable once written.

    Recovery: publish under a new version number (or create a run with a new id).
    """


class StorageUnavailable(StoreError):
    """The storage behind the store failed transiently: a network error, a timeout, an I/O
    error, a 5xx or throttling answer from S3. Every adapter raises this one type for it.

    Recovery: retry the same operation after a backoff. Nothing a reader can observe was
    half-written (objects are written whole and the pointer moves last).
    """
