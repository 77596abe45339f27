"""The optional C extension qpcbuild.runtime._suffix_tree (pyproject.toml holds the metadata).

`pip install -e .` builds it in place. optional=True: where it cannot be built (no C compiler)
the install still succeeds and qpcbuild/runtime/suffix_tree.py uses its Python class.
"""

import sys

from setuptools import Extension, setup

# The tree's float32 walk must round exactly as the Python one does: no -ffast-math, and no
# multiply and add fused into one rounding (an FMA, which GCC emits by default on e.g. ARM).
FLAGS = [] if sys.platform == "win32" else ["-O2", "-ffp-contract=off"]

setup(ext_modules=[Extension("qpcbuild.runtime._suffix_tree", ["qpcbuild/runtime/_suffix_tree.c"],
                             optional=True, extra_compile_args=FLAGS)])
