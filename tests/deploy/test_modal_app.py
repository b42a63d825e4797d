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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import app as tether_app
from deploy.fleet_config import DEFAULT_SGLANG_FLAGS, load_fleet, parse_fleet
from deploy.modal_app import (
    CONTROL_PLANE_SLOT,
    REPLICA_URL_SLOT,
    ModalPlan,
    build_app,
    build_plan,
)
from tests.fixtures.real_cli import parse_tether

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
        "from cli import app\n"
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
        assert params["control_plane"] == [CP_URL]
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
    assert params["control_plane"] == [CP_URL]


# ------------------------------------------------------------------ build_app, recorded

# The stand-in mirrors modal-client 1.5.4 (commit 69519aef, py/modal/app.py, _image.py,
# _partial_function.py): keyword-only parameters with those names, so a removed or
# renamed one (keep_warm, concurrency_limit, container_idle_timeout,
# allow_concurrent_inputs were dropped in 1.4) fails here with a TypeError.
_LOCAL_STEPS = {"add_local_file", "add_local_dir", "add_local_python_source"}


def _container_options(
    *,
    image: Any,
    secrets: list[Any] | None = None,
    volumes: dict[str, Any] | None = None,
    gpu: str | None = None,
    min_containers: int | None = None,
    max_containers: int | None = None,
    buffer_containers: int | None = None,
    scaledown_window: int | None = None,
    timeout: int = 300,
    startup_timeout: int | None = None,
) -> dict[str, Any]:
    """The options `App.function` and `App.cls` share, by their 1.5.4 names and defaults."""
    return dict(locals())


class _Recorder:
    """Records what `build_app` declares; shaped like the parts of the Modal SDK it uses."""

    def __init__(self) -> None:
        self.app_kwargs: dict[str, Any] = {}
        self.functions: dict[str, dict[str, Any]] = {}
        self.classes: dict[str, dict[str, Any]] = {}
        self.web_servers: list[dict[str, Any]] = []
        self.concurrent: list[int] = []
        self.secret_keys: dict[str, set[str]] = {}

    def module(self) -> types.ModuleType:
        rec = self
        modal = types.ModuleType("modal")

        class Image:
            def __init__(self, steps: list[tuple[str, Any]]) -> None:
                self.steps = steps

            @classmethod
            def from_registry(cls, tag: str, *, add_python: str | None = None) -> Image:
                return cls([("from_registry", tag)])

            def _then(self, name: str, args: tuple[Any, ...]) -> Image:
                # _image.py: no build step may follow an add_local_* without copy=True.
                if name not in _LOCAL_STEPS and any(n in _LOCAL_STEPS for n, _ in self.steps):
                    raise AssertionError(f"{name} after add_local_*: Modal refuses this image")
                return Image([*self.steps, (name, args)])

            def pip_install(self, *packages: str) -> Image:
                return self._then("pip_install", packages)

            def run_commands(self, *commands: str) -> Image:
                return self._then("run_commands", commands)

            def env(self, vars: dict[str, str]) -> Image:
                assert all(isinstance(v, str) for v in vars.values())
                return self._then("env", (vars,))

            def add_local_file(self, local_path: str, remote_path: str) -> Image:
                assert remote_path.startswith("/"), "Modal needs an absolute remote_path"
                assert Path(local_path).is_file(), local_path
                return self._then("add_local_file", (local_path, remote_path))

            def add_local_python_source(
                self,
                *modules: str,
                copy: bool = False,
                ignore: Sequence[str] | Callable[[Path], bool] = ("<only .py files>",),
            ) -> Image:
                for module in modules:
                    assert importlib.util.find_spec(module) is not None, module
                return self._then("add_local_python_source", (modules, ignore))

        class App:
            def __init__(self, name: str | None = None, *, include_source: bool = True) -> None:
                self.name = name
                rec.app_kwargs = {"name": name, "include_source": include_source}

            def function(self, *, name: str | None = None, **options: Any) -> Any:
                declared = {"name": name, **_container_options(**options)}

                def register(f: Any) -> Any:
                    rec.functions[name or f.__name__] = declared
                    return f

                return register

            def cls(self, **options: Any) -> Any:
                declared = _container_options(**options)

                def register(c: type) -> type:
                    rec.classes[c.__name__] = {**declared, "cls": c}
                    return c

                return register

        def web_server(port: int, *, startup_timeout: float = 5.0) -> Any:
            rec.web_servers.append({"port": port, "startup_timeout": startup_timeout})
            return lambda f: f

        def concurrent(*, max_inputs: int | None = None, target_inputs: int | None = None) -> Any:
            assert max_inputs is not None, "`@modal.concurrent()` needs max_inputs"
            rec.concurrent.append(max_inputs)
            return lambda f: f

        def lifecycle() -> Any:
            return lambda f: f

        def secret_from_name(name: str, *, required_keys: list[str] | None = None) -> Any:
            rec.secret_keys.setdefault(name, set()).update(required_keys or ())
            return ("secret", name)

        def volume_from_name(name: str, *, create_if_missing: bool = False) -> Any:
            return ("volume", name, create_if_missing)

        modal.App = App
        modal.Image = Image
        modal.Secret = types.SimpleNamespace(from_name=secret_from_name)
        modal.Volume = types.SimpleNamespace(from_name=volume_from_name)
        modal.concurrent = concurrent
        modal.web_server = web_server
        modal.enter = modal.exit = modal.method = lifecycle
        return modal


