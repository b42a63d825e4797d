"""Where everything lives inside a store: the object keys of runs, pointers and versions.

The layout is Modal Stitch's, so either system can read the other's runs:

    <root>/<run_id>/run.json
    <root>/<run_id>/latest
    <root>/<run_id>/updates/weight_v000007/model.safetensors.index.json
    <root>/<run_id>/updates/weight_v000007/*.safetensors

Keys here are relative to the store root and always use "/". This module validates every
name that becomes part of a key and must never touch storage itself.
"""

from __future__ import annotations

from store.errors import InvalidName
from store.types import VersionRef, validate_run_id

RUN_FILENAME = "run.json"
POINTER_FILENAME = "latest"
UPDATES_DIRNAME = "updates"
# A publisher's claim on a version number: the digest of the files it is writing. Readers
# that load a version folder as a Hugging Face checkpoint ignore dot-files.
CLAIM_FILENAME = ".tether-claim"


def validate_file_name(name: str) -> str:
    """Return `name` if it is a safe relative file name inside a version folder.

    Refused (with `InvalidName`): empty names, absolute paths, backslashes, `..` or `.`
    segments, empty segments and NUL bytes. Sub-folders ("shards/a.safetensors") are allowed.
    """
    if not isinstance(name, str) or not name:
        raise InvalidName(
            f"file name {name!r} is empty or not a string; use e.g. 'model.safetensors'"
        )
    if name.startswith("/") or "\\" in name or "\x00" in name or ":" in name.split("/")[0]:
        raise InvalidName(
            f"file name {name!r} must be a relative path with '/' separators "
            "(no leading '/', no backslashes, no drive letters)"
        )
    for segment in name.split("/"):
        if segment in {"", ".", ".."}:
            raise InvalidName(
                f"file name {name!r} has an empty, '.' or '..' segment; "
                "files must stay inside their version folder"
            )
    return name


def run_prefix(run_id: str) -> str:
    """`run-a` → `run-a/`."""
    return f"{validate_run_id(run_id)}/"


def run_key(run_id: str) -> str:
    """The key of a run's metadata, `<run_id>/run.json`."""
    return run_prefix(run_id) + RUN_FILENAME


def pointer_key(run_id: str) -> str:
    """The key of a run's pointer, `<run_id>/latest`."""
    return run_prefix(run_id) + POINTER_FILENAME


def updates_prefix(run_id: str) -> str:
    """The folder holding a run's versions, `<run_id>/updates/`."""
    return run_prefix(run_id) + UPDATES_DIRNAME + "/"


def version_prefix(ref: VersionRef) -> str:
    """The folder of one version, `<run_id>/updates/weight_v000007/`."""
    return updates_prefix(ref.run_id) + ref.dir_name + "/"


def version_file_key(ref: VersionRef, name: str) -> str:
    """The key of one file of a version, after validating `name`."""
    return version_prefix(ref) + validate_file_name(name)
