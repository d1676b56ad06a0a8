"""The JSON Schema of ``llmgw.yaml`` and of the node agent's file (``llmgw config schema``), for editors."""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter

from .model import _ConfigIn


def config_schema(*, agent: bool = False) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of ``llmgw.yaml`` (or, with ``agent``, the node agent's file).

    It describes the file's shape and every value's form; what needs more than
    the file (an environment variable being set, an alias clashing with a model
    another endpoint serves) only the loader checks.
    """
    from .agent import _AgentIn  # (loaded on first use: `llmgw serve` never needs it)

    model = _AgentIn if agent else _ConfigIn
    schema = TypeAdapter(model).json_schema()
    docs = _field_docs()
    for name, sub in [(model.__name__, schema), *schema.get("$defs", {}).items()]:
        for key, prop in sub.get("properties", {}).items():
            doc = docs.get(name, {}).get(key)
            if doc:
                form = prop.get("description")
                prop["description"] = f"{doc} ({form})" if form else doc
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **schema,
        "title": "llmgw node agent" if agent else "llmgw.yaml",
    }


def _field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field -> the docstring written under the field, in the modules that define the files' classes."""
    import ast
    import inspect
    import sys
    from itertools import pairwise

    from .agent import _AgentIn

    try:
        trees = [ast.parse(inspect.getsource(sys.modules[m.__module__])) for m in (_ConfigIn, _AgentIn)]
    except (OSError, TypeError):  # pragma: no cover - no source shipped: no descriptions
        return {}
    out: dict[str, dict[str, str]] = {}
    for cls in (n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt, nxt in pairwise(cls.body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                out.setdefault(cls.name, {})[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return out
