"""`tether demo --engines`: a count, or a precision and engine kind per engine."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from cli import app
from demo.settings import DemoSettings, parse_engines


def test_a_count_gives_reference_engines_in_bf16_fp8_nvfp4_turn() -> None:
    count, layout = parse_engines("4")
    settings = DemoSettings(engines=count, layout=layout)
    assert [settings.precision_of(i) for i in range(4)] == ["bf16", "fp8", "nvfp4", "bf16"]
    assert {settings.kind_of(i) for i in range(4)} == {"reference"}


def test_a_list_names_each_engine_and_the_kind_defaults_to_reference() -> None:
    count, layout = parse_engines("bf16:vllm, fp8:reference,nvfp4")
    settings = DemoSettings(engines=count, layout=layout)
    assert settings.engines == 3
    assert [(settings.precision_of(i), settings.kind_of(i)) for i in range(3)] == [
        ("bf16", "vllm"),
        ("fp8", "reference"),
        ("nvfp4", "reference"),
    ]


@pytest.mark.parametrize(
    ("given", "named"),
    [("bf16:sglang", "kind must be one of"), ("fp16", "precision must be one of"),
     ("fp8:vllm", "use bf16:vllm")],
)  # fmt: skip
def test_a_bad_engine_list_is_refused_before_anything_starts(given: str, named: str) -> None:
    result = CliRunner().invoke(app, ["demo", "--engines", given])
    assert result.exit_code != 0
    assert named in result.output
