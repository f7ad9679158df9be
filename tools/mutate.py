"""Mutation check: plants each bug of tools/mutations.py, one at a time, and runs the tests meant
to catch it. A bug whose tests still pass "survived": the suite has a hole there.

    python tools/mutate.py                 # every mutation
    python tools/mutate.py --only ID ...   # some of them
    python tools/mutate.py --bugs FILE     # the MUTATIONS list of another file (an audit's)
    python tools/mutate.py --list

It works on a scratch copy of the repository (tracked and untracked files, plus the built kernel
library), never on your files: edit and run tests meanwhile as you like. For each mutation it
checks that the snippet occurs exactly once (otherwise the entry is "stale": the source changed,
update the entry), writes the mutated file, rebuilds the kernels when a C++ file changed, runs
the entry's tests (first failure stops them) and restores the file and the library, also on
Ctrl-C. By default an entry's tests are its whole test files (a node id counts as its file), as a
maintainer would run them; `--as-listed` runs the node ids only. Each test file gets a time budget
(`--budget`, seconds); a run past it is reported as a time-out, never as a pass or a failure.
Before the first mutation the listed tests must pass on the unmutated copy (per build environment),
or nothing could be concluded: a failing or timed-out baseline is reported as such, with its log.
Exit status 0 when every bug was caught.
Not part of CI: a full run takes one to two hours on 2 cores (about a minute per C++ rebuild).
"""
import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from mutations import MUTATIONS  # noqa: E402

CPP = (".cc", ".h")
FILE_BUDGET = 300  # seconds per test file of one run (the slowest default file takes ~60 s)
BUILD_TIMEOUT = 900


