"""A store in an S3-compatible bucket (s3://BUCKET/PREFIX): AWS S3, SeaweedFS, MinIO.

Talks to S3 with boto3 directly. The pointer is swapped with S3 conditional writes:
`If-None-Match: *` creates it only if absent, `If-Match: <etag>` replaces it only if nobody
else did since it was read; a 412 (or a 409 from a concurrent conditional write) is a lost
race. Single PUTs are atomic, so readers never see half an object.

Endpoint: `storage_options["endpoint_url"]`, else `TETHER_S3_ENDPOINT_URL`, else
`AWS_ENDPOINT_URL`, else AWS. Credentials: `storage_options["key"]`/`["secret"]` (s3fs's
names) or `aws_access_key_id`/`aws_secret_access_key`, else boto3's usual chain.
"""

from __future__ import annotations

import os
from typing import Any

from store.errors import InvalidName, PointerConflict, StoreError
from store.objects.base import Cell, Listing, ObjectStore
from store.settings import StoreSettings

_LOST_RACE = {"412", "409", "PreconditionFailed", "ConditionalRequestConflict"}
_MISSING = {"404", "NoSuchKey", "NotFound"}


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

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.ClientError as exc:
            raise self._translate(exc, key) from exc

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        byte_range = f"bytes={start}-{start + length - 1}"
        try:
            response = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=byte_range
            )
        except self.client.exceptions.ClientError as exc:
            if _code(exc) == "InvalidRange":
                return b""
            raise self._translate(exc, key) from exc
        return response["Body"].read()

    def size(self, key: str) -> int | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.ClientError as exc:
            if _code(exc) in _MISSING:
                return None
            raise self._translate(exc, key) from exc
        return int(head["ContentLength"])

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=bytes(data))
        except self.client.exceptions.ClientError as exc:
            raise self._translate(exc, key) from exc

    def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=bytes(data), IfNoneMatch="*"
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
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full, Delimiter="/"):
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
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        return True

    def delete_prefix(self, prefix: str) -> int:
        paginator = self.client.get_paginator("list_objects_v2")
        keys = [
            item["Key"]
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            for item in page.get("Contents", [])
        ]
        for start in range(0, len(keys), 1000):
            batch = [{"Key": k} for k in keys[start : start + 1000]]
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch})
        return len(keys)

    def read_cell(self, key: str) -> Cell:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.ClientError as exc:
            if _code(exc) in _MISSING:
                return Cell(data=None, token=None)
            raise self._translate(exc, key) from exc
        return Cell(data=response["Body"].read(), token=response["ETag"])

    def swap_cell(self, key: str, data: bytes, token: object) -> None:
        condition = {"IfNoneMatch": "*"} if token is None else {"IfMatch": str(token)}
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=bytes(data), **condition
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
        return StoreError(f"S3 request for {self.url}/{key} failed: {exc}")


def _code(exc: Exception) -> str:
    response = getattr(exc, "response", {}) or {}
    return str(response.get("Error", {}).get("Code", ""))
