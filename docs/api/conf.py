"""The API reference, generated from the docstrings (Sphinx autodoc):

    pip install -e ".[docs]" && python -m sphinx -W -b html docs/api build/api

It documents the package that Python imports (install it first, as above)."""
import ms_moe_ops

project = "ms_moe_ops"
release = version = ms_moe_ops.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
# the docstrings quote code as `name`
default_role = "code"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": True}
# MindSpore's own classes (Cell, Parameter) are not documented here
nitpicky = False
html_theme = "alabaster"
exclude_patterns = ["_build"]