@pytest.fixture
def recorded(plan: ModalPlan, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[_Recorder, Any]]:
    import deploy.modal_app as modal_app

    recorder = _Recorder()
    monkeypatch.setitem(sys.modules, "modal", recorder.module())
    monkeypatch.setattr(modal_app, "_PLAN", None)
    built = build_app(plan, EXAMPLE)
    yield recorder, built
    for pool in plan.pools:
        monkeypatch.delattr(modal_app, pool.class_name, raising=False)


def test_built_app_declares_one_gpu_class_per_pool_and_a_web_control_plane(
    plan: ModalPlan, recorded: tuple[_Recorder, Any]
) -> None:
    import deploy.modal_app as modal_app

    recorder, built = recorded
    assert built.name == plan.app_name
    assert recorder.web_servers == [{"port": plan.controlplane.port, "startup_timeout": 300}]
    assert recorder.concurrent == [plan.controlplane.concurrency]
    cp = recorder.functions["controlplane"]
    assert [s for _, s in cp["secrets"]] == list(plan.controlplane.secrets)
    assert (cp["min_containers"], cp["max_containers"]) == (
        plan.controlplane.min_containers,
        plan.controlplane.max_containers,
    )
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


def test_replica_start_gets_the_whole_boot_budget_and_methods_a_short_timeout(
    plan: ModalPlan, recorded: tuple[_Recorder, Any]
) -> None:
    recorder, _ = recorded
    for pool in plan.pools:
        declared = recorder.classes[pool.class_name]
        waits = (3 if pool.convert_argv else 2) * pool.startup_timeout_s
        assert declared["startup_timeout"] == waits
        assert declared["timeout"] < pool.startup_timeout_s


def test_images_add_our_sources_pyproject_and_fleet_file_after_every_build_step(
    plan: ModalPlan, recorded: tuple[_Recorder, Any]
) -> None:
    from deploy.modal_app import CONTAINER_FLEET_PATH, CONTAINER_PYPROJECT_PATH, FLEET_ENV

    recorder, _ = recorded
    # The app does not also auto-mount `deploy`: the images carry every package.
    assert recorder.app_kwargs["include_source"] is False
    images = [recorder.functions["controlplane"]["image"]]
    images += [recorder.classes[p.class_name]["image"] for p in plan.pools]
    for image in images:
        names = [name for name, _ in image.steps]
        sources = names.index("add_local_python_source")
        assert names[sources - 2 : sources] == ["add_local_file", "add_local_file"]
        assert set(names[sources:]) == {"add_local_python_source"}
        remote = {args[1] for name, args in image.steps if name == "add_local_file"}
        # In a container the module rebuilds the plan from both files, at these paths.
        assert remote == {CONTAINER_FLEET_PATH, CONTAINER_PYPROJECT_PATH}
        env = next(args[0] for name, args in image.steps if name == "env")
        assert env[FLEET_ENV] == CONTAINER_FLEET_PATH


def test_plan_reads_its_requirements_from_the_container_path_of_pyproject() -> None:
    from deploy.modal_app import CONTAINER_PYPROJECT_PATH, PYPROJECT

    # Containers hold the packages in /root: the pyproject must sit beside them there.
    assert PYPROJECT.parent == Path(__file__).resolve().parents[2]
    assert Path(CONTAINER_PYPROJECT_PATH).parent == Path("/root")
    assert PYPROJECT.name == Path(CONTAINER_PYPROJECT_PATH).name


