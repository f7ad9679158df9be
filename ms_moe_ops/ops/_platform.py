"""Where an operator runs: device target, Ascend SoC family, execution mode, forced implementation.

Read on every resolution: MindSpore fixes the target per process, but the mode changes between
calls and tests patch these functions. The values come straight from MindSpore's C++ context
(about 2 us a read) rather than through `ms.get_context` (about 80 us, which made the resolver the
main cost of a small operator call in PyNative mode); both read the same live setting.
"""
import os

from mindspore import GRAPH_MODE

from .._compat import ascend_soc_version, context_param

IMPL_ENV = "MS_MOE_OPS_IMPL"
GRAPH, PYNATIVE = "graph", "pynative"
# The SoC families the aclnn kernels document: Atlas A2 (910B), Atlas A3 (910_93), Ascend 950.
A2, A3, ASCEND_950 = "A2", "A3", "950"


def device_target():
    return context_param("device_target")


def execution_mode(compiling=False):
    """GRAPH while a graph is compiled (`compiling`: _compat.compiling() at the call site), which
    includes a @ms.jit function in PyNative mode, where the context still says PyNative; else
    what the context says."""
    return GRAPH if compiling or context_param("mode") == GRAPH_MODE else PYNATIVE


def jit_level():
    """The context's jit_level ("O0", "O1", "O2"; '' when unset: MindSpore's default, kernel by
    kernel on Atlas A2/A3/950). A level given to one `ms.jit(jit_level=...)` is not seen here."""
    return context_param("jit_level") or ""


def soc_family(target=None):
    """'A2', 'A3' or '950' on those Ascend SoCs, another SoC's name elsewhere on Ascend, '' off
    Ascend (target: the device target when the caller has it). MindSpore reads the short SoC
    name (ascend910b, ascend910_93, ascend950) when the device is set; the full CANN name
    (Ascend910B1, ...) is the fallback before that."""
    if (target or device_target()) != "Ascend":
        return ""
    name = ascend_soc_version()
    if not name:
        try:
            import acl  # pylint: disable=import-outside-toplevel  # CANN's pyACL, on Ascend hosts
            name = acl.get_soc_name() or ""
        except (ImportError, AttributeError):
            name = ""
    return family_of(name)


def family_of(soc_name):
    """SoC family of a MindSpore short name or a CANN full name ('' stays '')."""
    name = soc_name.lower()
    if name.startswith(("ascend950", "ascend910_95")):
        return ASCEND_950
    if name.startswith("ascend910_93"):
        return A3
    if name.startswith("ascend910b"):
        return A2
    return soc_name


def forced_impl():
    """The implementation name MS_MOE_OPS_IMPL forces (lower case), or None."""
    return os.environ.get(IMPL_ENV, "").strip().lower() or None
