"""Which aclnn kernels an installed CANN has (ms_moe_ops/ops/_cann.py), on fake CANN layouts: small
shared libraries built here that export what a CANN op-api library would, placed where MindSpore
2.10 looks for them."""
import os
import shutil
import subprocess

import pytest

from ms_moe_ops.ops import _cann

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="builds fake op-api libraries with a C compiler")


def _library(path, kernels, extra=()):
    """A shared library at path exporting aclnnX and aclnnXGetWorkspaceSize for each kernel X
    (and the names in extra)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    names = [n for k in kernels for n in (k, k + "GetWorkspaceSize")] + list(extra)
    source = path + ".c"
    with open(source, "w") as f:
        f.write("".join(f"int {n}(void) {{ return 0; }}\n" for n in names) or "int nothing;\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", path, source], check=True)
    return path


@needs_cc
def test_a_kernel_in_the_toolkits_op_api_library(tmp_path):
    root = tmp_path / "cann"
    _library(str(root / "lib64" / "libopapi.so"), ["aclnnMoeGatingTopK"])
    env = {"ASCEND_HOME_PATH": str(root)}
    assert _cann.missing_kernel("aclnnMoeGatingTopK", env) == ""
    why = _cann.missing_kernel("aclnnSwigluGroupQuantGrad", env)
    assert "does not have aclnnSwigluGroupQuantGrad" in why and "libopapi.so" in why


@needs_cc
def test_both_phases_must_be_exported(tmp_path):
    root = tmp_path / "cann"
    # only the second phase: MindSpore would fail at GetWorkspaceSize
    _library(str(root / "lib64" / "libopapi.so"), [], extra=["aclnnMoeFFN"])
    assert _cann.missing_kernel("aclnnMoeFFN", {"ASCEND_HOME_PATH": str(root)})


@needs_cc
def test_per_package_libraries_vendors_and_custom_paths(tmp_path):
    root = tmp_path / "toolkit"
    _library(str(root / "lib64" / "libopapi.so"), [])
    _library(str(root / "lib64" / "libopapi_nn.so"), ["aclnnSwigluGroupQuantGrad"])
    vendors = root / "opp" / "vendors"
    _library(str(vendors / "mine" / "op_api" / "lib" / "libcust_opapi.so"), ["aclnnMine"])
    _library(str(vendors / "ignored" / "op_api" / "lib" / "libcust_opapi.so"), ["aclnnIgnored"])
    (vendors / "config.ini").write_text("load_priority=mine\n")
    custom = tmp_path / "custom"
    _library(str(custom / "op_api" / "lib" / "libcust_opapi.so"), ["aclnnCustom"])
    env = {"ASCEND_OPP_PATH": str(root / "opp"), "ASCEND_CUSTOM_OPP_PATH": str(custom)}
    for kernel in ("aclnnSwigluGroupQuantGrad", "aclnnMine", "aclnnCustom"):
        assert _cann.missing_kernel(kernel, env) == "", kernel
    assert _cann.missing_kernel("aclnnIgnored", env)  # a vendor not in load_priority
    libs = _cann.op_api_libraries(env)
    assert libs[0] == str(custom / "op_api" / "lib" / "libcust_opapi.so")
    assert libs[-1] == str(root / "lib64" / "libopapi.so")


def test_no_cann_at_all_says_how_to_point_at_one(tmp_path, monkeypatch):
    monkeypatch.setattr(_cann, "_loaded_acl_roots", lambda: [])
    why = _cann.missing_kernel("aclnnMoeGatingTopK", {"ASCEND_HOME_PATH": str(tmp_path)})
    assert "no CANN op-api library found" in why and "ASCEND_HOME_PATH" in why


def test_files_that_are_no_library_export_nothing(tmp_path):
    fake = tmp_path / "libopapi.so"
    fake.write_bytes(b"not an ELF file")
    assert _cann.exported_symbols(str(fake)) == frozenset()
    assert _cann.exported_symbols(str(tmp_path / "absent.so")) == frozenset()


@needs_cc
def test_imported_symbols_are_not_exports(tmp_path):
    # a library that calls aclnnX without defining it does not have it
    path = tmp_path / "libuses.so"
    source = tmp_path / "uses.c"
    source.write_text("extern int aclnnX(void);\nint use(void) { return aclnnX(); }\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    symbols = _cann.exported_symbols(str(path))
    assert "use" in symbols and "aclnnX" not in symbols


@needs_cc
def test_kernels_of_a_library_the_op_api_library_needs(tmp_path):
    # MindSpore's dlsym on libopapi.so's handle also finds what its dependencies export
    root = tmp_path / "cann"
    lib64 = root / "lib64"
    _library(str(lib64 / "libaclnn_moe.so"), ["aclnnMoeGatingTopK"])
    source = lib64 / "opapi.c"
    source.write_text("int aclnnOther(void) { return 0; }\n")
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib64 / "libopapi.so"), str(source),
                    f"-L{lib64}", "-Wl,--no-as-needed", "-laclnn_moe"], check=True)
    assert _cann.missing_kernel("aclnnMoeGatingTopK", {"ASCEND_HOME_PATH": str(root)}) == ""


_STUB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cann_stub")
# the seed document's layout: one parameter a line
_SEED_BACKWARD = """
aclnnStatus aclnnMoeGatingTopKBackwardGetWorkspaceSize(
  const aclTensor  *xNorm,
  const aclTensor  *gradY,
  const aclTensor  *expertIdx,
  int64_t           renorm,
  int64_t           normType,
  double            routedScalingFactor,
  double            eps,
  const aclTensor  *out,
  uint64_t         *workspaceSize,
  aclOpExecutor   **executor);
