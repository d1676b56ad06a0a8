"""The admin API's answers said in a line, as ``llmgw ctl`` and the console print them.

Standard library only: ``llmgw ctl`` imports this and must start fast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["reload_summary"]


def _names(kind: str, ids: Sequence[Any]) -> str:
    return f"{kind}{'' if len(ids) == 1 else 's'} {', '.join(map(str, ids))}"


def reload_summary(answer: Mapping[str, Any]) -> str:
    """What ``POST /admin/v1/reload`` changed, e.g. ``configuration reloaded: added endpoint b; changed
    deployment chat (replicas 2 → 1)``.

    Args:
        answer: the reload's answer: ``added``, ``removed``, ``changed`` (endpoint ids) and
            ``deployments`` (``added``, ``removed``, ``changed`` names, ``replicas``: name -> [before, after]),
            ``models`` (names whose ``models:`` entry changed) and ``settings`` (the other sections that did).

    Returns:
        One line. From an llmgw that does not name its models and settings, without endpoint or
        deployment changes it says only that (the rest may still have changed): it never claims that
        nothing did unless the answer says so.
    """
    deps = answer.get("deployments")
    deps = deps if isinstance(deps, Mapping) else {}
    counts = deps.get("replicas")
    counts = counts if isinstance(counts, Mapping) else {}
    parts = []
    for verb in ("added", "removed", "changed"):
        ids = answer.get(verb)
        if isinstance(ids, list) and ids:
            parts.append(f"{verb} {_names('endpoint', ids)}")
    for verb in ("added", "removed", "changed"):
        names = deps.get(verb)
        if not isinstance(names, list) or not names:
            continue
        shown = []
        for n in names:
            c = counts.get(n) if verb == "changed" else None
            shown.append(f"{n} (replicas {c[0]} → {c[1]})" if isinstance(c, Sequence) and len(c) == 2 else str(n))
        parts.append(f"{verb} {_names('deployment', shown)}")
    models = answer.get("models")
    if isinstance(models, list) and models:
        parts.append(f"changed the settings of {_names('model', models)}")
    sections = answer.get("settings")
    if isinstance(sections, list) and sections:
        parts.append(f"changed {', '.join(map(str, sections))}")
    if not parts:
        if "settings" in answer:  # (an answer that names settings: nothing else did change)
            if answer.get("restart_needed_for"):
                return "configuration reloaded: nothing changed that applies without a restart"
            return "configuration reloaded: nothing changed"
        return "configuration reloaded: no endpoint or deployment changed"
    return "configuration reloaded: " + "; ".join(parts)
