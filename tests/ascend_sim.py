"""Making the resolver choose as on an Ascend device, on CPU: the device target and SoC family
it reads, and what the installed CANN has (by default every kernel the package binds); and
telling the CPU backend's refusal of an Ascend kernel from any other error."""
import re

from ms_moe_ops.ops import _cann, _impls, _op, _platform

# The primitives only an Ascend device has, as the CPU backend names them when it refuses one.
ASCEND_ONLY = ("GroupedMatmulV4", "MoeTokenPermute", "InnerMoeTokenUnpermute", "FFNExt",
               "aclnnMoeGatingTopK", "aclnnMoeGatingTopKBackward", "aclnnSwigluGroupQuantGrad",
               "aclnnFFNV3", "IndexAddExt")


def as_on(monkeypatch, soc, cann_missing=()):
    """The package resolves as on an Ascend device of SoC family `soc` whose CANN has every aclnn
    kernel but those named in cann_missing. The resolver's choices made before are forgotten
    (they are cached per platform, not per installed CANN)."""
    monkeypatch.setattr(_platform, "device_target", lambda: "Ascend")
    monkeypatch.setattr(_platform, "soc_family", lambda target=None: soc)
    with_cann(monkeypatch, cann_missing)


def with_cann(monkeypatch, missing=()):
    """The installed CANN has every aclnn kernel but `missing` (symbols, headers that match the
    bindings, the SoC's op-info), and MindSpore can build the C++ extension."""
    def lacks(kernel, *_):
        return f"the installed CANN does not have {kernel}" if kernel in missing else ""

    monkeypatch.setattr(_cann, "kernel_missing", lacks)
    monkeypatch.setattr(_cann, "unavailable", lacks)
    monkeypatch.setattr(_impls, "extension_missing", lambda: "")
    # what failed to build under another simulated CANN (on CPU: the C++ extension, which is
    # compiled for Ascend only) is forgotten with it
    monkeypatch.setattr(_op, "_BROKEN", {})
    _op.choose.cache_clear()


def backend_refusal(error):
    """The primitive the CPU backend refused in error's message ('Kernel select failed':
    "Unsupported op [X] on CPU", or a Custom aclnn primitive's missing function), or None when the
    error came from anywhere else (the front end)."""
    message = str(error)
    if "Kernel select failed" not in message and "user defined function path" not in message:
        return None
    found = re.search(r"Unsupported op \[(\w+)\] on CPU", message) or \
        re.search(r"user defined function path '(aclnn\w+)", message)
    return found.group(1) if found else None
