"""`sparse-v3`: positions coded within classes of the base value's magnitude round-trip bit
for bit on any input, are smaller than sparse-v2 where changes depend on magnitude, fall back
to sparse-v2 blocks where they do not, and older encodings still fold."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.codecs import class_kernels, encode_version, fold
from store.codecs.delta import encode_delta
from store.codecs.fold import read_manifest
from store.codecs.sparse_v2 import SparseV2Codec
from store.codecs.sparse_v3 import FORM_GAPS, SparseV3Codec
from store.errors import ChecksumMismatch, CorruptPayload
from store.tensors import RawTensor
from tests.store.codec_round_trip import bf16_tensor, encoded_on_one_and_two_threads, round_trip
from tests.store.payload_damage import assert_every_truncation_refused, flip_outcomes
from tests.store.tensor_cases import raw_tensors, successors

SMALL_BLOCKS = SparseV3Codec(block_log2=8)  # 256-element blocks: every test spans several
BF16_SPECIAL = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x0001, 0x8001, 0x7F7F]


class ForcedClasses(SparseV3Codec):
    """Writes every changed block in the class form, classes starting at the given exponent
    bins (those the dtype has), so the class path is exercised on inputs the encoder would
    code as sparse-v2."""

    def __init__(self, bins: list[int], block_log2: int = 8) -> None:
        super().__init__(block_log2=block_log2)
        self._bins = bins

    def _plan_classes(self, old, old_values, shift):
        keymask = (1 << (8 * old.dtype.itemsize - 1)) - 1
        starts = {0} | {b << shift for b in self._bins if b << shift <= keymask}
        return sorted(starts), 0.0


def as_bf16(values: np.ndarray) -> np.ndarray:
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def adam_like_step(size: int, lr: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(base, target) BF16 bits: Gaussian weights, each moved by about lr, so small values
    change and large ones do not, as in a real optimizer step."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(0.0, 0.02, size).astype(np.float32)
    base = as_bf16(weights)
    values = (base.astype(np.uint32) << 16).view(np.float32)
    step = np.clip(rng.normal(0.0, 1.0, size), -1, 1).astype(np.float32)
    return base, as_bf16(values + np.float32(lr) * step)


def block_forms(payload: np.ndarray, block_log2: int, count: int) -> list[int]:
    """The form byte of each block (0 = sparse-v2 gaps, else the class count)."""
    raw = bytes(payload)
    offset = 3
    for _ in range(2):  # n, k
        while raw[offset] & 0x80:
            offset += 1
        offset += 1
    lengths = []
    for _ in range(-(-count >> block_log2) - 1):
        value = shift = 0
        while True:
            byte = raw[offset]
            offset += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        lengths.append(value)
    forms = []
    for length in [*lengths, None]:
        forms.append(raw[offset])
        offset += length or 0
    return forms


@pytest.mark.parametrize("lr", [1e-7, 1e-6, 1e-5])
def test_magnitude_dependent_changes_take_the_class_form_and_cost_less_than_sparse_v2(lr):
    base, new = adam_like_step(1 << 16, lr, 1)
    target, old = bf16_tensor(new), bf16_tensor(base)
    v3 = SparseV3Codec().encode_tensor(target, old)
    v2 = SparseV2Codec().encode_tensor(target, old)
    assert block_forms(v3, 22, base.size) != [FORM_GAPS]
    assert v3.size < 0.9 * v2.size
    assert np.array_equal(round_trip(SparseV3Codec(), target, old), target.data)
    assert np.array_equal(round_trip(SMALL_BLOCKS, target, old), target.data)


def test_uniform_changes_stay_sparse_v2_blocks_at_one_byte_more():
    rng = np.random.default_rng(2)
    base = as_bf16(rng.normal(0.0, 0.02, 1 << 16))
    new = base.copy()
    where = rng.random(base.size) < 0.01
    new[where] += np.where(rng.random(int(where.sum())) < 0.5, 1, 65535).astype(np.uint16)
    v3 = SparseV3Codec().encode_tensor(bf16_tensor(new), bf16_tensor(base))
    v2 = SparseV2Codec().encode_tensor(bf16_tensor(new), bf16_tensor(base))
    assert block_forms(v3, 22, base.size) == [FORM_GAPS]
    assert v3.size == v2.size + 1


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_dtype_and_shape_round_trips(data):
    old = data.draw(raw_tensors())
    new = data.draw(successors(old))
    assert np.array_equal(round_trip(SMALL_BLOCKS, new, old), new.data)
    bins = data.draw(st.lists(st.integers(1, 255), max_size=4, unique=True))
    forced = ForcedClasses(bins)
    if old.dtype != "U8":  # U8 has no magnitude classes: always sparse-v2 blocks
        assert np.array_equal(round_trip(forced, new, old), new.data)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.sampled_from(BF16_SPECIAL) | st.integers(0, 2**16 - 1), min_size=1, max_size=700),
    st.lists(st.integers(0, 699), max_size=300),
    st.sampled_from([1, 2, 65535, 0x8000, 0x7FFF, 0x4000]),
    st.lists(st.integers(1, 255), max_size=6, unique=True),
)
def test_class_form_round_trips_any_classes_and_bases(values, positions, delta, bins):
    """NaN, ±inf, ±0 and subnormal bases; changes at both ends, in runs, crossing zero; any
    class table, including classes with no elements, one class holding everything, and
    classes where most elements change (coded by their unchanged ones)."""
    old = np.array(values, dtype=np.uint16)
    new = old.copy()
    where = np.array([p for p in positions if p < old.size], dtype=np.int64)
    new[where] = (new[where] + np.uint16(delta)).astype(np.uint16)
    new[0] ^= 0x0001
    new[-1] = 0xFFC1 if old[-1] != 0xFFC1 else 0x8000  # a NaN payload or -0.0 at the end
    target, base = bf16_tensor(new), bf16_tensor(old)
    for codec in (ForcedClasses(bins), ForcedClasses([]), ForcedClasses([0xFF])):
        assert np.array_equal(round_trip(codec, target, base), target.data)


@pytest.mark.parametrize("size", [1, 2, 63, 64, 65, 255, 256, 257])
def test_tiny_tensors_and_word_edges_round_trip(size):
    rng = np.random.default_rng(size)
    old = as_bf16(rng.normal(0, 1e-3, size))
    for where in ([0], [size - 1], list(range(size))):
        new = old.copy()
        new[where] += np.uint16(1)
        target, base = bf16_tensor(new), bf16_tensor(old)
        for codec in (SparseV3Codec(), ForcedClasses([]), ForcedClasses([116, 118])):
            assert np.array_equal(round_trip(codec, target, base), target.data)


def test_a_class_where_every_element_changes_costs_no_positions():
    """Elements below 1e-4 all change, the rest never: the classes say it all."""
    rng = np.random.default_rng(5)
    old = as_bf16(np.where(rng.random(1 << 14) < 0.3, 1e-6, 0.5) * rng.choice([-1, 1], 1 << 14))
    new = np.where((old & 0x7FFF) < 0x3800, old + np.uint16(1), old).astype(np.uint16)
    target, base = bf16_tensor(new), bf16_tensor(old)
    payload = SparseV3Codec().encode_tensor(target, base)
    changes = int((new != old).sum())
    assert payload.size < 40 + changes / 8  # headers plus one sign bit per change
    assert np.array_equal(round_trip(SparseV3Codec(), target, base), target.data)


def _deposited(x: int, m: int) -> int:
    """pdep by its definition: bit t of x goes to m's t-th set bit."""
    out, t = 0, 0
    for bit in range(64):
        if m >> bit & 1:
            out |= (x >> t & 1) << bit
            t += 1
    return out


