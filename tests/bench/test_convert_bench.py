"""The conversion benchmark runs on a small Qwen3-shaped checkpoint and proves identity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_convert_bench_reports_rates_and_bitwise_identity_as_the_last_json_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.convert", "--hidden", "256", "--layers", "2",
         "--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--intermediate", "512",
         "--vocab", "512", "--repeats", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )  # fmt: skip
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["bitwise_identical"] is True
    for key in (
        "full_fp8_gb_s",
        "full_nvfp4_gb_s",
        "incremental_fp8_gb_s_at_0_25pct",
        "incremental_nvfp4_gb_s_at_0_25pct",
        "incremental_nvfp4_gb_s_cpu_at_0_25pct",
        "incremental_fp8_with_diff_gb_s_at_5pct",
        "agent_fp8_gb_s_at_0_25pct",
        "agent_nvfp4_gb_s_at_0_25pct",
        "agent_nvfp4_gb_s_cpu_at_0_25pct",
        "adversarial_nvfp4_gb_s_at_0_25pct",
    ):
        assert figures[key] > 0, key
    # The agent's path took every changed tensor's positions from the fold.
    assert figures["agent_fp8_tensors_positions_from_fold"] > 0
    assert figures["agent_nvfp4_tensors_positions_from_fold"] > 0
    # The adversarial step moved every fused group's global amax: 4 groups in each of the
    # 2 layers (q/k/v, o, gate/up, down) were converted in full, and still bit-identical.
    assert figures["adversarial_tiles_or_groups_in_full_nvfp4_at_0_25pct"] == 8
