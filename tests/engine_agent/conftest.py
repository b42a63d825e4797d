"""Fixtures of the engine-agent tests: tiny checkpoints and real reference engine processes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.refit import training_step
from launcher.processes import ProcessGroup
from store.tensors import RawTensor
from tests.fixtures.processes import (
    TETHER,
    ManagedProcess,
    free_port,
    start_process,
    wait_ready,
    wait_until,
)

# ---------------------------------------------------------------- engine agents
# Published versions of the tiny model, a control plane process and agent processes.

AGENT_START_DEADLINE_S = 120.0


class VersionChain:
    """Publishes versions of the tiny model to a folder store: v0 is the boot checkpoint,
    every later version a small training-like update of the one before."""

    def __init__(self, store_root: Path, run_id: str, boot: Path) -> None:
        from engine_agent.precision.checkpoint import read_tensors
        from store.store import Store
        from store.torch_bridge import state_dict_to_raw

        self.store_root = store_root
        self.run_id = run_id
        self.boot = boot
        self.store = Store(str(store_root))
        self.store.create_run(run_id)
        self.tensors: dict[int, dict[str, RawTensor]] = {}
        self._publish(0, state_dict_to_raw(read_tensors(boot)), "full")

    @property
    def latest(self) -> int:
        return max(self.tensors)

    def _publish(self, version: int, tensors: dict[str, RawTensor], codec: str, corrupt=False):
        from store.codecs import encode_version
        from store.types import VersionRef

        base = self.tensors.get(version - 1) if codec != "full" else None
        files = encode_version(
            tensors,
            base,
            version=version,
            base_version=version - 1 if base is not None else None,
            codec=codec,
        )
        if corrupt:
            # Flip bytes near the end of every shard: inside the payload, after the header.
            for name in files:
                if name.endswith(".safetensors"):
                    data = bytearray(files[name])
                    for i in range(1, 64):
                        data[-i] ^= 0x5A
                    files[name] = bytes(data)
        self.store.publish(VersionRef(self.run_id, version), files)
        if not corrupt:
            self.tensors[version] = tensors

    def publish(self, kind: str = "delta", *, corrupt: bool = False) -> int:
        """Publish the next version as a FULL (`kind="full"`), an xor delta (`"xor"`) or a
        sparse delta (else); a corrupt one is published with damaged payload bytes (and is
        not remembered as a valid base)."""
        version = max(self.latest, self._published()) + 1
        tensors = training_step(self.tensors[self.latest], seed=version)
        codec = kind if kind in ("full", "xor") else "sparse"
        self._publish(version, tensors, codec, corrupt)
        return version

    def _published(self) -> int:
        pointer = self.store.read_pointer(self.run_id)
        return pointer.version if pointer else -1

    def torch_tensors(self, version: int) -> dict:
        from store.torch_bridge import raw_to_state_dict

        return raw_to_state_dict(self.tensors[version])

    def write_folder(self, version: int, out: Path) -> Path:
        """The canonical BF16 checkpoint of `version` as a folder an engine can load."""
        import shutil

        from engine_agent.precision.checkpoint import copy_side_files, write_safetensors_folder

        write_safetensors_folder(out, self.torch_tensors(version))
        shutil.copyfile(self.boot / "config.json", out / "config.json")
        copy_side_files(self.boot, out)
        return out


@dataclass
class ControlPlaneProcess:
    process: ManagedProcess
    url: str
    tokens: dict[str, str]

    def call(self, method: str, path: str, role: str = "admin", **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.tokens[role]}"}
        return httpx.request(method, self.url + path, headers=headers, timeout=30.0, **kwargs)

    def engines(self, run_id: str) -> list[dict]:
        reply = self.call("GET", "/v1/engines", params={"run_id": run_id})
        assert reply.status_code == 200, reply.text
        return reply.json()["engines"]

    def engine(self, run_id: str, url: str) -> dict | None:
        found = [e for e in self.engines(run_id) if e["url"] == url]
        return found[0] if found else None

    def notify(self, run_id: str, version: int) -> None:
        reply = self.call(
            "POST", f"/v1/runs/{run_id}/versions", "trainer", json={"version": version}
        )
        assert reply.status_code == 201, reply.text


def start_controlplane(root: Path, env: dict[str, str] | None = None) -> ControlPlaneProcess:
    """`tether controlplane serve` on SQLite, as the demo starts it, with short leases and
    no token cache (`env` overrides settings), and a token per role."""
    from demo.local_fleet import start_controlplane as start_demo_controlplane

    env = {"TETHER_LEASE_SECONDS": "5", "TETHER_TOKEN_CACHE_S": "0", **(env or {})}
    cp = start_demo_controlplane(
        ProcessGroup(root), f"sqlite:///{root / 'cp.db'}", str(root / "store"), env
    )
    return ControlPlaneProcess(cp.process, cp.url, cp.tokens)


def launch_agent(
    name: str,
    engine_url: str,
    precision: str,
    root: Path,
    *,
    store_root: Path,
    run_id: str,
    boot_model: Path,
    boot_version: int | None = 0,
    control_plane: ControlPlaneProcess | None = None,
    extra: tuple[str, ...] = (),
    work_dir: Path | None = None,
    env_overrides: dict[str, str] | None = None,
) -> ManagedProcess:
    """Start `tether agent run` for one engine (without waiting for it); `env_overrides`
    (TETHER_AGENT_* variables) override the agent's settings."""
    port = free_port()
    cmd = [
        TETHER, "agent", "run", "--engine-url", engine_url, "--precision", precision,
        "--store", str(store_root), "--run", run_id, "--port", str(port),
        "--boot-model", str(boot_model), "--work-dir", str(work_dir or root / f"{name}-work"),
        *extra,
    ]  # fmt: skip
    if boot_version is not None:
        cmd += ["--boot-version", str(boot_version)]
    env = {"TETHER_AGENT_RETRY_INITIAL_S": "0.2", "TETHER_AGENT_RETRY_MAX_S": "1",
           "TETHER_AGENT_POINTER_POLL_S": "0.2", "TETHER_AGENT_ENGINE_PROBE_S": "0.3"}  # fmt: skip
    if control_plane is not None:
        cmd += ["--control-plane", control_plane.url]
        env["TETHER_TOKEN"] = control_plane.tokens["engine"]
    env.update(env_overrides or {})
    return start_process(
        name, cmd, root / f"{name}.log", url=f"http://127.0.0.1:{port}", env=env, wait=False
    )


def wait_agent(agent: ManagedProcess) -> ManagedProcess:
    """Until the agent's proxy answers `/server_info`."""
    return wait_ready(agent, "/server_info", deadline_s=AGENT_START_DEADLINE_S)


def server_info(agent: ManagedProcess) -> dict:
    reply = httpx.get(f"{agent.url}/server_info", timeout=10.0)
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_applied(agent: ManagedProcess, version: int, deadline_s: float = 60.0) -> dict:
    """Until the agent serves `version` and has nothing staged; return its server info."""

    def done() -> dict | None:
        if not agent.alive():
            raise AssertionError(f"{agent.name} exited:\n{agent.log_tail()}")
        info = server_info(agent)
        ok = info["applied_version"] == version and info["staging_target"] is None
        return info if ok else None

    return wait_until(done, deadline_s, f"{agent.name} to serve v{version}")


def generate(url: str, body: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=timeout)
