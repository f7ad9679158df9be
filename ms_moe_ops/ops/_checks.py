"""Validation helpers for infer functions: every message names the operator, the argument, what
was expected and what was given (SPEC error rules), and converters of Python arguments that take
them as MindSpore does (numpy scalars for numbers, dtype objects for dtypes)."""
import numbers

import mindspore as ms

FLOATS = ("float32", "float16", "bfloat16")

_MSTYPES = {
    "float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16, "float64": ms.float64,
    "int8": ms.int8, "int32": ms.int32, "int64": ms.int64, "uint8": ms.uint8,
    "uint64": ms.uint64, "bool": ms.bool_,
}
_NAMES = {v: k for k, v in _MSTYPES.items()}


def dtype_name(dtype):
    """'float32' for ms.float32 (or a tensor type of it)."""
    if hasattr(dtype, "element_type"):
        dtype = dtype.element_type()
    return _NAMES.get(dtype, str(dtype).lower())


def to_mstype(name):
    return _MSTYPES[name]


def attr_error(op, name, expected, got):
    return ValueError(f"{op}: attribute '{name}' must be {expected}, got {got!r}")


def check_dtype(op, name, dtype, allowed):
    if dtype not in allowed:
        raise TypeError(f"{op}: '{name}' must have dtype {' or '.join(allowed)}, got {dtype}")


def check_same_dtype(op, name, dtype, other_name, other_dtype):
    if dtype != other_dtype:
        raise TypeError(f"{op}: '{name}' must have the dtype of '{other_name}' ({other_dtype}), "
                        f"got {dtype}")


# Shapes from `set_inputs(Tensor(shape=[None, ...]))` hold -1 for a dimension known only at run
# time, or are [-2] when even the rank is: the checks below pass what they cannot know yet.
UNKNOWN_RANK = -2


def unknown_rank(shape):
    return len(shape) == 1 and shape[0] == UNKNOWN_RANK


def known(dim):
    return dim >= 0


def differ(a, b):
    """Two dimensions that are both known and not equal."""
    return known(a) and known(b) and a != b


def product(a, b):
    """a * b, unknown (-1) when either is."""
    return a * b if known(a) and known(b) else -1


def check_rank(op, name, shape, ranks):
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if len(shape) not in ranks and not unknown_rank(shape):
        want = " or ".join(f"{r}-D" for r in ranks)
        raise ValueError(f"{op}: '{name}' must be {want}, got shape {list(shape)}")


def dims(op, name, shape, rank):
    """The `rank` dimensions of shape after checking its rank (all unknown for an unknown rank)."""
    check_rank(op, name, shape, rank)
    return [-1] * rank if unknown_rank(shape) else list(shape)


def check_shape(op, name, shape, expected, what=""):
    if unknown_rank(shape) or unknown_rank(expected):
        return
    if len(shape) != len(expected) or any(differ(a, b) for a, b in zip(shape, expected)):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{op}: '{name}' must have shape {list(expected)}{extra}, "
                         f"got {list(shape)}")


def check_range(op, name, value, lo, hi, what=""):
    """lo <= value <= hi for a known value (hi unknown: no upper bound)."""
    if known(value) and (value < lo or (known(hi) and value > hi)):
        extra = f" ({what})" if what else ""
        raise ValueError(f"{op}: {name} must be in [{lo}, {hi}]{extra}, got {value}")


def int_arg(owner, name, value, minimum=1):
    """value as a Python int (numpy integers too): TypeError for anything else (bools included),
    ValueError below minimum."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def dtype_arg(owner, name, value, allowed):
    """The name of a dtype given as a MindSpore dtype (ms.float16) or its name ("float16"); it
    must be one of allowed (names). TypeError for other kinds of value, ValueError for others."""
    expected = f"one of {', '.join(allowed)} (a name or a MindSpore dtype)"
    if isinstance(value, ms.dtype.Type):
        given = dtype_name(value)
    elif isinstance(value, str):
        given = value
    else:
        raise TypeError(f"{owner}: {name} must be {expected}, got {type(value).__name__} "
                        f"({value!r})")
    if given not in allowed:
        raise ValueError(f"{owner}: {name} must be {expected}, got {value!r}")
    return given