def copy_repository(dest):
    """Tracked and untracked (not ignored) files, and the built kernel library, into dest."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    files += [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "ms_moe_ops", "_kernels*.so"))]
    for rel in filter(None, files):
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))


def build(repo, env_extra, log):
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "--force"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    with open(log, "a") as f:
        f.write(proc.stdout + proc.stderr)
    return proc.returncode == 0


def run_tests(repo, tests, log, budget, markers=None):
    """pytest exit code (0 passed, 1 a test failed, other: could not run) for tests in repo, or
    "timeout" when they ran past budget seconds per test file."""
    env = dict(os.environ, PYTHONPATH=repo)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:randomly", "-p",
           "no:cacheprovider", *(["-m", markers] if markers is not None else []), *tests]
    timeout = budget * len({t.split("::")[0] for t in tests})
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout)
        out, code = proc.stdout[-20000:] + proc.stderr[-5000:], proc.returncode
    except subprocess.TimeoutExpired as e:
        out = _text(e.stdout)[-20000:] + _text(e.stderr)[-5000:]
        code, out = "timeout", out + f"\n** time-out after {timeout} s\n"
    with open(log, "a") as f:
        f.write(" ".join(cmd) + "\n" + out)
    return code


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def load_mutations(path):
    """The MUTATIONS list of a Python file (one of ours, or an audit's in the same format)."""
    spec = importlib.util.spec_from_file_location("_bugs", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MUTATIONS


def targets(m, as_listed):
    """The tests run for an entry: whole files by default."""
    return list(m["tests"]) if as_listed else sorted({t.split("::")[0] for t in m["tests"]})


def env_key(env):
    return tuple(sorted((env or {}).items()))


class Library:
    """The unmutated kernel library of each build environment, built once and put back after
    every mutation (the native one is the library copied with the repository, or built)."""

    def __init__(self, repo, workdir, log):
        self.repo, self.workdir, self.log, self.saved = repo, workdir, log, {}
        if not glob.glob(os.path.join(repo, "ms_moe_ops", "_kernels*.so")):
            self._build({})
        self._save(())

    def path(self):
        return glob.glob(os.path.join(self.repo, "ms_moe_ops", "_kernels*.so"))[0]

    def _build(self, env):
        if not build(self.repo, env, self.log):
            raise RuntimeError(f"the unmutated sources do not build with {env}; see {self.log}")

    def _save(self, key):
        self.saved[key] = os.path.join(self.workdir, f"kernels{len(self.saved)}.so")
        shutil.copy2(self.path(), self.saved[key])

    def use(self, env):
        key = env_key(env)
        if key not in self.saved:
            self._build(dict(key))
            self._save(key)
        shutil.copy2(self.saved[key], self.path())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutations only")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--bugs", metavar="FILE", help="plant the MUTATIONS of this file instead")
    parser.add_argument("--also", nargs="+", default=[], metavar="TEST",
                        help="test files run after every entry's own (suites meant to cover all)")
    parser.add_argument("--as-listed", action="store_true",
                        help="run the listed node ids only, not their whole files")
    parser.add_argument("--budget", type=float, default=FILE_BUDGET, metavar="SECONDS",
                        help=f"time budget per test file of one run (default {FILE_BUDGET})")
    parser.add_argument("--markers", metavar="EXPR",
                        help='pytest -m expression (default: the default run; "" runs every test)')
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy (its path is printed)")
    args = parser.parse_args()
    catalogue = load_mutations(args.bugs) if args.bugs else MUTATIONS
    entries = [dict(m, tests=targets(m, args.as_listed) + [t for t in args.also if t not in m["tests"]])
               for m in catalogue
               if not args.only or m["id"] in args.only]
    if args.list:
        for m in catalogue:
            print(f"{m['id']:42s} {m['file']:32s} {m['what']}")
        return 0
    if args.only and len(entries) != len(args.only):
        sys.exit(f"unknown ids: {sorted(set(args.only) - {m['id'] for m in catalogue})}")

    workdir = tempfile.mkdtemp(prefix="ms_moe_ops_mutate_")
    repo = os.path.join(workdir, "repo")
    log = os.path.join(tempfile.gettempdir(), os.path.basename(workdir) + ".log")  # kept
    print(f"scratch copy: {repo} (log: {log})", flush=True)
    results = []
    try:
        copy_repository(repo)
        library = Library(repo, workdir, log)
        # the tests must pass before anything is planted, in every build environment used
        for key in sorted({env_key(m.get("build_env")) for m in entries}):
            library.use(dict(key))
            tests = union([m["tests"] for m in entries if env_key(m.get("build_env")) == key])
            print(f"baseline {dict(key) or 'native'}: {len(tests)} test targets ...", flush=True)
            code = run_tests(repo, tests, log, args.budget, args.markers)
            if code == "timeout":
                sys.exit(f"the baseline run of the listed tests timed out ({args.budget:.0f} s "
                         f"per file; {dict(key) or 'native'}): raise --budget; see {log}")
            if code != 0:
                sys.exit(f"the listed tests fail without any mutation ({dict(key) or 'native'}, "
                         f"pytest exit {code}); see {log}")
        for i, m in enumerate(entries, 1):
            results.append(mutate_one(m, repo, library, log, args.budget, args.markers))
            print(f"[{i}/{len(entries)}] {m['id']}: {results[-1][1]} ({results[-1][2]:.0f} s)",
                  flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return report(results)


def union(test_lists):
    """Every test target once; node ids inside a listed file are left to the file."""
    targets = {t for tests in test_lists for t in tests}
    return sorted(t for t in targets if "::" not in t or t.split("::")[0] not in targets)


def mutate_one(m, repo, library, log, budget, markers):
    start = time.time()
    path = os.path.join(repo, m["file"])
    if not os.path.exists(path):
        return m, "stale (file missing)", 0.0
    with open(path, encoding="utf-8") as f:
        original = f.read()
    count = original.count(m["original"])
    if count != 1:
        return m, f"stale (snippet found {count} times)", 0.0
    stat = os.stat(path)
    cpp = m["file"].endswith(CPP)
    env = m.get("build_env")
    with open(log, "a") as f:
        f.write(f"\n==== {m['id']}\n")
    try:
        library.use(env)
        with open(path, "w", encoding="utf-8") as f:
            f.write(original.replace(m["original"], m["replacement"]))
        if cpp and not build(repo, env, log):
            return m, "does not build", time.time() - start
        code = run_tests(repo, m["tests"], log, budget, markers)
        status = {0: "SURVIVED", 1: "caught", "timeout": "TIMEOUT (neither caught nor passed)"}.get(
            code, f"error (pytest: {code})")
        return m, status, time.time() - start
    finally:
        with open(path, "w", encoding="utf-8") as f:
            f.write(original)
        os.utime(path, (stat.st_atime, stat.st_mtime))
        if cpp:
            library.use(env)


def report(results):
    width = max((len(m["id"]) for m, _, _ in results), default=10)
    for m, status, seconds in results:
        print(f"{m['id']:{width}s}  {status:24s} {seconds:6.0f} s  {m['what']}")
    counts = {}
    for _, status, _ in results:
        key = status.split(" ")[0].lower()
        counts[key] = counts.get(key, 0) + 1
    print(", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0 if counts.get("caught", 0) == len(results) else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("interrupted: the scratch copy was removed, your files were never touched")
