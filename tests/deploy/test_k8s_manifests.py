"""The Kubernetes manifests: every command parses with the real CLI, probes hit real routes.

Kubernetes expands `$(VAR)` in a container's args from its environment; these tests expand
them the same way (ConfigMap, literal values, a stand-in pod IP) before parsing, so an
undefined variable fails here too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from deploy.fleet_config import DEFAULT_SGLANG_FLAGS
from tests.fixtures.real_cli import parse_tether

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
POD_IP = "10.1.2.3"
AGENT_PORT = 8800
CONTROLPLANE_PORT = 8700


REPO = K8S.parents[1]
# `make install` puts checkov in its own environment: its pins clash with the project's.
CHECKOV_TOOL = REPO / ".venv" / "checkov" / "bin" / "checkov"


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
        assert params["control_plane"] == [CONFIG["TETHER_CONTROL_PLANE"]]
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
    from controlplane.settings import ControlPlaneSettings
    from engine_agent.gate import AdmissionGate
    from engine_agent.proxy import VersionedProxy
    from engine_agent.status import AgentStatus
    from wire import Precision

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


@pytest.mark.parametrize(
    "doc", [pytest.param(d, id=f"{d['kind']}/{d['metadata']['name']}") for d in DOCS]
)
def test_every_manifest_is_valid_for_the_kubernetes_api_schema(doc: dict[str, Any]) -> None:
    # Offline: the package carries the API's OpenAPI schemas. strict refuses unknown fields,
    # which is how a misspelt key (a probe that is never configured) would slip through.
    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def checkov_binary() -> str:
    found = os.environ.get("TETHER_CHECKOV") or (
        str(CHECKOV_TOOL) if CHECKOV_TOOL.exists() else shutil.which("checkov")
    )
    if not found:
        pytest.skip("checkov is not installed: `make install` puts it in .venv/checkov")
    return found


def test_the_policy_scanner_finds_nothing_and_every_accepted_finding_says_why() -> None:
    # --skip-download keeps checkov offline (no guideline or policy fetch).
    flags = ["--framework", "kubernetes", "--skip-download", "-o", "json"]
    scan = subprocess.run(
        [checkov_binary(), "-d", str(K8S), *flags],
        capture_output=True,
        text=True,
        timeout=240,
    )
    report = json.loads(scan.stdout)
    failed = [f"{c['check_id']} {c['resource']}" for c in report["results"]["failed_checks"]]
    assert failed == [], f"checkov findings: {failed}"
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["passed"] > 100, "checkov checked the manifests"
    for skipped in report["results"]["skipped_checks"]:
        reason = skipped["check_result"].get("suppress_comment", "")
        assert len(reason) > 20, f"{skipped['check_id']} skipped without a reason"


def listen_address(c: dict[str, Any]) -> tuple[str, int]:
    """The host and port the container's own command binds (its --host/--port flags)."""
    args = command_line(c)
    assert "--port" in args and "--host" in args, f"{c['name']}: no --host/--port to probe"
    return args[args.index("--host") + 1], int(args[args.index("--port") + 1])


def probe_target(c: dict[str, Any], probe: dict[str, Any]) -> tuple[str, int]:
    """The host and port a kubelet probe dials: the pod IP for httpGet/tcpSocket, whatever
    URL an exec probe opens from inside the container."""
    if "exec" in probe:
        joined = " ".join(probe["exec"]["command"])
        match = re.search(r"http://([\w.]+):(\d+)/", joined)
        assert match, f"{c['name']}: exec probe opens no URL: {joined}"
        return match.group(1), int(match.group(2))
    action = probe.get("httpGet") or probe["tcpSocket"]
    port = action["port"]
    if isinstance(port, str):
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == port)
    return action.get("host", POD_IP), port


def probed_containers() -> list[Any]:
    return [
        pytest.param(c, kind, id=f"{name}/{c['name']}/{kind}")
        for name, spec in pod_specs()
        for c in containers(spec)
        for kind in ("startupProbe", "readinessProbe", "livenessProbe")
        if kind in c
    ]


@pytest.mark.parametrize(("spec", "kind"), probed_containers())
def test_every_probe_dials_the_address_its_container_listens_on(
    spec: dict[str, Any], kind: str
) -> None:
    host, port = listen_address(spec)
    probe_host, probe_port = probe_target(spec, spec[kind])
    assert probe_port == port, f"{kind} dials port {probe_port}, the command binds {port}"
    reachable = {"0.0.0.0": {POD_IP, "127.0.0.1"}, "127.0.0.1": {"127.0.0.1"}}[host]
    assert probe_host in reachable, f"{kind} dials {probe_host}, the command binds {host}"


def test_the_probe_check_refuses_an_http_probe_on_a_loopback_engine() -> None:
    # The defect that shipped: SGLang bound 127.0.0.1 while the kubelet dialled the pod IP.
    sglang = container(engine_pools()[0][1], "sglang")
    broken = {"httpGet": {"path": "/health", "port": listen_address(sglang)[1]}}
    with pytest.raises(AssertionError, match=re.escape(f"dials {POD_IP}")):
        test_every_probe_dials_the_address_its_container_listens_on(
            {**sglang, "livenessProbe": broken}, "livenessProbe"
        )
