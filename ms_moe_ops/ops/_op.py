"""The operator pattern: one declaration per operator, several implementations, one resolver.

An `OpDef` holds everything about an operator once: inputs (optional ones marked), typed
attributes with defaults, outputs, shape/dtype inference with all validation, the bprop, and its
implementations in order of preference (`Impl`: the CPU kernel, an aclnn kernel, a MindSpore
built-in primitive, a composition of MindSpore ops). Calling an OpDef resolves the implementation
for the call, builds it once (cached per attribute set) and applies it; nothing else in the
package repeats a signature.

Resolution rules (`choose`):
- MS_MOE_OPS_IMPL=<name> forces the implementation of that name on every operator that has one:
  if it cannot run here or refuses the call, the error surfaces (ValueError). Operators without
  one resolve as usual.
- Otherwise the first declared implementation that runs on this device target, Ascend SoC family
  and execution mode, and whose `supports(attrs, args, soc)` accepts the call, is chosen. A fallback
  (a preferred implementation of this device passed over) is logged at INFO with the reasons,
  other choices at DEBUG (logger "ms_moe_ops").
- If none fits: NotImplementedError naming the platform and every implementation's reason.
Choices are cached per (operator, attributes, target, SoC, mode, override, input dtypes/shapes).
"""
import contextlib
import functools
import logging
import numbers
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Tuple

import numpy as np
import mindspore as ms
from mindspore import nn

from .. import _compat
from . import _platform
from ._checks import dtype_name

_log = logging.getLogger("ms_moe_ops")

# Implementation names (MS_MOE_OPS_IMPL takes one of them)
KERNEL, ACLNN, BUILTIN, COMPOSITION = "kernel", "aclnn", "builtin", "composition"
IMPL_NAMES = (KERNEL, ACLNN, BUILTIN, COMPOSITION)
MODES = (_platform.GRAPH, _platform.PYNATIVE)
# C types a scalar can have when it crosses a Custom aclnn registration, by reg-info type
# (MindSpore 2.10 mindspore/ops/operations/_custom_ops_utils.py, _get_type_declaration; its C++
# side keeps a string alive for the call, so a char* crosses too). A list of ints (aclIntArray)
# could only be a constant of the graph: a Custom primitive declares no input whose value is
# read on the host at run time.
ACLNN_SCALARS = {"int": "int64_t", "bool": "bool", "float": "float", "double": "double",
                 "str": "char*"}
# a kernel's optional tensor argument this package never passes (always nullptr)
ABSENT = "absent"
# an input the kernel takes as a host aclIntArray of its values (C++ extension route only)
HOST = "host"
_TENSORS = ("tensor", ABSENT, HOST)


@dataclass(frozen=True)
class Attr:
    """A typed attribute. `kind` is bool, int, float or str; floats reach the CPU kernel as
    float32 (an aclnn binding declares its own C type for each scalar).

    Values are taken as MindSpore's own operators take them: numpy scalars for bool, int and float
    (an int for a float too, never a bool for a number), and a MindSpore dtype for a str
    attribute (its name, e.g. ms.float16 -> "float16")."""
    name: str
    kind: type
    default: object

    def convert(self, op_name, value):
        kind = self.kind
        if kind is bool:
            ok = isinstance(value, (bool, np.bool_))
        elif kind is str and isinstance(value, ms.dtype.Type):
            value, ok = dtype_name(value), True
        elif kind is str:
            ok = isinstance(value, str)
        else:
            number = numbers.Integral if kind is int else numbers.Real
            ok = isinstance(value, number) and not isinstance(value, bool)
        if not ok:
            raise TypeError(f"{op_name}: attribute '{self.name}' must be {kind.__name__}, "
                            f"got {type(value).__name__} ({value!r})")
        return kind(value)


