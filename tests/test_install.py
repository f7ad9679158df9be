"""Installing: the kernel build says what it compiles and how far it is, where the person waiting
sees it (pip shows a build's own output only with -v), and an install of an unchanged checkout
reuses the library it built rather than compiling again (a second `pip install -e .` ran the
whole 2-3 minute build: its build directories are new every time).

setup.py's parts are tested here directly (its setup() runs only as a script); the slow test runs
pip itself, in a virtual environment, on a copy of the repository."""
import fcntl
import importlib.util
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import termios
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "setup.py")
needs_checkout = pytest.mark.skipif(not os.path.isfile(SETUP), reason="needs the repository's setup.py")


@pytest.fixture(scope="module")
def setup_py():
    spec = importlib.util.spec_from_file_location("ms_moe_ops_setup", SETUP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def on_a_terminal(args, env=None, cwd=None, timeout=600):
    """Runs args in a new session whose controlling terminal is a fresh pseudo-terminal, with
    stdout and stderr captured apart from it (as pip captures a build backend's): (exit status,
    what reached the terminal, stdout + stderr)."""
    master, slave = pty.openpty()

    def adopt_terminal():  # (in the child, a session leader: the terminal becomes its own)
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)
        os.close(slave)

    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(slave,),
                            preexec_fn=adopt_terminal, env=env, cwd=cwd)
    # (the slave stays open here: with no descriptor of it open, reading the master fails, and
    # the child may open /dev/tty only later)
    seen, captured, deadline = b"", b"", time.monotonic() + timeout
    reader = proc.stdout.fileno()
    os.set_blocking(master, False)
    while True:
        ready, _, _ = select.select([master, reader], [], [], 1.0)
        if master in ready:
            seen += os.read(master, 65536)
        if reader in ready:
            data = os.read(reader, 65536)
            captured += data
            if not data and proc.poll() is not None:
                break
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{args} took more than {timeout} s")
    proc.wait()
    try:
        seen += os.read(master, 65536)
    except BlockingIOError:
        pass
    os.close(slave)
    os.close(master)
    return proc.returncode, seen.decode(errors="replace"), captured.decode(errors="replace")


# -- the parts -----------------------------------------------------------------------------------

@needs_checkout
def test_progress_lines(setup_py):
    """A line per step: which object of which path, how many of how many, the time so far; each
    starts at the line's beginning (over a spinner pip may have drawn)."""
    class Stream(list):
        def write(self, text):
            self.append(text)

        def flush(self):
            pass

    out = Stream()
    progress = setup_py.Progress(out)
    progress.say("compiling the CPU kernels: 29 compiles")
    for what in ("generic/gating.cc", "avx2/ffn.cc"):
        progress.compiled(what, 29)
    assert out == ["\rms_moe_ops: compiling the CPU kernels: 29 compiles (0:00)\n",
                   "\rms_moe_ops: [ 1/29] compiled generic/gating.cc (0:00)\n",
                   "\rms_moe_ops: [ 2/29] compiled avx2/ffn.cc (0:00)\n"]


@needs_checkout
@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "no-terminal"])
def test_progress_reaches_the_terminal_past_captured_output(terminal):
    """With its output captured, as pip runs a build: the lines reach the controlling terminal
    when the process has one, else stderr (CI, logs)."""
    code = (f"import importlib.util as u; s = u.spec_from_file_location('s', {SETUP!r}); "
            f"m = u.module_from_spec(s); s.loader.exec_module(m); m.Progress().say('step one')")
    if terminal:
        status, seen, captured = on_a_terminal([sys.executable, "-c", code], timeout=60)
    else:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              start_new_session=True, stdin=subprocess.DEVNULL, timeout=60)
        status, seen, captured = done.returncode, "", done.stdout + done.stderr
    assert status == 0, captured
    assert ("ms_moe_ops: step one" in seen) == terminal, seen
    assert ("ms_moe_ops: step one" in captured) != terminal, captured


