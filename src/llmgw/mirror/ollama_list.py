"""What a local Ollama store holds: every model and tag, without importing anything.

The console's Mirror view lists these (through ``GET /admin/v1/mirror/ollama``) so an
operator can pick one to import. Like :mod:`.ollama`, it only reads: manifests are
parsed with the same checks as an import, and what is found is described, not
trusted: a manifest that does not parse, a blob that is missing or the wrong size, a
manifest that links out of the store, each is listed with its problem, so the list
explains why a model cannot be imported before anyone tries.

The blobs are only looked at with ``stat`` (:func:`~.ollama.check_blobs`), never read: hashing
gigabytes per model would make the list as slow as importing every model. A blob of the
right size with damaged bytes is therefore listed as importable and refused by the
import's digest check.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .errors import OllamaBlobError, OllamaManifestError
from .ollama import (
    MAX_MANIFEST_BYTES,
    OllamaName,
    _within,
    candidate_roots,
    check_blobs,
    parse_manifest,
)

__all__ = ["MAX_LISTED", "list_ollama"]

MAX_LISTED = 2000
"""At most this many manifests are read (a store is a few dozen; the bound keeps a huge one cheap).
Each costs at most :data:`~.ollama.MAX_CHECKED_BLOBS` ``stat`` calls, fewer where tags share blobs."""


def _dirs(path: Path) -> list[str]:
    try:
        return sorted(e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


def _tags(path: Path) -> list[str]:
    """The manifests in a model's directory: files, and links (:func:`_describe` checks where they lead)."""
    try:
        return sorted(
            e.name for e in os.scandir(path) if e.is_file(follow_symlinks=False) or e.is_symlink()
        )
    except OSError:
        return []


class _Store:
    """One Ollama models directory being listed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.good_blobs: set[tuple[str, int, bool]] = set()
        """Blobs already found in place (the tags of a model share them): each is looked at once."""


def _describe(store: _Store, host: str, namespace: str, model: str, tag: str) -> dict[str, Any]:
    root = store.root
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
    # SECURITY: as find_manifest, never read through a link that leaves the store (the manifest,
    # or manifests/ itself, may be one); the row says so rather than hide a model `ollama list` shows.
    real = os.path.realpath(path)
    if not _within(real, store.real_root):
        row["problem"] = (
            f"the manifest is a symbolic link to {real}, outside the Ollama store; llmgw does not"
            " follow links out of the store. Replace the link with the file"
        )
        return row
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
        if len(models) > 1:
            row["problem"] = f"the manifest has {len(models)} model layers; llmgw expects one. Pull the model again"
            return row
        try:
            check_blobs(root, manifest, name.display, known_good=store.good_blobs)
        except (OllamaBlobError, OllamaManifestError) as exc:
            row["problem"] = str(exc)
        except OSError as exc:
            row["problem"] = f"cannot look at its blobs: {exc}"
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
        store = _Store(root)
        for host in _dirs(manifests):
            for namespace in _dirs(manifests / host):
                for model in _dirs(manifests / host / namespace):
                    for tag in _tags(manifests / host / namespace / model):
                        key = (host.lower(), namespace.lower(), model.lower(), tag.lower())
                        if key in seen:
                            continue  # the first store wins, as an import would find it
                        if len(models) >= MAX_LISTED:
                            truncated = True
                            break
                        seen.add(key)
                        models.append(_describe(store, host, namespace, model, tag))
    models.sort(key=lambda m: (m["name"].lower(), m["store"]))
    return {"stores": stores, "searched": [str(r) for r in search], "models": models, "truncated": truncated}
