"""The Modal app, checked offline: plan per pool, real-CLI command lines, the app it builds.

`modal` is not installed here (nor in CI). The plan is plain data; `build_app` is driven
with a small recording stand-in for the Modal SDK, an outside system, to check what it
would declare to Modal.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from deploy.cli import app as tether_app
from deploy.fleet import DEFAULT_SGLANG_FLAGS, load_fleet, parse_fleet
from deploy.modal_app import (
    CONTROL_PLANE_SLOT,
    REPLICA_URL_SLOT,
    ModalPlan,
    build_app,
    build_plan,
)
from tests.deploy.real_cli import parse_tether

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "fleet.example.toml"
CP_URL = "https://me--tether-controlplane.modal.run"
REPLICA_URL = "https://abc123.r5.modal.host"


@pytest.fixture(scope="module")
def plan() -> ModalPlan:
    return build_plan(load_fleet(EXAMPLE))


def test_module_imports_without_modal_and_builds_no_app() -> None:
    import deploy.modal_app

    assert importlib.util.find_spec("modal") is None
    assert deploy.modal_app.app is None


def test_every_declared_pool_gets_its_gpu_precision_image_replicas_and_secrets(
    plan: ModalPlan,
) -> None:
    fleet = load_fleet(EXAMPLE)
    assert [p.name for p in plan.pools] == [p.name for p in fleet.pools]
    expected_precision = {"b200": "nvfp4", "h100": "fp8", "a100": "bf16"}
    for pool, declared in zip(plan.pools, fleet.pools, strict=True):
        assert pool.gpu == declared.accelerator
        assert pool.precision == expected_precision[pool.name]
        assert pool.image.base == fleet.engine.image
        assert (pool.min_containers, pool.max_containers) == (
            declared.min_replicas,
            declared.max_replicas,
        )
        assert set(pool.secrets) == {fleet.engine.secret, fleet.store.secret}
        assert pool.volumes == {fleet.model.mount: fleet.model.volume}
        assert "engine_agent" in pool.image.local_packages


def test_engine_image_does_not_reinstall_what_sglang_ships(plan: ModalPlan) -> None:
    names = {req.split(">")[0].split("[")[0] for req in plan.pools[0].image.pip}
    assert not names & {"torch", "transformers"}
    assert {"zstandard", "xxhash", "boto3"} <= names


def test_control_plane_image_has_no_torch(plan: ModalPlan) -> None:
    assert not any(req.startswith("torch") for req in plan.controlplane.image.pip)


def test_control_plane_command_starts_without_the_engine_only_packages() -> None:
    # The control-plane image has no torch/transformers; `tether` must still load.
    script = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'safetensors', 'tokenizers'):\n"
        "    sys.modules[name] = None\n"
        "from typer.testing import CliRunner\n"
        "from deploy.cli import app\n"
        "result = CliRunner().invoke(app, ['controlplane', 'serve', '--help'])\n"
        "sys.exit(result.exit_code)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]


def test_agent_command_lines_parse_with_the_real_agent_parser(plan: ModalPlan) -> None:
    fleet = load_fleet(EXAMPLE)
    for pool in plan.pools:
        assert CONTROL_PLANE_SLOT in pool.agent_argv and REPLICA_URL_SLOT in pool.agent_argv
        command, params = parse_tether(pool.agent_argv_for(CP_URL, REPLICA_URL))
        assert command == "tether agent run"
        assert params["precision"] == pool.precision
        assert params["accelerator"] == pool.accelerator
        assert params["run_id"] == fleet.run
        assert params["store"] == fleet.store.url
        assert params["control_plane"] == CP_URL
        assert params["advertise_url"] == REPLICA_URL
        assert params["engine_url"] == f"http://127.0.0.1:{pool.sglang_port}"
        assert params["port"] == pool.agent_port
        assert f"pool={pool.name}" in params["label"]
        assert "--token" not in pool.agent_argv, "the token comes from the secret's env"


def test_quantized_pools_convert_the_boot_checkpoint_and_boot_sglang_on_it(
    plan: ModalPlan,
) -> None:
    for pool in plan.pools:
        sglang = list(pool.sglang_argv)
        model = sglang[sglang.index("--model-path") + 1]
        assert " ".join(DEFAULT_SGLANG_FLAGS[pool.precision]) in " ".join(sglang)
        assert sglang[sglang.index("--host") + 1] == "127.0.0.1"
        if pool.precision == "bf16":
            assert pool.convert_argv is None
            continue
        assert pool.convert_argv is not None
        command, params = parse_tether(pool.convert_argv)
        assert command == "tether model convert"
        assert params["precision"] == pool.precision
        assert str(params["out"]) == model


def test_control_plane_commands_parse_and_skip_migration_on_serve(plan: ModalPlan) -> None:
    command, params = parse_tether(plan.controlplane.serve_argv)
    assert command == "tether controlplane serve"
    assert params["no_migrate"] is True
    assert params["port"] == plan.controlplane.port
    assert parse_tether(plan.controlplane.migrate_argv)[0] == "tether controlplane migrate"


def test_real_parser_rejects_a_flag_the_agent_does_not_have() -> None:
    with pytest.raises(Exception, match="no-such-flag"):
        parse_tether(["tether", "agent", "run", "--no-such-flag", "x"])


def test_a_configured_control_plane_url_is_written_into_the_command_line() -> None:
    text = EXAMPLE.read_text().replace(
        '# url = "https://me--tether-controlplane.modal.run"', f'url = "{CP_URL}"'
    )
    plan = build_plan(parse_fleet(text))
    assert plan.control_plane_url == CP_URL
    assert CONTROL_PLANE_SLOT not in plan.pools[0].agent_argv
    _, params = parse_tether(plan.pools[0].agent_argv_for("unused", REPLICA_URL))
    assert params["control_plane"] == CP_URL


# ------------------------------------------------------------------ build_app, recorded


class _Recorder:
    """Records what `build_app` declares; shaped like the parts of the Modal SDK it uses."""

    def __init__(self) -> None:
        self.functions: dict[str, dict[str, Any]] = {}
        self.classes: dict[str, dict[str, Any]] = {}
        self.web_servers: list[dict[str, Any]] = []

    def module(self) -> types.ModuleType:
        rec = self
        modal = types.ModuleType("modal")

        class Image:
            def __init__(self, steps: list[tuple[str, Any]]) -> None:
                self.steps = steps

            @classmethod
            def from_registry(cls, tag: str) -> Image:
                return cls([("from_registry", tag)])

            def __getattr__(self, name: str) -> Any:
                return lambda *a, **k: Image([*self.steps, (name, a)])

        class App:
            def __init__(self, name: str) -> None:
                self.name = name

            def function(self, **kwargs: Any) -> Any:
                def register(f: Any) -> Any:
                    rec.functions[kwargs["name"]] = kwargs
                    return f

                return register

            def cls(self, **kwargs: Any) -> Any:
                def register(c: type) -> type:
                    rec.classes[c.__name__] = {**kwargs, "cls": c}
                    return c

                return register

        def web_server(port: int, startup_timeout: int) -> Any:
            rec.web_servers.append({"port": port, "startup_timeout": startup_timeout})
            return lambda f: f

        modal.App = App
        modal.Image = Image
        modal.Secret = types.SimpleNamespace(from_name=lambda n: ("secret", n))
        modal.Volume = types.SimpleNamespace(from_name=lambda n, **_: ("volume", n))
        modal.concurrent = lambda max_inputs: lambda f: f
        modal.web_server = web_server
        modal.enter = modal.exit = modal.method = lambda: lambda f: f
        return modal


def test_built_app_declares_one_gpu_class_per_pool_and_a_web_control_plane(
    plan: ModalPlan, monkeypatch: pytest.MonkeyPatch
) -> None:
    import deploy.modal_app as modal_app

    recorder = _Recorder()
    monkeypatch.setitem(sys.modules, "modal", recorder.module())
    monkeypatch.setattr(modal_app, "_PLAN", None)
    built = build_app(plan, EXAMPLE)
    assert built.name == plan.app_name
    assert recorder.web_servers == [{"port": plan.controlplane.port, "startup_timeout": 300}]
    cp = recorder.functions["controlplane"]
    assert [s for _, s in cp["secrets"]] == list(plan.controlplane.secrets)
    assert "migrate" in recorder.functions
    for pool in plan.pools:
        declared = recorder.classes[pool.class_name]
        assert declared["gpu"] == pool.gpu
        assert declared["min_containers"] == pool.min_containers
        assert declared["max_containers"] == pool.max_containers
        assert [s for _, s in declared["secrets"]] == list(pool.secrets)
        assert declared["image"].steps[0] == ("from_registry", pool.image.base)
        assert declared["cls"].pool_name == pool.name
        assert getattr(modal_app, pool.class_name) is declared["cls"]
    for pool in plan.pools:
        monkeypatch.delattr(modal_app, pool.class_name)


# ------------------------------------------------------------------ tether deploy modal


def test_dry_run_prints_every_pool_and_command_without_modal() -> None:
    result = CliRunner().invoke(
        tether_app, ["deploy", "modal", "--config", str(EXAMPLE), "--dry-run"], terminal_width=200
    )
    assert result.exit_code == 0, result.output
    for text in ("PoolB200", "PoolH100", "PoolA100", "nvfp4", "tether agent run", "migrate"):
        assert text in result.output
    assert "secrets to create: tether-controlplane, tether-engine, tether-store" in result.output


def test_deploy_without_the_modal_client_says_how_to_install_it() -> None:
    result = CliRunner().invoke(tether_app, ["deploy", "modal", "--config", str(EXAMPLE)])
    assert result.exit_code == 1
    assert "modal setup" in result.output


def test_bad_fleet_file_exits_2_with_the_problem(tmp_path: Path) -> None:
    bad = tmp_path / "fleet.toml"
    bad.write_text('run = "r"\n[[pools]]\nname = "x"\naccelerator = "T4"\n')
    result = CliRunner().invoke(tether_app, ["deploy", "modal", "--config", str(bad)])
    assert result.exit_code == 2
    assert "no precision for accelerator 'T4'" in result.output
    assert "Traceback" not in result.output