def test_events_are_deposited_on_members_alike_by_pdep_and_by_selects():
    """The decoder places a word's events with `deposit`: the CPU's pdep where it is fast,
    else one select per event; both must be pdep exactly, whatever bits x holds past m's
    count (they belong to the next word)."""
    rng = np.random.default_rng(12)
    random = [int(w) for w in rng.integers(0, 2**64, 600, dtype=np.uint64)]
    dense = list(zip(random[:200], random[200:400], strict=True))
    sparse = [(x, m & a & b) for x, m, a, b in zip(*[iter(random)] * 4, strict=True)]
    edges = [(x, m) for x in (0, 1, 2**64 - 1, 0x5555) for m in (0, 1, 2**63, 2**64 - 1, 0xF0F0)]
    cases = dense + sparse + edges
    by_selects = numba.njit(class_kernels._deposit_py)
    chosen = numba.njit(lambda x, m: class_kernels.deposit(x, m))
    for x, m in cases:
        expected = _deposited(x, m)
        assert int(by_selects(np.uint64(x), np.uint64(m))) == expected
        assert int(chosen(np.uint64(x), np.uint64(m))) == expected


def test_a_chunks_changes_are_listed_alike_by_vector_compress_and_by_bit_scans():
    """The decoder lists a chunk's changes with `list_bits`: AVX-512 compresses where the
    CPU has them, else bit scans four at a time; both must give every set bit's index in
    order and its count, for empty, full and partial words."""
    rng = np.random.default_rng(13)
    words = rng.integers(0, 2**64, 64, dtype=np.uint64)
    words &= rng.integers(0, 2**64, 64, dtype=np.uint64)
    words[:3] = [0, 2**64 - 1, 1]
    words[-1] = 2**63
    expected = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
    by_scans = numba.njit(class_kernels._list_bits_py)
    for words_used in (0, 1, 2, 3, 40, 64):
        want = expected[expected < 64 * words_used]
        for kernel in (by_scans, class_kernels.list_bits):
            out = np.zeros(class_kernels.CHUNK + 64, np.uint16)
            count = kernel(words, words_used, out)
            assert count == want.size
            assert np.array_equal(out[:count], want)


