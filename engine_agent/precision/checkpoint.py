"""Reading and writing Hugging Face checkpoint folders (config + safetensors + index).

Owns the on-disk layout the converter and the reference engine share: one
`model.safetensors` shard plus a `model.safetensors.index.json` that lists every tensor
(SGLang ignores shards missing from the index). Writing is byte-deterministic: same tensors
in, same bytes out. Must never quantize or interpret tensor values.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

SHARD_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Files that travel with a checkpoint but hold no tensors.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)


def write_safetensors_folder(out: Path, tensors: dict[str, torch.Tensor]) -> int:
    """Write `tensors` as one shard plus its index into `out`; return the bytes written."""
    return write_safetensors_folder_hashed(out, tensors)[0]


def write_safetensors_folder_hashed(
    out: Path, tensors: dict[str, torch.Tensor]
) -> tuple[int, dict[str, str]]:
    """`write_safetensors_folder`, also returning the xxh3-128 digest of each file it wrote
    (as `folder_checksums` gives them), hashed from memory as it writes: reading a staged
    shard back to hash it cost a fifth of the write stage (0.18 s per 400 MB here).

    The shard's bytes are those of `safetensors.torch.save_file` (its layout, metadata
    `{"format": "pt"}`), written by `store.safetensors_io` one tensor at a time.
    """
    from store.checksum import tensor_checksum
    from store.safetensors_io import write_file
    from store.torch_bridge import state_dict_to_raw

    out.mkdir(parents=True, exist_ok=True)
    ordered = {name: tensors[name].contiguous() for name in sorted(tensors)}
    size, shard_digest = write_file(
        out / SHARD_NAME, state_dict_to_raw(ordered, copy=False), {"format": "pt"}
    )
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in ordered.values())},
        "weight_map": dict.fromkeys(ordered, SHARD_NAME),
    }
    index_text = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    (out / INDEX_NAME).write_bytes(index_text)
    return size, {SHARD_NAME: shard_digest, INDEX_NAME: tensor_checksum(index_text)}


def folder_checksums(folder: str | Path, known: Mapping[str, str] | None = None) -> dict[str, str]:
    """xxh3-128 of every file directly in `folder`, by file name; a file named in `known`
    takes its digest from there instead of being read (`write_safetensors_folder_hashed`).

    Two agents that staged the same version at the same precision log the same digests;
    an incremental and a full conversion of one version do too.
    """
    from store.checksum import file_checksum

    known = known or {}
    return {
        p.name: known.get(p.name) or file_checksum(p)
        for p in sorted(Path(folder).iterdir())
        if p.is_file()
    }


def read_config(folder: str | Path) -> dict[str, Any]:
    """The folder's config.json as a dict."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"expected a Hugging Face checkpoint folder with config.json, found none at {path}; "
            "point at the folder that `tether model init-tiny` or the converter wrote"
        )
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def shard_files(folder: str | Path) -> list[Path]:
    """The safetensors shards of a folder: those its index names, else every *.safetensors."""
    root = Path(folder)
    index = root / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"expected *.safetensors in {root}, found none")
    return shards


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, in its stored dtype."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in shard_files(folder):
        tensors.update(load_file(str(shard)))
    return tensors


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy tokenizer and generation files that exist in `src` into `dst`."""
    copied = []
    for name in SIDE_FILES:
        path = Path(src) / name
        if path.is_file():
            shutil.copyfile(path, Path(dst) / name)
            copied.append(name)
    return copied
