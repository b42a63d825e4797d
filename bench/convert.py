"""Conversion benchmark: full and incremental BF16 → FP8-block / NVFP4, on one core.

Builds a Qwen3-shaped BF16 checkpoint (synthetic N(0, 0.02) weights, ≥ 200 M parameters by
default), then for each precision:

- converts it in full (`convert_tensors`) and reports GB/s of BF16 weights per core;
- publishes a chain of versions, each changing 0.1%, 0.25%, 1% and 5% of every tensor's
  elements by one or two BF16 ulps (an RL step's shape), and converts each from the
  previous one with `IncrementalConverter`. The effective rate is BF16 bytes of the
  quantized weights divided by the wall time of the incremental conversion, with the
  changed positions given (as the fold knows them) and, separately, with the positions
  found by diffing the two versions' bits (what the agent's stager does when the fold did
  not patch from the very tensors it converted last);
- at 0.25%, the agent's own path: the new version folded from a real `sparse` delta and
  converted by the stager's `VersionConverter`, which takes the positions from the fold
  (one run, after a full conversion of the previous version);
- converts every version in full again and compares every tensor's bytes and the config
  files: `bitwise_identical` must be true.

Run: `tether bench convert` or `python -m bench.convert`. torch and numpy run on one
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


def _step(tensors: dict, density: float, seed: int) -> tuple[dict, dict]:
    """A copy where `density` of every tensor's elements moved by one or two BF16 ulps of
    magnitude (sign kept, never to NaN or inf), and the sorted flat positions that changed."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    new, changes = {}, {}
    for name, tensor in tensors.items():
        bits = tensor.view(-1).view(torch.int16).numpy().view(np.uint16).copy()
        count = max(1, round(density * bits.size))
        positions = np.unique(rng.integers(0, bits.size, count))
        magnitude = (bits[positions] & 0x7FFF).astype(np.int32)
        steps = rng.choice(np.array([-2, -1, 1, 2], dtype=np.int32), size=positions.size)
        # Reflect a step that would leave [1, largest finite] so every position changes.
        moved = magnitude + steps
        moved = np.where((moved < 1) | (moved > 0x7F7F), magnitude - steps, moved)
        bits[positions] = (bits[positions] & 0x8000) | moved.astype(np.uint16)
        new[name] = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).view(tensor.shape)
        changes[name] = positions.astype(np.int64)
    return new, changes


def _best_of(repeats: int, work: Callable[[], object]) -> tuple[float, float]:
    """(least CPU seconds of this thread, least wall seconds) over `repeats` runs of `work`.

    CPU time of the one thread doing the work is the rate of a core of its own, which a
    machine shared with other jobs cannot show in wall time.
    """
    cpu = wall = float("inf")
    for _ in range(max(1, repeats)):
        started_cpu, started_wall = time.thread_time(), time.perf_counter()
        work()
        cpu = min(cpu, time.thread_time() - started_cpu)
        wall = min(wall, time.perf_counter() - started_wall)
    return cpu, wall


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