def test_the_sparse_codec_writes_sparse_v3_and_threads_do_not_change_the_bytes():
    base_bits, new_bits = adam_like_step((1 << 22) + 1000, 1e-6, 4)  # two blocks
    base, target = {"w": bf16_tensor(base_bits)}, {"w": bf16_tensor(new_bits)}
    one, two = encoded_on_one_and_two_threads(
        lambda _: encode_version(target, base, version=1, base_version=0, codec="sparse")
    )
    assert one == two
    assert read_manifest(one).delta_encoding == "sparse-v3"
    assert np.array_equal(fold(base, [two])["w"].data, target["w"].data)


def test_versions_published_as_sparse_v2_still_fold():
    base_bits, middle_bits = adam_like_step(5000, 1e-5, 6)
    base, middle = {"w": bf16_tensor(base_bits)}, {"w": bf16_tensor(middle_bits)}
    target = {"w": bf16_tensor(middle_bits + np.uint16(1))}
    old = encode_delta(SparseV2Codec(), middle, base, version=1, base_version=0, shard_bytes=2**30)
    new = encode_version(target, middle, version=2, base_version=1, codec="sparse")
    assert read_manifest(old).delta_encoding == "sparse-v2"
    assert read_manifest(new).delta_encoding == "sparse-v3"
    assert np.array_equal(fold(base, [old, new])["w"].data, target["w"].data)


def class_payload() -> tuple[np.ndarray, RawTensor, RawTensor]:
    base, new = adam_like_step(700, 3e-5, 9)
    old, target = bf16_tensor(base), bf16_tensor(new)
    payload = SMALL_BLOCKS.encode_tensor(target, old)
    assert FORM_GAPS not in block_forms(payload, 8, 700)
    return payload, target, old


def test_every_truncation_of_a_class_payload_is_refused():
    payload, _new, old = class_payload()
    assert_every_truncation_refused(SMALL_BLOCKS, payload, old)


def test_byte_flips_in_a_class_payload_are_refused_or_left_to_the_checksum():
    """Nothing but CorruptPayload escapes the decoder; most flips are refused outright."""
    payload, new, old = class_payload()
    refused, wrong = flip_outcomes(SMALL_BLOCKS, payload, new, old)
    assert refused > payload.size // 4
    assert refused + wrong > payload.size // 2


def test_a_corrupt_class_version_never_returns_tensors():
    _payload, new, old = class_payload()
    files = encode_version({"t": new}, {"t": old}, version=1, base_version=0, codec="sparse")
    shard = next(name for name in files if name.endswith(".safetensors"))
    body = bytearray(files[shard])
    body[-3] ^= 0xFF
    with pytest.raises((CorruptPayload, ChecksumMismatch)):
        fold({"t": old}, [{**files, shard: bytes(body)}])
