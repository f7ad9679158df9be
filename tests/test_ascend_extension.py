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
    return subprocess.run(["g++", "-std=c++17", "-fsyntax-only",
                           f"-I{os.path.join(first_include, 'aclnnop')}",
                           f"-I{os.path.join(STUB, 'include', 'aclnnop')}",
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


def _stub_cann(monkeypatch, root):
    for name in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_CUSTOM_OPP_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ASCEND_OPP_PATH", os.path.join(str(root), "opp"))


def test_the_cache_key_follows_the_installed_cann_headers(tmp_path, monkeypatch):
    root = tmp_path / "cann"
    (root / "opp").mkdir(parents=True)
    (root / "include").symlink_to(os.path.join(STUB, "include"))
    _stub_cann(monkeypatch, root)
    before = _extension.module_name(ENTRIES, "Ascend")
    assert _extension.module_name(ENTRIES, "Ascend") == before  # deterministic
    (root / "include").unlink()
    (root / "include").mkdir()
    os.symlink(os.path.join(STUB, "include", "aclnn"), root / "include" / "aclnn")
    os.symlink(os.path.join(EARLY_950, "aclnnop"), root / "include" / "aclnnop")  # another release
    assert _extension.module_name(ENTRIES, "Ascend") != before
    (root / "version.cfg").write_text("version=9.1.0\n")
    assert _extension.module_name(ENTRIES, "CPU") == _extension.module_name(ENTRIES, "CPU")


def test_the_extension_includes_custom_installed_kernel_headers_first(tmp_path, monkeypatch):
    root = tmp_path / "cann"
    vendor = root / "opp" / "vendors" / "custom_moe" / "op_api" / "include"
    vendor.mkdir(parents=True)
    (root / "opp" / "vendors" / "config.ini").write_text("load_priority=custom_moe\n")
    (root / "include").symlink_to(os.path.join(STUB, "include"))
    _stub_cann(monkeypatch, root)
    folders = _extension.include_folders("Ascend")
    assert folders[:3] == [_extension.BINDING_DIR, str(vendor), str(root / "include" / "aclnnop")]
    source = _extension.cpp_source(ENTRIES, "Ascend")
    assert '#include "aclnn_moe_ffn.h"' in source and "aclnnop/" not in source


def test_processes_building_one_extension_take_turns(tmp_path, monkeypatch):
    """The lock is held from writing the sources to loading the module, and excludes another
    process (flock from a second open file description, as another process would have)."""
    import fcntl

    monkeypatch.setenv(_extension.CACHE_ENV, str(tmp_path))
    entries = ENTRIES[:1]
    folder = tmp_path / _extension.module_name(entries, "Ascend")
    (folder / "build").mkdir(parents=True)
    (folder / "build" / "build.lock").write_text("")  # left by a killed build
    seen = []

    class Fake:
        def load(self):
            with open(folder / "ms_moe_ops.lock") as other:
                try:
                    fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    seen.append("free")
                except BlockingIOError:
                    seen.append("held")
            seen.append(os.path.exists(folder / "build" / "build.lock"))
            return "module"

    def fake_builder(entries_, backend, directory=None, include_paths=()):
        _extension.write_sources(entries_, backend, directory)
        return Fake()

    monkeypatch.setattr(_extension, "builder", fake_builder)
    _extension.load.cache_clear()
    try:
        assert _extension.load(entries, "Ascend") == "module"
    finally:
        _extension.load.cache_clear()
    assert seen == ["held", False]
    with open(folder / "ms_moe_ops.lock") as other:  # released afterwards
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


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


def test_absent_optional_tensors_reach_aclnn_as_null_pointers():
    """An absent tensor is passed as what MindSpore 2.10 converts to nullptr, never as an empty
    tensor: PyNative, an empty std::optional<ms::Tensor> (aclnn_op_runner.h's Arg keeps it
    std::nullopt, op_api_convert.h's ConvertType(std::optional<TensorPtr>) returns nullptr);
    GRAPH, a null KernelTensor* or a None-typed one (ConvertType(const KernelTensor *) returns
    nullptr for both); and the runner prepares only the present tensors (Present)."""
    ffn = next((op, b, s) for op, b, s in ENTRIES if b.kernel == "aclnnFFNV3")
    source = _extension.cpp_source((ffn,), "Ascend")
    launch = next(line for line in source.splitlines() if "LAUNCH_ACLNN_FUNC(aclnnFFNV3" in line)
    assert launch.count("std::optional<ms::Tensor>()") == 4  # the antiquant tensors
    assert "const std::optional<ms::Tensor> &bias1" in source  # optional inputs: None -> nullopt
    run_op = next(line for line in source.splitlines() if "RunOp(stream" in line)
    assert run_op.count("static_cast<mindspore::kernel::KernelTensor *>(nullptr)") == 4
    assert "moe_ext::Present(" in source
    assert "ms::Tensor()" not in source  # no empty (undefined) tensor stands in for one
    convert = open(os.path.join(MS_DIR, "include", "mindspore", "ops", "kernel", "ascend", "acl_ir",
                                "op_api_convert.h")).read()
    assert "tensor == nullptr || tensor->type_id() == kMetaTypeNone" in convert


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
    monkeypatch.setattr(_indexing, "_index_add",
                        lambda: lambda target, dim, index, values, alpha: seen.append(index.dtype)
                        or target)
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
    assert selftest.run(("float32",), ("pynative", "graph"), repeat=1, out=out) == 0, out.getvalue()
    for mode in ("pynative", "graph"):  # every operator and Cell in both modes
        for name in ("moe_gating_top_k", "moe_gating_top_k_backward", "swiglu_group_quant_grad",
                     "moe_ffn", "MoeFFN (Cell)", "GatingTopK (Cell)"):
            assert f"| {name} | float32 | {mode} | " in out.getvalue()
    assert "FAILED" not in out.getvalue()
    assert ms.get_context("mode") == ms.PYNATIVE_MODE  # left as found


# -- the ops.Custom route: MindSpore's own generator against the stub tree ------------------------

CUSTOM = [(op, b) for op in OPERATORS for impl in op.impls
          if impl.binding is not None and impl.route == "" for b in (impl.binding,)]


def _mindspore_callback(monkeypatch, tmp_path, op, binding, opp):
    """What a Custom aclnn primitive does when it is built on a device (custom_ops.py,
    Custom._generate_get_workspace_size_func): its aclnn header's types as MindSpore's own parser
    reads them from the installed tree (CustomInfoGenerator.get_aclnn_api_types, [] when it finds
    no header: then the registration's), the callback it generates from them, compiled as
    _compile_aot does against the tree's include folder."""
    from mindspore.ops.operations._custom_ops_utils import CustomCodeGenerator, CustomInfoGenerator

    monkeypatch.setenv("ASCEND_OPP_PATH", opp)
    info = _impls.aclnn_reg_info(op, binding)
    generator = CustomCodeGenerator()
    header = CustomInfoGenerator(binding.kernel).get_aclnn_api_types()
    types = header or generator.get_api_types_by_reg_info(info)
    source = tmp_path / f"{binding.kernel}_callback.cc"
    source.write_text(generator.generate_callback_by_types(binding.kernel, info, types))
    include = os.path.join(os.path.dirname(opp.rstrip(os.sep)), "include")
    done = subprocess.run(["g++", "-std=c++17", "--shared", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=0",
                           f"-I{include}", "-o", str(tmp_path / "callback.so"), str(source)],
                          capture_output=True, text=True, timeout=120)
    return header, generator.get_api_types_by_reg_info(info), done


@pytest.mark.parametrize("op,binding", CUSTOM, ids=[b.kernel for _, b in CUSTOM])
def test_mindspore_reads_the_stub_header_and_compiles_the_callback(monkeypatch, tmp_path, op,
                                                                   binding):
    header, registered, done = _mindspore_callback(monkeypatch, tmp_path, op, binding,
                                                   os.path.join(STUB, "opp"))
    assert done.returncode == 0, done.stderr
    if binding.kernel == "aclnnFFNV3":
        # MindSpore 2.10 looks for aclnn_ffnv3.h; CANN's file is aclnn_ffn_v3.h: it falls back to
        # the registration (docs/ascend.md)
        assert header == []
    else:
        assert header[:-2] == registered[:-2]


def test_mindspore_reads_a_header_that_disagrees_with_the_registration(monkeypatch, tmp_path):
    op, binding = next((o, b) for o, b in CUSTOM if b.kernel == "aclnnSwigluGroupQuantGrad")
    early = tmp_path / "cann"
    (early / "opp").mkdir(parents=True)
    include = early / "include"
    include.mkdir()
    for entry in os.listdir(os.path.join(STUB, "include")):
        if entry != "aclnnop":
            os.symlink(os.path.join(STUB, "include", entry), include / entry)
    os.symlink(os.path.join(EARLY_950, "aclnnop"), include / "aclnnop")
    header, registered, _ = _mindspore_callback(monkeypatch, tmp_path, op, binding,
                                                str(early / "opp"))
    assert header[:-2] != registered[:-2]
    assert header[4] == "aclIntArray*" and registered[4] == "aclTensor*"


# -- the resolver's extension route, run on CPU -----------------------------------------------------

@pytest.fixture
def cpu_built_extension(monkeypatch):
    """The extension route as the resolver builds it, with the extension compiled for CPU: the
    same generated YAML, inference, registration and argument order; this package's CPU kernels
    instead of the aclnn ones."""
    mod = _extension.load(ENTRIES, "CPU")
    monkeypatch.setattr(_extension, "function",
                        lambda op, binding, backend="Ascend", symbol="":
                        getattr(mod, _extension.op_name(binding)))
    return mod


@pytest.mark.slow
def test_resolver_runs_the_extension_route_in_pynative_and_compiles_it_in_graph(
        monkeypatch, cpu_built_extension):
    from ascend_sim import as_on
    from ms_moe_ops.ops import _op, _platform, moe_ffn, moe_gating_top_k
    from ms_moe_ops.ops.ffn import MOE_FFN

    rng = np.random.default_rng(1)
    logits = ms.Tensor(rng.standard_normal((8, 16)).astype(np.float32))
    x = ms.Tensor((rng.standard_normal((8, 8)) * 0.5).astype(np.float16))
    counts = ms.Tensor(np.array([3, 0, 5], np.int64))
    w1 = ms.Tensor((rng.standard_normal((3, 8, 12)) * 0.2).astype(np.float16))
    w2 = ms.Tensor((rng.standard_normal((3, 12, 8)) * 0.2).astype(np.float16))
    want_router = GATING_TOP_K.impl("kernel").build(GATING_TOP_K, GATING_TOP_K.resolve(k=2))(
        (logits, None))
    want_ffn = MOE_FFN.impl("kernel").build(MOE_FFN, MOE_FFN.resolve())(
        (x, counts, w1, None, w2, None, None, None, None, None)).asnumpy()

    as_on(monkeypatch, _platform.A2, cann_missing=("aclnnFFNV3",))
    with _op.record_choices() as log:
        y, idx, norm = moe_gating_top_k(logits, 2)
        got_ffn = moe_ffn(x, counts, w1, w2).asnumpy()
    assert log == [("moe_gating_top_k", "aclnn"), ("moe_ffn", "aclnn")]
    np.testing.assert_array_equal(y.asnumpy(), want_router[0].asnumpy())
    np.testing.assert_array_equal(idx.asnumpy(), want_router[1].asnumpy())
    # x_norm: MindSpore's sigmoid beside the kernel (called with out_flag false), not the kernel's
    np.testing.assert_allclose(norm.asnumpy(), want_router[2].asnumpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_ffn, want_ffn)  # aclnnMoeFFN's binding, host counts

    def step(a, c):
        return moe_ffn(a, c, w1, w2)

    ms.set_context(mode=ms.GRAPH_MODE)
    # the GRAPH route: our inference (out_spec, the counts value-depend) accepted by the front end
    with pytest.raises(RuntimeError, match=r"Unsupported op \[Custom_aclnn_moe_ffn\] on CPU"):
        ms.jit(step)(x, counts)