def _agent_path(
    precision: str, old: dict, new: dict, config: dict, scales: dict | None
) -> tuple[float, float, int]:
    """(CPU s, wall s, tensors whose positions came from the fold) of the agent's stager
    converting `new` after `old`: `new` is folded from a real `sparse` delta, and the
    `VersionConverter` takes the changed positions from the fold instead of diffing."""
    from engine_agent.precision.incremental import VersionConverter
    from store.codecs import encode_version, fold
    from store.torch_bridge import to_raw

    raw_old = {name: to_raw(t) for name, t in old.items()}
    delta = encode_version(
        {name: to_raw(t) for name, t in new.items()}, raw_old, version=1, base_version=0,
        codec="sparse",
    )  # fmt: skip
    folded = fold(raw_old, [delta])
    converter = VersionConverter(precision)
    converter.convert(raw_old, config, scales)  # the full conversion of the previous version
    cpu, wall = _best_of(1, partial(converter.convert, folded, config, scales))
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
    figures: dict[str, Any] = {"parameters": parameters, "threads": 1}
    identical = True
    table = Table("precision", "conversion", "density", "seconds", "GB/s", "vs full")
    for precision in [p.strip() for p in precisions.split(",") if p.strip()]:
        plan = plan_quantization(v0, precision)
        weights = [f"{m}.weight" for m in plan.quantized]
        weight_bytes = sum(v0[n].numel() * v0[n].element_size() for n in weights)
        scales = dict.fromkeys(plan.quantized, 1.0 / 2688) if precision == "nvfp4" else None
        converter = IncrementalConverter(precision)
        with console.status(f"{precision}: full conversion"):
            full_s, full_wall = _best_of(
                repeats, partial(convert_tensors, v0, config, precision, scales)
            )
            converter.convert(v0, config, None, scales)
        full_rate = weight_bytes / full_s / 1e9
        figures[f"full_{precision}_gb_s"] = significant(full_rate)
        figures[f"full_{precision}_gb_s_wall"] = significant(weight_bytes / full_wall / 1e9)
        figures["weight_bytes"] = weight_bytes
        table.add_row(precision, "full", "-", f"{full_s:.2f}", f"{full_rate:.3f}", "1.0x")
        tensors = v0
        for i, density in enumerate(DENSITIES):
            with console.status(f"{precision}: {density:.2%} of elements changed"):
                new, changes = _step(tensors, density, seed=100 + i)
                found = _diff(tensors, new)
                assert all(np.array_equal(found[n], changes[n]) for n in new), (
                    "the bit diff disagrees with the positions the update changed"
                )
                diff_s, diff_wall = _best_of(repeats, partial(_diff, tensors, new))
                result = converter.convert(new, config, changes, scales)
                report = result[3]
                # Converting the same change again redoes the same work on the same state:
                # the best of a few runs filters out a busy machine's noise.
                incremental_s, incremental_wall = _best_of(
                    repeats, partial(converter.convert, new, config, changes, scales)
                )
                full = convert_tensors(new, config, precision, scales)
                identical &= not report.full and _identical(result, full)
                del full, result
            rate = weight_bytes / incremental_s / 1e9
            with_diff = weight_bytes / (incremental_s + diff_s) / 1e9
            key = f"{density * 100:g}".replace(".", "_")
            if density == AGENT_DENSITY:
                with console.status(f"{precision}: the agent's path at {density:.2%}"):
                    agent_s, agent_wall, from_fold = _agent_path(
                        precision, tensors, new, config, scales
                    )
                agent_rate = weight_bytes / agent_s / 1e9
                figures[f"agent_{precision}_gb_s_at_{key}pct"] = significant(agent_rate)
                figures[f"agent_{precision}_gb_s_wall_at_{key}pct"] = significant(
                    weight_bytes / agent_wall / 1e9
                )
                figures[f"agent_{precision}_tensors_positions_from_fold"] = from_fold
                table.add_row(
                    precision, "  agent (fold positions)", f"{density:.2%}", f"{agent_s:.3f}",
                    f"{agent_rate:.2f}", f"{agent_rate / full_rate:.1f}x",
                )  # fmt: skip
            figures[f"incremental_{precision}_gb_s_at_{key}pct"] = significant(rate)
            figures[f"incremental_{precision}_with_diff_gb_s_at_{key}pct"] = significant(with_diff)
            figures[f"incremental_{precision}_gb_s_wall_at_{key}pct"] = significant(
                weight_bytes / incremental_wall / 1e9
            )
            figures[f"incremental_{precision}_with_diff_gb_s_wall_at_{key}pct"] = significant(
                weight_bytes / (incremental_wall + diff_wall) / 1e9
            )
            figures[f"tiles_or_groups_in_full_{precision}_at_{key}pct"] = (
                report.tiles_requantized + report.groups_converted_in_full
            )
            table.add_row(
                precision, "incremental", f"{density:.2%}", f"{incremental_s:.3f}",
                f"{rate:.2f}", f"{rate / full_rate:.1f}x",
            )  # fmt: skip
            table.add_row(
                precision, "  + bit diff", f"{density:.2%}", f"{incremental_s + diff_s:.3f}",
                f"{with_diff:.2f}", f"{with_diff / full_rate:.1f}x",
            )  # fmt: skip
            tensors = new
    figures["bitwise_identical"] = identical
    console.print(table)
    console.print(
        f"{parameters / 1e6:.0f}M parameters, {figures['weight_bytes'] / 1e9:.2f} GB of BF16 "
        "weights converted; GB/s = BF16 weight bytes per CPU second of the one converting "
        "thread (the *_wall figures in the JSON use wall time)"
    )
    print(json.dumps(figures))
    return figures


if __name__ == "__main__":
    import typer

    typer.run(run)