def test_tether_shim_puts_the_image_packages_on_the_path(tmp_path: Path) -> None:
    from deploy.modal_app import TETHER_SHIM

    shim = tmp_path / "tether"
    command = TETHER_SHIM.replace("/usr/local/bin/tether", str(shim))
    subprocess.run(["sh", "-c", command], check=True, timeout=30)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A stand-in interpreter that reports what the shim hands it.
    (bin_dir / "python3").write_text('#!/bin/sh\necho "$PYTHONPATH|$*"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": "/opt/x"}
    done = subprocess.run(
        [str(shim), "agent", "run", "--port", "8800"],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=30,
        check=True,
    )
    assert done.stdout.strip() == "/root:/opt/x|-m cli agent run --port 8800"


def test_only_gpu_strings_modal_documents_pass_the_check() -> None:
    from deploy.modal_app import gpu_type, unknown_gpu_types

    accepted = ["H100", "h200", "B200", "B200+", "H100!", "A100-80GB:2", "L40S", "a100"]
    assert unknown_gpu_types(accepted) == []
    assert unknown_gpu_types(["B300", "B300:2", "MI300X"]) == ["B300", "B300:2", "MI300X"]
    assert gpu_type("a100-80gb:4") == "A100-80GB"


# ------------------------------------------------------------------ tether deploy modal


def test_dry_run_prints_every_pool_and_command_without_modal() -> None:
    result = CliRunner().invoke(
        tether_app, ["deploy", "modal", "--config", str(EXAMPLE), "--dry-run"], terminal_width=200
    )
    assert result.exit_code == 0, result.output
    for text in ("PoolB200", "PoolH100", "PoolA100", "nvfp4", "tether agent run", "migrate"):
        assert text in result.output
    assert "secrets to create: tether-controlplane, tether-engine, tether-store" in result.output


def test_dry_run_says_b300_is_in_the_table_but_not_a_modal_gpu() -> None:
    result = CliRunner().invoke(
        tether_app, ["deploy", "modal", "--config", str(EXAMPLE), "--dry-run"], terminal_width=300
    )
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "B300 → nvfp4 is kept for other platforms, but B300 is not a Modal GPU type" in output
    assert "B200+" in output
    # The example's own pools all use names Modal offers.
    assert "Modal will refuse this deploy" not in output


def test_dry_run_warns_about_a_pool_on_a_gpu_modal_does_not_offer(tmp_path: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('run = "r"\n[[pools]]\nname = "b300"\naccelerator = "B300"\n')
    result = CliRunner().invoke(
        tether_app, ["deploy", "modal", "--config", str(fleet), "--dry-run"], terminal_width=300
    )
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "pool 'b300': gpu 'B300' is not a Modal GPU type" in output


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


def test_each_secret_must_hold_the_keys_its_processes_read(
    plan: ModalPlan, recorded: tuple[_Recorder, Any]
) -> None:
    recorder, _ = recorded
    fleet = load_fleet(EXAMPLE)
    assert plan.store_url.startswith("s3://")
    assert recorder.secret_keys == {
        fleet.controlplane.secret: {"TETHER_DB_URL"},
        fleet.engine.secret: {"TETHER_TOKEN"},
        fleet.store.secret: {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"},
    }


def test_images_carry_each_package_with_its_package_data(recorded: tuple[_Recorder, Any]) -> None:
    """Modal's `add_local_python_source` adds only `.py` files unless told otherwise; the
    images need the package data a wheel holds too (the dashboard, the warm-up delta)."""
    from deploy.modal_app import TETHER_PACKAGES

    recorder, _ = recorded
    images = [recorder.functions["controlplane"]["image"]]
    images += [declared["image"] for declared in recorder.classes.values()]
    for image in images:
        ignores = {
            args[0][0]: args[1] for name, args in image.steps if name == "add_local_python_source"
        }
        assert sorted(ignores) == sorted(TETHER_PACKAGES)

        def kept(package: str, path: str, ignores: dict[str, Any] = ignores) -> bool:
            return not ignores[package](Path(path))

        for package, path in [
            ("store", "codecs/warm.py"),
            ("store", "codecs/warm_delta/model-00000-of-00001.safetensors"),
            ("store", "codecs/warm_delta/model.safetensors.index.json"),
            ("controlplane", "static/dashboard.html"),
            ("controlplane", "static/dashboard.js"),
            ("controlplane", "migrations/script.py.mako"),
            ("deploy", "fleet.example.toml"),
            ("deploy", "k8s/config.yaml"),
        ]:
            assert kept(package, path), (package, path)
            assert (Path(__file__).resolve().parents[2] / package / path).is_file(), path
        for package, path in [
            ("store", "codecs/__pycache__/warm.cpython-311.pyc"),
            ("store", "codecs/__pycache__/sparse_kernels._rice_unpack_py-300.py311.nbi"),
            ("controlplane", ".secrets.json"),
            ("engine_agent", "notes.txt"),
            ("store", "codecs/warm_delta.bak/model.bin"),
        ]:
            assert not kept(package, path), (package, path)
