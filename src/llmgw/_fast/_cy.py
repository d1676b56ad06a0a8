"""Stands in for Cython's ``cython`` module where Cython is not installed.

The data-path twins (``server_py``, ``upstream_py``, ...) are compiled by Cython
from their own source, with an augmenting ``.pxd`` each. They ask
``cython.compiled`` to bind, as plain Python, only the names that the compiled
build takes from its ``.pxd`` (cimported types, functions and C enums). A pure
install has no Cython: this module answers for it.
"""

compiled = False
