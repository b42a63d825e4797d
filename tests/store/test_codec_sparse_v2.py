"""`sparse-v2`: exact round trips at every density, the documented layout, old payloads still
readable, and corrupt payloads refused."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from store.codecs import encode_version, fold
from store.codecs.bitstreams import rice_decode, rice_encode, rice_parameter
from store.codecs.delta import encode_delta
from store.codecs.fold import read_manifest
from store.codecs.sparse import SparseCodec, float_order, float_unorder
from store.codecs.sparse_kernels import (
    ERR_MAGNITUDE,
    ERR_POSITION,
    OK,
    RICE_SAMPLE,
    change_mask,
    rice_apply_steps,
    step_one,
)
from store.codecs.sparse_v2 import SparseV2Codec
from store.errors import ChecksumMismatch, CorruptPayload
from store.tensors import RawTensor
from tests.store.codec_round_trip import bf16_tensor, encoded_on_one_and_two_threads, round_trip
from tests.store.payload_damage import assert_every_truncation_refused, flip_outcomes
from tests.store.tensor_cases import raw_tensors, successors

SMALL_BLOCKS = SparseV2Codec(block_log2=8)  # 256-element blocks: every test spans several


def moved(base: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """`base` with `fraction` of its elements moved one or two steps, or replaced."""
    rng = np.random.default_rng(seed)
    new = base.copy()
    where = rng.random(base.size) < fraction
    new[where] += rng.choice(np.array([1, 2, 65535, 40000], dtype=np.uint16), int(where.sum()))
    return new


@pytest.mark.parametrize("fraction", [0.0, 0.0005, 0.001, 0.0025, 0.02, 0.1, 0.25, 0.9, 1.0])
def test_every_density_round_trips_bit_for_bit(fraction):
    base = np.random.default_rng(1).integers(0, 65536, 5000, dtype=np.uint16)
    new = moved(base, fraction, 2)
    if fraction == 1.0:
        new = base + np.uint16(1)
    for codec in (SMALL_BLOCKS, SparseV2Codec()):
        out = round_trip(codec, bf16_tensor(new), bf16_tensor(base))
        assert np.array_equal(out, new.view(np.uint8))


def test_an_unchanged_tensor_has_no_payload():
    base = bf16_tensor(np.arange(1000, dtype=np.uint16))
    assert SparseV2Codec().encode_tensor(base, base) is None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_dtype_and_shape_round_trips(data):
    old = data.draw(raw_tensors())
    new = data.draw(successors(old))
    assert np.array_equal(round_trip(SMALL_BLOCKS, new, old), new.data)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=700),
    st.lists(st.integers(0, 699), max_size=200),
    st.sampled_from([0, 1, 65535, 0x8000, 0x7FFF]),
)
def test_clustered_and_extreme_changes_round_trip(values, positions, delta):
    """Long runs, changes at both ends, sign flips, NaN and -0.0 patterns."""
    old = np.array(values, dtype=np.uint16)
    new = old.copy()
    where = np.array([p for p in positions if p < old.size], dtype=np.int64)
    new[where] = (new[where] + np.uint16(delta or 0x8000)).astype(np.uint16)
    new[-1] = 0xFFC1 if old[-1] != 0xFFC1 else 0x8000  # a NaN payload or -0.0 at the end
    assert np.array_equal(
        round_trip(SMALL_BLOCKS, bf16_tensor(new), bf16_tensor(old)), new.view(np.uint8)
    )


def test_one_ulp_steps_cost_about_their_entropy():
    """1 % of values moving one ulp: positions near n*H2(q), values about one bit each."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 65536, 1 << 20, dtype=np.uint16)
    new = base.copy()
    where = rng.random(base.size) < 0.01
    new[where] += np.where(rng.random(int(where.sum())) < 0.5, 1, 65535).astype(np.uint16)
    q = where.mean()
    entropy_bits = base.size * -(q * np.log2(q) + (1 - q) * np.log2(1 - q)) + where.sum()
    payload = SparseV2Codec().encode_tensor(bf16_tensor(new), bf16_tensor(base))
    assert payload.size * 8 < 1.03 * entropy_bits


