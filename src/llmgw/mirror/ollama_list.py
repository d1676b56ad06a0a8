"""What a local Ollama store holds: every model and tag, without importing anything.

The console's Mirror view lists these (through ``GET /admin/v1/mirror/ollama``) so an
operator can pick one to import. Like :mod:`.ollama`, it only reads: manifests are
parsed with the same checks as an import, and what is found is described, not
trusted: a manifest that does not parse is listed with its problem, so the list
explains why a model cannot be imported before anyone tries.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import OllamaManifestError
from .ollama import (
    MAX_MANIFEST_BYTES,
    OllamaName,
    candidate_roots,
    parse_manifest,
)

__all__ = ["MAX_LISTED", "list_ollama"]

MAX_LISTED = 2000
"""At most this many manifests are read (a store is a few dozen; the bound keeps a huge one cheap)."""


def _dirs(path: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _files(path: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_file(follow_symlinks=False))
    except OSError:
        return []


def _describe(root: Path, host: str, namespace: str, model: str, tag: str) -> dict[str, Any]:
    name = OllamaName(host, namespace, model, tag)
    path = root / "manifests" / host / namespace / model / tag
    row: dict[str, Any] = {
        "name": name.display,
        "store": str(root),
        "size": None,
        "format": None,
        "projector": False,
        "digest": None,
        "problem": None,
    }
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise OllamaManifestError(f"the manifest is larger than {MAX_MANIFEST_BYTES} bytes")
        manifest = parse_manifest(data, f"the manifest of {name.display}")
    except (OSError, OllamaManifestError) as exc:
        row["problem"] = str(exc) if isinstance(exc, OllamaManifestError) else f"cannot read the manifest: {exc}"
        return row
    row["size"] = sum(layer.size for layer in manifest.layers)
    row["digest"] = manifest.digest
    kinds = {layer.kind for layer in manifest.layers}
    row["projector"] = "projector" in kinds
    if "tensor" in kinds:
        row["format"] = "safetensors"
        row["problem"] = "stored as safetensors tensor layers, not GGUF: it cannot be mirrored"
    elif "model" in kinds:
        row["format"] = "gguf"
        models = [la for la in manifest.layers if la.kind == "model"]
        row["digest"] = models[0].digest if len(models) == 1 else manifest.digest
    else:
        row["problem"] = "no model layer: there are no local weights to mirror"
    return row


def list_ollama(roots: Sequence[Path] | None = None) -> dict[str, Any]:
    """Every model of every Ollama store found (:func:`~.ollama.candidate_roots` by default).

    Returns:
        ``{"stores": [paths looked in that exist], "searched": [every path],
        "models": [{name, store, size, format, projector, digest, problem}],
        "truncated": bool}``; ``format`` is ``gguf``, ``safetensors`` or ``None``,
        ``problem`` a one-line reason it cannot be imported (``None`` when it can).
    """
    search = list(roots if roots is not None else candidate_roots())
    stores: list[str] = []
    models: list[dict[str, Any]] = []
    seen: set[tuple[str, str, str, str]] = set()
    truncated = False
    for root in search:
        manifests = root / "manifests"
        if not manifests.is_dir():
            continue
        stores.append(str(root))
        for host in _dirs(manifests):
            for namespace in _dirs(manifests / host):
                for model in _dirs(manifests / host / namespace):
                    for tag in _files(manifests / host / namespace / model):
                        key = (host.lower(), namespace.lower(), model.lower(), tag.lower())
                        if key in seen:
                            continue  # the first store wins, as an import would find it
                        if len(models) >= MAX_LISTED:
                            truncated = True
                            break
                        seen.add(key)
                        models.append(_describe(root, host, namespace, model, tag))
    models.sort(key=lambda m: (m["name"].lower(), m["store"]))
    return {"stores": stores, "searched": [str(r) for r in search], "models": models, "truncated": truncated}