"""


def test_prototype_types_of_a_header():
    assert _cann.prototype_types(_SEED_BACKWARD, "aclnnMoeGatingTopKBackward") == [
        "aclTensor*", "aclTensor*", "aclTensor*", "int64_t", "int64_t", "double", "double",
        "aclTensor*", "uint64_t*", "aclOpExecutor**"]
    assert _cann.prototype_types(_SEED_BACKWARD, "aclnnMoeGatingTopK") is None
    assert _cann.op_type("aclnnFFNV3") == "FFN" and _cann.op_type("aclnnMoeFFN") == "MoeFFN"


# a generated header's variations: export macro, comments (with commas and parentheses) between
# and inside the parameters, const after the type and after the *, a default argument, a macro
# definition that mentions the name, line breaks anywhere
_MESSY = """
#define ACLNN_API __attribute__((visibility("default")))
/* aclnnMoeGatingTopKBackwardGetWorkspaceSize(int x); an older form, commented out */
ACLNN_API aclnnStatus
aclnnMoeGatingTopKBackwardGetWorkspaceSize(  // (first stage)
    aclTensor const *xNorm,   /* [T, E], float32 (or bf16, fp16) */
    const aclTensor* const gradY,
    const struct aclTensor *expertIdx,
    int64_t renorm,           // 0: renorm before (default), 1: after
    int64_t normType = 0,
    double routedScalingFactor,
    const double eps,
    aclTensor *out,
    uint64_t* workspaceSize,
    aclOpExecutor ** executor);
