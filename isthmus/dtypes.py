"""Element types: IFRT `DTypeProto.Kind` names, numpy dtypes and XLA type names in one table.

The IFRT kind is named (e.g. ``KIND_BF16``) rather than numbered here; the front end resolves
names to the numbers of the installed schema. Strings are not numpy numeric types: IFRT
`KIND_STRING` arrays hold Python ``bytes`` objects, one per element.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class DType:
    """One element type."""

    kind: str  # IFRT DTypeProto.Kind name, e.g. "KIND_F32"
    numpy: np.dtype | None  # None for strings and tokens
    mlir: str  # element type as MLIR prints it, e.g. "f32", "i1", "bf16"
    bits: int  # bits per element; 0 for variable-size (strings)

    @property
    def is_string(self) -> bool:
        return self.kind == "KIND_STRING"

    @property
    def itemsize(self) -> int:
        """Bytes per element in a host buffer (sub-byte types use one byte each)."""
        return self.numpy.itemsize if self.numpy is not None else 0

    def __repr__(self) -> str:
        return f"DType({self.kind})"


def _d(kind: str, dtype: object, mlir: str, bits: int) -> DType:
    return DType(kind, None if dtype is None else np.dtype(dtype), mlir, bits)


_TABLE = (
    _d("KIND_PRED", np.bool_, "i1", 8),
    _d("KIND_S2", ml_dtypes.int2, "i2", 2),
    _d("KIND_S4", ml_dtypes.int4, "i4", 4),
    _d("KIND_S8", np.int8, "i8", 8),
    _d("KIND_S16", np.int16, "i16", 16),
    _d("KIND_S32", np.int32, "i32", 32),
    _d("KIND_S64", np.int64, "i64", 64),
    _d("KIND_U2", ml_dtypes.uint2, "ui2", 2),
    _d("KIND_U4", ml_dtypes.uint4, "ui4", 4),
    _d("KIND_U8", np.uint8, "ui8", 8),
    _d("KIND_U16", np.uint16, "ui16", 16),
    _d("KIND_U32", np.uint32, "ui32", 32),
    _d("KIND_U64", np.uint64, "ui64", 64),
    _d("KIND_F16", np.float16, "f16", 16),
    _d("KIND_F32", np.float32, "f32", 32),
    _d("KIND_F64", np.float64, "f64", 64),
    _d("KIND_BF16", ml_dtypes.bfloat16, "bf16", 16),
    _d("KIND_C64", np.complex64, "complex<f32>", 64),
    _d("KIND_C128", np.complex128, "complex<f64>", 128),
    _d("KIND_F8E3M4", ml_dtypes.float8_e3m4, "f8E3M4", 8),
    _d("KIND_F8E4M3", ml_dtypes.float8_e4m3, "f8E4M3", 8),
    _d("KIND_F8E4M3FN", ml_dtypes.float8_e4m3fn, "f8E4M3FN", 8),
    _d("KIND_F8E4M3B11FNUZ", ml_dtypes.float8_e4m3b11fnuz, "f8E4M3B11FNUZ", 8),
    _d("KIND_F8E4M3FNUZ", ml_dtypes.float8_e4m3fnuz, "f8E4M3FNUZ", 8),
    _d("KIND_F8E5M2", ml_dtypes.float8_e5m2, "f8E5M2", 8),
    _d("KIND_F8E5M2FNUZ", ml_dtypes.float8_e5m2fnuz, "f8E5M2FNUZ", 8),
    _d("KIND_F8E8M0FNU", ml_dtypes.float8_e8m0fnu, "f8E8M0FNU", 8),
    _d("KIND_F4E2M1FN", ml_dtypes.float4_e2m1fn, "f4E2M1FN", 4),
    _d("KIND_STRING", None, "!string", 0),
    _d("KIND_TOKEN", None, "!stablehlo.token", 0),
)

BY_KIND: dict[str, DType] = {d.kind: d for d in _TABLE}
BY_MLIR: dict[str, DType] = {d.mlir: d for d in _TABLE}
BY_NUMPY: dict[np.dtype, DType] = {d.numpy: d for d in _TABLE if d.numpy is not None}

STRING = BY_KIND["KIND_STRING"]
TOKEN = BY_KIND["KIND_TOKEN"]
PRED = BY_KIND["KIND_PRED"]


def passes_as(dtype: DType, shape: tuple[int, ...], param: DType,
              param_shape: tuple[int, ...]) -> bool:
    """An array of `dtype` and `shape` may be a program's argument of `param`: the same, or
    jax's stand-in for a token (a bool[0] buffer, which PjRt takes for a token parameter)."""
    return (dtype == param and shape == param_shape) or (
        param == TOKEN and dtype == PRED and shape == (0,))


def from_numpy(dtype: np.dtype) -> DType:
    """The DType of a numpy dtype; KeyError for dtypes IFRT cannot carry."""
    return BY_NUMPY[np.dtype(dtype)]