class AclnnBinding(NamedTuple):
    """How an aclnn kernel is called: its name; its call arguments in the prototype's order as
    (name, kind), kind "tensor" (an input of the OpDef), ABSENT (an optional tensor argument
    passed as None) or a reg-info scalar type (an attribute of the OpDef, or one of `fixed`);
    the dtype combinations it is called with (the OpDef's inputs in its order, then outputs);
    `fixed`: (name, value) of scalar arguments the OpDef has no attribute for."""
    kernel: str
    args: Tuple[Tuple[str, str], ...]
    dtypes: Tuple[Tuple[str, ...], ...]
    fixed: Tuple[Tuple[str, object], ...] = ()

    @property
    def tensors(self):
        """The tensor arguments (present and absent), in the kernel's order."""
        return tuple(arg for arg, kind in self.args if kind in _TENSORS)

    @property
    def scalars(self):
        return tuple((arg, kind) for arg, kind in self.args if kind not in _TENSORS)

    @property
    def outputs(self):
        """How many outputs the kernel writes (its dtype rows: the OpDef's inputs, then them)."""
        return len(self.dtypes[0]) - sum(kind in ("tensor", HOST) for _, kind in self.args)


class TensorInfo(NamedTuple):
    """What an implementation's `supports` sees of an input: dtype name and shape (-1 for a
    dimension only known at run time, (-2,) when even the rank is)."""
    dtype: str
    shape: Tuple[int, ...]


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: declared once
class Impl:
    """One way to run an operator.

    name: one of IMPL_NAMES. target: the device target it runs on ("CPU", "Ascend"), None for
    any. socs: the Ascend SoC families (see _platform), None for any. modes: execution modes.
    build(op, attrs) -> f(inputs) applying the operator to the tuple of inputs.
    supports(attrs, args, soc) -> (ok, reason), args mapping each input name to a TensorInfo
    (None when absent), soc the SoC family: the implementation's own limits, checked before it
    is chosen.
    grad: "op" (the OpDef's bprop, attached by the resolver), "self" (the built callable brings
    its gradient: a Custom primitive with the bprop attached, or MindSpore's autodiff of it), or
    a function (attrs) -> bprop used instead of the OpDef's.
    binding: aclnn only: its AclnnBinding.
    available() -> '' when what the implementation calls is installed here (the CPU kernel
    library was built, the installed CANN has the aclnn kernel), else the reason it is not;
    asked only on the target, SoC and mode the implementation runs on.
    warn: a cost worth knowing (e.g. "G times the flops"): logged at WARNING whenever the
    resolver chooses this implementation by itself.
    about: what it calls, in a few words (the implementation tables of docs/ and of
    `python -m ms_moe_ops.info` show it). symbol: the CPU kernel's symbol (kernel only).
    route: "extension" for an aclnn kernel called through the C++ extension (CustomOpBuilder),
    "" for one called through ops.Custom.
    host_values: reads input values on the host at every step (value-depend inputs): in GRAPH
    mode only kernel by kernel (jit_level O0/O1), not in a whole sunk graph (O2).
    """
    name: str
    build: Callable
    target: Optional[str] = None
    socs: Optional[Tuple[str, ...]] = None
    modes: Tuple[str, ...] = MODES
    supports: Optional[Callable] = None
    grad: object = "op"
    binding: Optional[AclnnBinding] = None
    available: Optional[Callable] = None
    warn: str = ""
    about: str = ""
    symbol: str = ""
    route: str = ""
    host_values: bool = False

    def __post_init__(self):
        if self.name not in IMPL_NAMES:
            raise ValueError(f"Impl: name must be one of {IMPL_NAMES}, got {self.name!r}")

    def elsewhere(self, target, soc, mode):
        """Why this implementation does not run on (target, soc, mode) at all, or ''."""
        if self.target is not None and target != self.target:
            return f"runs on {self.target} only"
        if self.socs is not None and soc not in self.socs:
            return f"runs on {'/'.join(self.socs)} only"
        if mode not in self.modes:
            return f"runs in {'/'.join(self.modes)} mode only"
        return ""

    def unavailable(self, target, soc, mode, jit_level=""):
        """Why this implementation cannot run here (elsewhere, or not installed), or ''."""
        why = self.elsewhere(target, soc, mode)
        if not why and self.host_values and mode == _platform.GRAPH and jit_level == "O2":
            why = ("reads its inputs' values on the host at every step, which a graph sunk "
                   "whole (jit_level O2) cannot do: kernel by kernel only (O0/O1)")
        if not why and self.available is not None:
            why = self.available()
        return why


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: declared once
class OpDef:
    """Declaration of one operator.

    infer(attrs, *shapes) -> tuple of output shapes and infer_dtype(attrs, *dtypes) -> tuple of
    output dtype names receive one entry per input (None for an absent optional input); dtypes
    are names such as "float32". They raise TypeError/ValueError for bad input. check_attrs(attrs)
    validates attribute values alone. bprop(attrs) returns the bprop function
    f(*inputs, out, dout) -> one gradient per input. impls: the implementations, preferred first.
    """
    name: str
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    infer: Callable
    infer_dtype: Callable
    impls: Tuple[Impl, ...]
    attrs: Tuple[Attr, ...] = ()
    optional: Tuple[str, ...] = ()
    check_attrs: Optional[Callable] = None
    bprop: Optional[Callable] = None

    def __post_init__(self):
        # a name may repeat across routes (the aclnn kernel through ops.Custom in GRAPH mode,
        # through the C++ extension in PyNative mode) but not within one target and mode
        names = [(impl.name, impl.target, mode, tuple(impl.socs or ()), impl.about)
                 for impl in self.impls for mode in impl.modes]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"{self.name}: impls must name each implementation once per mode, "
                             f"got {[impl.name for impl in self.impls]}")
        for impl in self.impls:
            if impl.binding is not None:
                _check_binding(self, impl.binding)

    def resolve(self, **kwargs):
        """Attribute dict with defaults filled in, types converted and values validated."""
        known = {a.name: a for a in self.attrs}
        for key in kwargs:
            if key not in known:
                raise TypeError(f"{self.name}: unknown attribute '{key}'")
        attrs = {a.name: a.convert(self.name, kwargs.get(a.name, a.default)) for a in self.attrs}
        if self.check_attrs is not None:
            self.check_attrs(attrs)
        return attrs

    def impl(self, name, target=None, soc=None, mode=None):
        """The first implementation called `name` (that runs on target, soc and mode when they
        are given), or None."""
        found = [impl for impl in self.impls if impl.name == name]
        if mode is not None:
            found = [impl for impl in found if not impl.elsewhere(target, soc, mode)] or found
        return found[0] if found else None

    def __call__(self, *inputs, **kwargs):
        """Applies the operator: inputs in declaration order (None for absent optional ones)."""
        # compiling: in a GRAPH-mode Cell, and in a @ms.jit function called in PyNative mode
        # (the context still says PyNative there)
        return _resolve(self, _signature(inputs), _compat.compiling(), **kwargs)(inputs)


