"""Incremental conversion: the next version's FP8/NVFP4 checkpoint from the previous one.

Owns `IncrementalConverter`, which keeps, for one engine precision, the converted tensors
of the last version it produced plus small per-tile state, and turns the next version into
exactly the bytes `convert_tensors` would write, touching only what the change requires:

- FP8 128×128 blocks: an element's code depends on its value and its tile's scale
  (amax/448). A tile is requantized whole when a changed element exceeds its amax, when a
  changed element may have held the amax (its previous code was ±448, the only code the
  amax element can have while the scale is a normal float) or when its scale is not a
  normal float; elsewhere only the changed elements are recoded.
- NVFP4: codes depend on the 16-element group's scale and the fused group's global amax
  (`weight_scale_2`, shared by q/k/v and gate/up). Only the 16-element groups holding a
  change are requantized. The global amax changes when a changed element exceeds it, or
  when a group that may have held it (its previous scale was 448) changes: the amax is then
  measured again, and if it moved, the fused group is converted in full. A fused group
  whose global scale is not a finite normal float (an inf weight makes it inf, and a full
  conversion then codes every element from inf/inf) is always converted in full.

Everything else falls back to a full conversion: no previous state (boot, restart, a
conversion that raised), unknown positions, a different tensor set or layout, another
config or set of input scales, or a tensor whose change is dense (more than
`dense_fraction` of its elements). Elements are recoded with the same functions and the
same fp32 operations as a full conversion (`fp8.encode`, `nvfp4.encode_groups`), which is
what makes the result bit-identical.

State kept between versions: the converted checkpoint itself (updated in place, so at most
one copy besides the staged folder on disk), one fp32 threshold (its amax) per FP8 tile
(1/16384 of the weights) and one float per NVFP4 fused group. A conversion that raises
leaves no state, so the next one is full. Must never write into the caller's canonical
tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine_agent.precision import fp8, nvfp4
from engine_agent.precision.compiled import bf16_bits, compiled_kernel
from engine_agent.precision.convert import convert_tensors
from engine_agent.precision.plan import QuantPlan, check_precision, plan_quantization
from store.tensors import RawTensor

# numba missing: the torch ops below give the same bytes, slower.
_fp8_kernel = compiled_kernel("fp8_kernel", "incremental FP8 recoding runs as torch ops")
_nvfp4_kernel = compiled_kernel("nvfp4_kernel", "incremental NVFP4 recoding runs as torch ops")


# Above this share of changed elements a tensor is converted in full: recoding scattered
# elements costs several times more per element than a streaming conversion.
DENSE_FRACTION = 0.2
# Smallest normal fp32: below it a scale loses precision and the "amax element codes to
# ±448" rule no longer holds, so such tiles are always requantized whole.
_MIN_NORMAL = 2.0**-126
# The E4M3 byte of +448 with the sign bit masked off; -448 is 0xFE.
_E4M3_448 = 0x7E
_BLOCK_SHIFT = fp8.BLOCK.bit_length() - 1  # tile index = element index >> 7
_GROUP_SHIFT = nvfp4.GROUP.bit_length() - 1  # 16-group index = flat element index >> 4
# Beyond this many elements tied at a fused group's global amax (an all-zero group, say),
# their positions are not kept.
_MAX_HOLDERS = 4096


@dataclass(frozen=True)
class ConversionReport:
    """What one conversion did: full or incremental, and how much it touched."""

    full: bool
    reason: str
    tensors_changed: int = 0
    elements_changed: int = 0
    tiles_requantized: int = 0
    groups_converted_in_full: int = 0


# (tensors, config.json dict, extra JSON files, report): `convert_tensors`' result plus how.
Converted = tuple[
    dict[str, torch.Tensor], dict[str, Any], dict[str, dict[str, Any]], ConversionReport
]


@dataclass
class _Fp8Tensor:
    q: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [⌈N/128⌉, ⌈K/128⌉]
    threshold: torch.Tensor  # fp32 [tiles]: a changed |x| above it forces a whole-tile redo


def _scale_is_normal(scale: float) -> bool:
    """A finite normal fp32 scale: the only kind the incremental rules hold for."""
    return _MIN_NORMAL <= scale < float("inf")


def _fp8_threshold(amax: torch.Tensor) -> torch.Tensor:
    """Per tile: its amax, or -1 (every change redoes the tile) when its scale is not a
    normal float (tiny or non-finite amax); a zero tile keeps 0 (any non-zero redoes it)."""
    normal = (amax >= _MIN_NORMAL * fp8.E4M3_MAX) & torch.isfinite(amax)
    return torch.where(normal | (amax == 0), amax, torch.full_like(amax, -1.0)).reshape(-1)


@dataclass
class _Nvfp4Group:
    members: tuple[str, ...]
    global_amax: float
    scale_2: torch.Tensor
    # Flat positions, per member, of the elements whose |x| is the global amax (BF16 bits
    # `holder_bits`): the amax can only drop when all of them change. None when unknown
    # (too many, or weights that are not BF16): then a changed group whose old scale was
    # 448 costs a scan of the whole fused group.
    holders: dict[str, np.ndarray] | None = None
    holder_bits: int = -1
    index: int = 0  # the group's row in `_Nvfp4Tables`


@dataclass
class _Nvfp4Tables:
    """What the compiled recoding reuses between versions, one row per fused group (its
    `index`), valid for the group's `scale_2` and current output tensors only: a group's
    row is renewed whenever it is converted in full."""

    bounds: np.ndarray  # uint16 [F, 257, 9]: where each scale's E2M1 codes step
    scale_2: np.ndarray  # float32 [F]
    holder_bits: np.ndarray  # int64 [F]
    # Per member, the addresses of its packed codes and scale bytes (tensors `out` holds).
    outputs: dict[str, tuple[int, int]]


def _amax_holders(
    weights: Mapping[str, torch.Tensor], amax: float
) -> tuple[int, dict[str, np.ndarray] | None]:
    """BF16 magnitude bits of `amax` and where each weight holds it (None if unknown)."""
    if amax <= 0 or any(w.dtype != torch.bfloat16 for w in weights.values()):
        return -1, None
    bits = int(torch.tensor(amax).to(torch.bfloat16).view(torch.int16).item()) & 0x7FFF
    holders = {}
    for module, weight in weights.items():
        magnitude = bf16_bits(weight) & 0x7FFF
        holders[module] = np.flatnonzero(magnitude == bits)
        if sum(h.size for h in holders.values()) > _MAX_HOLDERS:
            return -1, None
    return bits, holders


@dataclass
class _State:
    plan: QuantPlan
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    input_scales: dict[str, float] | None
    source_config: dict[str, Any]
    out: dict[str, torch.Tensor]
    config: dict[str, Any]
    extra: dict[str, dict[str, Any]]
    fp8: dict[str, _Fp8Tensor] = field(default_factory=dict)
    nvfp4: dict[str, _Nvfp4Group] = field(default_factory=dict)  # keyed by first member
    nvfp4_tables: _Nvfp4Tables | None = None  # made at the first compiled NVFP4 step


def changed_positions(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Sorted flat indices (int64) where two same-sized element arrays differ, bit for bit.

    Compares 8-byte words first, so a sparse change costs one pass over both buffers.
    """
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"cannot diff {old.dtype}{old.shape} against {new.dtype}{new.shape}")
    old_b, new_b = old.reshape(-1).view(np.uint8), new.reshape(-1).view(np.uint8)
    per_word = 8 // old.itemsize if old.itemsize <= 8 else 1
    whole = (old_b.size // 8) * 8
    words = np.flatnonzero(old_b[:whole].view(np.uint64) != new_b[:whole].view(np.uint64))
    candidates = (words[:, None] * per_word + np.arange(per_word)).reshape(-1)
    tail = np.arange(whole // old.itemsize, old.size, dtype=np.int64)
    candidates = np.concatenate([candidates, tail]) if tail.size else candidates
    old_e, new_e = old.reshape(-1), new.reshape(-1)
    changed: np.ndarray = candidates[old_e[candidates] != new_e[candidates]]
    return changed.astype(np.int64, copy=False)


def _layout(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


class IncrementalConverter:
    """Converts successive versions of one checkpoint to one precision, incrementally."""

    def __init__(self, precision: str, dense_fraction: float = DENSE_FRACTION) -> None:
        self.precision = check_precision(precision)
        self.dense_fraction = dense_fraction
        self._state: _State | None = None

    @property
    def has_state(self) -> bool:
        return self._state is not None

    def reset(self) -> None:
        """Forget the previous version: the next conversion is full."""
        self._state = None

    def convert(
        self,
        tensors: Mapping[str, torch.Tensor],
        config: dict[str, Any],
        changes: Mapping[str, np.ndarray] | None,
        input_scales: Mapping[str, float] | None = None,
    ) -> tuple[
        dict[str, torch.Tensor], dict[str, Any], dict[str, dict[str, Any]], ConversionReport
    ]:
        """`convert_tensors`' result for `tensors`, from the previous version plus `changes`.

        `changes` maps each tensor that differs from the previously converted version to
        the sorted flat indices of its changed elements; tensors it does not name are
        unchanged. None means "unknown": the conversion is full. The returned tensors are
        the converter's state and change in place at the next call: write them out first.
        """
        scales = dict(input_scales) if input_scales is not None else None
        state = self._state
        reason = self._full_reason(state, tensors, config, changes, scales)
        self._state = None  # an exception below must leave no half-updated state
        if reason is not None:
            out, out_config, extra = convert_tensors(tensors, config, self.precision, scales)
            self._state = self._fresh_state(tensors, config, scales, out, out_config, extra)
            return out, out_config, extra, ConversionReport(full=True, reason=reason)
        assert state is not None and changes is not None
        report = self._apply(state, tensors, changes)
        self._state = state
        return dict(state.out), state.config, state.extra, report

    # ---- deciding ------------------------------------------------------------------------

    def _full_reason(
        self,
        state: _State | None,
        tensors: Mapping[str, torch.Tensor],
        config: dict[str, Any],
        changes: Mapping[str, np.ndarray] | None,
        scales: dict[str, float] | None,
    ) -> str | None:
        if self.precision == "bf16":
            return "bf16 needs no conversion state"
        if state is None:
            return "no previous version converted"
        if changes is None:
            return "changed positions unknown"
        if _layout(tensors) != state.layout:
            return "tensor names, dtypes or shapes changed"
        if scales != state.input_scales:
            return "input scales changed"
        if config != state.source_config:
            return "config changed"
        if any(name not in tensors for name in changes):
            return "changes name a tensor the checkpoint lacks"
        return None

    def _fresh_state(
        self,
        tensors: Mapping[str, torch.Tensor],
        config: dict[str, Any],
        scales: dict[str, float] | None,
        out: dict[str, torch.Tensor],
        out_config: dict[str, Any],
        extra: dict[str, dict[str, Any]],
    ) -> _State | None:
        if self.precision == "bf16":
            return None
        plan = plan_quantization(dict(tensors), self.precision)
        source = copy.deepcopy(config)
        state = _State(plan, _layout(tensors), scales, source, dict(out), out_config, extra)
        if self.precision == "fp8":
            for module in plan.quantized:
                weight = tensors[f"{module}.weight"]
                q, scale = out[f"{module}.weight"], out[f"{module}.weight_scale_inv"]
                state.fp8[module] = _Fp8Tensor(q, scale, _fp8_threshold(fp8.block_amax(weight)))
        else:
            for index, group in enumerate(plan.groups):
                weights = {m: tensors[f"{m}.weight"] for m in group}
                amax = max(nvfp4.tensor_amax(w) for w in weights.values())
                scale_2 = out[f"{group[0]}.weight_scale_2"]
                bits, holders = _amax_holders(weights, amax)
                state.nvfp4[group[0]] = _Nvfp4Group(
                    tuple(group), amax, scale_2, holders, bits, index
                )
        return state

    # ---- applying ------------------------------------------------------------------------

    def _apply(
        self, state: _State, tensors: Mapping[str, torch.Tensor], changes: Mapping[str, np.ndarray]
    ) -> ConversionReport:
        quantized = {f"{m}.weight" for m in state.plan.quantized}
        touched = {name: pos for name, pos in changes.items() if len(pos)}
        for name, tensor in tensors.items():
            if name not in quantized:
                # Kept BF16: always the new object, so no old version stays referenced.
                state.out[name] = tensor
        tiles = full_groups = 0
        if self.precision == "fp8":
            for module in state.plan.quantized:
                positions = touched.get(f"{module}.weight")
                if positions is not None:
                    tiles += self._fp8_tensor(state, module, tensors[f"{module}.weight"], positions)
        elif _nvfp4_kernel is not None and all(
            tensors[name].dtype == torch.bfloat16 for name in quantized
        ):
            full_groups = self._nvfp4_compiled(state, tensors, touched)
        else:
            for group in state.plan.groups:
                if any(f"{m}.weight" in touched for m in group):
                    full_groups += self._nvfp4_group(state, group, tensors, touched)
        return ConversionReport(
            full=False,
            reason="incremental",
            tensors_changed=len(touched),
            elements_changed=sum(len(p) for p in touched.values()),
            tiles_requantized=tiles,
            groups_converted_in_full=full_groups,
        )

    def _fp8_tensor(
        self, state: _State, module: str, weight: torch.Tensor, positions: np.ndarray
    ) -> int:
        """Update one FP8 tensor in place; return the number of tiles requantized whole."""
        entry = state.fp8[module]
        cols = weight.shape[1]
        if len(positions) > self.dense_fraction * weight.numel():
            q, scale = fp8.quantize_fp8_block(weight)
            entry.q.copy_(q)
            entry.scale.copy_(scale)
            entry.threshold.copy_(_fp8_threshold(fp8.block_amax(weight)))
            return int(entry.scale.numel())
        if _fp8_kernel is not None:
            redone: int = _fp8_kernel.recode_changes(
                bf16_bits(weight),
                (weight.shape[0], cols),
                positions,
                entry.q.view(-1).view(torch.uint8).numpy(),
                entry.scale.view(-1).numpy(),
                entry.threshold.numpy(),
            )
            return redone
        block = fp8.BLOCK
        tiles_per_row = entry.scale.shape[1]
        row, col = np.divmod(positions, cols)
        tile = torch.from_numpy((row >> _BLOCK_SHIFT) * tiles_per_row + (col >> _BLOCK_SHIFT))
        pos = torch.from_numpy(positions)
        # index_select/index_copy_ are the lean 1-D gather/scatter; `t[pos]` costs more.
        values = weight.reshape(-1).index_select(0, pos).to(torch.float32)
        q_bytes = entry.q.view(-1).view(torch.uint8)
        old_codes = q_bytes.index_select(0, pos)
        threshold = entry.threshold.index_select(0, tile)
        # `not <=` rather than `>`, so a NaN (outside the contract) still redoes its tile.
        whole = ~(values.abs() <= threshold) | ((old_codes & 0x7F) == _E4M3_448)
        redo = torch.unique(tile[whole]).tolist() if bool(whole.any()) else []
        # Recode every changed element with its tile's current scale; tiles redone whole
        # below overwrite theirs, so filtering them out first would only cost more.
        codes = fp8.encode(values, entry.scale.view(-1).index_select(0, tile))
        q_bytes.index_copy_(0, pos, codes.view(torch.uint8))
        scale_flat = entry.scale.view(-1)
        for t in redo:
            r0, c0 = (t // tiles_per_row) * block, (t % tiles_per_row) * block
            part = weight[r0 : r0 + block, c0 : c0 + block]
            amax = fp8.block_amax(part)
            q, scale = fp8.quantize_fp8_block(part)
            entry.q[r0 : r0 + block, c0 : c0 + block] = q
            scale_flat[t] = scale.reshape(())
            entry.threshold[t] = _fp8_threshold(amax).reshape(())
        return len(redo)

    def _nvfp4_group(
        self,
        state: _State,
        group: tuple[str, ...],
        tensors: Mapping[str, torch.Tensor],
        touched: Mapping[str, np.ndarray],
    ) -> int:
        """Update one fused NVFP4 group in place; return 1 if it was converted in full."""
        entry = state.nvfp4[group[0]]
        weights = {m: tensors[f"{m}.weight"] for m in group}
        work: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        needs_full = not _scale_is_normal(float(entry.scale_2))
        maybe_lost_max = False
        for module in group:
            positions = touched.get(f"{module}.weight")
            if positions is None:
                continue
            weight = weights[module]
            if len(positions) > self.dense_fraction * weight.numel():
                needs_full = True
                break
            group_ids = positions >> _GROUP_SHIFT
            first = np.empty(group_ids.size, dtype=bool)
            first[0] = True
            np.not_equal(group_ids[1:], group_ids[:-1], out=first[1:])
            groups = torch.from_numpy(group_ids[first])
            values = weight.reshape(-1, nvfp4.GROUP).index_select(0, groups).to(torch.float32)
            group_amax = nvfp4.group_amax(values)
            # Unchanged elements never exceed the old global amax, so this is the changes'.
            if not float(group_amax.max()) <= entry.global_amax:
                needs_full = True
                break
            scale_bytes = state.out[f"{module}.weight_scale"].view(-1).view(torch.uint8)
            old_scales = scale_bytes.index_select(0, groups)
            maybe_lost_max |= bool(((old_scales & 0x7F) == _E4M3_448).any())
            work[module] = (groups, values, group_amax)
        if not needs_full and maybe_lost_max:
            amax = max(nvfp4.tensor_amax(w) for w in weights.values())
            needs_full = amax != entry.global_amax
        if needs_full:
            self._nvfp4_group_full(state, entry, weights)
            return 1
        for module, (groups, values, group_amax) in work.items():
            codes, scales = nvfp4.encode_groups(values, entry.scale_2, group_amax)
            state.out[f"{module}.weight"].view(-1, nvfp4.GROUP // 2).index_copy_(0, groups, codes)
            scale_bytes = state.out[f"{module}.weight_scale"].view(-1).view(torch.uint8)
            scale_bytes.index_copy_(0, groups, scales.view(torch.uint8))
        return 0

    def _nvfp4_compiled(
        self, state: _State, tensors: Mapping[str, torch.Tensor], touched: Mapping[str, np.ndarray]
    ) -> int:
        """`_nvfp4_group` for every fused group with one compiled call over all changed
        tensors (`nvfp4_kernel.recode_tensors_in_place`); return the groups converted in
        full."""
        assert _nvfp4_kernel is not None
        kernel = _nvfp4_kernel
        tables = state.nvfp4_tables or self._nvfp4_tables(state)
        rows: list[tuple[int, ...]] = []
        # Per fused group recoded: (entry, first row, [(module, positions)]).
        recoded: list[tuple[_Nvfp4Group, int, list[tuple[str, np.ndarray]]]] = []
        whole: list[_Nvfp4Group] = []
        keep: list[Any] = []  # arrays whose addresses the table holds, alive until the call returns
        for group in state.plan.groups:
            changed = [(m, touched[f"{m}.weight"]) for m in group if f"{m}.weight" in touched]
            if not changed:
                continue
            entry = state.nvfp4[group[0]]
            if not _scale_is_normal(float(tables.scale_2[entry.index])) or any(
                len(p) > self.dense_fraction * tensors[f"{m}.weight"].numel() for m, p in changed
            ):
                whole.append(entry)
                continue
            members = []
            for module, positions in changed:
                weight = tensors[f"{module}.weight"].contiguous()
                positions = np.ascontiguousarray(positions, np.int64)
                keep += (weight, positions)
                packed, scales = tables.outputs[module]
                rows.append(
                    (
                        weight.data_ptr(), weight.numel(), positions.ctypes.data, positions.size,
                        packed, scales, entry.index,
                    )
                )  # fmt: skip
                members.append((module, positions))
            recoded.append((entry, len(rows) - len(members), members))
        if rows:
            table = np.array(rows, np.int64).reshape(-1, kernel.COLUMNS)
            update = kernel.recode_tensors_in_place(
                table, tables.bounds, tables.scale_2, tables.holder_bits
            )
            # Unchanged elements never exceed the old global amax, so these are the changes'.
            amaxes = update.amax.tolist()
            old_448 = update.old_scale_was_448.tolist()
            for entry, first, members in recoded:
                span = range(first, first + len(members))
                if not all(amaxes[r] <= entry.global_amax for r in span):
                    whole.append(entry)
                    continue
                found = [
                    (m, p, update.new_holders(r)) for r, (m, p) in zip(span, members, strict=True)
                ]
                holders = _next_holders(entry, found)
                if holders is not None:
                    # Every element that held the global amax changed and none reached it.
                    if not any(h.size for h in holders.values()):
                        whole.append(entry)
                        continue
                elif any(old_448[r] for r in span):
                    members_now = [tensors[f"{m}.weight"] for m in entry.members]
                    if max(nvfp4.tensor_amax(w) for w in members_now) != entry.global_amax:
                        whole.append(entry)
                        continue
                entry.holders = holders
        del keep
        for entry in whole:
            weights = {m: tensors[f"{m}.weight"] for m in entry.members}
            self._nvfp4_group_full(state, entry, weights)
        return len(whole)

    def _nvfp4_tables(self, state: _State) -> _Nvfp4Tables:
        assert _nvfp4_kernel is not None
        entries = list(state.nvfp4.values())
        tables = _Nvfp4Tables(
            np.stack([_nvfp4_kernel.new_code_bounds() for _ in entries]),
            np.zeros(len(entries), np.float32),
            np.zeros(len(entries), np.int64),
            {},
        )
        state.nvfp4_tables = tables
        for entry in entries:
            _renew_row(state, tables, entry)
        return tables

    def _nvfp4_group_full(
        self, state: _State, entry: _Nvfp4Group, weights: Mapping[str, torch.Tensor]
    ) -> None:
        amax = max(nvfp4.tensor_amax(w) for w in weights.values())
        for module, weight in weights.items():
            packed, block_scale, scale_2 = nvfp4.quantize_nvfp4(weight, amax)
            state.out[f"{module}.weight"] = packed
            state.out[f"{module}.weight_scale"] = block_scale
            state.out[f"{module}.weight_scale_2"] = scale_2
        entry.global_amax = amax
        entry.scale_2 = state.out[f"{entry.members[0]}.weight_scale_2"]
        entry.holder_bits, entry.holders = _amax_holders(weights, amax)
        if state.nvfp4_tables is not None:
            _renew_row(state, state.nvfp4_tables, entry)


def _renew_row(state: _State, tables: _Nvfp4Tables, entry: _Nvfp4Group) -> None:
    """Make a fused group's row of the compiled recoding's tables match its current scale
    and output tensors (which a full conversion of the group replaces)."""
    tables.bounds[entry.index] = 0  # every scale's bounds found again, for the new scale_2
    tables.scale_2[entry.index] = float(entry.scale_2)
    tables.holder_bits[entry.index] = entry.holder_bits
    for m in entry.members:
        packed, scales = state.out[f"{m}.weight"], state.out[f"{m}.weight_scale"]
        assert packed.is_contiguous() and scales.is_contiguous()
        tables.outputs[m] = (packed.data_ptr(), scales.data_ptr())


def _next_holders(
    entry: _Nvfp4Group, updates: list[tuple[str, np.ndarray, np.ndarray]]
) -> dict[str, np.ndarray] | None:
    """Where the global amax is held after `updates` ((member, changed positions, new
    holders) each); None if that is not known."""
    if entry.holders is None:
        return None
    holders = entry.holders
    for module, positions, new_holders in updates:
        old = holders[module]
        if not old.size and not new_holders.size:
            continue  # the common case: nothing to track in this member
        if holders is entry.holders:
            holders = dict(holders)
        if old.size:
            at = np.minimum(np.searchsorted(positions, old), positions.size - 1)
            old = old[positions[at] != old]  # those the change did not touch
        holders[module] = np.union1d(old, new_holders) if new_holders.size else old
    if sum(h.size for h in holders.values()) > _MAX_HOLDERS:
        return None
    return holders


class VersionConverter:
    """`IncrementalConverter` fed with canonical `RawTensor`s, as the agent holds them.

    Finds what changed by identity first (the fold returns the base's own object for every
    tensor no delta touched), then from the positions the fold recorded on a tensor it
    patched from the previous version's own tensor (`RawTensor.changed`), and by a
    word-wise bit comparison otherwise; reuses the torch view of every unchanged tensor.
    Holds references to the last converted version's canonical tensors, which the agent
    holds anyway as the base of its next catch-up.
    """

    def __init__(self, precision: str, *, incremental: bool = True) -> None:
        self.converter = IncrementalConverter(precision)
        self.incremental = incremental
        self._previous: dict[str, tuple[RawTensor, torch.Tensor]] = {}
        self.positions_from_fold = 0  # tensors whose changes the fold reported (not diffed)

    def convert(
        self,
        tensors: Mapping[str, RawTensor],
        config: dict[str, Any],
        input_scales: Mapping[str, float] | None = None,
    ) -> tuple[
        dict[str, torch.Tensor], dict[str, Any], dict[str, dict[str, Any]], ConversionReport
    ]:
        from store.torch_bridge import to_torch

        previous, self._previous = self._previous, {}
        changes: dict[str, np.ndarray] | None = {} if self.incremental and previous else None
        state: dict[str, torch.Tensor] = {}
        for name, raw in tensors.items():
            before = previous.get(name)
            if before is not None and before[0] is raw:
                state[name] = before[1]
                continue
            state[name] = to_torch(raw)
            if changes is None:
                continue
            if before is None or not before[0].same_layout(raw):
                changes = None
                continue
            # The fold's own record of what it changed, when it folded from this very
            # tensor; a bit diff of the two versions otherwise.
            known = raw.changed.relative_to(before[0]) if raw.changed is not None else None
            if known is None:
                known = changed_positions(before[0].bits(), raw.bits())
            else:
                self.positions_from_fold += 1
            positions = known
            if positions.size:
                changes[name] = positions
        if self.converter.precision != "bf16" and not self.incremental:
            self.converter.reset()
        with _one_torch_thread():
            result = self.converter.convert(state, config, changes, input_scales)
        self._previous = {name: (raw, state[name]) for name, raw in tensors.items()}
        return result


@contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Run torch ops on one thread meanwhile. Conversion is many ops on cache-sized chunks;
    intra-op threads split each into slivers and synchronise after every one, which on a
    busy host (an agent beside a serving engine) made a full conversion 10-50x slower in
    wall time than one thread. torch's setting is per process, hence the restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
