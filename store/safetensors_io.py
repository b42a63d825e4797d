"""The safetensors file format, written and read without torch (every dtype, F8 included).

Layout: 8-byte little-endian header length N, N bytes of compact JSON (padded with spaces so
the data starts on an 8-byte boundary), then the tensor bytes back to back. Tensors are laid
out as the reference library does (widest dtype first, then by name) and `__metadata__` keys
are sorted, so the same tensors always give the same bytes. Loading returns zero-copy views.

This module owns the byte format only; it never decides what the tensors mean.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from store.checksum import TensorDigest
from store.errors import CorruptPayload, InvalidName
from store.tensors import DTYPE_SIZES, RawTensor, as_buffer

METADATA_KEY = "__metadata__"
_HEADER_LIMIT = 100_000_000  # the reference implementation refuses larger headers too

# The reference library orders tensors by dtype, widest first, then by name; mirroring that
# makes our shards byte-identical to `safetensors.numpy.save` apart from metadata key order
# (which it leaves to a randomised hash map).
_DTYPE_ORDER = [
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
]
_DTYPE_RANK = {code: rank for rank, code in enumerate(_DTYPE_ORDER)}


def validate_tensor_name(name: object) -> str:
    """Return `name` if it can safely name a tensor (and a key derived from it), else raise."""
    if not isinstance(name, str) or not name:
        raise InvalidName(f"tensor name must be a non-empty string, got {name!r}")
    if name == METADATA_KEY:
        raise InvalidName(f"tensor name {name!r} is reserved by the safetensors format")
    if ".." in name or name.startswith("/") or "\\" in name or "\x00" in name:
        raise InvalidName(
            f"tensor name {name!r} is not allowed: no '..', no leading '/', no backslash or NUL"
        )
    return name


def _layout_order(tensors: Mapping[str, RawTensor]) -> list[str]:
    return sorted(tensors, key=lambda n: (-_DTYPE_RANK.get(tensors[n].dtype, 0), n))


def _head(
    tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[str]]:
    """The length prefix and padded JSON header of `tensors`, and their names in layout order."""
    header: dict[str, Any] = {}
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise InvalidName(
                    f"safetensors metadata must map str to str, got {key!r}: {value!r}"
                )
        header[METADATA_KEY] = {key: metadata[key] for key in sorted(metadata)}
    names = _layout_order(tensors)
    offset = 0
    for name in names:
        validate_tensor_name(name)
        tensor = tensors[name]
        header[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, names


def dump(tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """Serialize `tensors` (and string `metadata`) to safetensors bytes."""
    head, names = _head(tensors, metadata)
    # One copy of each tensor straight into the result; no intermediate buffer.
    parts: list[bytes | memoryview] = [head]
    parts += (as_buffer(tensors[name].data) for name in names)
    return b"".join(parts)


def write_file(
    path: str | Path, tensors: Mapping[str, RawTensor], metadata: Mapping[str, str] | None = None
) -> tuple[int, str]:
    """Write the bytes `dump` would give to `path`, tensor by tensor (never the whole file in
    memory); return the bytes written and their xxh3-128 hex digest (`file_checksum`'s),
    taken from the tensors in memory rather than by reading the file back."""
    head, names = _head(tensors, metadata)
    size = len(head) + sum(tensors[name].nbytes for name in names)
    digest = TensorDigest(size)
    with open(path, "wb") as out:
        for data in (memoryview(head), *(as_buffer(tensors[name].data) for name in names)):
            digest.update(data)
            out.write(data)
    return size, digest.hexdigest()


def read_header(buf: bytes | bytearray | memoryview) -> tuple[dict[str, Any], int]:
    """Parse the JSON header; return it and the offset where tensor data starts.

    Needs only the first `8 + N` bytes, so a ranged read of the file's start is enough.
    """
    if len(buf) < 8:
        raise CorruptPayload(
            f"safetensors file is {len(buf)} bytes: expected at least the 8-byte header "
            "length; the file is truncated, fetch it again"
        )
    (length,) = struct.unpack("<Q", bytes(buf[:8]))
    if length > _HEADER_LIMIT or 8 + length > len(buf):
        raise CorruptPayload(
            f"safetensors header claims {length} bytes but only {len(buf) - 8} follow; "
            "the file is truncated or not safetensors"
        )
    try:
        header = json.loads(bytes(buf[8 : 8 + length]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptPayload(f"safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptPayload(
            f"safetensors header must be a JSON object, found {type(header).__name__}"
        )
    return header, 8 + length


def _tensor_entry(name: str, entry: object) -> tuple[str, tuple[int, ...], int, int]:
    if not isinstance(entry, dict):
        raise CorruptPayload(f"header entry for {name!r} must be an object, found {entry!r}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise CorruptPayload(
            f"tensor {name!r} has dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
        )
    if not isinstance(shape, list) or any(
        not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape
    ):
        raise CorruptPayload(f"tensor {name!r} has a malformed shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or any(not isinstance(o, int) or isinstance(o, bool) for o in offsets)
    ):
        raise CorruptPayload(f"tensor {name!r} has malformed data_offsets {offsets!r}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def load(buf: bytes | bytearray | memoryview) -> tuple[dict[str, RawTensor], dict[str, str]]:
    """Parse safetensors bytes into zero-copy tensors and the string metadata.

    The tensors' data must tile the data section exactly (as the reference reader demands);
    anything else raises `CorruptPayload`. Names are validated (`InvalidName`).
    """
    header, start = read_header(buf)
    metadata = header.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or any(
        not isinstance(k, str) or not isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptPayload(f"safetensors __metadata__ must map str to str, got {metadata!r}")
    data_len = len(buf) - start
    whole = np.frombuffer(buf, dtype=np.uint8)
    entries = []
    for name, entry in header.items():
        validate_tensor_name(name)
        entries.append((name, *_tensor_entry(name, entry)))
    entries.sort(key=lambda e: (e[3], e[4]))
    tensors: dict[str, RawTensor] = {}
    expected_begin = 0
    for name, dtype, shape, begin, end in entries:
        nbytes = DTYPE_SIZES[dtype]
        for d in shape:
            nbytes *= d
        if begin != expected_begin or end - begin != nbytes:
            raise CorruptPayload(
                f"tensor {name!r} ({dtype}{list(shape)}, {nbytes} bytes) sits at "
                f"[{begin}, {end}) but the next free byte is {expected_begin}; "
                "the header is inconsistent"
            )
        if end > data_len:
            raise CorruptPayload(
                f"tensor {name!r} ends at byte {end} of a {data_len}-byte data section; "
                "the file is truncated, fetch it again"
            )
        expected_begin = end
        tensors[name] = RawTensor(dtype, shape, whole[start + begin : start + end])
    if expected_begin != data_len:
        raise CorruptPayload(
            f"safetensors data section is {data_len} bytes but the tensors cover "
            f"{expected_begin}; the file is truncated or has trailing bytes"
        )
    return tensors, dict(metadata)