def _check_binding(op, binding):
    """An aclnn binding passes every input of the OpDef once, as tensor arguments before every
    scalar (MindSpore passes a registration's inputs first, then its attributes), scalars of
    crossable types that are attributes or fixed values, and gives a dtype for every input and
    output."""
    kernel, args = binding.kernel, binding.args
    present = [arg for arg, kind in args if kind in ("tensor", HOST)]
    if sorted(present) != sorted(op.inputs):
        raise ValueError(f"{op.name}: the {kernel} binding must pass the inputs {op.inputs} "
                         f"once each, got {tuple(present)}")
    if [kind in _TENSORS for _, kind in args] != \
            [True] * len(binding.tensors) + [False] * len(binding.scalars):
        raise ValueError(f"{op.name}: the {kernel} binding must list its tensors before its "
                         f"scalars, got {args}")
    known = {a.name for a in op.attrs} | {name for name, _ in binding.fixed}
    for arg, kind in binding.scalars:
        if kind not in ACLNN_SCALARS:
            raise TypeError(f"{op.name}: {kernel} argument '{arg}' has type {kind!r}, which cannot "
                            f"cross a Custom aclnn registration (only {sorted(ACLNN_SCALARS)})")
        if arg not in known:
            raise ValueError(f"{op.name}: {kernel} argument '{arg}' is not an attribute of the op")
    width = len(op.inputs) + len(op.outputs)
    if not binding.dtypes or any(len(row) != width for row in binding.dtypes):
        raise ValueError(f"{op.name}: every {kernel} dtype combination must name {width} dtypes "
                         f"(inputs, then outputs), got {binding.dtypes}")


