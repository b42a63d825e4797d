"""A store in an S3-compatible bucket (s3://BUCKET/PREFIX): AWS S3, SeaweedFS, MinIO.

Talks to S3 with boto3 directly. The pointer is swapped with S3 conditional writes:
`If-None-Match: *` creates it only if absent, `If-Match: <etag>` replaces it only if nobody
else did since it was read; a 412 (or a 409 from a concurrent conditional write) is a lost
race. Single PUTs are atomic, so readers never see half an object.

Errors: a lost race is `PointerConflict` (or False from `put_if_absent`), a missing key
`FileNotFoundError`; every transient failure (no connection, a timeout, a 5xx, throttling)
is `StorageUnavailable`, the one retryable type; other refusals are `StoreError`. A boto3
too old for conditional writes (before 1.35.69) is named as such, never taken for a race.

Endpoint: `storage_options["endpoint_url"]`, else `TETHER_S3_ENDPOINT_URL`, else
`AWS_ENDPOINT_URL`, else AWS. Credentials: `storage_options["key"]`/`["secret"]` (s3fs's
names) or `aws_access_key_id`/`aws_secret_access_key`, else boto3's usual chain.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from store.errors import InvalidName, PointerConflict, StorageUnavailable, StoreError
from store.objects.base import Cell, Listing, ObjectStore
from store.settings import StoreSettings

_LOST_RACE = {"412", "409", "PreconditionFailed", "ConditionalRequestConflict"}
_MISSING = {"404", "NoSuchKey", "NotFound"}
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "503"}
# The first botocore whose S3 model has PutObject's IfMatch (IfNoneMatch came in 1.35.2).
CONDITIONAL_WRITES_BOTOCORE = "1.35.69"

_T = TypeVar("_T")


class S3Objects(ObjectStore):
    """Objects in `bucket` under `prefix`."""

    def __init__(self, location: str, storage_options: dict[str, Any]) -> None:
        import boto3
        from botocore.config import Config

        bucket, _, prefix = location.partition("/")
        if not bucket:
            raise InvalidName(f"s3://{location} names no bucket; use s3://BUCKET/PREFIX")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        options = dict(storage_options)
        endpoint = (
            options.pop("endpoint_url", None)
            or StoreSettings().s3_endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        key = options.pop("key", None) or options.pop("aws_access_key_id", None)
        secret = options.pop("secret", None) or options.pop("aws_secret_access_key", None)
        region = options.pop("region_name", None) or os.environ.get("AWS_REGION", "us-east-1")
        config = Config(
            s3={"addressing_style": "path"} if endpoint else {},
            retries={"max_attempts": 3, "mode": "standard"},
        )
        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name=region,
            config=config,
        )

    def _key(self, key: str) -> str:
        return self.prefix + key

    def _call(self, key: str, request: Callable[[], _T]) -> _T:
        """Run one S3 request; a failure below HTTP (connection, timeout, a bad parameter)
        becomes Tether's error. HTTP answers (`ClientError`) are left to the caller, which
        knows which codes mean a lost race or a missing key, and then to `_translate`."""
        from botocore.exceptions import BotoCoreError, ParamValidationError

        try:
            return request()
        except ParamValidationError as exc:
            if "IfMatch" in str(exc) or "IfNoneMatch" in str(exc):
                raise StoreError(
                    "this botocore cannot send S3 conditional writes (IfMatch/IfNoneMatch), "
                    "which the pointer's compare-and-swap needs: install boto3 and botocore "
                    f">= {CONDITIONAL_WRITES_BOTOCORE} (pip install 'tether[s3]')"
                ) from exc
            raise StoreError(f"S3 request for {self.url}/{key} is malformed: {exc}") from exc
        except BotoCoreError as exc:
            raise StorageUnavailable(
                f"S3 at {self.url} did not answer for {key} ({type(exc).__name__}: {exc}); "
                "retry when the endpoint is reachable"
            ) from exc

    def get(self, key: str) -> bytes:
        try:
            return bytes(
                self._call(
                    key,
                    lambda: self.client.get_object(Bucket=self.bucket, Key=self._key(key))[
                        "Body"
                    ].read(),
                )
            )
        except self.client.exceptions.ClientError as exc:
            raise self._translate(exc, key) from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        byte_range = f"bytes={start}-{start + length - 1}"
        try:
            return bytes(
                self._call(
                    key,
                    lambda: self.client.get_object(
                        Bucket=self.bucket, Key=self._key(key), Range=byte_range
                    )["Body"].read(),
                )
            )
        except self.client.exceptions.ClientError as exc:
            if _code(exc) == "InvalidRange":
                return b""
            raise self._translate(exc, key) from exc

    def size(self, key: str) -> int | None:
        try:
            head = self._call(
                key, lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            )
        except self.client.exceptions.ClientError as exc:
            if _code(exc) in _MISSING:
                return None
            raise self._translate(exc, key) from exc
        return int(head["ContentLength"])

    def put(self, key: str, data: bytes) -> None:
        try:
            self._call(
                key,
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=bytes(data)
                ),
            )
        except self.client.exceptions.ClientError as exc:
            raise self._translate(exc, key) from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            self._call(
                key,
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=bytes(data), IfNoneMatch="*"
                ),
            )
        except self.client.exceptions.ClientError as exc:
            if _code(exc) in _LOST_RACE:
                return False
            raise self._translate(exc, key) from exc
        return True

    def list(self, prefix: str) -> Listing:
        listing = Listing()
        full = self._key(prefix)
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            pages = self._call(
                prefix,
                lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/")),
            )
            for page in pages:
                for common in page.get("CommonPrefixes", []):
                    listing.dirs.append(common["Prefix"][len(full) :].rstrip("/"))
                for item in page.get("Contents", []):
                    name = item["Key"][len(full) :]
                    if name and "/" not in name:
                        listing.files[name] = int(item["Size"])
        except self.client.exceptions.ClientError as exc:
            raise self._translate(exc, prefix) from exc
        listing.dirs.sort()
        return listing

    def delete(self, key: str) -> bool:
        if self.size(key) is None:
            return False
        try:
            self._call(
                key, lambda: self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
            )
        except self.client.exceptions.ClientError as exc:
            raise self._translate(exc, key) from exc
        return True

    def delete_prefix(self, prefix: str) -> int:
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            pages = self._call(
                prefix,
                lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix))),
            )
            keys = [item["Key"] for page in pages for item in page.get("Contents", [])]
            for start in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[start : start + 1000]]
                self._call(
                    prefix,
                    partial(
                        self.client.delete_objects, Bucket=self.bucket, Delete={"Objects": batch}
                    ),
                )
        except self.client.exceptions.ClientError as exc:
            raise self._translate(exc, prefix) from exc
        return len(keys)

    def read_cell(self, key: str) -> Cell:
        try:
            data, token = self._call(key, lambda: self._read_with_etag(key))
        except self.client.exceptions.ClientError as exc:
            if _code(exc) in _MISSING:
                return Cell(data=None, token=None)
            raise self._translate(exc, key) from exc
        return Cell(data=data, token=token)

    def _read_with_etag(self, key: str) -> tuple[bytes, str]:
        response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        return response["Body"].read(), response["ETag"]

    def swap_cell(self, key: str, data: bytes, token: object) -> None:
        condition = {"IfNoneMatch": "*"} if token is None else {"IfMatch": str(token)}
        try:
            self._call(
                key,
                lambda: self.client.put_object(
                    Bucket=self.bucket, Key=self._key(key), Body=bytes(data), **condition
                ),
            )
        except self.client.exceptions.ClientError as exc:
            if _code(exc) in _LOST_RACE:
                raise PointerConflict(
                    f"{self.url}/{key} changed since it was read (S3 answered "
                    f"{_code(exc)} to a conditional write). Re-read the pointer and decide again"
                ) from exc
            raise self._translate(exc, key) from exc

    def _translate(self, exc: Exception, key: str) -> Exception:
        code = _code(exc)
        if code in _MISSING:
            return FileNotFoundError(f"{self.url}/{key} does not exist")
        if code == "NoSuchBucket":
            return StoreError(
                f"bucket {self.bucket!r} does not exist at this endpoint; create it first"
            )
        if code in _THROTTLED or _status(exc) >= 500:
            return StorageUnavailable(
                f"S3 at {self.url} failed transiently for {key} ({code or _status(exc)}: "
                f"{exc}); retry after a backoff"
            )
        return StoreError(f"S3 request for {self.url}/{key} failed: {exc}")


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", {}) or {}
    return str(response.get("Error", {}).get("Code", ""))


def _status(exc: Exception) -> int:
    response = getattr(exc, "response", {}) or {}
    return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