@needs_checkout
def test_a_library_is_reused_only_when_nothing_it_was_built_from_changed(setup_py, tmp_path):
    settings = {"compiler": ["c++"], "env": {}}
    source = tmp_path / "kernel.cc"
    source.write_text("int f();\n")
    first, second = (tmp_path / d / "_kernels.so" for d in ("build", "inplace"))

    def built(path, **record):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"library")
        (path.parent / setup_py.RECORD).write_text(json.dumps(
            {"built": True, "library": path.name, "settings": settings, **record}))
        later = time.time() + 10
        os.utime(path, (later, later))

    reusable = lambda: setup_py.reusable([str(first), str(second)], [str(source)], settings)
    assert reusable() is None  # nothing built
    built(second)
    assert reusable() == str(second)  # the in-place library of an earlier install
    built(first)
    assert reusable() == str(first)
    assert setup_py.reusable([str(first)], [str(source)], {**settings, "env": {"MS_MOE_OPS_OPT": "-O1"}}) is None
    os.utime(source, (time.time() + 20, time.time() + 20))
    assert reusable() is None  # a source newer than both
    built(first, built=False)
    os.utime(source, (0, 0))
    assert reusable() == str(second)  # a record of a failed build is no library
    (second.parent / setup_py.RECORD).write_text("{")
    assert reusable() is None


# -- pip itself ----------------------------------------------------------------------------------

def _copy_repository(dest):
    """The repository's own files (no build products, no version control) into dest."""
    skip = shutil.ignore_patterns(".git", "build", "*.so", "*.egg-info", "__pycache__", "runs",
                                  "rank_*", "kernel_meta", ".pytest_cache", "_kernels_build.json")
    shutil.copytree(ROOT, dest, ignore=skip)


@needs_checkout
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "ms_moe_ops")),
                    reason="needs a checkout with the package's sources")
def test_pip_install_shows_progress_and_a_second_install_is_fast(tmp_path):
    """`pip install -e .` into a virtual environment (seeing this one's packages), on a pseudo-
    terminal: pip itself prints no build output, the terminal shows every compile; a second
    install of the unchanged checkout reuses the library, says so and takes under 60 s. (-O1:
    the same compiles in a fraction of the time; --no-build-isolation: nothing downloaded.)"""
    repo = tmp_path / "ms_moe_ops"
    _copy_repository(repo)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = dict(os.environ, MS_MOE_OPS_OPT="-O1", MS_MOE_OPS_REQUIRE_KERNELS="1")
    env.pop("PYTHONPATH", None)
    install = [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", str(repo)]
    # (not from tmp_path: its folder ms_moe_ops would be imported as a namespace package)
    status, seen, captured = on_a_terminal(install, env=env, cwd=str(venv), timeout=1200)
    assert status == 0, captured[-3000:]
    assert "compiled" not in captured  # pip hid the build's output ...
    paths = json.loads((repo / "ms_moe_ops" / "_kernels_build.json").read_text())["paths"]
    sources = [os.path.basename(p) for p in os.listdir(repo / "custom_aot") if p.endswith(".cc")]
    for path in paths:  # ... the terminal showed every compile
        for source in sources:
            assert f"compiled {path}/custom_aot/{source}" in seen, (path, source, seen)
    assert "the CPU kernels are built" in seen
    start = time.monotonic()
    status, seen, captured = on_a_terminal(install, env=env, cwd=str(venv), timeout=600)
    seconds = time.monotonic() - start
    assert status == 0, captured[-3000:]
    assert "the CPU kernels are up to date" in seen and "compiled" not in seen, seen
    assert seconds < 60, seconds
    print(f"second install: {seconds:.1f} s")
    done = subprocess.run([python, "-c", "import ms_moe_ops.ops, sys; print(ms_moe_ops.__file__); "
                           "print(ms_moe_ops.ops.swiglu_group(__import__('mindspore').ops.ones((2, 4)))"
                           "[0].shape)"],
                          capture_output=True, text=True, env=env, cwd=str(venv), timeout=300)
    assert done.returncode == 0 and done.stdout.startswith(str(repo)), done.stdout + done.stderr
