"""The fleet file: precision per accelerator, SGLang flags per precision, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.fleet_config import (
    DEFAULT_PRECISION_TABLE,
    DEFAULT_SGLANG_FLAGS,
    DEFAULT_SGLANG_IMAGE,
    FleetConfigError,
    accelerator_family,
    load_fleet,
    parse_fleet,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "fleet.example.toml"


def one_pool(accelerator: str, extra: str = "", name: str = "p", sections: str = "") -> str:
    """A fleet with one pool; `sections` go between `run` and the pool (TOML order)."""
    pool = f'[[pools]]\nname = "{name}"\naccelerator = "{accelerator}"\n'
    return f'run = "r1"\n{sections}{pool}{extra}'


@pytest.mark.parametrize(
    ("accelerator", "precision"),
    [
        ("B200", "nvfp4"),
        ("B300", "nvfp4"),
        ("H100", "fp8"),
        ("H100!", "fp8"),
        ("H200", "fp8"),
        ("A100", "bf16"),
        ("A100-80GB", "bf16"),
        ("L40S", "bf16"),
    ],
)
def test_default_table_gives_each_accelerator_its_documented_precision(
    accelerator: str, precision: str
) -> None:
    fleet = parse_fleet(one_pool(accelerator))
    assert fleet.precision_for(fleet.pools[0]) == precision


def test_precision_section_overrides_the_default_for_its_accelerator_only() -> None:
    fleet = parse_fleet(one_pool("L40S", sections='[precision]\nL40S = "fp8"\n'))
    assert fleet.precision_for(fleet.pools[0]) == "fp8"
    assert fleet.precision_table()["A100"] == DEFAULT_PRECISION_TABLE["A100"]


def test_a_pools_own_precision_wins_over_the_table() -> None:
    fleet = parse_fleet(one_pool("H100", 'precision = "bf16"\n'))
    assert fleet.precision_for(fleet.pools[0]) == "bf16"


def test_unknown_accelerator_without_a_precision_is_rejected_with_the_fix() -> None:
    with pytest.raises(FleetConfigError, match=r"no precision for accelerator 'T4'.*\[precision\]"):
        parse_fleet(one_pool("T4"))


def test_sglang_flags_are_precision_defaults_then_common_then_pool_extras() -> None:
    text = one_pool(
        "H100",
        'sglang_flags = ["--disable-cuda-graph"]\n',
        sections='[sglang]\ncommon = ["--mem-fraction-static", "0.8"]\n',
    )
    fleet = parse_fleet(text)
    assert fleet.sglang_flags_for(fleet.pools[0]) == [
        *DEFAULT_SGLANG_FLAGS["fp8"],
        "--mem-fraction-static",
        "0.8",
        "--disable-cuda-graph",
    ]


def test_sglang_flags_section_replaces_a_precisions_defaults() -> None:
    flags = '[sglang.flags]\nfp8 = ["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]\n'
    fleet = parse_fleet(one_pool("H200", sections=flags))
    assert fleet.sglang_flags_for(fleet.pools[0]) == [
        "--quantization",
        "fp8",
        "--kv-cache-dtype",
        "fp8_e4m3",
    ]


def test_nvfp4_pools_launch_sglang_with_the_modelopt_fp4_method() -> None:
    fleet = parse_fleet(one_pool("B200"))
    flags = fleet.sglang_flags_for(fleet.pools[0])
    assert flags[flags.index("--quantization") + 1] == "modelopt_fp4"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('run = "r"\npools = []\n', "at least one"),
        (one_pool("H100") + one_pool("A100").replace('run = "r1"\n', ""), "unique"),
        (one_pool("H100", "min_replicas = 3\nmax_replicas = 2\n"), "min_replicas 3 > max"),
        (one_pool("H100", "gpu_type = 'x'\n"), "gpu_type"),
        (one_pool("H100", name="Bad_Name"), "lower-case"),
        (one_pool("H100", sections="[sglang.flags]\nint8 = []\n"), "int8"),
        ("run = [", "not valid TOML"),
    ],
)
def test_invalid_fleet_files_are_rejected_with_a_message_naming_the_problem(
    text: str, message: str
) -> None:
    with pytest.raises(FleetConfigError, match=message):
        parse_fleet(text)


def test_missing_fleet_file_points_at_the_example(tmp_path: Path) -> None:
    with pytest.raises(FleetConfigError, match=r"fleet\.example\.toml"):
        load_fleet(tmp_path / "absent.toml")


def test_example_fleet_parses_into_a_mixed_fleet_of_three_precisions() -> None:
    fleet = load_fleet(EXAMPLE)
    assert {fleet.precision_for(p) for p in fleet.pools} == {"nvfp4", "fp8", "bf16"}
    assert fleet.store.effective_url.startswith("s3://")


def test_a_volume_store_is_read_through_its_mount_as_a_local_folder() -> None:
    fleet = parse_fleet(one_pool("H100", sections='[store]\nvolume = "v"\nmount = "/store"\n'))
    assert fleet.store.effective_url == "file:///store"


def test_accelerator_family_strips_memory_size_count_and_exclusivity_marks() -> None:
    assert accelerator_family("a100-80gb") == "A100"
    assert accelerator_family("H100!") == "H100"
    assert accelerator_family("H200:8") == "H200"
    assert accelerator_family("B200+") == "B200"
    assert accelerator_family("H100!:2") == "H100"


def test_the_default_engine_image_is_a_pinned_cuda13_sglang_release() -> None:
    # Pinned, never `latest`; releases from 0.5.20 on publish CUDA 13 images only.
    repo, tag = DEFAULT_SGLANG_IMAGE.split(":")
    assert repo == "lmsysorg/sglang"
    assert tag.startswith("v0.5.") and tag.endswith("-cu130")
    assert parse_fleet(one_pool("H100")).engine.image == DEFAULT_SGLANG_IMAGE


def test_the_example_fleet_uses_the_default_engine_image() -> None:
    assert load_fleet(EXAMPLE).engine.image == DEFAULT_SGLANG_IMAGE


# Every option the precision defaults pass to `sglang.launch_server`, as SGLang's argument
# parser spells it (checked against SGLang's source; see docs/gpu-check.md).
SGLANG_OPTIONS = {"--dtype": {"bfloat16"}, "--quantization": {"fp8", "modelopt_fp4"}}


@pytest.mark.parametrize("precision", sorted(DEFAULT_SGLANG_FLAGS))
def test_precision_defaults_use_only_options_sglang_accepts(precision: str) -> None:
    flags = DEFAULT_SGLANG_FLAGS[precision]
    pairs = dict(zip(flags[::2], flags[1::2], strict=True))
    for option, value in pairs.items():
        assert value in SGLANG_OPTIONS[option], f"{precision}: {option} {value}"
