"""`engine_agent.precision.warm`: once it has run, an agent's conversions load no kernel.

Each probe runs in a fresh interpreter (a process loads each compiled kernel once, and this
one's earlier tests load them). It lists the FP8 and NVFP4 kernels' loaded signatures after
`warm_conversion(precision)`, then converts a model of other shapes as the agent's stager
does (`VersionConverter`): its first version in full, then a next version folded from a
sparse delta, whose changed positions come from the fold.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
import numpy as np
from engine_agent.precision import fp8_kernel, nvfp4_kernel
from engine_agent.precision.incremental import VersionConverter
from engine_agent.precision.warm import input_scales, warm_conversion
from store.codecs import decode_version, encode_version
from store.tensors import RawTensor
from tests.fixtures.kernels import loaded_kernels

def loaded():
    return loaded_kernels(fp8_kernel, nvfp4_kernel)

precision, mode = sys.argv[1], sys.argv[2]
seconds = warm_conversion(precision) if mode == "warm" else 0.0
warmed = loaded()
rng = np.random.default_rng(5)
base, target = {}, {}
for layer in range(2):
    for module, shape in [
        ("self_attn.q_proj", (384, 256)), ("self_attn.k_proj", (128, 256)),
        ("self_attn.v_proj", (128, 256)), ("self_attn.o_proj", (256, 384)),
        ("mlp.gate_proj", (512, 256)), ("mlp.up_proj", (512, 256)),
        ("mlp.down_proj", (256, 512)),
    ]:
        name = f"model.layers.{layer}.{module}.weight"
        values = (rng.standard_normal(shape) * 0.02).astype("<f4")
        bits = ((values.view("<u4") + 0x8000) >> 16).astype("<u2").reshape(-1)
        moved = bits + (rng.random(bits.size) < 0.01)
        base[name] = RawTensor("BF16", shape, bits.view(np.uint8))
        target[name] = RawTensor("BF16", shape, moved.astype("<u2").view(np.uint8))
files = encode_version(target, base, version=1, base_version=0, codec="sparse")
folded = decode_version(files, base)
scales = input_scales(base, precision)
converter = VersionConverter(precision)
converter.convert(base, {}, scales)
_, _, _, report = converter.convert(folded, {}, scales)
assert not report.full, report
print(json.dumps({"seconds": seconds, "warmed": sorted(warmed),
                  "loaded_by_conversion": sorted(loaded() - warmed),
                  "positions_from_fold": converter.positions_from_fold}))
"""


def probe(precision: str, mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, precision, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("precision", ["fp8", "nvfp4"])
def test_after_warm_conversion_a_catch_up_s_conversions_load_no_kernel(precision: str) -> None:
    warm = probe(precision, "warm")
    assert warm["seconds"] > 0
    assert warm["warmed"], "the warm-up loaded no conversion kernel"
    assert warm["positions_from_fold"] > 0, "the next version's changes must come from a fold"
    assert warm["loaded_by_conversion"] == [], "kernels the warm-up left to the first catch-up"
    # The comparison the warm case needs: unwarmed, the same conversions load kernels.
    cold = probe(precision, "cold")
    assert cold["warmed"] == []
    assert cold["loaded_by_conversion"], "an unwarmed conversion should have loaded kernels"


def test_bf16_needs_no_conversion_warm_up_and_the_command_names_what_it_warmed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from engine_agent.precision.warm import main, warm_conversion

    assert warm_conversion("bf16") == 0.0
    assert warm_conversion("NVFP4") > 0  # a name in any case, its input scales included
    with pytest.raises(ValueError, match="precision must be one of"):
        warm_conversion("int4")
    assert main(["bf16", "fp8"]) == 0
    printed = capsys.readouterr().out
    assert "conversion to bf16 warmed in 0.00s" in printed
    assert "conversion to fp8 warmed in" in printed
    with pytest.raises(SystemExit) as refused:
        main(["int4"])
    assert refused.value.code == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err
