"""Every storage adapter reports a transient failure as `StorageUnavailable`, the one
retryable error type, and a refusal or a missing key as what it is."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest
from botocore.exceptions import ParamValidationError

from store.errors import StorageUnavailable, StoreError
from store.objects.base import transient_os_errors
from store.objects.local import LocalObjects
from store.objects.s3 import CONDITIONAL_WRITES_BOTOCORE, S3Objects


def unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def unreachable_s3() -> S3Objects:
    options = {"endpoint_url": f"http://127.0.0.1:{unused_port()}", "key": "k", "secret": "s"}
    return S3Objects("bucket/prefix", options)


@pytest.mark.parametrize(
    "call",
    [
        lambda s3: s3.get("run/latest"),
        lambda s3: s3.put("run/x", b"1"),
        lambda s3: s3.put_if_absent("run/x", b"1"),
        lambda s3: s3.read_cell("run/latest"),
        lambda s3: s3.swap_cell("run/latest", b"1", None),
        lambda s3: s3.list("run/"),
        lambda s3: s3.size("run/x"),
    ],
    ids=["get", "put", "put_if_absent", "read_cell", "swap_cell", "list", "size"],
)
def test_an_unreachable_s3_endpoint_is_storage_unavailable(call) -> None:
    with pytest.raises(StorageUnavailable, match="did not answer"):
        call(unreachable_s3())


def test_a_botocore_without_conditional_writes_is_named_not_taken_for_a_race() -> None:
    s3 = unreachable_s3()

    def old_botocore() -> None:
        # What botocore < 1.35.69 raises for put_object(..., IfMatch=...).
        raise ParamValidationError(report='Unknown parameter in input: "IfMatch"')

    with pytest.raises(StoreError, match=f">= {CONDITIONAL_WRITES_BOTOCORE}") as caught:
        s3._call("run/latest", old_botocore)
    assert not isinstance(caught.value, StorageUnavailable)


def test_an_io_error_of_a_folder_store_is_storage_unavailable() -> None:
    with pytest.raises(StorageUnavailable, match="Input/output error"):  # noqa: SIM117
        with transient_os_errors("file:///store/run/latest"):
            raise OSError(errno.EIO, "Input/output error")


@pytest.mark.parametrize("answer", [FileNotFoundError, FileExistsError, PermissionError])
def test_an_os_answer_is_not_taken_for_a_transient_failure(answer: type[OSError]) -> None:
    with pytest.raises(answer), transient_os_errors("file:///store/x"):
        raise answer("an answer, not a failure")


def test_a_missing_key_of_a_folder_store_stays_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        LocalObjects(tmp_path).get("run/latest")