def _signature(inputs):
    """(dtype, shape) of every input, None for absent ones; a dimension known only at run time
    is -1, so a dynamic-shape graph still resolves once, while it is compiled."""
    out = ()
    for x in inputs:
        if x is None:
            out = out + (None,)
        elif not _compat.is_constant(len(x.shape)):
            # unknown rank: MindSpore's [-2], not a loop over a tuple of unknown length (whose
            # compiled form, cached across graphs, fails to join after another dynamic graph)
            out = out + ((x.dtype, (-2,)),)
        else:
            shape = ()
            for d in x.shape:
                shape = shape + ((d if _compat.is_constant(d) else -1),)
            out = out + ((x.dtype, shape),)
    return out


@functools.lru_cache(maxsize=4096, typed=True)  # typed: k=2.0 must not hit the entry of k=2
def _cached_attribute_items(op, **kwargs):
    return tuple(op.resolve(**kwargs).items())


def _attribute_items(op, **kwargs):
    if all(isinstance(v, (bool, int, float, str)) for v in kwargs.values()):
        return _cached_attribute_items(op, **kwargs)
    return tuple(op.resolve(**kwargs).items())  # raises the attribute's own TypeError


def _resolve_now(op, signature, compiling, **kwargs):
    items = _attribute_items(op, **kwargs)
    target = _platform.device_target()
    platform = (target, _platform.soc_family(target), _platform.execution_mode(compiling),
                _platform.forced_impl())
    jit_level = _platform.jit_level() if platform[2] == _platform.GRAPH else ""
    impl = choose(op, items, platform, signature, jit_level)
    try:
        name, fn = built(op, impl, items)
    except Exception as error:  # pylint: disable=broad-except
        if platform[3] is not None:  # forced: its errors surface
            raise
        # what MindSpore could not build here (an aclnn primitive without the CANN headers or
        # compiler it needs, ...) is passed over from now on, and the next choice taken
        _BROKEN[impl] = f"building it failed ({type(error).__name__}: {error})"
        _log.warning("%s: %s passed over: %s", op.name, impl.name, _BROKEN[impl])
        choose.cache_clear()
        return _resolve_now(op, signature, compiling, **kwargs)
    for log in _RECORDERS:
        log.append((op.name, name))
    return fn


_BROKEN = {}  # implementation -> why building it failed in this process


_RECORDERS = []  # the lists of record_choices() blocks open now


@contextlib.contextmanager
def record_choices():
    """Lists, in order, (operator, implementation) of every operator call resolved inside the
    block, as what runs: the implementation of the callable handed out (in PyNative mode every
    call; in GRAPH mode every call site while a graph is compiled)."""
    log = []
    _RECORDERS.append(log)
    try:
        yield log
    finally:
        _RECORDERS.remove(log)


# Run in Python while a graph is built: the choice is made once per compiled graph.
_resolve = _compat.run_at_compile_time(_resolve_now)


def describe(op, signature):
    """{input name: TensorInfo or None} from a call signature."""
    args = {}
    for name, entry in zip(op.inputs, signature):
        args[name] = None if entry is None else TensorInfo(dtype_name(entry[0]), tuple(entry[1]))
    return args


