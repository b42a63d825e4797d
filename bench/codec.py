"""Codec benchmark: how small and how fast each delta codec is on realistic RL updates.

Builds a synthetic Qwen3-shaped BF16 checkpoint (scaled to `--params`), keeps FP32 master
weights, applies real AdamW steps with random gradients at each learning rate, casts each
step to BF16 and encodes it against the previous step. Per step it prints the fraction of
BF16 values that changed; bytes as a percentage of the full checkpoint for `xor` (Stitch),
`sparse` (ours), XOR + zlib level 6, and the empirical entropy of the change; sparse encode
and decode+apply throughput on one core (GB of BF16 checkpoint per second of the codec
thread's CPU time, torch at one thread; wall-clock figures too); peak RSS. Ends with one
JSON line.

Run: `tether bench codec` or `python -m bench.codec --params 5e8 --steps 3`.
"""

from __future__ import annotations

import json
import math
import resource
import time
import tracemalloc
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import typer

QWEN3_VOCAB = 151_936
QWEN3_LAYERS = 28
HEAD_DIM = 128


def qwen3_shapes(params: float) -> dict[str, tuple[int, ...]]:
    """Qwen3-0.6B's tensor names and shape ratios, scaled to about `params` parameters.

    Hidden size h (a multiple of 64), intermediate 3h, query width 2h, key/value width h, as
    in Qwen3-0.6B; 28 layers and the full vocabulary once `params` is large enough.
    """
    layers = QWEN3_LAYERS if params >= 1e8 else max(2, round(QWEN3_LAYERS * (params / 1e8) ** 0.33))
    vocab = QWEN3_VOCAB if params >= 3e8 else max(256, round(QWEN3_VOCAB * params / 6e8))
    per_layer = 15 * layers  # h^2 terms: q 2h^2, k h^2, v h^2, o 2h^2, mlp 9h^2
    h = (-vocab + math.sqrt(vocab * vocab + 4 * per_layer * params)) / (2 * per_layer)
    h = max(64, round(h / 64) * 64)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (2 * h, h)
        shapes[p + "self_attn.k_proj.weight"] = (h, h)
        shapes[p + "self_attn.v_proj.weight"] = (h, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, 2 * h)
        shapes[p + "self_attn.q_norm.weight"] = (HEAD_DIM,)
        shapes[p + "self_attn.k_norm.weight"] = (HEAD_DIM,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (3 * h, h)
        shapes[p + "mlp.up_proj.weight"] = (3 * h, h)
        shapes[p + "mlp.down_proj.weight"] = (h, 3 * h)
    shapes["model.norm.weight"] = (h,)
    return shapes


class AdamW:
    """AdamW on FP32 master weights (decoupled weight decay, bias correction), one tensor at a
    time so only one gradient exists at once."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, wd: float = 0.01):
        import torch

        self.params, self.lr, self.betas, self.eps, self.wd = params, lr, betas, eps, wd
        self.m = {k: torch.zeros_like(p) for k, p in params.items()}
        self.v = {k: torch.zeros_like(p) for k, p in params.items()}
        self.t = 0

    def step(self, generator) -> None:
        import torch

        self.t += 1
        b1, b2 = self.betas
        c1, c2 = 1 - b1**self.t, 1 - b2**self.t
        for name, p in self.params.items():
            grad = torch.randn(p.shape, generator=generator) * 1e-3
            m, v = self.m[name], self.v[name]
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            p.mul_(1 - self.lr * self.wd)
            denom = (v / c2).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / c1)


def to_bf16_raw(params) -> dict:
    import torch

    from store.torch_bridge import to_raw

    return {name: to_raw(p.to(torch.bfloat16)) for name, p in params.items()}


def _entropy_bits(symbols: np.ndarray) -> float:
    counts = np.bincount(symbols)
    counts = counts[counts > 0]
    return float(-(counts * np.log2(counts / symbols.size)).sum())


def change_entropy_bytes(new: Mapping, old: Mapping) -> tuple[float, int]:
    """Empirical entropy of the change from `old` to `new`, in bytes, and the changed count.

    Per tensor: positions n*H2(k/n) (a changed/unchanged flag per element, order 0) plus the
    values k*H(symbol), where the symbol is the element's change taken as whichever has the
    lower empirical entropy: its XOR pattern or its zigzagged step in float order. See
    docs/format.md.
    """
    from store.codecs.sparse import float_order, scan_changes, zigzag

    total_bits, changed = 0.0, 0
    for name, t in new.items():
        a, b = t.bits(), old[name].bits()
        gaps, na, ob = scan_changes(a, b, np.dtype("<u8"))
        k, n = int(gaps.size), int(a.size)
        if k == 0:
            continue
        changed += k
        p = k / n
        if k < n:
            total_bits += n * -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
        xor = (na ^ ob).astype(np.int64)
        step = zigzag(float_order(na) - float_order(ob)).astype(np.int64)
        if t.itemsize > 2:  # too many distinct symbols for a dense histogram: count uniques
            total_bits += min(_unique_entropy(xor), _unique_entropy(step))
        else:
            total_bits += min(_entropy_bits(xor), _entropy_bits(step))
    return total_bits / 8, changed


def _unique_entropy(symbols: np.ndarray) -> float:
    _, counts = np.unique(symbols, return_counts=True)
    return float(-(counts * np.log2(counts / symbols.size)).sum())


def xor_zlib_bytes(new: Mapping, old: Mapping) -> int:
    """XOR of each tensor's bytes, zlib level 6: the figure published for Qwen3-0.6B."""
    return sum(
        len(zlib.compress(np.bitwise_xor(t.data, old[name].data), 6)) for name, t in new.items()
    )


def _size(files: Mapping[str, bytes]) -> int:
    return sum(len(b) for b in files.values())


@dataclass
class StepResult:
    lr: float
    step: int
    changed_fraction: float
    xor_pct: float
    sparse_pct: float
    zlib_pct: float
    entropy_pct: float
    sparse_over_xor: float
    sparse_over_entropy: float
    encode_gb_s: float
    decode_gb_s: float
    xor_encode_gb_s: float
    xor_decode_gb_s: float
    encode_gb_s_wall: float
    decode_gb_s_wall: float


def _timed(fn):
    """Run `fn`; return its result and the seconds it took, as (wall, this thread's CPU).

    The codecs run on one thread, so CPU seconds are the time on a core of its own; wall
    seconds also count time lost to other processes sharing the machine.
    """
    wall, cpu = time.perf_counter(), time.thread_time()
    result = fn()
    return result, (time.perf_counter() - wall, time.thread_time() - cpu)


def _extra_memory(fn, keep_bytes: int) -> int:
    """Peak bytes traced while `fn` runs, minus what it returns on purpose (`keep_bytes`)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del result
    return max(0, peak - before - keep_bytes)


def run(
    params: float = typer.Option(5e8, help="Approximate parameter count of the checkpoint."),
    steps: int = typer.Option(3, help="AdamW steps per learning rate."),
    lrs: str = typer.Option("1e-6,1e-5", help="Comma-separated learning rates."),
    seed: int = typer.Option(0, help="Seed for weights and gradients."),
    zlib_reference: bool = typer.Option(True, help="Also measure XOR + zlib-6 (slow)."),
) -> dict:
    """Encode AdamW steps of a synthetic Qwen3-like BF16 checkpoint with every delta codec."""
    import torch

    from store.codecs import encode_version, fold
    from store.tensors import total_bytes

    shapes = qwen3_shapes(params)
    n_params = sum(math.prod(s) for s in shapes.values())
    largest = max(math.prod(s) for s in shapes.values()) * 2
    print(
        f"checkpoint: {n_params / 1e9:.3f} B params, {len(shapes)} tensors, "
        f"BF16 {n_params * 2 / 2**30:.2f} GiB, largest tensor {largest / 2**20:.0f} MiB"
    )
    header = (
        f"{'lr':>7} {'step':>4} {'changed':>8} {'xor%':>7} {'sparse%':>8} {'zlib6%':>7} "
        f"{'entropy%':>8} {'sp/xor':>7} {'sp/ent':>7} {'enc GB/s':>8} {'dec GB/s':>8} "
        f"{'xor enc':>7} {'xor dec':>7} {'wall enc':>8} {'wall dec':>8}"
    )
    results: list[StepResult] = []
    memory: dict[str, float] = {}
    threads = torch.get_num_threads()
    for lr in [float(x) for x in lrs.split(",") if x.strip()]:
        generator = torch.Generator().manual_seed(seed)
        master = {n: torch.randn(s, generator=generator) * 0.02 for n, s in shapes.items()}
        optimizer = AdamW(master, lr)
        previous = to_bf16_raw(master)
        full = total_bytes(previous)
        print(header)
        for step in range(1, steps + 1):
            torch.set_num_threads(threads)
            optimizer.step(generator)
            current = to_bf16_raw(master)
            torch.set_num_threads(1)  # the codecs are measured on one core
            sparse, t_enc = _timed(
                lambda c=current, p=previous, s=step: encode_version(
                    c, p, version=s, base_version=s - 1, codec="sparse"
                )
            )
            xor, t_xor_enc = _timed(
                lambda c=current, p=previous, s=step: encode_version(
                    c, p, version=s, base_version=s - 1, codec="xor"
                )
            )
            _, t_dec = _timed(lambda p=previous, f=sparse: fold(p, [f]))
            _, t_xor_dec = _timed(lambda p=previous, f=xor: fold(p, [f]))
            entropy, changed = change_entropy_bytes(current, previous)
            zlib_bytes = xor_zlib_bytes(current, previous) if zlib_reference else 0
            r = StepResult(
                lr=lr,
                step=step,
                changed_fraction=changed / n_params,
                xor_pct=100 * _size(xor) / full,
                sparse_pct=100 * _size(sparse) / full,
                zlib_pct=100 * zlib_bytes / full,
                entropy_pct=100 * entropy / full,
                sparse_over_xor=_size(sparse) / _size(xor),
                sparse_over_entropy=_size(sparse) / max(entropy, 1.0),
                encode_gb_s=full / t_enc[1] / 1e9,
                decode_gb_s=full / t_dec[1] / 1e9,
                xor_encode_gb_s=full / t_xor_enc[1] / 1e9,
                xor_decode_gb_s=full / t_xor_dec[1] / 1e9,
                encode_gb_s_wall=full / t_enc[0] / 1e9,
                decode_gb_s_wall=full / t_dec[0] / 1e9,
            )
            results.append(r)
            print(
                f"{lr:>7.0e} {step:>4} {r.changed_fraction:>8.4f} {r.xor_pct:>7.3f} "
                f"{r.sparse_pct:>8.3f} {r.zlib_pct:>7.3f} {r.entropy_pct:>8.3f} "
                f"{r.sparse_over_xor:>7.3f} {r.sparse_over_entropy:>7.3f} {r.encode_gb_s:>8.2f} "
                f"{r.decode_gb_s:>8.2f} {r.xor_encode_gb_s:>7.2f} {r.xor_decode_gb_s:>7.2f} "
                f"{r.encode_gb_s_wall:>8.2f} {r.decode_gb_s_wall:>8.2f}",
                flush=True,
            )
            if step == steps and not memory:
                memory["encode_extra_over_largest"] = (
                    _extra_memory(
                        lambda c=current, p=previous: encode_version(
                            c, p, version=1, base_version=0, codec="sparse"
                        ),
                        _size(sparse),
                    )
                    / largest
                )
                memory["decode_extra_over_largest"] = (
                    _extra_memory(lambda p=previous, f=sparse: fold(p, [f]), full) / largest
                )
            previous = current
        torch.set_num_threads(threads)
        del master, optimizer
    first_lr = [r for r in results if r.lr == results[0].lr]
    last = first_lr[-1]
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"lr {last.lr:.0e}, step {last.step}: sparse is {last.sparse_over_xor:.3f}x xor "
        f"(target <= 0.55) and {last.sparse_over_entropy:.3f}x the entropy (target <= 1.3); "
        f"encode {last.encode_gb_s:.2f} GB/s (>= 0.5), decode+apply {last.decode_gb_s:.2f} GB/s "
        f"(>= 1); memory beyond the checkpoints: encode "
        f"{memory.get('encode_extra_over_largest', 0):.2f}x, decode "
        f"{memory.get('decode_extra_over_largest', 0):.2f}x the largest tensor (<= 2); "
        f"peak RSS {peak_rss_mb:.0f} MiB"
    )
    summary = {
        "params": n_params,
        "sparse_over_xor": round(last.sparse_over_xor, 4),
        "sparse_over_entropy": round(last.sparse_over_entropy, 4),
        "encode_gb_s": round(last.encode_gb_s, 3),
        "decode_gb_s": round(last.decode_gb_s, 3),
        "encode_gb_s_wall": round(last.encode_gb_s_wall, 3),
        "decode_gb_s_wall": round(last.decode_gb_s_wall, 3),
        "changed_fraction": round(last.changed_fraction, 5),
        "xor_pct": round(last.xor_pct, 4),
        "sparse_pct": round(last.sparse_pct, 4),
        "zlib6_pct": round(last.zlib_pct, 4),
        "entropy_pct": round(last.entropy_pct, 4),
        **{k: round(v, 3) for k, v in memory.items()},
        "peak_rss_mb": round(peak_rss_mb),
        "steps": [vars(r) for r in results],
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    typer.run(run)
