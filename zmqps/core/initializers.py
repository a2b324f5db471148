"""Seeded, sharding-independent variable initializers.

Rules of this module:

* Pure functions of ``(init config, variable name, full shape, dtype, row range)``:
  no global RNG state, no clocks, no environment.
* Sharding never changes values: the variable is cut, in flat C order, into fixed
  blocks of :data:`BLOCK_ELEMS` elements; block ``b`` is always drawn whole from
  ``PCG64(SeedSequence([seed, crc32(var), b]))`` and then sliced. Any split into row
  ranges therefore concatenates, bitwise, to the whole variable.
* Random draws happen in float64 and are cast once, so float16/32/64 variables with
  the same config agree up to rounding.
* Fans (glorot / he / lecun) are computed from the FULL shape, as Keras does.
* Bad configs raise :class:`~zmqps.wire.errors.InvalidArgument`; the config keys are
  those of :data:`zmqps.wire.schema.INIT`.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from zmqps.core.variables import FLOAT_DTYPES
from zmqps.wire.errors import InvalidArgument

__all__ = ["BLOCK_ELEMS", "INITIALIZERS", "fans", "initialize", "validate_init"]

#: Elements per random block. Part of the reproducibility contract: changing it
#: changes every random initial value.
BLOCK_ELEMS = 1 << 16

# stddev of a standard normal truncated to [-2, 2]; Keras divides by it so that
# truncated variance-scaling initializers keep the intended variance.
_TRUNC_STD = 0.87962566103423978

_F64 = npt.NDArray[np.float64]
_Sampler = Callable[[np.random.Generator, int], _F64]

_FLOAT_PARAMS = ("value", "low", "high", "mean", "stddev")


@dataclass(frozen=True)
class _Kind:
    params: tuple[str, ...]  # allowed keys besides "name" and "seed"
    random: bool


#: Known initializer names and the keys each accepts (besides ``name`` and ``seed``).
INITIALIZERS: Mapping[str, _Kind] = {
    "zeros": _Kind((), False),
    "ones": _Kind((), False),
    "constant": _Kind(("value",), False),
    "uniform": _Kind(("low", "high"), True),
    "normal": _Kind(("mean", "stddev"), True),
    "truncated_normal": _Kind(("mean", "stddev"), True),
    "glorot_uniform": _Kind((), True),
    "glorot_normal": _Kind((), True),
    "he_uniform": _Kind((), True),
    "he_normal": _Kind((), True),
    "lecun_uniform": _Kind((), True),
    "lecun_normal": _Kind((), True),
}

# Keras spellings users type.
_ALIASES = {
    "zeros_initializer": "zeros",
    "ones_initializer": "ones",
    "random_uniform": "uniform",
    "random_normal": "normal",
    "xavier_uniform": "glorot_uniform",
    "xavier_normal": "glorot_normal",
}


def _canonical(init: Mapping[str, Any]) -> str:
    if not isinstance(init, Mapping):
        raise InvalidArgument(f"initializer must be a map, got {type(init).__name__}")
    name = init.get("name")
    if not isinstance(name, str):
        raise InvalidArgument("initializer needs a string 'name'")
    name = _ALIASES.get(name, name)
    if name not in INITIALIZERS:
        raise InvalidArgument(
            f"unknown initializer {name!r}; known: {', '.join(sorted(INITIALIZERS))}"
        )
    return name


def _float(init: Mapping[str, Any], key: str, default: float) -> float:
    v = init.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InvalidArgument(f"initializer {key!r} must be a finite number, got {v!r}")
    return float(v)


def validate_init(init: Mapping[str, Any]) -> None:
    """Raise InvalidArgument unless ``init`` is a usable initializer config."""
    name = _canonical(init)
    allowed = {"name", "seed", *INITIALIZERS[name].params}
    unknown = sorted(set(init) - allowed)
    if unknown:
        raise InvalidArgument(f"initializer {name!r} does not take {', '.join(unknown)}")
    seed = init.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise InvalidArgument(f"initializer seed must be a 64-bit int, got {seed!r}")
    for key in _FLOAT_PARAMS:
        if key in init:
            _float(init, key, 0.0)
    if _float(init, "stddev", 0.0) < 0:
        raise InvalidArgument("initializer stddev must be >= 0")
    low, high = _float(init, "low", -0.05), _float(init, "high", 0.05)
    if low > high:
        raise InvalidArgument("initializer low must be <= high")
    if not math.isfinite(high - low):  # numpy cannot draw from it (an internal error)
        raise InvalidArgument(f"initializer range [{low:g}, {high:g}] is wider than a float64")


def fans(full_shape: tuple[int, ...]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a variable, computed like Keras from its full shape."""
    if len(full_shape) == 0:
        return 1, 1
    if len(full_shape) == 1:
        return full_shape[0], full_shape[0]
    if len(full_shape) == 2:
        return full_shape[0], full_shape[1]
    receptive = math.prod(full_shape[:-2])
    return full_shape[-2] * receptive, full_shape[-1] * receptive