@functools.lru_cache(maxsize=4096)
def choose(op, attr_items, platform, signature, jit_level=""):
    """The implementation for a call (see the module docstring for the rules); jit_level: the
    context's, in GRAPH mode."""
    target, soc, mode, forced = platform
    where = f"{target}{' ' + soc if soc else ''}, {mode} mode"
    if forced is not None and forced not in IMPL_NAMES:
        raise ValueError(f"{_platform.IMPL_ENV} must be one of {IMPL_NAMES}, got {forced!r}")
    attrs, args = dict(attr_items), describe(op, signature)
    validate(op, attrs, args)
    forced_impl = op.impl(forced, target, soc, mode) if forced else None
    if forced_impl is not None:
        why = forced_impl.unavailable(target, soc, mode, jit_level) or \
            _refusal(forced_impl, attrs, args, soc)
        if why:
            raise ValueError(f"{op.name}: {_platform.IMPL_ENV}={forced} forces the {forced} "
                             f"implementation, which cannot run this call ({where}): {why}")
        _log.info("%s: %s (forced by %s)", op.name, forced, _platform.IMPL_ENV)
        return forced_impl
    passed, elsewhere = [], []
    for impl in op.impls:
        why = impl.unavailable(target, soc, mode, jit_level) or _refusal(impl, attrs, args, soc)
        if not why:
            if impl.warn:
                _log.warning("%s: %s on %s (%s); passed over: %s", op.name, impl.name, where,
                             impl.warn, "; ".join(passed) or "none")
            elif passed:
                _log.info("%s: %s on %s; passed over: %s", op.name, impl.name, where,
                          "; ".join(passed))
            else:
                _log.debug("%s: %s on %s", op.name, impl.name, where)
            return impl
        if impl.target in (None, target):  # another device's implementation is no fallback
            passed.append(f"{impl.name} ({why})")
        else:
            elsewhere.append(f"{impl.name} ({why})")
    raise NotImplementedError(f"{op.name}: no implementation for this call on {where}: "
                              f"{'; '.join(elsewhere + passed)}")


def validate(op, attrs, args):
    """The declared checks, whatever implementation runs: required inputs, shapes (what is known
    of them: the infer functions pass unknown dimensions), dtypes (a Custom primitive's own
    inference repeats them)."""
    for name, info in args.items():
        if info is None and name not in op.optional:
            raise ValueError(f"{op.name}: input '{name}' is required, got None")
    infos = list(args.values())
    op.infer(attrs, *[None if i is None else list(i.shape) for i in infos])
    op.infer_dtype(attrs, *[None if i is None else i.dtype for i in infos])


def _refusal(impl, attrs, args, soc):
    if impl in _BROKEN:
        return _BROKEN[impl]
    if impl.supports is None:
        return ""
    ok, reason = impl.supports(attrs, args, soc)
    return "" if ok else reason


_BUILT = {}
_FORWARDS = []  # the callables _WithBprop Cells run, by index


def built(op, impl, attr_items):
    """(implementation name, callable) of one implementation for one attribute set (built
    once)."""
    key = (op, impl, attr_items)
    if key not in _BUILT:
        attrs = dict(attr_items)
        fn = impl.build(op, attrs)
        bprop = None
        if impl.grad == "op" and op.bprop is not None:
            bprop = op.bprop(attrs)
        elif callable(impl.grad):
            bprop = impl.grad(attrs)
        if bprop is not None:
            _FORWARDS.append(fn)
            fn = _WithBprop(len(_FORWARDS) - 1, bprop)
        _BUILT[key] = impl.name, fn
    return _BUILT[key]


def built_attribute_sets():
    """{(op, attribute items)} of every implementation built so far in this process."""
    return {(op, items) for op, _, items in _BUILT}


def _forward_now(index):
    return _FORWARDS[index]


# Looked up in Python at compile time (like _resolve) rather than held as a Cell attribute: in
# MindSpore 2.10 GRAPH mode a function parsed from a Cell attribute and a function the Cell's
# bprop obtains from such a lookup must not share helpers ("The func graph is empty"); fetched the
# same way on both sides, they may.
_forward = _compat.run_at_compile_time(_forward_now)


class _WithBprop(nn.Cell):
    """_FORWARDS[index](inputs) differentiated by bprop(*inputs, out, dout). The inputs travel as
    one tuple: a Cell's bprop cannot take *args in GRAPH mode."""

    def __init__(self, index, bprop):
        super().__init__()
        self.index = index
        self.backward = bprop

    def construct(self, inputs):
        return _forward(self.index)(inputs)

    def bprop(self, inputs, out, dout):
        return (self.backward(*inputs, out, dout),)
