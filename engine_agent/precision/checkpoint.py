"""Reading and writing Hugging Face checkpoint folders (config + safetensors + index).

Owns the on-disk layout the converter and the reference engine share: one
`model.safetensors` shard plus a `model.safetensors.index.json` that lists every tensor
(SGLang ignores shards missing from the index). Writing is byte-deterministic: same tensors
in, same bytes out. Must never quantize or interpret tensor values.
"""

from __future__ import annotations

import json
import shutil
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
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    ordered = {name: tensors[name].contiguous() for name in sorted(tensors)}
    save_file(ordered, str(out / SHARD_NAME), metadata={"format": "pt"})
    size = (out / SHARD_NAME).stat().st_size
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in ordered.values())},
        "weight_map": dict.fromkeys(ordered, SHARD_NAME),
    }
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return size


def folder_checksums(folder: str | Path) -> dict[str, str]:
    """xxh3-128 of every file directly in `folder`, by file name.

    Two agents that staged the same version at the same precision log the same digests;
    an incremental and a full conversion of one version do too.
    """
    from store.checksum import file_checksum

    return {p.name: file_checksum(p) for p in sorted(Path(folder).iterdir()) if p.is_file()}


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
