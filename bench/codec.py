"""Codec benchmark: size and speed of every delta codec at the densities RL updates have.

Three kinds of case, each encoded against its predecessor:

- a density sweep (`--densities`): a Qwen3-shaped BF16 checkpoint (`--params`) where exactly
  that fraction of each tensor's values moves, by one ulp (95 %) or two (5 %), up or down,
  whatever its value ("uniform": the positions carry no structure a codec could use);
- the same densities from an update rule (`--update-rule`, those in 0.1-10 %): every value of
  that checkpoint moved by an Adam-like step of about `lr`, rounded to BF16, so whether it
  changes depends on its magnitude as in a real step; `lr` is found by bisection to hit the
  density;
- real gradients (`bench.real_updates`): a small transformer trained with AdamW on the
  standard library's source, warmed up, then stepped at RL learning rates (`--rl-lrs`);
- quantized views of those real steps: consecutive FP8-block and NVFP4 conversions (the
  agent's converters), so U8/F8 codes and scales.

Per case: changed fraction; bytes of `xor` (Stitch), `sparse` (sparse-v3, ours) and the old
sparse-v1, and the entropy of the change (docs/format.md §7), as % of the target checkpoint;
ratios; encode and decode+apply (a verified `fold`) GB/s per core (checkpoint bytes per
second of the codec thread's CPU time, codec threads = 1) and on all cores (wall clock,
codec threads = `--threads`). Then the 1→2 thread speedup beside the machine's two-process
ceiling (`two_process_ceiling`), the catch-up stages (fetch from a folder store,
fold+verify, convert FP8, convert NVFP4, write the staged folder) in GB/s per core, and one
JSON line. Run: `tether bench codec` or `python -m bench.codec`.

Why over 500 lines: one benchmark script, read top to bottom as the procedure it measures.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import typer

from bench.catchup import catchup_stages
from bench.catchup import least_cpu as _cpu
from bench.figures import significant

QWEN3_VOCAB = 151_936
QWEN3_LAYERS = 28
HEAD_DIM = 128
DENSITIES = "0.0005,0.001,0.0025,0.005,0.01,0.02,0.05,0.1,0.25"
TARGET_RANGE = (0.001, 0.10)


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


def density_update(base: Mapping, fraction: float, seed: int) -> dict:
    """`base` with `fraction` of each tensor's BF16 values moved by one ulp (95 %) or two."""
    from store.codecs.sparse import float_order, float_unorder
    from store.tensors import RawTensor

    rng = np.random.default_rng(seed)
    out = {}
    for name, tensor in base.items():
        bits = tensor.bits().copy()
        where = np.flatnonzero(rng.random(bits.size, dtype=np.float32) < fraction)
        step = np.where(rng.random(where.size) < 0.95, 1, 2).astype(np.uint16)
        keys = float_order(bits[where])
        bits[where] = float_unorder(
            np.where(rng.random(where.size) < 0.5, keys + step, keys - step)
        )
        out[name] = RawTensor(tensor.dtype, tensor.shape, bits.view(np.uint8))
    return out


def _float32(bits: np.ndarray) -> np.ndarray:
    """float32 values of BF16 bit patterns (exact: BF16 is float32's upper half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """BF16 bit patterns of float32 `values`, rounded to nearest even (no NaNs here)."""
    bits = values.view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _adam_steps(size: int, rng: np.random.Generator) -> np.ndarray:
    """Adam's normalised step m / sqrt(v) per element, about ±1: a step of a value whose
    gradient keeps its sign is near ±1, a noisy one's smaller (|N(0, 1)| clipped to 1)."""
    magnitude = np.minimum(np.abs(rng.standard_normal(size, dtype=np.float32)), 1.0)
    return np.where(rng.random(size, dtype=np.float32) < 0.5, magnitude, -magnitude)


def rule_update(base: Mapping, lr: float, seed: int) -> dict:
    """`base` with every BF16 value moved by `lr` times an Adam-like step, rounded to BF16:
    a value changes only if its step exceeds half its ulp, so small values change often and
    large ones rarely, as in a real optimizer step."""
    from store.tensors import RawTensor

    rng = np.random.default_rng(seed)
    out = {}
    for name, tensor in base.items():
        values = _float32(tensor.bits())
        moved = values + np.float32(lr) * _adam_steps(values.size, rng)
        out[name] = RawTensor(tensor.dtype, tensor.shape, _bf16_bits(moved).view(np.uint8))
    return out


