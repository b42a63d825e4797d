"""Loading one precision's conversion kernels before the first catch-up needs them.

FP8 and NVFP4 conversion run compiled (numba) kernels, loaded from numba's on-disk cache at
their first call in a process, or compiled when the cache is cold: on the 2-core bench VM
the first FP8 conversion took 0.8 s more than the next and the first NVFP4 one 3.8 s
(cache cold), ~10-20 ms with it warm. In an agent that first call is its first staged
version, while the engine serves. `warm_conversion` converts a small decoder layer as a
catch-up does (`VersionConverter`: a full conversion, then an incremental one with a
sparse and a dense change), in memory. Never touches a file or the network.
"""

from __future__ import annotations

import time

import numpy as np

from store.tensors import RawTensor

# One decoder layer's Linear weights: q/k/v and gate/up form fused groups (NVFP4 shares a
# scale in each), o and down stand alone; two FP8 128 x 128 blocks each way.
_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_SIDE = 256


def warm_layer(side: int = _SIDE) -> dict[str, RawTensor]:
    """The canonical BF16 tensors of one decoder layer whose Linear weights are `side`
    square (the same on every call)."""
    rng = np.random.default_rng(0)
    tensors = {}
    for module in _LINEARS:
        values = (rng.standard_normal((side, side)) * 0.02).astype("<f4")
        bits = ((values.view("<u4") + 0x8000) >> 16).astype("<u2")  # to BF16, half up
        tensors[f"model.layers.0.{module}.weight"] = RawTensor(
            "BF16", (side, side), bits.reshape(-1).view(np.uint8)
        )
    norm = np.full(side, 0x3F80, "<u2")  # 1.0
    tensors["model.layers.0.input_layernorm.weight"] = RawTensor(
        "BF16", (side,), norm.view(np.uint8)
    )
    return tensors


def input_scales(tensors: dict[str, RawTensor], precision: str) -> dict[str, float] | None:
    """NVFP4's input scales for `tensors` (1.0 for every quantized module); None otherwise."""
    from engine_agent.precision.plan import plan_quantization
    from store.torch_bridge import raw_to_state_dict

    if precision != "nvfp4":
        return None
    plan = plan_quantization(raw_to_state_dict(tensors), precision)
    return {module: 1.0 for module in plan.quantized}


def warm_conversion(precision: str) -> float:
    """Convert `warm_layer()` to `precision` in full, then a next version of it with one
    element changed in one weight and a quarter of another changed (the incremental
    conversion's sparse path, and its dense one past `DENSE_FRACTION`); the seconds it took
    (0 for bf16)."""
    from engine_agent.precision.incremental import DENSE_FRACTION, VersionConverter
    from engine_agent.precision.plan import check_precision

    precision = check_precision(precision)
    if precision == "bf16":
        return 0.0
    started = time.perf_counter()
    first = warm_layer()
    scales = input_scales(first, precision)
    converter = VersionConverter(precision)
    converter.convert(first, {}, scales)
    second = dict(first)
    for module, share in (("self_attn.q_proj", 0.0), ("mlp.down_proj", DENSE_FRACTION + 0.05)):
        name = f"model.layers.0.{module}.weight"
        bits = first[name].bits().copy()
        moved = np.random.default_rng(1).random(bits.size) < share
        moved[0] = True
        bits[moved] += 1
        second[name] = RawTensor("BF16", first[name].shape, bits.view(np.uint8))
    _, _, _, report = converter.convert(second, {}, scales)
    if report.full:
        raise RuntimeError(f"the warm-up's second conversion was full: {report.reason}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m engine_agent.precision.warm",
        description="Load (compiling into numba's cache when it is cold) the conversion "
        "kernels of each precision given, as an engine agent of that precision does at "
        "boot. Run it when building an image so the cache ships with it.",
    )
    parser.add_argument("precisions", nargs="+", choices=("bf16", "fp8", "nvfp4"))
    for precision in parser.parse_args(argv).precisions:
        print(f"conversion to {precision} warmed in {warm_conversion(precision):.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
