"""Staging: turning a version's canonical tensors into a folder the engine can load.

Owns the staged checkpoint folders under `<work_dir>/staged/`: the weights converted to the
engine's precision (BF16 as is, FP8 128×128 blocks or NVFP4 through
`engine_agent.precision`), the boot model's config (with the matching `quantization_config`)
and its tokenizer/generation files. A folder is written under a temporary name and renamed
into place, so the engine is never pointed at a half-written checkpoint.

Conversion is incremental between versions (`engine_agent.precision.incremental`): the
stager keeps the last converted version and converts the next one from the positions that
changed, bit-identical to a full conversion; the staged folder's checksums are logged so
that identity can be checked across agents and versions.

NVFP4 `input_scale`s come from the boot checkpoint when it is NVFP4, else they are
calibrated once from the boot checkpoint's BF16 weights: a function of the boot model alone,
so every agent of a precision class writes identical bytes for a version. Must never talk to
the engine or the store.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine_agent.errors import StageFailed
from store.tensors import RawTensor

log = logging.getLogger(__name__)

STAGED_DIR = "staged"


@dataclass(frozen=True)
class StagedCheckpoint:
    """A loadable folder for `version` at `precision`, and what writing it cost."""

    version: int
    precision: str
    path: Path
    convert_s: float
    write_s: float
    bytes_written: int
    conversion: str = "full"  # "incremental", or "full" and why
    checksums: dict[str, str] = field(default_factory=dict)


class Stager:
    """Writes staged folders for one engine precision from canonical tensors."""

    def __init__(
        self,
        work_dir: Path,
        precision: str,
        boot_model: Path | None,
        *,
        incremental: bool = True,
    ) -> None:
        from engine_agent.precision.incremental import VersionConverter

        self.root = Path(work_dir) / STAGED_DIR
        self.precision = precision
        self.boot_model = boot_model
        self._config: dict[str, Any] | None = None
        self._input_scales: dict[str, float] | None = None
        self._converter = VersionConverter(precision, incremental=incremental)

    def _boot_config(self) -> dict[str, Any]:
        from engine_agent.precision.checkpoint import read_config

        if self._config is None:
            if self.boot_model is None:
                raise StageFailed(
                    "no boot model given: the agent needs the engine's boot checkpoint folder "
                    "(--boot-model) for config.json and the tokenizer files of staged folders"
                )
            try:
                self._config = read_config(self.boot_model)
            except FileNotFoundError as exc:
                raise StageFailed(str(exc)) from exc
        return self._config

    def input_scales(self, fallback: Mapping[str, object] | None = None) -> dict[str, float]:
        """NVFP4 input scales: from an NVFP4 boot folder, else calibrated once from the BF16
        boot weights (or, with no usable boot folder, from `fallback` torch tensors)."""
        from engine_agent.precision import (
            calibrate_input_scales,
            plan_quantization,
            read_input_scales,
        )
        from engine_agent.precision.checkpoint import read_tensors

        if self._input_scales is not None:
            return self._input_scales
        config = self._boot_config()
        scales = read_input_scales(self.boot_model) if self.boot_model else {}
        if not scales:
            boot = read_tensors(self.boot_model) if self.boot_model else {}
            source: Mapping[str, Any] = (
                boot if "quantization_config" not in config else (fallback or {})
            )
            if not source:
                raise StageFailed("NVFP4 needs input scales: give an NVFP4 or BF16 boot checkpoint")
            plan = plan_quantization(dict(source), "nvfp4")
            scales = calibrate_input_scales(source, config, plan, self.boot_model)
            log.info("calibrated %d NVFP4 input scales from the boot checkpoint", len(scales))
        self._input_scales = scales
        return scales

    @property
    def positions_from_fold(self) -> int:
        """Tensors whose changed positions the fold reported (not diffed), since start."""
        return self._converter.positions_from_fold

    def folder_for(self, version: int) -> Path:
        return self.root / f"v{version:06d}-{self.precision}"

    def stage(self, version: int, tensors: Mapping[str, RawTensor]) -> StagedCheckpoint:
        """Convert and write `tensors` (canonical, of `version`); return the staged folder."""
        from engine_agent.precision.checkpoint import (
            copy_side_files,
            folder_checksums,
            write_safetensors_folder_hashed,
        )
        from store.torch_bridge import raw_to_state_dict

        started = time.perf_counter()
        config = self._boot_config()
        try:
            scales = None
            if self.precision == "nvfp4":
                # Torch copies of the tensors only the first time, if calibration needs them.
                scales = self._input_scales or self.input_scales(raw_to_state_dict(tensors))
            out_tensors, out_config, extra, report = self._converter.convert(
                tensors, config, scales
            )
        except (ValueError, KeyError, IndexError, RuntimeError) as exc:
            raise StageFailed(f"converting v{version} to {self.precision} failed: {exc}") from exc
        conversion = "incremental" if not report.full else f"full ({report.reason})"
        convert_s = time.perf_counter() - started
        started = time.perf_counter()
        final = self.folder_for(version)
        scratch = self.root / f".writing-{final.name}"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            size, written = write_safetensors_folder_hashed(scratch, out_tensors)
            (scratch / "config.json").write_text(
                json.dumps(out_config, indent=2, sort_keys=True) + "\n"
            )
            for name, body in extra.items():
                (scratch / name).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
            if self.boot_model is not None:
                copy_side_files(self.boot_model, scratch)
            checksums = folder_checksums(scratch, known=written)
            shutil.rmtree(final, ignore_errors=True)
            scratch.rename(final)
        except Exception as exc:
            # ENOSPC surfaces as OSError from Python's writes but as safetensors' own
            # SafetensorError from its Rust writer: any failure here is a failed stage, and
            # the half-written folder must not stay behind to fill the disk further.
            shutil.rmtree(scratch, ignore_errors=True)
            raise StageFailed(
                f"writing the staged folder {final} failed: {type(exc).__name__}: {exc}"
            ) from exc
        write_s = time.perf_counter() - started
        log.info(
            "staged v%d as %s in %s (convert %.2fs, %s; write %.2fs); checksums %s",
            version,
            self.precision,
            final,
            convert_s,
            conversion,
            write_s,
            " ".join(f"{name}={digest}" for name, digest in sorted(checksums.items())),
        )
        return StagedCheckpoint(
            version, self.precision, final, convert_s, write_s, size, conversion, checksums
        )

    def remove_scratch(self) -> None:
        """Delete half-written `.writing-*` folders a previous process left behind."""
        if self.root.is_dir():
            for path in self.root.glob(".writing-*"):
                shutil.rmtree(path, ignore_errors=True)

    def prune(self, keep: set[int]) -> None:
        """Delete staged folders of versions not in `keep` (the served and the next)."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith(".writing-"):
                continue
            if not any(path == self.folder_for(v) for v in keep):
                shutil.rmtree(path, ignore_errors=True)
