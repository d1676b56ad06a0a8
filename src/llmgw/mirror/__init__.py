"""The model mirror: a verified, content-addressed store of model files.

* :mod:`.store`: blobs by SHA-256 and the SQLite catalogue; how an import stays
  safe against interruption and concurrency.
* :mod:`.importer`: importing GGUF files (``llmgw mirror import``).
* :mod:`.ollama`: importing from a local Ollama store (``llmgw mirror import-ollama``).
* :mod:`.gguf`: a bounded GGUF header reader.
* :mod:`.serve`: the control plane serving blobs to node agents (admin listener, per-node credentials).
* :mod:`.fetch`: the agent's client for that (resumable, verified, atomic into the node's store).
* :mod:`.resolve`: a mirror reference to its blobs and the facts placement needs (sizes, KV cache).

Usage guide and guarantees: ``docs/mirror.md``.
"""

from __future__ import annotations

from .catalogue import FileEntry, ModelRecord, StoredFile
from .errors import MirrorError
from .importer import ImportResult, import_file
from .ollama import import_ollama
from .store import BlobCheck, BlobResult, GcReport, MirrorStore, default_root

__all__ = [
    "BlobCheck",
    "BlobResult",
    "FileEntry",
    "GcReport",
    "ImportResult",
    "MirrorError",
    "MirrorStore",
    "ModelRecord",
    "StoredFile",
    "default_root",
    "import_file",
    "import_ollama",
]
