"""The Modal app for a mixed-accelerator fleet: the control plane plus one class per pool.

`build_plan(fleet)` turns a fleet file into plain data (images, GPUs, replicas, secrets,
volumes and the exact command lines of every container); `build_app(plan)` turns that plan
into a `modal.App`. Only `build_app` imports `modal`, so this module imports, and its plan
can be checked, on a machine without Modal or credentials.

Deploy with `tether deploy modal --config fleet.toml`, which runs
`python -m modal deploy -m deploy.modal_app` with `TETHER_FLEET_CONFIG` pointing at the
file, then calls the deployed `migrate` function once (`run_migration`). At import the
module builds `app` from that variable; inside a container the same fleet file and
`pyproject.toml` are added to the image, so both sides build the same plan and app.

Written against the Modal 1.x SDK (checked against modal-client 1.5.4): `App.cls` /
`App.function` with `min_containers`/`max_containers`/`startup_timeout` (1.2+),
`modal.concurrent`, `modal.web_server`, `modal.enter`/`modal.exit`, `modal.forward`.

Each replica container converts the base checkpoint to its pool's precision, starts SGLang
on loopback, opens a Modal tunnel to the agent's port (every replica needs its own address:
the control plane routes to one engine, not to a load balancer) and starts the agent with
that URL as its advertised address. SIGTERM reaches the agent first, so it deregisters.

Must never be imported by a package other than the CLI (`tether deploy`; ARCHITECTURE §1),
and must never import `modal` at module level: only `build_app`, `run_migration`
and the container hooks do.

Why over 500 lines: Modal imports one module into every container and looks the classes up
in it by name, so the plan, the images and the container hooks live together.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import threading
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.fleet_config import FleetConfig, PoolConfig, load_fleet
from deploy.replica import SGLANG_ENV, ReplicaSpec, agent_argv, convert_argv, sglang_argv

if TYPE_CHECKING:
    import modal

log = logging.getLogger(__name__)

FLEET_ENV = "TETHER_FLEET_CONFIG"
CONTAINER_FLEET_PATH = "/root/tether-fleet.toml"
# `project_requirements` reads the pyproject beside the packages; in a container the
# packages live in /root, so the file goes there too.
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
CONTAINER_PYPROJECT_PATH = "/root/pyproject.toml"
CONTROLPLANE_FUNCTION = "controlplane"
MIGRATE_FUNCTION = "migrate"
# Placeholders in a pool's agent command line, filled inside the container at start.
CONTROL_PLANE_SLOT = "{control_plane_url}"
REPLICA_URL_SLOT = "{replica_url}"

# The `gpu` strings Modal documents (modal.com/docs/guide/gpu, Aug 2026); a count may follow
# as `:N`. `H100!` pins H100 (plain `H100` may be upgraded to H200); `B200+` may run on a
# B200 or a B300. There is no plain `B300`: no pool can ask for one by that name.
MODAL_GPU_TYPES = frozenset(
    {
        "T4",
        "L4",
        "A10",
        "A10G",
        "L40S",
        "A100",
        "A100-40GB",
        "A100-80GB",
        "RTX-PRO-6000",
        "H100",
        "H100!",
        "H200",
        "B200",
        "B200+",
    }
)

# Packages the SGLang image already ships, at the versions SGLang was built against.
ENGINE_IMAGE_PROVIDES = frozenset(
    {"torch", "transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "numpy"}
)
# Source only (no dependencies): `tether` imports every noun's module, `bench` included.
TETHER_PACKAGES = (
    "store",
    "controlplane",
    "engine_agent",
    "trainer_client",
    "sandboxes",
    "deploy",
    "cli",
    "demo",
    "launcher",
    "reference_engine",
    "wire",
    "bench",
)
# The images get the source folders (in /root), not an installed wheel, so `tether` is a
# shim. It puts /root on the path itself: the child processes it starts must find the
# packages whatever the image's working directory is (SGLang's is /sgl-workspace/sglang).
TETHER_SHIM = (
    "printf '#!/bin/sh\\nexport PYTHONPATH=/root${PYTHONPATH:+:$PYTHONPATH}\\n"
    'exec python3 -m cli "$@"\\n\' > /usr/local/bin/tether'
    " && chmod +x /usr/local/bin/tether"
)
# Seconds for one call of a replica's `server_info` method (its inputs, not its start).
METHOD_TIMEOUT_S = 60


@dataclass(frozen=True)
class ImagePlan:
    """A container image: a registry base, pip requirements, shell steps, our packages."""

    base: str
    pip: tuple[str, ...]
    commands: tuple[str, ...]
    local_packages: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ControlPlanePlan:
    name: str
    image: ImagePlan
    secrets: tuple[str, ...]
    volumes: dict[str, str]
    port: int
    min_containers: int
    max_containers: int
    concurrency: int
    serve_argv: tuple[str, ...]
    migrate_argv: tuple[str, ...]


@dataclass(frozen=True)
class PoolPlan:
    """One Modal class: `min_containers..max_containers` replicas on `gpu`."""

    name: str
    class_name: str
    gpu: str
    accelerator: str
    precision: str
    image: ImagePlan
    secrets: tuple[str, ...]
    volumes: dict[str, str]
    min_containers: int
    max_containers: int
    startup_timeout_s: int
    agent_port: int
    sglang_port: int
    work_dir: str
    convert_argv: tuple[str, ...] | None
    sglang_argv: tuple[str, ...]
    agent_argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def container_startup_timeout_s(self) -> int:
        """Modal's `startup_timeout`: the enter hook waits up to `startup_timeout_s` for each
        of conversion (if any), SGLang's /health and the agent's /health, one after another."""
        steps = 3 if self.convert_argv else 2
        return steps * self.startup_timeout_s

    def agent_argv_for(self, control_plane_url: str, replica_url: str) -> list[str]:
        """The agent's command line with the container's real URLs filled in."""
        return [
            arg.replace(CONTROL_PLANE_SLOT, control_plane_url).replace(
                REPLICA_URL_SLOT, replica_url
            )
            for arg in self.agent_argv
        ]


@dataclass(frozen=True)
class ModalPlan:
    app_name: str
    run: str
    store_url: str
    control_plane_url: str | None
    controlplane: ControlPlanePlan
    pools: tuple[PoolPlan, ...]
    # Keys each secret must hold; Modal refuses the deploy when one is missing, instead
    # of replicas failing at start.
    secret_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def required_keys(self, secret: str) -> list[str]:
        return list(self.secret_keys.get(secret, ()))

    def pool(self, name: str) -> PoolPlan:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"no pool {name!r} in this plan; pools: {[p.name for p in self.pools]}")

    def commands(self) -> list[tuple[str, str]]:
        """(where, shell command) for every process the plan starts, in start order."""
        rows = [
            (f"{CONTROLPLANE_FUNCTION} (once)", shlex.join(self.controlplane.migrate_argv)),
            (CONTROLPLANE_FUNCTION, shlex.join(self.controlplane.serve_argv)),
        ]
        for pool in self.pools:
            if pool.convert_argv:
                rows.append((pool.class_name, shlex.join(pool.convert_argv)))
            rows.append((pool.class_name, shlex.join(pool.sglang_argv)))
            rows.append((pool.class_name, shlex.join(pool.agent_argv)))
        return rows


def class_name_for(pool: PoolConfig) -> str:
    """`h100-fast` → `PoolH100Fast`: a valid Python identifier and Modal class tag."""
    return "Pool" + "".join(part.capitalize() for part in pool.name.split("-"))


def project_requirements(*extras: str, exclude: frozenset[str] = frozenset()) -> tuple[str, ...]:
    """Requirements of the core package plus `extras`, read from pyproject.toml."""
    pyproject = PYPROJECT
    try:
        project = tomllib.loads(pyproject.read_text())["project"]
    except (OSError, KeyError) as exc:
        raise RuntimeError(
            f"cannot read the project's requirements from {pyproject}: deploy from a "
            "checkout of the Tether repository"
        ) from exc
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    kept: list[str] = []
    for req in requirements:
        name = req.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
        if name not in exclude and req not in kept:
            kept.append(req)
    return tuple(kept)


def gpu_type(gpu: str) -> str:
    """`a100-80gb:2` → `A100-80GB`: the type part of a Modal `gpu` string, as Modal spells it."""
    return gpu.split(":", 1)[0].strip().upper()


def unknown_gpu_types(gpus: list[str] | tuple[str, ...]) -> list[str]:
    """The `gpu` strings among `gpus` whose type is not one Modal documents."""
    return [gpu for gpu in gpus if gpu_type(gpu) not in MODAL_GPU_TYPES]


def _volumes(fleet: FleetConfig, with_model: bool) -> dict[str, str]:
    volumes: dict[str, str] = {}
    if with_model and fleet.model.volume:
        volumes[fleet.model.mount] = fleet.model.volume
    if fleet.store.volume:
        volumes[fleet.store.mount] = fleet.store.volume
    return volumes


def _secrets(*names: str | None) -> tuple[str, ...]:
    return tuple(n for n in names if n)


def _secret_keys(fleet: FleetConfig) -> dict[str, tuple[str, ...]]:
    """What each named secret must contain (a secret used for several roles needs all)."""
    wanted: list[tuple[str | None, tuple[str, ...]]] = [
        (fleet.controlplane.secret, ("TETHER_DB_URL",)),
        (fleet.engine.secret, ("TETHER_TOKEN",)),
    ]
    if fleet.store.effective_url.startswith("s3://"):
        wanted.append((fleet.store.secret, ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")))
    keys: dict[str, tuple[str, ...]] = {}
    for name, needed in wanted:
        if name:
            keys[name] = tuple(dict.fromkeys((*keys.get(name, ()), *needed)))
    return keys


def build_plan(fleet: FleetConfig) -> ModalPlan:
    """Everything the Modal app will create, as plain data."""
    store_url = fleet.store.effective_url
    cp = fleet.controlplane
    controlplane = ControlPlanePlan(
        name=CONTROLPLANE_FUNCTION,
        image=ImagePlan(
            base=cp.image,
            pip=project_requirements("controlplane", "s3"),
            commands=(TETHER_SHIM,),
            local_packages=TETHER_PACKAGES,
        ),
        secrets=_secrets(cp.secret, fleet.store.secret),
        volumes=_volumes(fleet, with_model=False),
        port=cp.port,
        min_containers=cp.min_replicas,
        max_containers=cp.max_replicas,
        concurrency=cp.concurrency,
        # The database URL and the admin token come from the secret (TETHER_DB_URL,
        # TETHER_ADMIN_TOKEN); migrations run once, from the `migrate` function.
        serve_argv=(
            "tether",
            "controlplane",
            "serve",
            "--store",
            store_url,
            "--host",
            "0.0.0.0",
            "--port",
            str(cp.port),
            "--no-migrate",
        ),
        migrate_argv=("tether", "controlplane", "migrate"),
    )
    engine_pip = project_requirements("agent", "s3", exclude=ENGINE_IMAGE_PROVIDES)
    pools = []
    for pool in fleet.pools:
        precision = fleet.precision_for(pool)
        spec = ReplicaSpec(
            precision=precision,
            accelerator=pool.accelerator,
            run=fleet.run,
            store_url=store_url,
            base_model=fleet.model.path,
            boot_version=fleet.model.boot_version,
            gpus=pool.gpus,
            sglang_flags=tuple(fleet.sglang_flags_for(pool)),
            control_plane_url=cp.url or CONTROL_PLANE_SLOT,
            advertise_url=REPLICA_URL_SLOT,
            sglang_port=fleet.engine.sglang_port,
            agent_port=fleet.engine.agent_port,
            work_dir=fleet.engine.work_dir,
            capacity=pool.capacity,
            labels={"pool": pool.name, **pool.labels},
        )
        converted = convert_argv(spec)
        pools.append(
            PoolPlan(
                name=pool.name,
                class_name=class_name_for(pool),
                gpu=pool.gpu,
                accelerator=pool.accelerator,
                precision=precision,
                image=ImagePlan(
                    base=pool.image or fleet.engine.image,
                    pip=engine_pip,
                    commands=(TETHER_SHIM,),
                    local_packages=TETHER_PACKAGES,
                    env=dict(SGLANG_ENV),
                ),
                secrets=_secrets(fleet.engine.secret, fleet.store.secret),
                volumes=_volumes(fleet, with_model=True),
                min_containers=pool.min_replicas,
                max_containers=pool.max_replicas,
                startup_timeout_s=fleet.engine.startup_timeout_s,
                agent_port=fleet.engine.agent_port,
                sglang_port=fleet.engine.sglang_port,
                work_dir=fleet.engine.work_dir,
                convert_argv=tuple(converted) if converted else None,
                sglang_argv=tuple(sglang_argv(spec, python="python3")),
                agent_argv=tuple(agent_argv(spec)),
                env=dict(SGLANG_ENV),
            )
        )
    return ModalPlan(
        app_name=fleet.app,
        run=fleet.run,
        store_url=store_url,
        control_plane_url=cp.url,
        controlplane=controlplane,
        pools=tuple(pools),
        secret_keys=_secret_keys(fleet),
    )


# ----------------------------------------------------------------------------- Modal side
# Everything below runs only where `modal` is installed: on the deploying machine (to
# describe the app) and inside the containers (to run it).

_PLAN: ModalPlan | None = None


def _image(spec: ImagePlan, fleet_file: Path | None) -> modal.Image:
    import modal

    image = modal.Image.from_registry(spec.base)
    if spec.pip:
        image = image.pip_install(*spec.pip)
    if spec.commands:
        image = image.run_commands(*spec.commands)
    image = image.env({**spec.env, FLEET_ENV: CONTAINER_FLEET_PATH})
    # Modal allows no build step after an `add_local_*` (mounted at start): these go last.
    if fleet_file is not None:
        image = image.add_local_file(str(fleet_file), CONTAINER_FLEET_PATH)
    image = image.add_local_file(str(PYPROJECT), CONTAINER_PYPROJECT_PATH)
    data = package_data(PYPROJECT)
    for package in spec.local_packages:
        image = image.add_local_python_source(package, ignore=not_package_file(package, data))
    return image


def package_data(pyproject: Path) -> dict[str, list[str]]:
    """pyproject's `[tool.setuptools.package-data]`: the files besides `.py` that a package
    needs (the dashboard's static files, the codecs' warm-up delta), by package ("*": any)."""
    table = tomllib.loads(pyproject.read_text())
    data: dict[str, list[str]] = table.get("tool", {}).get("setuptools", {}).get("package-data", {})
    return data


def not_package_file(package: str, data: dict[str, list[str]]) -> Callable[[Path], bool]:
    """Modal's `ignore` for the folder of `package` (paths relative to it): keep `.py` files
    and the package data a wheel of the project would hold; drop the rest, bytecode and
    numba's caches (`__pycache__`, keyed by the building machine's CPU) and dot-files.
    Modal's own default keeps only `.py` files, which left the images without them."""

    def ignore(path: Path) -> bool:
        parts = path.parts
        if any(part == "__pycache__" or part.startswith(".") for part in parts):
            return True
        if path.suffix == ".py":
            return False
        for depth in range(len(parts)):  # each package the file lies under, innermost last
            owner = ".".join((package, *parts[:depth]))
            inside = "/".join(parts[depth:])
            for key, patterns in data.items():
                if key in ("*", owner) and any(fnmatch(inside, pattern) for pattern in patterns):
                    return False
        return True

    return ignore