def _truncated_standard(rng: np.random.Generator, n: int) -> _F64:
    """Standard normal draws, each redrawn (from the same stream) until |z| <= 2."""
    z = rng.standard_normal(n)
    bad = np.flatnonzero(np.abs(z) > 2.0)
    while bad.size:
        z[bad] = rng.standard_normal(bad.size)
        bad = bad[np.abs(z[bad]) > 2.0]
    return z


def _uniform(low: float, high: float) -> _Sampler:
    return lambda rng, n: rng.uniform(low, high, n)


def _normal(mean: float, stddev: float) -> _Sampler:
    return lambda rng, n: mean + stddev * rng.standard_normal(n)


def _truncated(mean: float, stddev: float) -> _Sampler:
    return lambda rng, n: mean + stddev * _truncated_standard(rng, n)


def _sampler(name: str, init: Mapping[str, Any], full_shape: tuple[int, ...]) -> _Sampler:
    fan_in, fan_out = fans(full_shape)
    fan_avg = (fan_in + fan_out) / 2.0
    if name == "uniform":
        return _uniform(_float(init, "low", -0.05), _float(init, "high", 0.05))
    if name == "normal":
        return _normal(_float(init, "mean", 0.0), _float(init, "stddev", 0.05))
    if name == "truncated_normal":
        return _truncated(_float(init, "mean", 0.0), _float(init, "stddev", 0.05))
    # variance scaling: (scale, fan)
    scale, fan = {
        "glorot_uniform": (1.0, fan_avg),
        "glorot_normal": (1.0, fan_avg),
        "he_uniform": (2.0, fan_in),
        "he_normal": (2.0, fan_in),
        "lecun_uniform": (1.0, fan_in),
        "lecun_normal": (1.0, fan_in),
    }[name]
    if name.endswith("_uniform"):
        limit = math.sqrt(3.0 * scale / fan)
        return _uniform(-limit, limit)
    return _truncated(0.0, math.sqrt(scale / fan) / _TRUNC_STD)


def _seed(init: Mapping[str, Any]) -> int:
    return int(init.get("seed", 0)) % (1 << 64)  # SeedSequence wants a non-negative int


def initialize(
    init: Mapping[str, Any],
    var: str,
    full_shape: tuple[int, ...],
    dtype: str,
    row_start: int,
    rows: int,
) -> np.ndarray[Any, np.dtype[Any]]:
    """Rows ``[row_start, row_start + rows)`` of variable ``var``, freshly initialized.

    Returns a new C-contiguous array of shape ``(rows, *full_shape[1:])`` and ``dtype``.
    """
    validate_init(init)
    name = _canonical(init)
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgument(f"dtype {dtype!r} not in {', '.join(FLOAT_DTYPES)}")
    full_shape = tuple(int(d) for d in full_shape)
    if not full_shape or any(d <= 0 for d in full_shape):
        raise InvalidArgument(f"bad variable shape {full_shape}")
    if rows < 0 or row_start < 0 or row_start + rows > full_shape[0]:
        raise InvalidArgument(f"rows [{row_start}, {row_start + rows}) outside {full_shape}")
    out = np.empty((rows, *full_shape[1:]), dtype=dtype)
    if not INITIALIZERS[name].random:
        value = 1.0 if name == "ones" else _float(init, "value", 0.0)
        _check_range(abs(value), dtype, name)
        out.fill(value)
        return out
    _fill_random(
        out.reshape(-1), _sampler(name, init, full_shape), _seed(init), var, full_shape, row_start
    )
    return out


def _fill_random(
    flat: np.ndarray[Any, np.dtype[Any]],
    sample: _Sampler,
    seed: int,
    var: str,
    full_shape: tuple[int, ...],
    row_start: int,
) -> None:
    total = math.prod(full_shape)
    lo = row_start * math.prod(full_shape[1:])
    hi = lo + flat.shape[0]
    var_key = zlib.crc32(var.encode("utf-8"))
    for b in range(lo // BLOCK_ELEMS, -(-hi // BLOCK_ELEMS)):
        b_lo = b * BLOCK_ELEMS
        b_hi = min(b_lo + BLOCK_ELEMS, total)
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, var_key, b])))
        block = sample(rng, b_hi - b_lo)
        s, e = max(lo, b_lo), min(hi, b_hi)
        part = block[s - b_lo : e - b_lo]
        _check_range(float(np.max(np.abs(part))), str(flat.dtype), "random")
        flat[s - lo : e - lo] = part


def _check_range(magnitude: float, dtype: str, what: str) -> None:
    if magnitude > float(np.finfo(dtype).max):
        raise InvalidArgument(f"{what} initializer: values overflow {dtype}")
