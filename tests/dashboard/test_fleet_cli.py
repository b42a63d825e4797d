"""`tether fleet status` and `tether fleet watch` against a running control plane."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from demo.local_fleet import LocalControlPlane
from demo.local_fleet import start_controlplane as start_demo_controlplane
from launcher.processes import ProcessGroup, free_port, wait_until
from tests.controlplane.conftest import publish
from tests.fixtures.processes import ROOT, TETHER

RUN = "cli-run"


@dataclass
class Plane:
    cp: LocalControlPlane
    engines: dict[str, str]  # precision -> engine id

    def tether(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, "COLUMNS": "200", "TETHER_CONTROL_PLANE": self.cp.url}
        env["TETHER_TOKEN"] = self.cp.tokens["viewer"] if token is None else token
        return subprocess.run(
            [TETHER, "fleet", *args], cwd=ROOT, capture_output=True, text=True, env=env,
            timeout=60,
        )  # fmt: skip


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Plane]:
    root = tmp_path_factory.mktemp("fleet-cli")
    store = root / "store"
    with ProcessGroup(root / "logs") as group:
        cp = start_demo_controlplane(
            group, f"sqlite:///{root / 'cp.db'}", str(store), {"TETHER_LEASE_SECONDS": "3600"}
        )
        trainer = {"Authorization": f"Bearer {cp.tokens['trainer']}"}
        engine = {"Authorization": f"Bearer {cp.tokens['engine']}"}
        assert httpx.post(f"{cp.url}/v1/runs", json={"run_id": RUN}, headers=trainer).is_success
        for version in (0, 1):
            publish(store, RUN, version)
            reply = httpx.post(
                f"{cp.url}/v1/runs/{RUN}/versions", json={"version": version}, headers=trainer
            )
            assert reply.status_code == 201, reply.text
        ids = {}
        for precision, version in (("bf16", 1), ("nvfp4", 0)):
            body = {"url": f"http://127.0.0.1:9/{precision}", "run_id": RUN,
                    "precision": precision, "applied_version": version, "sync_state": "ready",
                    "accelerator": "b200", "labels": {"zone": "a"}}  # fmt: skip
            reply = httpx.post(f"{cp.url}/v1/engines", json=body, headers=engine)
            assert reply.status_code == 201, reply.text
            ids[precision] = reply.json()["engine_id"]

        def listed() -> bool:  # the overview is built from the next snapshot
            doc = cp.get("/v1/fleet/overview", "viewer")
            return len(doc["engines"]) == 2 and doc["runs"][0]["latest_version"] == 1

        wait_until(listed, 30.0, "the overview to list both engines")
        yield Plane(cp, ids)


def test_status_json_is_the_overview_document(plane: Plane) -> None:
    done = plane.tether("status", "--json", "--run", RUN)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    rows = {e["engine_id"]: e for e in doc["engines"]}
    assert rows[plane.engines["bf16"]]["applied_version"] == 1
    assert rows[plane.engines["nvfp4"]]["applied_version"] == 0
    assert rows[plane.engines["nvfp4"]]["target_version"] == 1
    assert [r["run_id"] for r in doc["runs"]] == [RUN]


def test_status_draws_runs_precisions_and_engines_most_behind_first(plane: Plane) -> None:
    done = plane.tether("status")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert f"run {RUN}: latest v1" in out
    assert "by precision" in out and "engines (2 of 2, most behind first)" in out
    engine_lines = [line for line in out.splitlines() if "sglang" in line]
    assert plane.engines["nvfp4"][:12] in engine_lines[0]  # one version behind: listed first
    assert "b200" in engine_lines[0]
    assert plane.tether("status", "--limit", "0").stdout.count("sglang") == 0


def test_watch_redraws_until_its_count_and_json_gives_one_document_per_read(plane: Plane) -> None:
    done = plane.tether("watch", "--json", "--count", "2", "--interval", "0.1")
    assert done.returncode == 0, done.stderr
    docs = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(docs) == 2 and all(len(d["engines"]) == 2 for d in docs)
    drawn = plane.tether("watch", "--count", "2", "--interval", "0.1")
    assert drawn.returncode == 0, drawn.stderr
    assert f"run {RUN}" in drawn.stdout


def test_a_refused_token_or_an_unreachable_plane_is_a_clear_error(plane: Plane) -> None:
    refused = plane.tether("status", token="tth_wrong")
    assert refused.returncode == 1
    assert "401" in refused.stderr and "unknown bearer token" in refused.stderr
    engine = plane.tether("status", token=plane.cp.tokens["engine"])
    assert engine.returncode == 1 and "403" in engine.stderr
    nobody = plane.tether("status", "--control-plane", f"http://127.0.0.1:{free_port()}")
    assert nobody.returncode == 1 and "cannot reach" in nobody.stderr
    missing = plane.tether("status", token="")
    assert missing.returncode == 1 and "no token" in missing.stderr


def test_the_cli_never_prints_the_token(plane: Plane) -> None:
    for args in (("status",), ("status", "--json"), ("watch", "--count", "1")):
        done = plane.tether(*args)
        assert plane.cp.tokens["viewer"] not in done.stdout + done.stderr