def _volume_map(volumes: dict[str, str]) -> dict[str, Any]:
    import modal

    return {
        mount: modal.Volume.from_name(name, create_if_missing=True)
        for mount, name in volumes.items()
    }


def serve_controlplane() -> None:
    """Start the control plane; Modal's web_server waits for its port."""
    import subprocess

    assert _PLAN is not None, "the Modal app was built without a plan"
    subprocess.Popen(list(_PLAN.controlplane.serve_argv))


def migrate() -> str:
    """Bring the PostgreSQL schema up to date (run once per deploy)."""
    import subprocess

    assert _PLAN is not None, "the Modal app was built without a plan"
    done = subprocess.run(
        list(_PLAN.controlplane.migrate_argv), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"migration failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout.strip()


def _control_plane_url(plan: ModalPlan) -> str:
    if plan.control_plane_url:
        return plan.control_plane_url
    import modal

    url = modal.Function.from_name(plan.app_name, CONTROLPLANE_FUNCTION).get_web_url()
    if not url:
        raise RuntimeError(
            f"the control plane of app {plan.app_name!r} has no web URL; deploy it first "
            "or set [controlplane] url in the fleet file"
        )
    return url


def replica_start(self: Any) -> None:
    """Container start: convert, SGLang, tunnel, agent; then watch both children."""
    import modal

    from launcher.processes import ProcessFailed, ProcessGroup, log_tail

    assert _PLAN is not None, "the Modal app was built without a plan"
    pool = _PLAN.pool(self.pool_name)
    self.group = ProcessGroup(Path(pool.work_dir) / "logs")
    if pool.convert_argv:
        converter = self.group.start("convert", pool.convert_argv)
        if converter.process.wait(timeout=pool.startup_timeout_s) != 0:
            raise ProcessFailed(
                f"boot conversion failed; log {converter.log_path}:\n{log_tail(converter.log_path)}"
            )
    self.sglang = self.group.start(
        "sglang", pool.sglang_argv, env=pool.env, url=f"http://127.0.0.1:{pool.sglang_port}"
    )
    self.sglang.wait_http("/health", pool.startup_timeout_s)
    self.tunnel_context = modal.forward(pool.agent_port)
    tunnel = self.tunnel_context.__enter__()
    argv = pool.agent_argv_for(_control_plane_url(_PLAN), tunnel.url)
    self.agent = self.group.start("agent", argv, url=f"http://127.0.0.1:{pool.agent_port}")
    # 503 until the first catch-up completes, then 200: the replica is in routing.
    self.agent.wait_http("/health", pool.startup_timeout_s)
    log.info("replica of pool %s serving at %s", pool.name, tunnel.url)
    threading.Thread(target=_watch, args=(self,), daemon=True).start()


def _watch(self: Any) -> None:
    """A dead engine or a terminal agent ends the container; Modal starts a fresh one."""
    import time

    while self.agent.alive() and self.sglang.alive():
        time.sleep(2.0)
    log.error("a replica process exited; stopping the container")
    replica_stop(self)
    os._exit(1)


def replica_stop(self: Any) -> None:
    """Agent first (it deregisters and stops routing here), then the engine."""
    for name, grace_s in (("agent", 60.0), ("sglang", 30.0)):
        process = getattr(self, name, None)
        if process is not None:
            process.stop(grace_s=grace_s)
    context = getattr(self, "tunnel_context", None)
    if context is not None:
        context.__exit__(None, None, None)
        self.tunnel_context = None


def replica_server_info(self: Any) -> dict[str, Any]:
    """The agent's /server_info (applied version, sync state, timings), for
    `modal.Cls.from_name(app, "PoolH100")().server_info.remote()`."""
    import httpx

    assert _PLAN is not None
    port = _PLAN.pool(self.pool_name).agent_port
    return httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10.0).json()


