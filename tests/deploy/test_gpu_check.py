"""The GPU check imports and plans without a GPU; its agent command parses for real.

Running it needs an NVIDIA GPU and SGLang (see docs/gpu-check.md); CI only holds it to its
interface here.
"""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from deploy import gpu_check
from deploy.replica import agent_argv
from tests.fixtures.real_cli import parse_tether


def test_help_describes_the_check_without_touching_a_gpu() -> None:
    result = CliRunner().invoke(gpu_check.app, ["--help"])
    assert result.exit_code == 0
    assert "--plan" in result.output and "--engine" in result.output


def test_plan_prints_both_engines_and_agents_and_runs_nothing(tmp_path: Path) -> None:
    work = tmp_path / "never-created"
    result = CliRunner().invoke(
        gpu_check.app, ["--plan", "--work-dir", str(work)], terminal_width=400
    )
    assert result.exit_code == 0, result.output
    assert "sglang.launch_server" in result.output
    assert "--quantization fp8" in result.output
    assert result.output.count("tether agent run") == 2
    assert not work.exists()


def test_checked_agents_use_command_lines_the_real_parser_accepts(tmp_path: Path) -> None:
    for precision in gpu_check.PRECISIONS:
        spec = gpu_check.replica_spec(tmp_path, precision, False, f"file://{tmp_path}/store")
        command, params = parse_tether(agent_argv(spec))
        assert command == "tether agent run"
        assert params["precision"] == precision
        assert not params["control_plane"], "the check follows the store pointer alone"


def test_an_unknown_engine_kind_is_refused_with_exit_code_2(tmp_path: Path) -> None:
    result = CliRunner().invoke(gpu_check.app, ["--engine", "vllm", "--work-dir", str(tmp_path)])
    assert result.exit_code == 2


def test_engine_flags_are_ones_sglang_launch_server_defines() -> None:
    # Spellings checked against SGLang's server arguments (see docs/gpu-check.md).
    known = {
        "--dtype", "--quantization", "--mem-fraction-static", "--random-seed",
        "--context-length", "--log-level", "--disable-radix-cache", "--disable-cuda-graph",
    }  # fmt: skip
    for precision in gpu_check.PRECISIONS:
        flags = gpu_check.engine_flags(precision, cuda_graph=False)
        assert {f for f in flags if f.startswith("--")} <= known


def test_nvfp4_is_checked_where_the_gpu_runs_it_natively_and_in_the_rehearsal() -> None:
    assert gpu_check.checked_precisions("sglang", (9, 0)) == ("bf16", "fp8")
    assert gpu_check.checked_precisions("sglang", None) == ("bf16", "fp8")
    assert gpu_check.checked_precisions("sglang", (10, 0))[-1] == "nvfp4"
    assert gpu_check.checked_precisions("reference", None)[-1] == "nvfp4"
    spec = gpu_check.replica_spec(Path("/w"), "nvfp4", False, "file:///w/store")
    assert "modelopt_fp4" in gpu_check.engine_flags("nvfp4", cuda_graph=False)
    assert spec.boot_dir == "/w/nvfp4/boot-nvfp4"
