"""The documents hold: the README's quick start runs as written, every performance table is the
one its CSV makes (tools/bench_tables.py), and the links between the documents resolve."""
import os
import re
import subprocess
import sys

import ms_moe_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(name):
    with open(os.path.join(ROOT, name), encoding="utf-8") as f:
        return f.read()


def test_quick_start_runs_and_prints_no_warning():
    """The README's quick start runs as written, as a new user runs it (a fresh process, from
    another directory): it prints the loss and the imbalance, and nothing on stderr, no warning
    of MindSpore's (its nn.Adam logged "'FusedSparseAdam' is deprecated", MindSpore's notice
    about its own class, in every run)."""
    code = re.search(r"## Quick start\n\n```python\n(.*?)```", _read("README.md"), re.S).group(1)
    package = os.path.dirname(os.path.dirname(os.path.realpath(ms_moe_ops.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (package, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=env, cwd=os.path.dirname(ROOT))
    assert len(code.strip().splitlines()) <= 12
    assert done.returncode == 0, done.stderr
    assert "[" in done.stdout  # the loss and the layer's imbalance
    assert done.stderr == "" and "WARNING" not in done.stdout, done.stderr + done.stdout


def test_performance_tables_are_made_from_their_csvs():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench_tables.py"),
                           "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "<!-- table: goals -->" in _read("README.md")
    assert "<!-- table: scaling -->" in _read("benchmarks/README.md")


def test_tables_follow_the_data(tmp_path, monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import bench_tables
    finally:
        sys.path.pop(0)
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "goals.csv").write_text("goal,run,ours,other,unit,ratio\n"
                                       "router-torch,quiet,20.5,82,ms,4.0\n"
                                       "router-torch,busy,,,ms,3.5\n")
    monkeypatch.setattr(bench_tables, "ROOT", str(tmp_path))
    table = bench_tables.goals_table()
    assert "| quiet ratio | busy ratio |" in table
    assert "| 20.5 ms / 82 ms | 4.00x faster | 3.50x faster | 4x |" in table
    text = "a\n<!-- table: goals -->\nold\n<!-- /table -->\nb"
    assert bench_tables.regenerate(text) == f"a\n<!-- table: goals -->\n{table}\n<!-- /table -->\nb"


def test_links_between_documents_resolve():
    broken = []
    for name in ["README.md", "tests/README.md", "benchmarks/README.md", "CHANGELOG.md"] + [
            os.path.join("docs", d) for d in os.listdir(os.path.join(ROOT, "docs"))
            if d.endswith(".md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", _read(name)):
            if not os.path.exists(os.path.join(ROOT, os.path.dirname(name), target)):
                broken.append(f"{name} -> {target}")
    assert not broken, broken


def test_the_version_is_one_and_has_its_changelog_section():
    import configparser

    import ms_moe_ops

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    assert cfg["metadata"]["version"] == ms_moe_ops.__version__
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        sections = re.findall(r"^## (\S+)", f.read(), re.M)
    assert sections and sections[0] == ms_moe_ops.__version__, (
        f"CHANGELOG.md's newest section is {sections[:1]}, the version {ms_moe_ops.__version__}")
    citation = re.findall(r"^version: *(\S+)$", _read("CITATION.cff"), re.M)
    assert citation == [ms_moe_ops.__version__], f"CITATION.cff says version {citation}"
    # and nowhere else: every other place reads it (docs/api/conf.py, the package's metadata)
    written = [path for path in _text_files() if re.search(
        r"version_*\s*[:=]\s*['\"]?" + re.escape(ms_moe_ops.__version__), _read(path))]
    package = ["ms_moe_ops/__init__.py"] if os.path.isdir(os.path.join(ROOT, "ms_moe_ops")) else []
    assert sorted(written) == sorted(["CITATION.cff", "setup.cfg"] + package), written


def _text_files():
    """The repository's source and documentation files (not CHANGELOG.md, whose sections name
    every version)."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "runs", "__pycache__")]
        for name in files:
            path = os.path.relpath(os.path.join(folder, name), ROOT)
            if name.endswith((".py", ".cfg", ".toml", ".cff", ".md", ".rst", ".txt")) and \
                    path != "CHANGELOG.md" and "egg-info" not in path:
                out.append(path)
    return out


def test_the_python_versions_agree():
    """The README names the Python versions setup.cfg's python_requires allows (MindSpore 2.10's
    own range), and the package's sources are of the oldest one's grammar."""
    import ast
    import configparser
    from importlib import metadata

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    requires = cfg["options"]["python_requires"]
    assert requires == ">=3.9,<3.13" == metadata.metadata("mindspore")["Requires-Python"].replace(" ", "")
    assert "with Python 3.9 to 3.12 (MindSpore 2.10's; tested: 3.11)" in " ".join(_read("README.md").split())
    package = os.path.dirname(os.path.realpath(ms_moe_ops.__file__))
    for folder, _, files in os.walk(package):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    ast.parse(f.read(), filename=name, feature_version=(3, 9))