def test_sparse_v2_threads_do_not_change_the_bytes():
    base = {"w": bf16_tensor(np.random.default_rng(4).integers(0, 65536, 3 << 22, dtype=np.uint16))}
    target = {"w": bf16_tensor(moved(base["w"].bits(), 0.01, 5))}
    one, two = encoded_on_one_and_two_threads(
        lambda threads: encode_delta(
            SparseV2Codec(), target, base, version=1, base_version=0, shard_bytes=2**30,
            workers=threads,
        )
    )  # fmt: skip
    assert one == two
    assert read_manifest(one).delta_encoding == "sparse-v2"
    assert np.array_equal(fold(base, [two])["w"].data, target["w"].data)


def test_versions_published_as_sparse_v1_still_fold():
    base = {"w": bf16_tensor(np.random.default_rng(6).integers(0, 65536, 4000, dtype=np.uint16))}
    middle = {"w": bf16_tensor(moved(base["w"].bits(), 0.02, 7))}
    target = {"w": bf16_tensor(moved(middle["w"].bits(), 0.02, 8))}
    old = encode_delta(SparseCodec(), middle, base, version=1, base_version=0, shard_bytes=2**30)
    new = encode_version(target, middle, version=2, base_version=1, codec="sparse")
    assert read_manifest(old).delta_encoding == "sparse-v1"
    assert np.array_equal(fold(base, [old, new])["w"].data, target["w"].data)


def payload_pair() -> tuple[np.ndarray, RawTensor, RawTensor]:
    base = np.random.default_rng(9).integers(0, 65536, 700, dtype=np.uint16)
    old, new = bf16_tensor(base), bf16_tensor(moved(base, 0.05, 10))
    return SMALL_BLOCKS.encode_tensor(new, old), new, old


def test_every_truncation_is_refused():
    payload, _new, old = payload_pair()
    assert_every_truncation_refused(SMALL_BLOCKS, payload, old)


def test_byte_flips_are_refused_or_left_to_the_checksum():
    """A flipped byte raises CorruptPayload (nothing else escapes the decoder); the few that
    still parse (a padding bit, a raw low-bits byte) give bytes the target checksum rejects."""
    payload, new, old = payload_pair()
    refused, wrong = flip_outcomes(SMALL_BLOCKS, payload, new, old)
    # Nothing but CorruptPayload escaped; most flips are refused outright, and of the rest
    # some only touch padding bits (the result is right), the others are left to the checksum.
    assert refused > payload.size // 4
    assert refused + wrong > payload.size // 2


def test_a_payload_for_another_tensor_is_refused():
    payload, _new, old = payload_pair()
    with pytest.raises(CorruptPayload, match="another tensor"):
        SMALL_BLOCKS.apply_into(np.zeros(702, np.uint8), payload, 2, "t")
    with pytest.raises(CorruptPayload, match="another tensor"):
        SMALL_BLOCKS.apply_into(old.data.copy(), payload, 1, "t")


def test_a_corrupt_version_never_returns_tensors():
    _payload, new, old = payload_pair()
    files = encode_version({"t": new}, {"t": old}, version=1, base_version=0, codec="sparse")
    shard = next(name for name in files if name.endswith(".safetensors"))
    body = bytearray(files[shard])
    body[-3] ^= 0xFF
    with pytest.raises((CorruptPayload, ChecksumMismatch)):
        fold({"t": old}, [{**files, shard: bytes(body)}])


# -- a decoder written from docs/format.md §5 alone, one element at a time ---------------------


