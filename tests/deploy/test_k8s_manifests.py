"""The Kubernetes manifests: every command parses with the real CLI, probes hit real routes.

Kubernetes expands `$(VAR)` in a container's args from its environment; these tests expand
them the same way (ConfigMap, literal values, a stand-in pod IP) before parsing, so an
undefined variable fails here too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from deploy.fleet import DEFAULT_SGLANG_FLAGS
from tests.deploy.real_cli import parse_tether

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
POD_IP = "10.1.2.3"
AGENT_PORT = 8800
CONTROLPLANE_PORT = 8700


def load_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = load_documents()
CONFIG = next(d for d in DOCS if d["kind"] == "ConfigMap")["data"]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in DOCS if d["kind"] == kind]


def pod_specs() -> list[tuple[str, dict[str, Any]]]:
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in DOCS
        if "spec" in d and "template" in d["spec"]
    ]


def engine_pools() -> list[tuple[str, dict[str, Any]]]:
    return [(n, s) for n, s in pod_specs() if n.startswith("tether-pool-")]


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in containers(spec) if c["name"] == name)


def environment(c: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(CONFIG)
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[var["name"]] = POD_IP
        else:
            env[var["name"]] = f"<secret {var['name']}>"
    return env


def command_line(c: dict[str, Any]) -> list[str]:
    env = environment(c)

    def expand(arg: str) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group(1)
            assert name in env, f"container {c['name']}: $({name}) is not in its environment"
            return env[name]

        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, str(arg))

    return [expand(a) for a in [*c.get("command", []), *c.get("args", [])]]


def tether_containers() -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{name}/{c['name']}", c)
        for name, spec in pod_specs()
        for c in containers(spec)
        if c.get("command", [None])[0] == "tether"
    ]


def test_manifests_hold_the_control_plane_migrations_and_two_engine_pools() -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in DOCS}
    assert ("Deployment", "tether-controlplane") in names
    assert ("Service", "tether-controlplane") in names
    assert ("Job", "tether-migrate") in names
    assert len(engine_pools()) == 2


def test_kustomization_lists_every_manifest_file() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.parametrize("spec", [pytest.param(c, id=w) for w, c in tether_containers()])
def test_every_tether_command_parses_with_the_real_cli(spec: dict[str, Any]) -> None:
    command, _ = parse_tether(command_line(spec))
    assert command in {
        "tether agent run",
        "tether controlplane serve",
        "tether controlplane migrate",
        "tether model convert",
    }


def test_agents_advertise_their_pod_address_and_follow_the_configured_run() -> None:
    for name, spec in engine_pools():
        _, params = parse_tether(command_line(container(spec, "agent")))
        assert params["advertise_url"] == f"http://{POD_IP}:{AGENT_PORT}", name
        assert params["port"] == AGENT_PORT
        assert params["run_id"] == CONFIG["TETHER_RUN"]
        assert params["store"] == CONFIG["TETHER_STORE"]
        assert params["control_plane"] == CONFIG["TETHER_CONTROL_PLANE"]
        assert params["engine_url"] == "http://127.0.0.1:30000"


def test_engine_boots_the_folder_its_precision_needs_with_that_precisions_flags() -> None:
    for name, spec in engine_pools():
        _, agent = parse_tether(command_line(container(spec, "agent")))
        sglang = command_line(container(spec, "sglang"))
        precision = agent["precision"]
        flags = DEFAULT_SGLANG_FLAGS[precision]
        joined = " ".join(sglang)
        assert " ".join(flags) in joined, f"{name}: {precision} needs {flags}"
        model = sglang[sglang.index("--model-path") + 1]
        if precision == "bf16":
            assert model == str(agent["boot_model"]), name
        else:
            _, convert = parse_tether(command_line(container(spec, "convert-boot")))
            assert convert["precision"] == precision
            assert str(convert["out"]) == model
            assert str(convert["src"]) == str(agent["boot_model"])
        assert sglang[sglang.index("--host") + 1] == "127.0.0.1", "SGLang stays on loopback"


def test_engine_pools_request_a_gpu_and_probe_the_agents_health_route() -> None:
    for name, spec in engine_pools():
        sglang = container(spec, "sglang")
        agent = container(spec, "agent")
        assert sglang["resources"]["limits"]["nvidia.com/gpu"] >= 1, name
        probe = agent["readinessProbe"]["httpGet"]
        assert probe["path"] == "/health"
        assert probe["port"] in ("agent", AGENT_PORT)


def test_pods_give_the_agent_time_to_deregister_before_the_engine_stops() -> None:
    for name, spec in engine_pools():
        assert spec["terminationGracePeriodSeconds"] >= 60, name
        pre_stop = " ".join(container(spec, "sglang")["lifecycle"]["preStop"]["exec"]["command"])
        assert f"/dev/tcp/127.0.0.1/{AGENT_PORT}" in pre_stop
        env = environment(container(spec, "agent"))
        assert env["TETHER_TOKEN"].startswith("<secret")


def test_control_plane_probes_and_secrets() -> None:
    spec = dict(pod_specs())["tether-controlplane"]
    cp = container(spec, "controlplane")
    assert cp["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert cp["livenessProbe"]["httpGet"]["path"] == "/healthz"
    env = environment(cp)
    assert env["TETHER_DB_URL"].startswith("<secret")
    _, params = parse_tether(command_line(cp))
    assert params["port"] == CONTROLPLANE_PORT
    assert params["no_migrate"] is True, "replicas must not race the migration Job"
    service = of_kind("Service")[0]
    assert service["spec"]["ports"][0]["port"] == CONTROLPLANE_PORT


def test_probed_routes_exist_on_the_real_control_plane_and_agent(tmp_path: Path) -> None:
    from controlplane.app import create_app
    from controlplane.schema import Precision
    from controlplane.settings import ControlPlaneSettings
    from engine_agent.gate import AdmissionGate
    from engine_agent.proxy import VersionedProxy
    from engine_agent.status import AgentStatus

    settings = ControlPlaneSettings(db_url=f"sqlite:///{tmp_path}/cp.db", store=str(tmp_path))
    cp_routes = {r.path for r in create_app(settings).routes}
    assert {"/healthz", "/readyz"} <= cp_routes
    proxy = VersionedProxy(
        engine_url="http://127.0.0.1:9",
        gate=AdmissionGate(),
        status=AgentStatus(),
        precision=Precision("fp8"),
        run_id="r",
        server_info=dict,
    )
    assert "/health" in {r.path for r in proxy.app().routes}