"""


def test_prototype_types_of_a_messy_header():
    assert _cann.prototype_types(_MESSY, "aclnnMoeGatingTopKBackward") == \
        _cann.prototype_types(_SEED_BACKWARD, "aclnnMoeGatingTopKBackward")


def test_every_bound_kernel_has_its_operator_type():
    from ms_moe_ops.ops import OPERATORS, _extension

    kernels = {b.kernel for _, b, _ in _extension.every_binding(OPERATORS)}
    types = {k: _cann.op_types(k) for k in kernels}
    assert types == {"aclnnFFNV3": ("FFN",), "aclnnMoeFFN": ("MoeFFN", "FFN"),
                     "aclnnMoeGatingTopK": ("MoeGatingTopK",),
                     "aclnnMoeGatingTopKBackward": ("MoeGatingTopKBackward",),
                     "aclnnSwigluGroupQuantGrad": ("SwigluGroupQuantGrad",)}


def _op_info(folder, soc, types):
    config = folder / "op_impl" / "ai_core" / "tbe" / "config" / soc
    config.mkdir(parents=True)
    (config / f"aic-{soc}-ops-info.json").write_text("{" + ", ".join(f'"{t}": {{}}' for t in types) + "}")


@pytest.mark.parametrize("soc", ["ascend950", "Ascend950PR_9599", "ascend910_95"])
def test_op_info_of_vendors_and_soc_aliases(tmp_path, soc):
    root = tmp_path / "cann"
    _op_info(root / "opp" / "built-in", "ascend950", ["MoeGatingTopK"])
    vendors = root / "opp" / "vendors"
    _op_info(vendors / "custom_moe", "ascend950", ["SwigluGroupQuantGrad"])
    (vendors / "config.ini").write_text("load_priority=custom_moe\n")
    env = {"ASCEND_HOME_PATH": str(root)}
    assert _cann.soc_mismatch("aclnnMoeGatingTopK", soc, env) == ""
    assert _cann.soc_mismatch("aclnnSwigluGroupQuantGrad", soc, env) == ""  # the vendor's
    assert "does not list MoeGatingTopKBackward" in _cann.soc_mismatch(
        "aclnnMoeGatingTopKBackward", soc, env)
    assert _cann.soc_mismatch("aclnnMoeGatingTopKBackward", "Ascend910B3", env) == ""  # no file
    _op_info(root / "opp" / "built-in", "ascend910b", ["FFN"])
    assert _cann.soc_mismatch("aclnnMoeFFN", "Ascend910B3", env) == ""


def test_headers_of_custom_installed_kernels(tmp_path):
    root = tmp_path / "cann"
    vendor = root / "opp" / "vendors" / "custom_moe" / "op_api" / "include"
    vendor.mkdir(parents=True)
    (root / "opp" / "vendors" / "config.ini").write_text("load_priority=custom_moe\n")
    (root / "include" / "aclnnop").mkdir(parents=True)
    for folder in (vendor, root / "include" / "aclnnop"):
        (folder / "aclnn_moe_ffn.h").write_text("")
    env = {"ASCEND_HOME_PATH": str(root)}
    assert _cann.header_folders(env) == [str(vendor), str(root / "include" / "aclnnop")]
    assert _cann.header_paths("aclnnMoeFFN", "aclnn_moe_ffn.h", env)[0] == \
        str(vendor / "aclnn_moe_ffn.h")


@needs_cc
@pytest.mark.parametrize("release,expected", [("include", ""), ("variants/early950", "declares")])
def test_a_kernel_whose_installed_header_disagrees_is_unavailable(tmp_path, monkeypatch, release,
                                                                  expected):
    from ms_moe_ops.ops import _extension, _impls
    from ms_moe_ops.ops.swiglu import SWIGLU_GROUP_QUANT_GRAD

    root = tmp_path / "cann"
    _library(str(root / "lib64" / "libopapi.so"), ["aclnnSwigluGroupQuantGrad"])
    header = "aclnn_swiglu_group_quant_grad.h"
    (root / "include" / "aclnnop").mkdir(parents=True)
    with open(os.path.join(_STUB, release, "aclnnop", header)) as f:
        (root / "include" / "aclnnop" / header).write_text(f.read())
    for name in ("ASCEND_OPP_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_CUSTOM_OPP_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(root))
    _cann.unavailable.cache_clear()
    binding = SWIGLU_GROUP_QUANT_GRAD.impl("aclnn").binding
    why = _cann.unavailable(binding.kernel, _extension.header_name(binding.kernel),
                            _impls.prototype_types(binding), "ascend950")
    _cann.unavailable.cache_clear()
    assert (expected in why) if expected else why == ""