def leb128(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def bits_msb_first(data: bytes, count: int) -> list[int]:
    return [(data[i // 8] >> (7 - i % 8)) & 1 for i in range(count)]


def doc_order(x: int, w: int) -> int:
    sign, ones = 1 << (8 * w - 1), (1 << (8 * w)) - 1
    return x ^ (sign | ((x >> (8 * w - 1)) * ones))


def doc_unorder(y: int, w: int) -> int:
    sign, ones = 1 << (8 * w - 1), (1 << (8 * w)) - 1
    return y ^ (sign | (((y >> (8 * w - 1)) ^ 1) * ones))


def doc_rice(low: bytes, unary: bytes, unary_bits: int, count: int, r: int) -> list[int]:
    plane = -(-count // 8)
    values = [0] * count
    for j in range(r):
        for i, bit in enumerate(bits_msb_first(low[j * plane :], count)):
            values[i] |= bit << j
    i = run = 0
    for bit in bits_msb_first(unary, unary_bits):
        if bit:
            values[i] += run << r
            i, run = i + 1, 0
        else:
            run += 1
    assert i == count
    return values


def doc_positions(gaps: list[int], start: int) -> list[int]:
    positions, p = [], start - 1
    for gap in gaps:
        p += gap + 1
        positions.append(p)
    return positions


def doc_decode(payload: bytes, old: list[int], w: int) -> list[int]:
    assert payload[0] == 0x32 and payload[1] == w
    block = 1 << payload[2]
    n, at = leb128(payload, 3)
    k, at = leb128(payload, at)
    lengths = []
    for _ in range(-(-n // block) - 1):
        length, at = leb128(payload, at)
        lengths.append(length)
    lengths.append(len(payload) - at - sum(lengths))
    new, total, modulus = list(old), 0, 1 << (8 * w)
    for index, length in enumerate(lengths):
        body, at = payload[at : at + length], at + length
        changes, p = leb128(body, 0)
        total += changes
        if not changes:
            continue
        mode, r = body[p], body[p + 1]
        unary_bits, p = leb128(body, p + 2)
        plane = -(-changes // 8)
        sizes = [r * plane, -(-unary_bits // 8)]
        if mode == 2:
            nonzero, p = leb128(body, p)
            sizes.append(plane)
            if nonzero:
                r_gap = body[p]
                gap_bits, p = leb128(body, p + 1)
                r_value = body[p]
                value_bits, p = leb128(body, p + 1)
                inner = -(-nonzero // 8)
                sizes += [r_gap * inner, -(-gap_bits // 8), r_value * inner, -(-value_bits // 8)]
        else:
            sizes += [changes] * w
        kinds = [(body[p + j // 4] >> (2 * (j % 4))) & 3 for j in range(len(sizes))]
        p += -(-len(sizes) // 4)
        lengths = []
        for kind, size in zip(kinds, sizes, strict=True):
            if kind == 1:
                length, p = leb128(body, p)
            else:
                length = size if kind == 0 else 0
            lengths.append(length)
        streams = []
        for kind, length, size in zip(kinds, lengths, sizes, strict=True):
            raw = body[p : p + length]
            p += length
            if kind == 1:
                raw = zstandard.ZstdDecompressor().decompress(raw)
            streams.append(bytes(size) if kind == 2 else raw)
        gaps = doc_rice(streams[0], streams[1], unary_bits, changes, r)
        positions = doc_positions(gaps, index * block)
        if mode == 2:
            signs = bits_msb_first(streams[2], changes)
            magnitudes = [0] * changes
            if nonzero:
                where = doc_positions(doc_rice(streams[3], streams[4], gap_bits, nonzero, r_gap), 0)
                stored = doc_rice(streams[5], streams[6], value_bits, nonzero, r_value)
                for i, m in zip(where, stored, strict=True):
                    magnitudes[i] = m + 1
            for i, position in enumerate(positions):
                step = magnitudes[i] + 1
                step = (modulus - step) % modulus if signs[i] else step
                new[position] = doc_unorder((doc_order(old[position], w) + step) % modulus, w)
        else:
            planes = streams[2:]
            for i, position in enumerate(positions):
                value = sum(planes[j][i] << (8 * j) for j in range(w))
                new[position] = value if mode == 0 else new[position] ^ value
    assert total == k
    return new


@pytest.mark.parametrize("dtype", ["U8", "BF16", "F32"])
def test_a_decoder_written_from_the_document_reads_tethers_payloads(dtype):
    w = {"U8": 1, "BF16": 2, "F32": 4}[dtype]
    rng = np.random.default_rng(11)
    old = rng.integers(0, 2 ** (8 * w), 900, dtype=f"<u{w}")
    new = old.copy()
    new[rng.random(900) < 0.1] += 1  # mostly one-step moves: STEP
    new[::97] += 5  # some bigger ones: nonzero magnitudes
    as_raw = [RawTensor(dtype, (900,), a.view(np.uint8)) for a in (new, old)]
    payload = SMALL_BLOCKS.encode_tensor(*as_raw)
    assert payload is not None
    decoded = doc_decode(payload.tobytes(), [int(x) for x in old], w)
    assert decoded == [int(x) for x in new]


def documented_rice(values: np.ndarray, r: int) -> tuple[bytes, bytes, int]:
    """docs/format.md §5's Rice streams, written the slow obvious way: bit j of every value
    as plane j (least significant first), then each quotient as zeros and a one, both packed
    most significant bit first."""
    planes = b"".join(np.packbits((values >> j) & 1).tobytes() for j in range(r))
    unary = "".join("0" * int(v >> r) + "1" for v in values)
    padded = unary + "0" * (-len(unary) % 8)
    return planes, bytes(int(padded[i : i + 8], 2) for i in range(0, len(padded), 8)), len(unary)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.integers(0, 5000), min_size=1, max_size=300),
    r=st.integers(0, 12),
)
def test_rice_streams_are_the_documented_bits_and_decode_back(values, r):
    array = np.array(values, dtype=np.uint32)
    low, unary, bits = rice_encode(array, r)
    assert (low.tobytes(), unary.tobytes(), bits) == documented_rice(array, r)
    assert np.array_equal(rice_decode(low, unary, bits, array.size, r, "t"), array)


@pytest.mark.parametrize(("count", "bits"), [(4, 8), (6, 8), (5, 7), (5, 10)])
def test_a_unary_stream_with_another_number_of_codes_is_refused(count, bits):
    low, unary, unary_bits = rice_encode(np.array([0, 1, 2, 0, 0], dtype=np.uint32), 0)
    assert unary_bits == 8  # 1 01 001 1 1
    with pytest.raises(CorruptPayload):
        rice_decode(low, np.append(unary, 0xFF), bits, count, 0, "t")


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_a_one_unit_step_is_float_orders_plus_or_minus_one_for_every_pattern(dtype):
    """The decoder's branch-free step agrees with `float_order` on every bit pattern of
    the width, both directions, the zeros and the NaN patterns at either end included."""
    width = 8 * np.dtype(dtype).itemsize
    patterns = np.arange(1 << width, dtype=np.uint64).astype(dtype)
    for down, delta in ((0, 1), (1, -1)):
        expected = float_unorder(float_order(patterns) + dtype(delta % (1 << width)))
        found = [step_one(np.uint64(p), np.uint64(down), np.uint64(width - 1)) for p in patterns]
        assert np.array_equal(np.array(found, dtype=np.uint64).astype(dtype), expected)


def stepped_block(count: int, r: int, seed: int) -> dict:
    """A block of BF16 patterns and the Rice-coded STEP streams of `count` changes (gaps
    with parameter r, signs, every 7th change moved by 2 + a magnitude), and the block
    they should produce."""
    rng = np.random.default_rng(seed)
    gaps = rng.integers(0, 1 << (r + 1), count).astype(np.uint32)
    positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
    bits = rng.integers(0, 1 << 16, int(positions[-1]) + 1 + 5, dtype=np.uint64).astype(np.uint16)
    down = rng.random(count) < 0.5
    extra = np.zeros(count, np.int64)
    big = np.arange(3, count, 7)
    magnitudes = rng.integers(0, 40, big.size).astype(np.uint64)
    extra[big] = magnitudes.astype(np.int64) + 1
    steps = np.where(down, -1, 1) * (1 + extra)
    expected = bits.copy()
    keys = float_order(bits[positions]).astype(np.int64)
    expected[positions] = float_unorder(((keys + steps) % (1 << 16)).astype(np.uint16))
    low, unary, unary_bits = rice_encode(gaps, r)
    at_gaps = np.diff(np.concatenate([[-1], big])).astype(np.uint64) - np.uint64(1)
    return {
        "bits": bits, "low": low, "unary": unary, "unary_bits": unary_bits, "r": r,
        "down": np.packbits(down), "at": at_gaps, "magnitudes": magnitudes,
        "positions": positions, "expected": expected,
    }  # fmt: skip


def apply_stepped(
    block: dict, count: int | None = None, source: np.ndarray | None = None
) -> tuple[int, np.ndarray]:
    """Run the kernel on `block["bits"]` in place, or, with `source`, fill it from there."""
    found = np.empty(block["positions"].size if count is None else count, np.uint64)
    error = rice_apply_steps(
        block["bits"], block["bits"] if source is None else source, source is not None,
        block["low"], block["unary"], block["unary_bits"], block["r"],
        block["down"], block["at"], block["magnitudes"], 16, found,
    )  # fmt: skip
    return error, found


@pytest.mark.parametrize("r", [0, 3, 8, 11])
def test_gaps_decoded_and_stepped_in_one_pass_match_the_reference_across_chunks(r):
    """2,500 changes (three of the decoder's chunks), low planes below and above the 8
    it reads per group, signs both ways, and larger magnitudes on every 7th change."""
    block = stepped_block(2500, r, seed=r)
    error, found = apply_stepped(block)
    assert error == OK
    assert np.array_equal(found.view(np.int64), block["positions"])
    assert np.array_equal(block["bits"], block["expected"])


@pytest.mark.parametrize("r", [0, 8, 11])
def test_a_block_filled_from_its_source_while_stepping_matches_the_in_place_result(r):
    """With `fill`, the kernel copies the source chunk by chunk ahead of its steps and the
    rest after the last change: an output that starts as garbage ends exactly as a copy of
    the source patched in place would (every element, the tail past the last change too),
    and the source is not written."""
    block = stepped_block(2500, r, seed=r)
    source = block["bits"].copy()
    block["bits"] = np.full_like(source, 0xDEAD)
    error, found = apply_stepped(block, source=source)
    assert error == OK
    assert np.array_equal(found.view(np.int64), block["positions"])
    assert np.array_equal(block["bits"], block["expected"])
    assert np.array_equal(source, stepped_block(2500, r, seed=r)["bits"])


def test_gaps_that_run_past_the_block_or_magnitudes_past_the_last_change_are_refused():
    block = stepped_block(1500, 3, seed=1)
    block["bits"] = block["bits"][: int(block["positions"][-1])]  # the last change is outside
    assert apply_stepped(block)[0] == ERR_POSITION
    block = stepped_block(1500, 3, seed=1)
    block["at"] = block["at"].copy()
    block["at"][-1] += np.uint64(1500)
    assert apply_stepped(block)[0] == ERR_MAGNITUDE


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_changes_are_found_across_word_and_block_edges(dtype):
    """Changes at the first and last element, on both sides of 64-element mask words and of
    blocks, in every element width, with steps in both directions and of any size."""
    size = 3 * 256 + 70
    old = np.random.default_rng(3).integers(0, np.iinfo(dtype).max, size, dtype=dtype)
    new = old.copy()
    where = np.array([0, 63, 64, 127, 255, 256, 257, 511, 700, size - 1])
    new[where] += np.array([1, 2, 3, 200, 1, 1, 7, 1, 9, 1], dtype=dtype)
    dtype_name = {np.uint8: "U8", np.uint16: "BF16", np.uint32: "F32"}[dtype]
    target = RawTensor(dtype_name, (size,), new.view(np.uint8))
    base = RawTensor(dtype_name, (size,), old.view(np.uint8))
    assert np.array_equal(round_trip(SMALL_BLOCKS, target, base), target.data)
    assert np.array_equal(round_trip(SparseV2Codec(), target, base), target.data)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint64])
def test_the_change_mask_matches_numpy_across_scan_chunks(dtype):
    """The compiled scan compares 64 elements per vector compare: changes on both sides of
    word and 4096-element edges, a short last word, and words without any change all land
    in the right bits."""
    size = 3 * 4096 + 100
    rng = np.random.default_rng(9)
    old = rng.integers(0, np.iinfo(dtype).max, size, dtype=dtype)
    new = old.copy()
    where = np.array([0, 4095, 4096, 4097, 8191, 3 * 4096, size - 1])  # 4096..8191: one more
    new[where] += dtype(1)
    new[4100:8190:37] ^= dtype(0x80)
    words = np.empty(-(-size // 64), dtype=np.uint64)
    assert change_mask(new, old, words) == int(np.count_nonzero(new != old))
    expected = np.packbits(new != old, bitorder="little")
    assert words.view(np.uint8)[: expected.size].tobytes() == expected.tobytes()
    assert not words.view(np.uint8)[expected.size :].any()


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.integers(0, 2**20), min_size=1, max_size=400),
    repeat=st.sampled_from([1, 700]),  # 700: more values than the sample, every k-th is read
    limit=st.sampled_from([31, 62]),
)
def test_the_rice_parameter_is_the_cheapest_candidate_on_the_documented_sample(
    values, repeat, limit
):
    """docs/format.md: the r in log2(mean) - 3 .. + 2 (at most `limit`) with the least
    k(r+1) + sum(v >> r) over every (k // 2**16)-th value, the smallest on ties."""
    array = np.tile(np.array(values, dtype=np.uint64), repeat)
    total = int(array.sum())
    sample = array[:: max(1, array.size // RICE_SAMPLE)]
    centre = max(0, int(np.log2(max(total / array.size, 1.0))))
    candidates = range(max(0, centre - 3), min(centre + 2, limit) + 1)
    costs = {r: sample.size * (r + 1) + int((sample >> np.uint64(r)).sum()) for r in candidates}
    expected = min(candidates, key=lambda r: (costs[r], r))
    assert rice_parameter(array, total, limit) == expected
