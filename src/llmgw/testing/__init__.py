"""Helpers for testing and benchmarking llmgw against real engines.

Shipped with the package so benchmarks and users can run the same setup as the
test suite. Importing this package imports no test-only dependency:
:mod:`llmgw.testing.gguf_model` loads ``gguf``/``numpy`` only when it writes a model.
"""

from __future__ import annotations
