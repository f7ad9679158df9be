"""Every MindSpore internal or compiler behaviour the package relies on, in one place.

MindSpore 2.10's public API does not cover these; a MindSpore release may change any of them.
Each has a canary in tests/test_compat.py that fails with a message naming what changed, so an
upgrade breaks this file, visibly, and nothing else.
"""
import contextlib
import functools

from mindspore import nn as _nn
from mindspore.ops import functional as _F
from mindspore.ops.primitive import constexpr as _constexpr

# -- context --------------------------------------------------------------------------------------
# The live context from MindSpore's C++ object (about 2 us a read) rather than ms.get_context
# (about 80 us, most of a small operator's PyNative call).
from mindspore._c_expression import MSContext as _MSContext, ms_ctx_param as _ms_ctx_param


def context_param(name):
    """The context parameter `name` (e.g. "device_target", "mode") as MindSpore holds it."""
    return _MSContext.get_instance().get_param(getattr(_ms_ctx_param, name))


def ascend_soc_version():
    """MindSpore's short name of the Ascend SoC (ascend910b, ascend910_93, ascend950), '' before
    a device is set or off Ascend."""
    return _MSContext.get_instance().get_ascend_soc_version()


# -- graph compilation ------------------------------------------------------------------------

def run_at_compile_time(fn):
    """fn wrapped so that, called inside a GRAPH-mode construct, it runs in Python while the graph
    is built (once per compiled graph) instead of being compiled: MindSpore 2.10's parser
    executes a functools.partial object rather than parsing it. Its result must be a value the
    graph can hold (a constant, a callable, a Cell)."""
    return functools.partial(fn)


def _marker():
    return 0


@_constexpr(check=False)
def _parsed_away(fn):
    return fn is None


def compiling():
    """True when called from code MindSpore is compiling into a graph (a GRAPH-mode Cell, a
    @ms.jit function in PyNative mode), False when run by Python (about 1 us). MindSpore's own
    `_run_in_jit` (mindspore/graph/api.py) uses the same trick: a function handed to a constexpr
    from compiled code arrives as None."""
    return _parsed_away(_marker)


def is_constant(value):
    """True when value (a shape entry, a rank) is known while the graph is built; False for a
    dimension known only at run time (dynamic shapes)."""
    return _F.isconstant(value)


# -- primitives without a public functional API -------------------------------------------------

def auto_generate(name):
    """A primitive or function of mindspore.ops.auto_generate (MindSpore's generated operator
    table: GroupedMatmul's gmm_v2_op, the FFN primitive FFNExt, tensor_to_tuple, ...)."""
    from mindspore.ops import auto_generate as generated  # pylint: disable=import-outside-toplevel

    return getattr(generated, name)


# -- mixed precision --------------------------------------------------------------------------------
from mindspore.nn.cell import MixedPrecisionType as _MixedPrecisionType

# The Cell attribute value that stops MindSpore's automatic casts inside a Cell (PyNative).
NO_AUTOMATIC_CASTS = _MixedPrecisionType.NOTSET


def register_opaque_to_rewrite(*cells):
    """Makes MindSpore's source rewrite (AMP O1, custom_mixed_precision) treat these Cell classes
    as single nodes, as it treats its own Cell containers, instead of rewriting their source
    (rewrite's private `_subtree_black_list`)."""
    try:
        from mindspore.rewrite.common import namespace  # pylint: disable=import-outside-toplevel
    except ImportError:  # no rewrite, nothing to do
        return
    opaque = getattr(namespace, "_subtree_black_list", None)
    if isinstance(opaque, list):
        opaque.extend(c for c in cells if c not in opaque)


def amp_inner_cell(cell):
    """The Cell inside mindspore.amp's output-casting wrapper (what auto_mixed_precision O2/O3
    returns: the converted network, its output cast to float32; private `_backbone`), or None."""
    inner = getattr(cell, "_backbone", None)
    return inner if isinstance(inner, _nn.Cell) else None


# -- platforms ------------------------------------------------------------------------------------

def custom_platform_refusal():
    """'' when MindSpore runs Custom primitives on this platform, else its own message.
    MindSpore 2.10's `Custom.__init__` calls `Custom._check_platform`, which raises "Custom op
    only supported on Linux platform currently." elsewhere (mindspore/ops/operations/custom_ops.py);
    calling it is cheaper than building a primitive and says exactly what MindSpore would."""
    from mindspore.ops import Custom  # pylint: disable=import-outside-toplevel

    check = getattr(Custom, "_check_platform", None)
    if check is None:  # a MindSpore without the check
        return ""
    try:
        check(None)
    except Exception as error:  # pylint: disable=broad-except
        return str(error) or type(error).__name__
    return ""


# -- logging --------------------------------------------------------------------------------------

def mindspore_logger():
    """The logging.Logger MindSpore writes its Python-side warnings to (deprecations among them);
    it does not propagate to the root logger."""
    from mindspore import log  # pylint: disable=import-outside-toplevel

    return log._get_logger()  # pylint: disable=protected-access


@contextlib.contextmanager
def unlogged(text):
    """MindSpore's Python-side log records holding `text` are dropped while inside."""
    logger = mindspore_logger()

    def keep(record):
        return text not in record.getMessage()

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
