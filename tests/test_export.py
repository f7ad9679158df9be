"""Deployment: a net exported to MINDIR with these operators loads and runs in a fresh process
(nothing preloaded: the kernel library finds its BLAS by itself), with the exporting process's
results."""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from ms_moe_ops import MoELayer
from conftest import cpu_only, needs_kernels, numpy, tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.first = MoELayer(8, 6, 4, 2, n_shared_experts=1)
        self.second = MoELayer(8, 6, 4, 2, activation="fastgelu")

    def construct(self, x):
        return self.second(self.first(x))


def _net(rng):
    net = _Net()
    for p in net.trainable_params():
        p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    return net


def run_fresh(script, cwd):
    """Runs a Python script in a new interpreter that imports this tree's ms_moe_ops, with no
    library preloaded and no library path set."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@cpu_only("the exported graph holds the CPU kernels")
@pytest.mark.slow
def test_mindir_runs_in_a_fresh_process(tmp_path, rng):
    ms.set_context(mode=ms.GRAPH_MODE)
    net = _net(rng)
    x = rng.normal(0, 1, (7, 8)).astype(np.float32)
    expected = numpy(net(tensor(x)))
    ms.export(net, tensor(x), file_name=str(tmp_path / "moe"), file_format="MINDIR")
    np.save(tmp_path / "x.npy", x)
    run_fresh("""
        import numpy as np
        import mindspore as ms
        ms.set_context(mode=ms.GRAPH_MODE)
        x = ms.Tensor(np.load("x.npy"))
        graph = ms.load("moe.mindir")
        # first without importing the package, then after importing it
        np.save("y_plain.npy", ms.nn.GraphCell(graph)(x).asnumpy())
        import ms_moe_ops
        np.save("y_imported.npy", ms.nn.GraphCell(ms.load("moe.mindir"))(x).asnumpy())
    """, tmp_path)
    np.testing.assert_array_equal(np.load(tmp_path / "y_plain.npy"), expected)
    np.testing.assert_array_equal(np.load(tmp_path / "y_imported.npy"), expected)


@needs_kernels("reads the CPU kernel library")
def test_kernel_library_names_this_environments_blas():
    """The library's run path reaches the BLAS of the environment it runs in, not only the one
    it was built against: pip builds an editable install in an isolated environment that it
    deletes afterwards (a MINDIR then failed to load from a clean clone)."""
    import scipy_openblas32
    from ms_moe_ops.ops._impls import kernel_library

    library = kernel_library()
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    dynamic = subprocess.run([readelf, "-d", library], capture_output=True, text=True,
                             check=True).stdout
    runpath = re.search(r"R(?:UN)?PATH\)\s+Library r(?:un)?path: \[(.*)\]", dynamic).group(1)
    origin = os.path.dirname(library)
    dirs = {os.path.realpath(d.replace("$ORIGIN", origin)) for d in runpath.split(":")}
    assert os.path.realpath(scipy_openblas32.get_lib_dir()) in dirs, runpath