def _modal_secrets(plan: ModalPlan, names: tuple[str, ...]) -> list[Any]:
    import modal

    return [modal.Secret.from_name(n, required_keys=plan.required_keys(n)) for n in names]


def build_app(plan: ModalPlan, fleet_file: Path | None = None) -> modal.App:
    """The `modal.App` for `plan`; needs `modal` installed (not credentials)."""
    import modal

    global _PLAN
    _PLAN = plan
    # Every image adds our packages itself, so Modal need not mount this module's package.
    app = modal.App(plan.app_name, include_source=False)
    cp = plan.controlplane
    cp_image = _image(cp.image, fleet_file)
    app.function(
        image=cp_image,
        name=CONTROLPLANE_FUNCTION,
        secrets=_modal_secrets(plan, cp.secrets),
        volumes=_volume_map(cp.volumes),
        min_containers=cp.min_containers,
        max_containers=cp.max_containers,
    )(
        modal.concurrent(max_inputs=cp.concurrency)(
            modal.web_server(port=cp.port, startup_timeout=300)(serve_controlplane)
        )
    )
    app.function(
        image=cp_image,
        name=MIGRATE_FUNCTION,
        secrets=_modal_secrets(plan, cp.secrets),
        timeout=600,
    )(migrate)
    for pool in plan.pools:
        body = {
            "__module__": __name__,
            "__qualname__": pool.class_name,
            "pool_name": pool.name,
            "start": modal.enter()(replica_start),
            "stop": modal.exit()(replica_stop),
            "server_info": modal.method()(replica_server_info),
        }
        replica_cls = type(pool.class_name, (), body)
        # Containers import this module and look the class up by name.
        globals()[pool.class_name] = app.cls(
            image=_image(pool.image, fleet_file),
            gpu=pool.gpu,
            secrets=_modal_secrets(plan, pool.secrets),
            volumes=_volume_map(pool.volumes),
            min_containers=pool.min_containers,
            max_containers=pool.max_containers,
            startup_timeout=pool.container_startup_timeout_s,
            timeout=METHOD_TIMEOUT_S,
        )(replica_cls)
    return app


def run_migration(app_name: str) -> str:
    """Call the deployed app's `migrate` function once; return the schema head it reports.

    A call on the deployed function, not `modal run`: that would start an ephemeral copy
    of the whole app (control plane and GPU pools) just to run one function."""
    import modal

    return modal.Function.from_name(app_name, MIGRATE_FUNCTION).remote()


def _app_from_environment() -> modal.App | None:
    path = os.environ.get(FLEET_ENV)
    if not path or importlib.util.find_spec("modal") is None:
        return None
    return build_app(build_plan(load_fleet(path)), Path(path))


app = _app_from_environment()