def rule_lr(base: Mapping, fraction: float, seed: int, sample: int = 1 << 20) -> float:
    """The learning rate at which `rule_update` changes about `fraction` of the values
    (bisection in log lr on a strided sample of every tensor; the fraction grows with lr)."""
    total = sum(t.numel for t in base.values())
    stride = max(1, total // sample)
    values = _float32(np.concatenate([t.bits()[::stride] for t in base.values()]))
    steps = _adam_steps(values.size, np.random.default_rng(seed))
    old = _bf16_bits(values)
    low, high = -12.0, 0.0  # log10 lr
    for _ in range(40):
        mid = (low + high) / 2
        moved = _bf16_bits(values + np.float32(10**mid) * steps)
        if np.count_nonzero(moved != old) < fraction * values.size:
            low = mid
        else:
            high = mid
    return float(10 ** ((low + high) / 2))


def _size(files: Mapping[str, bytes]) -> int:
    return sum(len(b) for b in files.values())


def payload_bytes(files: Mapping[str, bytes]) -> int:
    """Bytes of the codec's payloads in a delta version: the files less the index and each
    shard's safetensors header (names, offsets, checksums: the same for every codec, and
    what dominates a tiny model's delta)."""
    total = 0
    for name, body in files.items():
        if name.endswith(".safetensors"):
            total += len(body) - 8 - int.from_bytes(body[:8], "little")
    return total


@dataclass
class Case:
    name: str
    kind: str  # "density" (uniform), "update" (rule), "real-bf16", "real-fp8", "real-nvfp4"
    checkpoint_bytes: int
    changed_fraction: float
    xor_pct: float
    sparse_pct: float
    sparse_v1_pct: float
    entropy_pct: float
    sparse_files_pct: float
    sparse_over_xor: float
    sparse_over_entropy: float
    v1_over_entropy: float
    encode_gb_s: float
    decode_gb_s: float
    xor_encode_gb_s: float
    xor_decode_gb_s: float
    encode_gb_s_all: float
    decode_gb_s_all: float

    @property
    def targeted(self) -> bool:
        """Density cases (uniform and update rule) in `TARGET_RANGE` and real BF16 steps;
        the quantized views are reported on their own (their XOR is already within 2x of
        the entropy, so no codec can be half of it)."""
        low, high = TARGET_RANGE
        if self.kind in ("density", "update"):
            return low <= self.changed_fraction * 1.02 <= high * 1.04
        return self.kind == "real-bf16"

    @property
    def xor_targeted(self) -> bool:
        """The cases `worst_sparse_over_xor` is taken over: targeted ones whose positions
        depend on the values, as a real step's do. A uniform case's order-0 entropy is the
        information in it, which at 0.25-0.5 % is above half of XOR+zstd (docs/benchmarks.md),
        so it is reported on its own (`uniform_worst_sparse_over_xor`)."""
        return self.targeted and self.kind != "density"


def _wall(fn: Callable[[], object], repeats: int) -> float:
    """Best wall-clock seconds of `repeats` runs (the least disturbed by other processes)."""
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure_case(
    name: str, kind: str, target: Mapping, base: Mapping, *, threads: int, repeats: int
) -> Case:
    """Encode `target` against `base` with every codec and time sparse and xor."""
    from store.codecs import encode_version, fold, workers
    from store.codecs.delta import encode_delta
    from store.codecs.sparse import SparseCodec
    from store.tensors import total_bytes

    full = total_bytes(target)

    def encode(codec: str) -> Callable[[], dict]:
        return lambda: encode_version(
            target, base, version=1, base_version=0, codec=codec, workers=workers.threads()
        )

    workers.set_threads(1)
    sparse, t_enc = _cpu(encode("sparse"), repeats)
    xor, t_xor_enc = _cpu(encode("xor"), repeats)
    _, t_dec = _cpu(lambda: fold(base, [sparse]), repeats)
    _, t_xor_dec = _cpu(lambda: fold(base, [xor]), repeats)
    v1 = encode_delta(SparseCodec(), target, base, version=1, base_version=0, shard_bytes=2**30)
    workers.set_threads(threads)
    wall_enc = _wall(encode("sparse"), repeats)
    wall_dec = _wall(lambda: fold(base, [sparse]), repeats)
    entropy, changed = change_entropy_bytes(target, base)
    elements = sum(t.numel for t in target.values())
    sizes = {"xor": payload_bytes(xor), "sparse": payload_bytes(sparse), "v1": payload_bytes(v1)}
    return Case(
        name=name,
        kind=kind,
        checkpoint_bytes=full,
        changed_fraction=changed / elements,
        xor_pct=100 * sizes["xor"] / full,
        sparse_pct=100 * sizes["sparse"] / full,
        sparse_v1_pct=100 * sizes["v1"] / full,
        entropy_pct=100 * entropy / full,
        sparse_files_pct=100 * _size(sparse) / full,
        sparse_over_xor=sizes["sparse"] / sizes["xor"],
        sparse_over_entropy=sizes["sparse"] / max(entropy, 1.0),
        v1_over_entropy=sizes["v1"] / max(entropy, 1.0),
        encode_gb_s=full / max(t_enc, 1e-9) / 1e9,
        decode_gb_s=full / max(t_dec, 1e-9) / 1e9,
        xor_encode_gb_s=full / max(t_xor_enc, 1e-9) / 1e9,
        xor_decode_gb_s=full / max(t_xor_dec, 1e-9) / 1e9,
        encode_gb_s_all=full / wall_enc / 1e9,
        decode_gb_s_all=full / wall_dec / 1e9,
    )


HEADER = (
    f"{'case':<22} {'changed':>8} {'xor%':>7} {'sparse%':>8} {'v1%':>7} {'entropy%':>8} "
    f"{'sp/xor':>6} {'sp/ent':>6} {'v1/ent':>6} {'enc/core':>8} {'dec/core':>8} "
    f"{'xor enc':>7} {'xor dec':>7} {'enc all':>7} {'dec all':>7}"
)


def _row(c: Case) -> str:
    return (
        f"{c.name:<22} {c.changed_fraction:>8.5f} {c.xor_pct:>7.3f} {c.sparse_pct:>8.3f} "
        f"{c.sparse_v1_pct:>7.3f} {c.entropy_pct:>8.4f} {c.sparse_over_xor:>6.3f} "
        f"{c.sparse_over_entropy:>6.3f} {c.v1_over_entropy:>6.3f} {c.encode_gb_s:>8.2f} "
        f"{c.decode_gb_s:>8.2f} {c.xor_encode_gb_s:>7.2f} {c.xor_decode_gb_s:>7.2f} "
        f"{c.encode_gb_s_all:>7.2f} {c.decode_gb_s_all:>7.2f}"
    )


def _speed_jobs(target: Mapping, base: Mapping) -> dict[str, Callable[[], object]]:
    """The jobs the speedup figures time: encode the update, decode+apply it (a verified
    fold), each with however many codec threads are set."""
    from store.codecs import encode_version, fold, workers

    files = encode_version(target, base, version=1, base_version=0, codec="sparse")
    return {
        "encode": lambda: encode_version(
            target, base, version=1, base_version=0, codec="sparse", workers=workers.threads()
        ),
        "decode": lambda: fold(base, [files]),
    }


def two_core_speedup(target: Mapping, base: Mapping, repeats: int) -> dict[str, float]:
    """Wall-clock speedup of 2 codec threads over 1: each repeat runs 1 thread then 2 back
    to back and takes the ratio of their wall times; the best and the median ratio over
    `repeats` are kept (on a shared machine the best is the least disturbed pair). Also the
    CPU concurrency the 2-thread runs reached (process CPU s / wall s, best): when other
    processes hold the cores, the wall ratio measures them rather than the codec."""
    from store.codecs import workers

    out: dict[str, float] = {}
    for label, job in _speed_jobs(target, base).items():
        job()  # warm: the first fold of a process faults in its result arena (~0.2 s of sys)
        ratios, concurrency, efficiency = [], [], []
        for _ in range(repeats):
            wall, cpu = {}, {}
            for count in (1, 2):
                workers.set_threads(count)
                cpu_start, started = time.process_time(), time.perf_counter()
                job()
                wall[count] = time.perf_counter() - started
                cpu[count] = time.process_time() - cpu_start
            concurrency.append(cpu[2] / wall[2])
            ratios.append(wall[1] / wall[2])
            efficiency.append(cpu[1] / cpu[2])
        out[f"two_core_speedup_{label}"] = max(ratios)
        out[f"two_core_speedup_{label}_median"] = float(np.median(ratios))
        out[f"two_thread_cpu_concurrency_{label}"] = max(concurrency)
        out[f"two_thread_cpu_concurrency_{label}_median"] = float(np.median(concurrency))
        # CPU s of 1 thread / CPU s of 2 (process total): 1.0 = parallelism costs no extra
        # work, so two free cores give up to 2x less load imbalance.
        out[f"two_thread_cpu_efficiency_{label}"] = float(np.median(efficiency))
        out[f"two_thread_cpu_efficiency_{label}_best"] = max(efficiency)
    return out


def two_process_ceiling(target: Mapping, base: Mapping, repeats: int) -> dict[str, float]:
    """What two cores of this machine give the one-thread job when nothing is shared but
    the hardware: two forked processes, each with its own copy of the checkpoints (sharing
    the pages, each would find the other's reads in the last-level cache, which threads on
    different tensors never do), each run it with 1 codec thread. Each repeat times process
    0 alone, then both at once (a barrier starts them together); the ratio is 2 x alone /
    the slower of the pair.

    No GIL, pool or task split is involved, so this bounds what any threading of the codec
    can reach here: memory bandwidth and caches the two cores share (and, on a VM, whatever
    the host gives its vCPUs) cost the pair the rest. `two_core_speedup` is best read
    against it (`two_core_of_ceiling_*`)."""
    import multiprocessing

    from store.codecs import workers

    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    results = context.SimpleQueue()

    def timed(job: Callable[[], object]) -> float:
        started = time.perf_counter()
        job()
        return time.perf_counter() - started

    def child(index: int) -> None:
        workers.set_threads(1)
        jobs = _speed_jobs(_private(target), _private(base))
        out: dict[str, tuple[list[float], list[float]]] = {}
        for label, job in jobs.items():
            job()  # warm, as in `two_core_speedup`
            alone, together = [], []
            for _ in range(repeats):
                barrier.wait()
                if index == 0:
                    alone.append(timed(job))
                barrier.wait()
                together.append(timed(job))
            out[label] = (alone, together)
        results.put((index, out))

    processes = [context.Process(target=child, args=(i,), daemon=True) for i in (0, 1)]
    for process in processes:
        process.start()
    got = dict(results.get() for _ in processes)
    for process in processes:
        process.join()
    figures: dict[str, float] = {}
    for label, (alone, together) in got[0].items():
        ratios = [
            2 * solo / max(first, second)
            for solo, first, second in zip(alone, together, got[1][label][1], strict=True)
        ]
        figures[f"two_process_ceiling_{label}"] = max(ratios)
        figures[f"two_process_ceiling_{label}_median"] = float(np.median(ratios))
    return figures


def _private(tensors: Mapping) -> dict:
    """A copy of `tensors` in memory of its own."""
    return {name: replace(t, data=t.data.copy()) for name, t in tensors.items()}


def speedup_figures(target: Mapping, base: Mapping, repeats: int) -> dict[str, float]:
    """`two_core_speedup`'s figures, the machine's `two_process_ceiling` measured right
    after on the same update, and the median speedup as a fraction of the median ceiling."""
    figures = two_core_speedup(target, base, repeats)
    figures.update(two_process_ceiling(target, base, repeats))
    for label in ("encode", "decode"):
        figures[f"two_core_of_ceiling_{label}"] = (
            figures[f"two_core_speedup_{label}_median"]
            / figures[f"two_process_ceiling_{label}_median"]
        )
    return figures


def print_two_core(figures: dict[str, float], pairs: int, density: float) -> None:
    """The 1 -> 2 thread figures as a small table (best and median of `pairs` pairs)."""
    print(f"2 codec threads / 1, {pairs} back-to-back pairs at {100 * density:g}% density:")
    print("(ceiling: 2 processes each running the 1-thread job at once, 2 x alone / pair)")
    heads = ("wall ratio", "CPU concurrency", "CPU efficiency", "ceiling")
    print(f"{'':<8} " + " ".join(f"{head:>16}" for head in heads))
    print(f"{'':<8} " + " ".join(f"{'best / median':>16}" for _ in heads))
    for label in ("encode", "decode"):
        cells = [
            (figures[f"two_core_speedup_{label}"], figures[f"two_core_speedup_{label}_median"]),
            (
                figures[f"two_thread_cpu_concurrency_{label}"],
                figures[f"two_thread_cpu_concurrency_{label}_median"],
            ),
            (
                figures[f"two_thread_cpu_efficiency_{label}_best"],
                figures[f"two_thread_cpu_efficiency_{label}"],
            ),
            (
                figures[f"two_process_ceiling_{label}"],
                figures[f"two_process_ceiling_{label}_median"],
            ),
        ]
        print(
            f"{label:<8} "
            + " ".join(f"{f'{a:.2f} / {b:.2f}':>16}" for a, b in cells)
            + f"  (median speedup {figures[f'two_core_of_ceiling_{label}']:.0%} of the ceiling)"
        )


def _quantized_worst(cases: list[Case]) -> dict[str, float]:
    quantized = [c for c in cases if c.kind in ("real-fp8", "real-nvfp4")]
    if not quantized:
        return {}
    return {
        "quantized_worst_sparse_over_xor": round(max(c.sparse_over_xor for c in quantized), 4),
        "quantized_worst_sparse_over_entropy": round(
            max(c.sparse_over_entropy for c in quantized), 4
        ),
        "quantized_min_encode_gb_s": significant(min(c.encode_gb_s for c in quantized)),
        "quantized_min_decode_gb_s": significant(min(c.decode_gb_s for c in quantized)),
    }


def real_cases(
    *, warmup_steps: int, lrs: list[float], steps: int, quantized: bool, seed: int
) -> list[tuple[str, str, dict, dict]]:
    """(name, kind, target, base) for consecutive real-gradient checkpoints and, with
    `quantized`, their FP8 and NVFP4 conversions."""
    from bench.real_updates import TinyLM, config, init_distance, rl_checkpoints
    from engine_agent.precision.convert import convert_tensors
    from engine_agent.precision.plan import plan_quantization
    from store.torch_bridge import state_dict_to_raw

    spec = TinyLM()
    pairs: list[tuple[str, str, dict, dict]] = []
    previous: dict | None = None
    scales: dict[str, float] | None = None
    for lr, step, state, loss in rl_checkpoints(
        spec, warmup_steps=warmup_steps, warmup_lr=3e-3, lrs=lrs, steps=steps, seed=seed
    ):
        views = {"real-bf16": state}
        if quantized:
            if scales is None:
                scales = {m: 1.0 for m in plan_quantization(state, "nvfp4").quantized}
            views["real-fp8"] = convert_tensors(state, config(spec), "fp8")[0]
            views["real-nvfp4"] = convert_tensors(state, config(spec), "nvfp4", scales)[0]
        current = {kind: state_dict_to_raw(view) for kind, view in views.items()}
        if step == 0:
            params = sum(t.numel() for t in state.values())
            print(
                f"real gradients: {params / 1e6:.2f} M params, warmed up {warmup_steps} AdamW "
                f"steps (loss {loss:.3f}, weight RMS {init_distance(state):.2f}x the init's); "
                f"lr {lr:.0e}"
            )
        elif previous is not None:
            for kind, tensors in current.items():
                label = kind.removeprefix("real-")
                pairs.append((f"{label} lr{lr:.0e} s{step}", kind, tensors, previous[kind]))
        previous = current
    return pairs


def run(
    params: float = typer.Option(1e8, help="Parameters of the density-sweep checkpoint."),
    densities: str = typer.Option(DENSITIES, help="Comma-separated changed fractions."),
    update_rule: bool = typer.Option(
        True, help="Add update-rule cases (an Adam-like step) at the densities in 0.1-10 %."
    ),
    real: bool = typer.Option(True, help="Add real-gradient checkpoints (trains a small model)."),
    warmup_steps: int = typer.Option(30, help="AdamW warm-up steps before the RL steps."),
    rl_lrs: str = typer.Option("1e-6,3e-6", help="Comma-separated RL learning rates."),
    rl_steps: int = typer.Option(2, help="RL steps per learning rate."),
    quantized: bool = typer.Option(True, help="Add FP8 and NVFP4 views of the real steps."),
    stages: bool = typer.Option(True, help="Measure the catch-up stages (needs torch)."),
    threads: int = typer.Option(os.cpu_count() or 1, help="Codec threads for 'all cores'."),
    repeats: int = typer.Option(2, help="Wall-clock runs per all-core figure (best kept)."),
    seed: int = typer.Option(0, help="Seed for weights and updates."),
    only_two_core: bool = typer.Option(
        False,
        help="Measure only the 1 -> 2 codec thread speedup (wall ratio, CPU concurrency and "
        "efficiency, best and median of --pairs pairs) and the machine's two-process "
        "ceiling at the density nearest 1%.",
    ),
    pairs: int = typer.Option(0, help="1 -> 2 thread pairs (0: 11 with --only-two-core, else 5)."),
) -> dict:
    """Encode every case with every delta codec; print the table and one JSON line."""
    from store.codecs import workers
    from store.codecs.warm import WARM_DTYPES, warm
    from store.synthetic import random_checkpoint

    # Every kernel loaded (compiled on a machine's first run) before any timing; U8 for the
    # quantized views' tensors.
    warm((*WARM_DTYPES, "U8"))
    load_before = os.getloadavg()
    shapes = qwen3_shapes(params)
    n_params = sum(math.prod(s) for s in shapes.values())
    base = random_checkpoint(seed, shapes)
    print(
        f"density sweep: {n_params / 1e9:.3f} B params, {len(shapes)} tensors, "
        f"BF16 {n_params * 2 / 2**30:.2f} GiB; codec threads for 'all' = {threads}; "
        f"load average {load_before[0]:.1f}"
    )
    fractions = [float(x) for x in densities.split(",") if x.strip()]
    if only_two_core:
        return _two_core_only(base, n_params, fractions, pairs or 11, seed, load_before)
    print(HEADER, flush=True)
    cases: list[Case] = []
    speed_pair = None
    for i, fraction in enumerate(fractions):
        target = density_update(base, fraction, seed + 1 + i)
        case = measure_case(
            f"density {100 * fraction:g}%", "density", target, base,
            threads=threads, repeats=repeats,
        )  # fmt: skip
        cases.append(case)
        print(_row(case), flush=True)
        if speed_pair is None or abs(fraction - 0.01) < abs(speed_pair[0] - 0.01):
            speed_pair = (fraction, target)
    if update_rule:
        low, high = TARGET_RANGE
        for i, fraction in enumerate(fractions):
            if not low <= fraction <= high:
                continue
            lr = rule_lr(base, fraction, seed + 100 + i)
            target = rule_update(base, lr, seed + 100 + i)
            case = measure_case(
                f"update {100 * fraction:g}%", "update", target, base,
                threads=threads, repeats=repeats,
            )  # fmt: skip
            cases.append(case)
            print(_row(case) + f"  lr {lr:.3g}", flush=True)
    if real:
        for name, kind, target, previous in real_cases(
            warmup_steps=warmup_steps,
            lrs=[float(x) for x in rl_lrs.split(",") if x.strip()],
            steps=rl_steps,
            quantized=quantized,
            seed=seed,
        ):
            case = measure_case(name, kind, target, previous, threads=threads, repeats=repeats)
            cases.append(case)
            print(_row(case), flush=True)
    speedup: dict[str, float] = {}
    stage_rates: dict[str, float] = {}
    stage_wall: dict[str, float] = {}
    if speed_pair is not None:
        speedup = speedup_figures(speed_pair[1], base, pairs or max(5, 2 * repeats))
        print_two_core(speedup, pairs or max(5, 2 * repeats), speed_pair[0])
        if stages:
            with tempfile.TemporaryDirectory(prefix="tether-bench-codec-") as scratch:
                stage_rates, stage_wall = catchup_stages(
                    speed_pair[1], base, Path(scratch), repeats
                )
    workers.set_threads(os.cpu_count() or 1)
    load_after = os.getloadavg()
    targeted = [c for c in cases if c.targeted]
    xor_targeted = [c for c in targeted if c.xor_targeted] or targeted
    uniform = [c for c in targeted if c.kind == "density"]
    summary = {
        "params": n_params,
        "worst_sparse_over_xor": round(max(c.sparse_over_xor for c in xor_targeted), 4),
        "worst_sparse_over_xor_cases": [c.name for c in xor_targeted],
        "uniform_worst_sparse_over_xor": (
            round(max(c.sparse_over_xor for c in uniform), 4) if uniform else None
        ),
        "worst_sparse_over_entropy": round(max(c.sparse_over_entropy for c in targeted), 4),
        "min_encode_gb_s": significant(min(c.encode_gb_s for c in targeted)),
        "min_decode_gb_s": significant(min(c.decode_gb_s for c in targeted)),
        "two_core_speedup": significant(
            min(
                speedup.get("two_core_speedup_encode", 0), speedup.get("two_core_speedup_decode", 0)
            )
        ),
        **{k: significant(v) for k, v in speedup.items()},
        "speedup_density": speed_pair[0] if speed_pair else None,
        **_quantized_worst(cases),
        "convert_fp8_gb_s": stage_rates.get("convert_fp8_gb_s"),
        "convert_nvfp4_gb_s": stage_rates.get("convert_nvfp4_gb_s"),
        "stages_gb_s_per_core": stage_rates,
        "stages_gb_s_wall": stage_wall,
        "threads": threads,
        "load_average": [round(load_before[0], 2), round(load_after[0], 2)],
        "cases": [
            {
                "name": c.name,
                "kind": c.kind,
                **{
                    k: (significant(v, 5) if isinstance(v, float) else v)
                    for k, v in vars(c).items()
                    if k not in ("name", "kind")
                },
            }
            for c in cases
        ],
    }
    print(
        f"over densities {TARGET_RANGE[0]:.1%}..{TARGET_RANGE[1]:.0%} and the real BF16 steps: "
        f"sparse <= {summary['worst_sparse_over_xor']}x xor on the update-rule and real cases "
        f"(target <= 0.5; uniform cases {summary['uniform_worst_sparse_over_xor']}x), "
        f"<= {summary['worst_sparse_over_entropy']}x the entropy (<= 1.1); per core encode "
        f">= {summary['min_encode_gb_s']} GB/s (>= 1), decode+apply >= "
        f"{summary['min_decode_gb_s']} GB/s (>= 2); 2 threads / 1: "
        f"{summary['two_core_speedup']}x (>= 1.8); stages per core: {stage_rates}; "
        f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}"
    )
    print(json.dumps(summary))
    return summary


def _two_core_only(
    base: Mapping,
    n_params: int,
    fractions: list[float],
    pairs: int,
    seed: int,
    load_before: tuple[float, float, float],
) -> dict:
    """`--only-two-core`: the speedup figures of `run`'s JSON alone, in about a minute."""
    from store.codecs import workers

    i, fraction = min(enumerate(fractions), key=lambda item: abs(item[1] - 0.01))
    # The same update `run` measures the speedup on (its seed for this density).
    target = density_update(base, fraction, seed + 1 + i)
    speedup = speedup_figures(target, base, pairs)
    workers.set_threads(os.cpu_count() or 1)
    load_after = os.getloadavg()
    print_two_core(speedup, pairs, fraction)
    summary = {
        "params": n_params,
        "two_core_speedup": significant(
            min(speedup["two_core_speedup_encode"], speedup["two_core_speedup_decode"])
        ),
        **{k: significant(v) for k, v in speedup.items()},
        "speedup_density": fraction,
        "pairs": pairs,
        "cpus": os.cpu_count(),
        "load_average": [round(load_before[0], 2), round(load_after[0], 2)],
    }
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    typer.run(run)
