"""The C++ extension route (ms_moe_ops/ops/_extension.py), checked without a device:

- every binding's prototype check compiles against the stub CANN tree (tests/cann_stub: the
  vendor prototypes, word for word), and fails against a header that declares other arguments
  (the early Ascend 950 aclnnSwigluGroupQuantGrad); the resolver's header check says the same;
- MindSpore's own op_def generator (ops_generate/gen_custom_ops.py) accepts every generated YAML;
- slow: the whole Ascend extension compiles against MindSpore 2.10's shipped headers and the stub
  tree; the CPU extension (same YAML, inference and registration; this package's CPU kernels)
  builds, runs in PyNative mode against the CPU kernels, and in GRAPH mode gets through MindSpore's
  front end (our C++ inference included) to kernel selection, where MindSpore's CPU backend has no
  kernel factory for these ops (that factory is Ascend's, libmindspore_ops_ascend.so).
"""
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import mindspore as ms

from ms_moe_ops.ops import OPERATORS, _cann, _extension, _impls
from ms_moe_ops.ops.gating import GATING_TOP_K
from conftest import cpu_only

pytestmark = cpu_only("compiles the Ascend route against a stub CANN tree")

HERE = os.path.dirname(os.path.abspath(__file__))
STUB = os.path.join(HERE, "cann_stub")
EARLY_950 = os.path.join(STUB, "variants", "early950")
ENTRIES = _extension.every_binding(OPERATORS)
MS_DIR = os.path.dirname(ms.__file__)


def _compile_prototypes(tmp_path, first_include):
    source = tmp_path / "prototypes.cc"
    source.write_text(_extension.prototype_source(ENTRIES))
    return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", f"-I{first_include}",
                           f"-I{os.path.join(STUB, 'include')}", f"-I{_extension.BINDING_DIR}",
                           str(source)], capture_output=True, text=True, timeout=120)


def test_every_binding_matches_its_header_in_the_stub_tree(tmp_path):
    kernels = sorted(b.kernel for _, b, _ in ENTRIES)
    assert kernels == ["aclnnFFNV3", "aclnnMoeFFN", "aclnnMoeGatingTopK",
                       "aclnnMoeGatingTopKBackward", "aclnnSwigluGroupQuantGrad"]
    done = _compile_prototypes(tmp_path, os.path.join(STUB, "include"))
    assert done.returncode == 0, done.stderr


def test_a_header_that_disagrees_fails_the_build_and_the_resolver_check(tmp_path):
    done = _compile_prototypes(tmp_path, EARLY_950)
    assert done.returncode != 0
    assert "the installed header of aclnnSwigluGroupQuantGrad does not declare" in done.stderr
    assert done.stderr.count("does not declare") == 1  # the other bindings still match
    # the same finding from the installed header, before anything is built
    swiglu = next(b for _, b, _ in ENTRIES if b.kernel == "aclnnSwigluGroupQuantGrad")
    types = _impls.prototype_types(swiglu)
    header = _extension.header_name(swiglu.kernel)
    assert _cann.header_mismatch(swiglu.kernel, header, types, {"ASCEND_HOME_PATH": STUB}) == ""


def test_header_check_reads_the_toolkit_include_folder(tmp_path):
    include = tmp_path / "include" / "aclnnop"
    include.mkdir(parents=True)
    with open(os.path.join(EARLY_950, "aclnnop", "aclnn_swiglu_group_quant_grad.h")) as f:
        (include / "aclnn_swiglu_group_quant_grad.h").write_text(f.read())
    swiglu = next(b for _, b, _ in ENTRIES if b.kernel == "aclnnSwigluGroupQuantGrad")
    why = _cann.header_mismatch(swiglu.kernel, "aclnn_swiglu_group_quant_grad.h",
                                _impls.prototype_types(swiglu), {"ASCEND_HOME_PATH": str(tmp_path)})
    assert "aclIntArray*" in why and "aclTensor*" in why


def test_soc_op_info_decides_whether_the_soc_has_the_kernel(tmp_path):
    config = tmp_path / "opp" / "built-in" / "op_impl" / "ai_core" / "tbe" / "config" / "ascend950"
    config.mkdir(parents=True)
    (config / "aic-ascend950-ops-info.json").write_text('{"MoeGatingTopK": {}, "FFN": {}}')
    env = {"ASCEND_HOME_PATH": str(tmp_path)}
    assert _cann.soc_mismatch("aclnnMoeGatingTopK", "ascend950", env) == ""
    assert _cann.soc_mismatch("aclnnFFNV3", "ascend950", env) == ""
    assert "does not list MoeGatingTopKBackward" in _cann.soc_mismatch(
        "aclnnMoeGatingTopKBackward", "ascend950", env)
    assert _cann.soc_mismatch("aclnnMoeGatingTopKBackward", "ascend910b", env) == ""  # no file


