"""The command lines of one rollout replica: boot conversion, SGLang, and the Tether agent.

A replica is three steps on one machine: convert the base BF16 checkpoint to the pool's
precision (skipped for BF16), start SGLang on loopback on that folder, then start the agent
beside it, which registers its proxy URL with the control plane and keeps SGLang on the
target version. The Modal app, the Kubernetes manifests (by test) and the GPU check all use
these exact argument lists, so one place decides them.

Must never start a process or read the environment: it returns lists of strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SGLANG_MODULE = "sglang.launch_server"

# SGLang's /health runs a one-token generation that waits behind a pause and 503s after
# 20 s; the agent pauses the engine for every commit, so health must not generate.
SGLANG_ENV: dict[str, str] = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}


@dataclass(frozen=True)
class ReplicaSpec:
    """Everything that decides a replica's command lines."""

    precision: str
    accelerator: str
    run: str
    store_url: str
    base_model: str
    boot_version: int = 0
    gpus: int = 1
    sglang_flags: tuple[str, ...] = ()
    control_plane_url: str | None = None
    advertise_url: str | None = None
    sglang_port: int = 30000
    agent_port: int = 8800
    agent_host: str = "0.0.0.0"
    work_dir: str = "/tmp/tether"
    capacity: int = 64
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.sglang_port}"

    @property
    def boot_dir(self) -> str:
        """The folder SGLang boots from: the base itself for BF16, else its conversion."""
        if self.precision == "bf16":
            return self.base_model
        return f"{self.work_dir}/boot-{self.precision}"


def convert_argv(spec: ReplicaSpec) -> list[str] | None:
    """`tether model convert ...` for the boot checkpoint, or None when BF16 needs none."""
    if spec.precision == "bf16":
        return None
    return [
        "tether",
        "model",
        "convert",
        "--src",
        spec.base_model,
        "--precision",
        spec.precision,
        "--out",
        spec.boot_dir,
    ]


def sglang_argv(spec: ReplicaSpec, python: str = "python") -> list[str]:
    """SGLang on loopback only: clients reach it through the agent's versioned proxy."""
    argv = [
        python,
        "-m",
        SGLANG_MODULE,
        "--model-path",
        spec.boot_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.sglang_port),
        "--weight-version",
        str(spec.boot_version),
    ]
    if spec.gpus > 1:
        argv += ["--tp-size", str(spec.gpus)]
    return argv + list(spec.sglang_flags)


def agent_argv(spec: ReplicaSpec) -> list[str]:
    """`tether agent run ...`; the token comes from TETHER_TOKEN, never the command line."""
    argv = [
        "tether",
        "agent",
        "run",
        "--engine-url",
        spec.engine_url,
        "--precision",
        spec.precision,
        "--run",
        spec.run,
        "--store",
        spec.store_url,
    ]
    if spec.control_plane_url:
        argv += ["--control-plane", spec.control_plane_url]
    argv += ["--host", spec.agent_host, "--port", str(spec.agent_port)]
    if spec.advertise_url:
        argv += ["--advertise-url", spec.advertise_url]
    argv += [
        "--boot-model",
        spec.base_model,
        "--boot-version",
        str(spec.boot_version),
        "--work-dir",
        f"{spec.work_dir}/agent",
        "--accelerator",
        spec.accelerator,
        "--capacity",
        str(spec.capacity),
    ]
    for key, value in sorted(spec.labels.items()):
        argv += ["--label", f"{key}={value}"]
    return argv
