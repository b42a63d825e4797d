"""Conversion benchmark: full and incremental BF16 → FP8-block / NVFP4, on one core.

Builds a Qwen3-shaped BF16 checkpoint (synthetic N(0, 0.02) weights, ≥ 200 M parameters by
default), then for each precision:

- converts it in full (`convert_tensors`) and reports GB/s of BF16 weights;
- walks a chain of versions at 0.1%, 0.25%, 1% and 5% change density, `repeats` steps per
  density, converting each from the previous one with `IncrementalConverter` (every measured
  conversion is a new step: converting the same change twice would find the state already
  updated and skip the work a real step does). The update is an RL step's shape: an
  optimizer moves every weight by about the learning rate, far less than a BF16 ulp, so an
  element's bits change mostly with probability proportional to 1/ulp (small weights change
  more often than large ones), by one ulp up or down (fitted to `bench.real_updates`' AdamW
  steps at lr 1e-6; `_EVEN_SHARE`). The rate is BF16 bytes of the quantized weights per
  second, with the changed positions given (as the fold knows them) and, separately, with
  the positions found by diffing the two versions' bits;
- at 0.25%, the agent's own path: each step folded from a real `sparse` delta and converted
  by the stager's `VersionConverter`, which takes the positions from the fold;
- at 0.25%, an adversarial step that also moves every tensor's largest element up one ulp,
  so every NVFP4 fused group's global amax moves (each group is converted in full) and one
  FP8 tile per tensor is redone, reported apart;
- compares the last step of each density, and the adversarial one, with a full conversion
  of the same tensors, byte for byte: `bitwise_identical` must be true.

Each rate is the median over the steps, twice: per second of wall time (the issue's
figure; un-suffixed keys) and per CPU second of the one converting thread (`*_cpu` keys:
the rate of a core of its own, which a machine shared with other jobs cannot show in wall
time). Run: `tether bench convert` or `python -m bench.convert`. torch and numpy run on one
thread. The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from bench.figures import significant

DENSITIES = (0.001, 0.0025, 0.01, 0.05)
AGENT_DENSITY = 0.0025  # the agent's whole convert path (fold positions) is measured here


def qwen3_shapes(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    intermediate: int,
    vocab: int,
) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Qwen3 dense checkpoint (tied embeddings)."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.self_attn.q_norm.weight": (head_dim,),
            f"{p}.self_attn.k_norm.weight": (head_dim,),
            f"{p}.mlp.gate_proj.weight": (intermediate, hidden),
            f"{p}.mlp.up_proj.weight": (intermediate, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, intermediate),
        }
    return shapes


def _checkpoint(shapes: dict[str, tuple[int, ...]], seed: int) -> dict:
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        values = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=generator)
        out[name] = values.to(torch.bfloat16)
    return out


# Share of an RL step's changes that fall evenly on every element whatever its size; the
# rest go in proportion to 1/ulp. Fitted to `bench.real_updates` (AdamW, lr 1e-6, 0.2 %
# density): the change rate halves per binade up to |x| ≈ 2^-6, then stays near 0.12 of the
# mean for the largest weights; no tensor's amax moved in 112 tensor-steps.
_EVEN_SHARE = 0.12


def _rl_positions(bits, density: float, rng):
    """Sorted positions an RL step changes: each element with probability proportional to
    1/ulp of its value (an update of the same tiny size everywhere crosses a BF16 rounding
    boundary that often) plus an even share (`_EVEN_SHARE`), `density` on average."""
    import numpy as np

    exponent = ((bits >> 7) & 0xFF).astype(np.intp)
    # ulp ∝ 2^exponent (subnormals share the smallest normal's ulp); in units of 2^-126.
    inverse_ulp = 2.0 ** -np.maximum(np.arange(256) - 1, 0).astype(np.float64)
    counts = np.bincount(exponent, minlength=256)
    relative = inverse_ulp * bits.size / float(counts @ inverse_ulp)  # mean 1 over elements
    chance = density * ((1 - _EVEN_SHARE) * relative + _EVEN_SHARE)
    chance = np.minimum(1.0, chance).astype(np.float32)
    return np.flatnonzero(rng.random(bits.size, dtype=np.float32) < chance[exponent])


def _step(tensors: dict, density: float, seed: int, model: str = "rl") -> tuple[dict, dict]:
    """A copy where about `density` of every tensor's elements moved, sign kept, never to NaN
    or inf, and the sorted flat positions that changed. `model`: "rl" (see `_rl_positions`;
    one ulp up or down), "uniform" (positions uniformly at random, one or two ulps), or
    "amax" ("uniform", plus every tensor's largest element up one ulp)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    new, changes = {}, {}
    for name, tensor in tensors.items():
        bits = tensor.view(-1).view(torch.int16).numpy().view(np.uint16).copy()
        if model == "rl":
            positions = _rl_positions(bits, density, rng)
            choices = np.array([-1, 1], dtype=np.int32)
        else:
            count = max(1, round(density * bits.size))
            positions = np.unique(rng.integers(0, bits.size, count))
            choices = np.array([-2, -1, 1, 2], dtype=np.int32)
        magnitude = (bits[positions] & 0x7FFF).astype(np.int32)
        steps = rng.choice(choices, size=positions.size)
        # Reflect a step that would leave [1, largest finite] so every position changes.
        moved = magnitude + steps
        moved = np.where((moved < 1) | (moved > 0x7F7F), magnitude - steps, moved)
        bits[positions] = (bits[positions] & 0x8000) | moved.astype(np.uint16)
        if model == "amax":
            top = int(np.argmax(bits & 0x7FFF))
            if (bits[top] & 0x7FFF) < 0x7F7F:
                bits[top] += 1  # magnitude up one ulp: the tensor's amax moves
                positions = np.union1d(positions, [top])
        new[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).view(tensor.shape)
        changes[name] = positions.astype(np.int64)
    return new, changes


def _median(values: list[float]) -> float:
    import statistics

    return float(statistics.median(values))


def _timed(work: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, CPU seconds of this thread, wall seconds) of one run of `work`."""
    started_cpu, started_wall = time.thread_time(), time.perf_counter()
    result = work()
    return result, time.thread_time() - started_cpu, time.perf_counter() - started_wall


def _diff(old: dict, new: dict) -> dict:
    """Changed positions per tensor, found the way the agent's stager finds them."""
    import torch

    from engine_agent.precision.incremental import changed_positions

    return {
        name: changed_positions(
            old[name].view(-1).view(torch.int16).numpy(),
            new[name].view(-1).view(torch.int16).numpy(),
        )
        for name in new
    }


def _agent_chain(
    precision: str, start: dict, density: float, seeds: list[int], config: dict,
    scales: dict | None,
) -> tuple[list[float], list[float], int]:  # fmt: skip
    """CPU and wall seconds of the agent's stager converting each step of a chain from
    `start`: every version is folded from a real `sparse` delta, and the `VersionConverter`
    takes the changed positions from the fold instead of diffing; also how many tensors'
    positions came from the fold."""
    from engine_agent.precision.incremental import VersionConverter
    from store.codecs import encode_version, fold
    from store.torch_bridge import to_raw

    converter = VersionConverter(precision)
    tensors, raw = start, {name: to_raw(t) for name, t in start.items()}
    converter.convert(raw, config, scales)  # the full conversion of the first version
    cpu, wall = [], []
    for version, seed in enumerate(seeds, start=1):
        new, _ = _step(tensors, density, seed)
        delta = encode_version(
            {name: to_raw(t) for name, t in new.items()}, raw, version=version,
            base_version=version - 1, codec="sparse",
        )  # fmt: skip
        folded = fold(raw, [delta])
        _, cpu_s, wall_s = _timed(partial(converter.convert, folded, config, scales))
        cpu.append(cpu_s)
        wall.append(wall_s)
        tensors, raw = new, folded
    return cpu, wall, converter.positions_from_fold


def _identical(a: tuple, b: tuple) -> bool:
    import torch

    out_a, config_a, extra_a = a[:3]
    out_b, config_b, extra_b = b[:3]
    if sorted(out_a) != sorted(out_b) or config_a != config_b or extra_a != extra_b:
        return False
    for name, t in out_a.items():
        u = out_b[name]
        if t.dtype != u.dtype or t.shape != u.shape:
            return False
        if not torch.equal(t.reshape(-1).view(torch.uint8), u.reshape(-1).view(torch.uint8)):
            return False
    return True


def run(
    hidden: int = 1024,
    layers: int = 16,
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 64,
    intermediate: int = 3072,
    vocab: int = 32768,
    precisions: str = "fp8,nvfp4",
    repeats: int = 3,
) -> dict[str, Any]:
    """Full and incremental conversion rates, one core, and bitwise identity."""
    import numpy as np
    import torch
    from rich.console import Console
    from rich.table import Table

    from engine_agent.precision import convert_tensors, plan_quantization
    from engine_agent.precision.incremental import IncrementalConverter

    torch.set_num_threads(1)
    console = Console()
    shapes = qwen3_shapes(hidden, layers, heads, kv_heads, head_dim, intermediate, vocab)
    config = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden, "vocab_size": vocab}
    with console.status("building the BF16 checkpoint"):
        v0 = _checkpoint(shapes, seed=0)
    parameters = sum(t.numel() for t in v0.values())
    steps = max(1, repeats)
    figures: dict[str, Any] = {
        "parameters": parameters,
        "threads": 1,
        "update_model": "rl: P(change) 0.88 in proportion to 1/ulp + 0.12 even, one ulp up or down",
        "steps_per_density": steps,
        "clock": "un-suffixed GB/s: wall time (median over steps); *_cpu: CPU time of the "
        "converting thread (median)",
    }
    identical = True
    table = Table(
        "precision", "conversion", "density", "GB/s wall", "GB/s CPU", "vs full", "in full"
    )

    def rates(
        key: str, weight_bytes: int, cpu: list[float], wall: list[float]
    ) -> tuple[float, float]:
        cpu_rate = weight_bytes / _median(cpu) / 1e9
        wall_rate = weight_bytes / _median(wall) / 1e9
        figures[key.replace("_gb_s", "_gb_s_cpu")] = significant(cpu_rate)
        figures[key] = significant(wall_rate)
        return wall_rate, cpu_rate

    for precision in [p.strip() for p in precisions.split(",") if p.strip()]:
        plan = plan_quantization(v0, precision)
        weights = [f"{m}.weight" for m in plan.quantized]
        weight_bytes = sum(v0[n].numel() * v0[n].element_size() for n in weights)
        figures["weight_bytes"] = weight_bytes
        scales = dict.fromkeys(plan.quantized, 1.0 / 2688) if precision == "nvfp4" else None
        converter = IncrementalConverter(precision)
        with console.status(f"{precision}: full conversion"):
            full_cpu, full_wall = [], []
            for _ in range(steps):
                _, cpu_s, wall_s = _timed(partial(convert_tensors, v0, config, precision, scales))
                full_cpu.append(cpu_s)
                full_wall.append(wall_s)
            converter.convert(v0, config, None, scales)
        full_rate, full_rate_cpu = rates(
            f"full_{precision}_gb_s", weight_bytes, full_cpu, full_wall
        )
        table.add_row(
            precision, "full", "-", f"{full_rate:.3f}", f"{full_rate_cpu:.3f}", "1.0x", ""
        )
        tensors = v0
        for i, density in enumerate(DENSITIES):
            key = f"{density * 100:g}".replace(".", "_")
            cpu, wall, diff_cpu, diff_wall, in_full = [], [], [], [], 0
            with console.status(f"{precision}: {density:.2%} of elements changed"):
                for r in range(steps):
                    new, changes = _step(tensors, density, seed=100 + 10 * i + r)
                    found, cpu_s, wall_s = _timed(partial(_diff, tensors, new))
                    assert all(np.array_equal(found[n], changes[n]) for n in new), (
                        "the bit diff disagrees with the positions the update changed"
                    )
                    diff_cpu.append(cpu_s)
                    diff_wall.append(wall_s)
                    result, cpu_s, wall_s = _timed(
                        partial(converter.convert, new, config, changes, scales)
                    )
                    cpu.append(cpu_s)
                    wall.append(wall_s)
                    report = result[3]
                    in_full += report.tiles_requantized + report.groups_converted_in_full
                    identical &= not report.full
                    if r == steps - 1:
                        full = convert_tensors(new, config, precision, scales)
                        identical &= _identical(result, full)
                        del full
                    del result
                    tensors = new
            figures[f"tiles_or_groups_in_full_{precision}_at_{key}pct"] = in_full
            rate, rate_cpu = rates(
                f"incremental_{precision}_gb_s_at_{key}pct", weight_bytes, cpu, wall
            )
            with_diff, with_diff_cpu = rates(
                f"incremental_{precision}_with_diff_gb_s_at_{key}pct", weight_bytes,
                [a + b for a, b in zip(cpu, diff_cpu, strict=True)],
                [a + b for a, b in zip(wall, diff_wall, strict=True)],
            )  # fmt: skip
            table.add_row(
                precision, "incremental", f"{density:.2%}", f"{rate:.2f}", f"{rate_cpu:.2f}",
                f"{rate_cpu / full_rate_cpu:.1f}x", str(in_full),
            )  # fmt: skip
            table.add_row(
                precision, "  + bit diff", f"{density:.2%}", f"{with_diff:.2f}",
                f"{with_diff_cpu:.2f}", f"{with_diff_cpu / full_rate_cpu:.1f}x", "",
            )  # fmt: skip
            if density != AGENT_DENSITY:
                continue
            with console.status(f"{precision}: the agent's path at {density:.2%}"):
                seeds = [500 + r for r in range(steps)]
                agent_cpu, agent_wall, from_fold = _agent_chain(
                    precision, tensors, density, seeds, config, scales
                )
            agent_rate, agent_rate_cpu = rates(
                f"agent_{precision}_gb_s_at_{key}pct", weight_bytes, agent_cpu, agent_wall
            )
            figures[f"agent_{precision}_tensors_positions_from_fold"] = from_fold
            table.add_row(
                precision, "  agent (fold positions)", f"{density:.2%}", f"{agent_rate:.2f}",
                f"{agent_rate_cpu:.2f}", f"{agent_rate_cpu / full_rate_cpu:.1f}x", "",
            )  # fmt: skip
            with console.status(f"{precision}: adversarial step at {density:.2%}"):
                new, changes = _step(tensors, density, seed=900, model="amax")
                result, cpu_s, wall_s = _timed(
                    partial(converter.convert, new, config, changes, scales)
                )
                report = result[3]
                full = convert_tensors(new, config, precision, scales)
                identical &= not report.full and _identical(result, full)
                del full, result
                tensors = new
            adversarial, adversarial_cpu = rates(
                f"adversarial_{precision}_gb_s_at_{key}pct", weight_bytes, [cpu_s], [wall_s]
            )
            moved = report.tiles_requantized + report.groups_converted_in_full
            figures[f"adversarial_tiles_or_groups_in_full_{precision}_at_{key}pct"] = moved
            table.add_row(
                precision, "  adversarial (every amax up)", f"{density:.2%}",
                f"{adversarial:.2f}", f"{adversarial_cpu:.2f}",
                f"{adversarial_cpu / full_rate_cpu:.1f}x", str(moved),
            )  # fmt: skip
    figures["bitwise_identical"] = identical
    console.print(table)
    console.print(
        f"{parameters / 1e6:.0f}M parameters, {figures['weight_bytes'] / 1e9:.2f} GB of BF16 "
        f"weights converted; {steps} steps per density, medians; GB/s = BF16 weight bytes per "
        "second of wall time, and per CPU second of the one converting thread"
    )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    import typer

    typer.run(run)
