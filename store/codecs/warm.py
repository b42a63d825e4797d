"""Warming the codecs before the first catch-up needs them.

A process's first fold pays once for what later folds get for free: importing the codecs
(numba among them) and loading each compiled kernel from numba's on-disk cache, or
compiling it when the cache is cold. In an engine agent that first fold runs while the
engine serves, in threads sharing the GIL with the proxy and the heartbeats, and it makes
the first version late by that much.

`warm_decoders()` pays it up front for a process that only folds (an engine agent): it
folds a small delta shipped with this package (`warm_delta/`) onto a base it regenerates,
in memory, and verifies the result. `warm()` encodes that delta first, for a process that
also encodes (a trainer, the benchmarks). Neither touches a store or the network.

`python -m store.codecs.warm --write` rewrites the shipped delta after a change to the
codec or to the cases below; a test fails until it matches a fresh encode.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from store.tensors import ELEMENT_BITS, RawTensor, dtype_size

# Dtypes a published checkpoint holds: BF16 weights, F32 norms or router tables.
WARM_DTYPES = ("BF16", "F32")
# The codec a trainer publishes with by default.
WARM_CODEC = "sparse"
# The shipped delta: `WARM_DTYPES`' case encoded with `WARM_CODEC`, as a version's files.
SHIPPED = "warm_delta"
# Enough elements that the codec plans several blocks of each tensor.
_ELEMENTS = 1 << 16
# (share of elements changed, how far each moves in units in the last place): an RL step's
# few small moves and a warm-up's many, and changes too large to code as steps. Each takes
# its own kernels: the steps' and the XOR patterns'.
_CHANGES = ((0.005, 2), (0.3, 2), (0.05, 1 << 12))
# A norm's or a bias's few elements: small tensors are coded together, from other buffers.
_SMALL = 64
# An optimizer's step: values under this magnitude move by one ulp, larger ones stay (a
# step of lr·~1 changes a value only where it exceeds half the value's ulp). Changes that
# follow the base's values are coded by class (sparse-v3), with kernels of their own, and
# classes (binades) where nearly every value moved by their complement: three binades here.
_SMALL_VALUES = 2.0**-6


def warm_case(
    dtypes: Sequence[str] = WARM_DTYPES,
) -> tuple[dict[str, RawTensor], dict[str, RawTensor]]:
    """(base, target): the same small update of each of `dtypes` on every call."""
    rng = np.random.default_rng(0)
    base: dict[str, RawTensor] = {}
    target: dict[str, RawTensor] = {}
    for dtype in dtypes:
        width = ELEMENT_BITS[dtype_size(dtype)]
        # Positive finite values of a trained weight's magnitudes (2^-9 to 2^-4), as bits.
        values = rng.uniform(2.0**-9, 2.0**-4, _ELEMENTS).astype("<f4").view("<u4")
        bits = (values >> 16 if width.itemsize == 2 else values).astype(width)
        moves = {}
        for share, ulps in _CHANGES:
            moving = rng.random(_ELEMENTS) < share
            moves[f"{share}.{ulps}"] = bits + moving * rng.integers(1, ulps + 1, _ELEMENTS)
        moves["step"] = np.where(values < np.float32(_SMALL_VALUES).view("<u4"), bits + 1, bits)
        for case, moved in moves.items():
            base[f"{dtype}.{case}"] = RawTensor(dtype, bits.shape, bits.view(np.uint8))
            target[f"{dtype}.{case}"] = RawTensor(
                dtype, bits.shape, moved.astype(width).view(np.uint8)
            )
        small = bits[:_SMALL].copy()
        small[::3] += 1
        base[f"{dtype}.small"] = RawTensor(dtype, small.shape, bits[:_SMALL].view(np.uint8))
        target[f"{dtype}.small"] = RawTensor(dtype, small.shape, small.view(np.uint8))
    return base, target


def encode_case(dtypes: Sequence[str] = WARM_DTYPES, codec: str = WARM_CODEC) -> dict[str, bytes]:
    """The files of `warm_case(dtypes)`'s update, encoded with `codec` as version 1 of 0."""
    from store.codecs import encode_version

    base, target = warm_case(dtypes)
    return encode_version(target, base, version=1, base_version=0, codec=codec)


def shipped_delta() -> dict[str, bytes]:
    """The shipped files of `encode_case()`, by file name."""
    folder = resources.files(__package__) / SHIPPED
    return {entry.name: entry.read_bytes() for entry in folder.iterdir() if entry.is_file()}


def _fold(files: Mapping[str, bytes], base: Mapping[str, RawTensor]) -> None:
    # The fold verifies each tensor it writes against the delta's checksums, as a catch-up
    # does: a codec that cannot fold the delta fails here (`store.errors`), before any
    # version depends on it.
    from store.codecs import decode_version

    decode_version(files, base)


def warm_decoders() -> float:
    """Fold the shipped delta onto its regenerated base; the seconds it took."""
    started = time.perf_counter()
    base, _ = warm_case()
    _fold(shipped_delta(), base)
    return time.perf_counter() - started


def warm(dtypes: Sequence[str] = WARM_DTYPES, codec: str = WARM_CODEC) -> float:
    """Encode and fold back a small update of each of `dtypes` with `codec`; the seconds
    it took. Loads the encoders' kernels as well as the decoders'."""
    started = time.perf_counter()
    base, _ = warm_case(dtypes)
    _fold(encode_case(dtypes, codec), base)
    return time.perf_counter() - started


def write_shipped(folder: Path) -> list[Path]:
    """Write `encode_case()`'s files into `folder` (emptied of other files first)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = encode_case()
    for stale in folder.iterdir():
        if stale.is_file() and stale.name not in files:
            stale.unlink()
    written = []
    for name, data in sorted(files.items()):
        (folder / name).write_bytes(data)
        written.append(folder / name)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m store.codecs.warm",
        description="Load the codecs' compiled kernels (compiling them into numba's cache "
        "when it is cold), as an engine agent does at boot. Run it when building an image "
        "so the cache ships with it.",
    )
    parser.add_argument(
        "--encoders",
        action="store_true",
        help="also load the encoders' kernels (a trainer's process needs them; an agent's not)",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help=f"rewrite the shipped delta ({SHIPPED}/ beside this module) from a fresh encode; "
        "after changing the codec or the warm-up's cases",
    )
    args = parser.parse_args(argv)
    if args.write:
        for path in write_shipped(Path(__file__).with_name(SHIPPED)):
            print(f"wrote {path} ({path.stat().st_size} bytes)")
        return 0
    seconds = warm() if args.encoders else warm_decoders()
    print(f"codecs warmed in {seconds:.2f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
