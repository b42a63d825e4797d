"""Conversions between torch tensors and `RawTensor`, bit for bit.

The only module of the store that touches torch, and it imports torch inside its functions so
that `import store` stays torch-free (the control plane image has no torch). Conversions go
through uint8 views of the storage, never through values, so NaN payloads, -0.0 and FP8
codes survive unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from store.errors import TensorMismatch
from store.tensors import RawTensor

if TYPE_CHECKING:
    import torch

# safetensors dtype code -> torch dtype attribute name (looked up lazily: torch builds differ).
_TORCH_NAMES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}


def _torch_dtype(code: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, _TORCH_NAMES.get(code, ""), None)
    if not isinstance(dtype, torch.dtype):
        raise TensorMismatch(f"dtype {code!r} has no torch equivalent in this torch build")
    return dtype


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a torch dtype; `TensorMismatch` if it has none."""
    import torch

    for code, attr in _TORCH_NAMES.items():
        if getattr(torch, attr, None) == dtype:
            return code
    raise TensorMismatch(f"torch dtype {dtype} has no safetensors code Tether stores")


def to_raw(t: torch.Tensor, *, copy: bool = True) -> RawTensor:
    """`t`'s bytes as a `RawTensor` (moved to CPU, made contiguous).

    With `copy=False` the result may share memory with `t`; only safe if `t` will not change
    while the RawTensor is in use.
    """
    import torch

    code = dtype_code(t.dtype)
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy()
    if copy:
        data = data.copy()
    return RawTensor(code, tuple(int(d) for d in t.shape), data)


def to_torch(r: RawTensor) -> torch.Tensor:
    """A CPU torch tensor with `r`'s bytes (a copy if `r`'s buffer is read-only)."""
    import torch

    if r.nbytes == 0:
        return torch.empty(r.shape, dtype=_torch_dtype(r.dtype))
    data = r.data if r.data.flags.writeable else r.data.copy()
    flat = torch.from_numpy(np.ascontiguousarray(data))
    return flat.view(_torch_dtype(r.dtype)).reshape(r.shape)


def state_dict_to_raw(sd: Mapping[str, torch.Tensor], *, copy: bool = True) -> dict[str, RawTensor]:
    """A state dict's tensors as `RawTensor`s, names kept."""
    return {name: to_raw(t, copy=copy) for name, t in sd.items()}


def raw_to_state_dict(d: Mapping[str, RawTensor]) -> dict[str, torch.Tensor]:
    """`RawTensor`s as CPU torch tensors, names kept."""
    return {name: to_torch(r) for name, r in d.items()}
