"""The suite's own reproducibility: every test starts from seeds of its own id, whatever the
order pytest-randomly chose (its --randomly-seed must not reach the generators), and GRAPH mode
compiles the sources as they were loaded, whatever is edited while the suite runs."""
import sys

import numpy as np
import pytest

import cases
import conftest
import ms_moe_ops
from conftest import run, seed_of


def test_numpy_global_state_is_the_tests_own_seed(request):
    # pytest-randomly reseeds numpy (and random) from the order seed before the test body runs
    # unless conftest switches that off: the state would then follow --randomly-seed
    expected = np.random.RandomState(seed_of(request.node.nodeid)).get_state()[1]
    assert np.array_equal(np.random.get_state()[1], expected)


def test_randomly_reset_seed_is_off(request):
    if request.config.pluginmanager.hasplugin("randomly"):
        assert request.config.option.randomly_reset_seed is False


def test_a_cells_initial_weights_do_not_follow_the_order_seed(request):
    # the reproduction: a fresh MoELayer's router weights came out different for
    # --randomly-seed=1 and 2. Built first thing in the test, they must equal those built again
    # after seeding as conftest's fixture does.
    import mindspore as ms
    from ms_moe_ops import MoELayer

    first = MoELayer(8, 6, 4, 2).router.weight.asnumpy()
    seed = seed_of(request.node.nodeid)
    ms.set_seed(seed % (2 ** 31))
    np.random.seed(seed)
    again = MoELayer(8, 6, 4, 2).router.weight.asnumpy()
    assert np.array_equal(first, again)


# -- a source file edited while the suite runs --------------------------------------------------

_FIRST = '''\
from mindspore import nn


class Twice(nn.Cell):
    def construct(self, x, y, z):
        return (x + y + z) * 2
'''
# the same module edited: three lines more above it, so that the line where Twice.construct
# starts in the loaded code now holds a function of one argument
_EDITED = '''\
def one(t):
    return t
''' + _FIRST


def _edited_module(tmp_path, monkeypatch, name, pin):
    """Twice.construct of a module loaded from _FIRST, after its file was rewritten with
    _EDITED (pinned as loaded first when pin)."""
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(_FIRST)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    if pin:
        conftest.pin_source(str(path))
    path.write_text(_EDITED)
    return module.Twice()


def test_graph_mode_compiles_the_source_as_it_was_loaded(tmp_path, monkeypatch):
    """MindSpore's GRAPH mode reads a function's source from its file when it compiles it, at
    the line where the loaded code starts: after an edit it parses whatever is there now (the
    flake of a full run, in which conftest.run's FnCell around a 3-argument function compiled as
    conftest's `def numpy(t)`). The suite pins the sources it loaded (conftest.pin_sources)."""
    import mindspore as ms
    from mindspore import Tensor

    args = [Tensor(np.full(2, v, np.float32)) for v in (1, 2, 3)]
    unpinned = _edited_module(tmp_path, monkeypatch, "edited_unpinned", pin=False)
    with pytest.raises(TypeError, match="parameters number of the function is 1, but the number "
                                        "of provided arguments is 3"):
        run(unpinned, *args, mode="graph")
    pinned = _edited_module(tmp_path, monkeypatch, "edited_pinned", pin=True)
    np.testing.assert_array_equal(run(pinned, *args, mode="graph").asnumpy(), [12, 12])
    assert ms.get_context("mode") == ms.PYNATIVE_MODE


def test_the_repositorys_sources_are_pinned():
    import linecache

    for module in (conftest, cases, ms_moe_ops.nn.moe_layer, ms_moe_ops.ops._op):
        entry = linecache.cache.get(module.__file__)
        assert entry is not None and entry[1] is None, module.__name__