def test_mindspore_generates_the_op_definitions_from_every_yaml(tmp_path):
    _, _, yamls = _extension.write_sources(ENTRIES, "CPU", str(tmp_path))
    out = tmp_path / "gen"
    yaml_dir = tmp_path / "yaml"
    yaml_dir.mkdir()
    for path in yamls:
        (yaml_dir / os.path.basename(path)).write_text(open(path).read())
    done = subprocess.run([sys.executable, "gen_custom_ops.py", "-i", str(yaml_dir), "-o", str(out),
                           "-m", "probe", "-d", ""], cwd=os.path.join(MS_DIR, "ops_generate"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    generated = (out / "gen_custom_ops_def.cc").read_text()
    for _, binding, _ in ENTRIES:
        assert f'"Custom_{_extension.op_name(binding)}"' in generated
    # aclnnMoeFFN's counts: a tensor input (value-depend in the generated inference)
    assert "def aclnn_moe_ffn(out_spec, activation, tokens_index_flag, output_dtype, padded, x, " \
        "expert_tokens" in (out / "gen_ops_def.py").read_text()


def test_generated_inference_declares_host_inputs_value_depend():
    moe_ffn = next((op, b, s) for op, b, s in ENTRIES if b.kernel == "aclnnMoeFFN")
    source = _extension.cpp_source((moe_ffn,), "Ascend")
    names = [n for n, _ in _extension.arguments(moe_ffn[0], moe_ffn[1])]
    assert f"moe_ext::SpecFuncImpl<0, {names.index('expert_tokens')}>" in source
    assert "moe_ext::HostValues(expert_tokens)" in source
    assert "GetValueWithCheck<std::vector<int64_t>>()" in source


@pytest.mark.slow
def test_the_ascend_extension_compiles_against_mindspore_and_the_stub_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("ASCEND_OPP_PATH", os.path.join(STUB, "opp"))
    b = _extension.builder(ENTRIES, "Ascend", directory=str(tmp_path))
    source = b.get_sources()[0]
    cmd = ["g++", "-fsyntax-only"] + b.get_cflags() + [f"-I{p}" for p in b.get_include_paths()] + \
        [f"-I{sysconfig.get_paths()['include']}", source]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.mark.slow
def test_cpu_extension_runs_the_cpu_kernels_in_pynative_and_compiles_in_graph():
    mod = _extension.load(ENTRIES, "CPU")
    rng = np.random.default_rng(0)
    x = ms.Tensor(rng.standard_normal((6, 16)).astype(np.float32))
    attrs = GATING_TOP_K.resolve(k=2, k_group=2, group_count=4)
    spec = _extension.encode_spec([[6, 2], [6, 2], [6, 16]], ["float32", "int32", "float32"])
    got = mod.aclnn_moe_gating_top_k(spec, *attrs.values(), x, None)
    want = GATING_TOP_K.impl("kernel").build(GATING_TOP_K, attrs)((x, None))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.asnumpy(), w.asnumpy())

    @ms.jit
    def graph(x):
        return mod.aclnn_moe_gating_top_k(spec, *attrs.values(), x, None)

    with pytest.raises(RuntimeError, match=r"Unsupported op \[Custom_aclnn_moe_gating_top_k\] on CPU"):
        graph(x)


# -- review findings outside the extension ------------------------------------------------------

def test_index_add_indices_are_int64(monkeypatch):
    # rows * N + index overflows int32 once M * N >= 2^31: the flat indices must be int64
    from ms_moe_ops.ops import _indexing

    seen = []
    monkeypatch.setattr(_indexing.mint, "index_add",
                        lambda target, dim, index, values: seen.append(index.dtype) or target)
    x = ms.Tensor(np.zeros((3, 5), np.float32))
    _indexing._index_add_per_row(x, ms.Tensor(np.array([[1], [2], [4]], np.int32)),
                                 ms.Tensor(np.ones((3, 1), np.float32)))
    assert seen == [ms.int64]


def test_expert_parallel_dispatcher_reads_the_platform_module():
    # the dry run patches ms_moe_ops.ops._platform; MindSpore's context would say CPU
    import inspect
    from ms_moe_ops.parallel import dispatcher

    source = inspect.getsource(dispatcher)
    assert "get_context" not in source and "_platform.device_target()" in source


def test_selftest_prints_a_table_and_passes_on_this_device():
    import io
    from ms_moe_ops import selftest

    out = io.StringIO()
    assert selftest.run(("float32",), ("pynative",), repeat=1, out=out) == 0
    assert "| moe_gating_top_k | float32 | pynative |" in out.getvalue()
