"""What the Cells check: their options when built, the tensors they receive when called.

A tensor is checked against the Cell's configuration (rank, last dimension, dtype) in PyNative
mode and, in GRAPH mode, while the graph is built; the error names the Cell, the argument, what
was expected and what was given. What a dynamic shape leaves unknown passes: a dimension known
only at run time passes the width check, an unknown rank the rank and width checks.
"""
import dataclasses

from mindspore import Tensor

from .. import _compat
from ..ops._checks import FLOATS, dtype_name, int_arg
from ..ops._op import _signature

__all__ = ["config_of", "int_arg", "checked", "same_rows", "FLOATS", "TOKENS"]

# The layouts of a batch of tokens of width H: [T, H] or [B, S, H] (see checked)
TOKENS = ("[T, {}]", "[B, S, {}]")


def config_of(owner, config_cls, config, args, options):
    """The config a Cell is built from: `config` itself when it is one (`options` replace some of
    its values), else config_cls(config, *args, **options): the options given one by one (config
    then holds the first, or None when all are keywords)."""
    if isinstance(config, config_cls):
        if args:
            raise TypeError(f"{owner}: takes a {config_cls.__name__} or its options, got a "
                            f"{config_cls.__name__} and {len(args)} more positional arguments")
        return dataclasses.replace(config, **options) if options else config
    if config is not None:
        args = (config,) + args
    try:
        return config_cls(*args, **options)
    except TypeError as error:  # a missing or unknown option: say whose
        raise TypeError(f"{owner}: {error}".replace("__init__()", config_cls.__name__)) from None


def _described(shape):
    return "[" + ", ".join("?" if d < 0 else str(d) for d in shape) + "]"


def _check_now(owner, name, signature, layouts, last, dtypes):
    (dtype, shape), = signature
    dtype = dtype_name(dtype)
    if dtype not in dtypes:
        raise TypeError(f"{owner}: '{name}' must have dtype {' or '.join(dtypes)}, got {dtype}")
    if tuple(shape) == (-2,):  # unknown rank
        return last
    ranks = [layout.count(",") + 1 for layout in layouts]
    wide = last is not None and len(shape) and shape[-1] >= 0 and shape[-1] != last
    if len(shape) not in ranks or wide:
        wanted = " or ".join(layout.format("?" if last is None else last) for layout in layouts)
        raise ValueError(f"{owner}: '{name}' must be {wanted}, got shape {_described(shape)}")
    return last


_check = _compat.run_at_compile_time(_check_now)


def _not_a_tensor_now(owner, name, x):
    kind = type(x)
    raise TypeError(f"{owner}: '{name}' must be a MindSpore Tensor, got {kind.__module__}."
                    f"{kind.__qualname__}" + (f" (wrap it: mindspore.Tensor({name}))"
                                              if hasattr(x, "__array__") else ""))


_not_a_tensor = _compat.run_at_compile_time(_not_a_tensor_now)


def checked(owner, name, x, layouts, last=None, dtypes=FLOATS):
    """Checks tensor x of Cell `owner` against its layouts (e.g. TOKENS; "{}" stands for `last`),
    its last dimension (None: any) and dtypes; returns `last`. In GRAPH mode the check runs while
    the graph is built, when the value it returns is used: use it (e.g. in a reshape)."""
    if not isinstance(x, Tensor):  # (a numpy array would fail later, naming MindSpore's dtype)
        _not_a_tensor(owner, name, x)
    return _check(owner, name, _signature((x,)), layouts, last, dtypes)


def _same_rows_now(owner, name, other, signature):
    (_, shape), (_, other_shape) = signature
    if tuple(shape) == (-2,) or tuple(other_shape) == (-2,) or not len(shape) or not len(other_shape):
        return 0
    if shape[0] >= 0 and other_shape[0] >= 0 and shape[0] != other_shape[0]:
        raise ValueError(f"{owner}: '{name}' must have one row per row of '{other}' "
                         f"({other_shape[0]}), got shape {_described(shape)}")
    return 0


_same_rows = _compat.run_at_compile_time(_same_rows_now)


def same_rows(owner, name, x, other, y):
    """Checks that tensor x (argument `name`) has as many rows as y (argument `other`) where both
    are known; returns 0 (in GRAPH mode the check runs when the value is used: use it)."""
    if not isinstance(x, Tensor):
        _not_a_tensor(owner, name, x)
    return _same_rows(owner, name, other, _signature((x, y)))
