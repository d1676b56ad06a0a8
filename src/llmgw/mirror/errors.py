"""The model mirror's errors.

Every message is meant to be shown to a user as is, on one line: it says what is
wrong and what to do about it. OS failures (permissions, I/O errors) stay builtin
:class:`OSError`\\ s, except "disk full" and "file too large", which the mirror turns into
:class:`NoSpaceError` and :class:`FileTooLargeError` because it knows the fix. SQLite's
errors never escape: the catalogue turns them into :class:`CatalogueAccessError` (cannot
write), :class:`NoSpaceError` (disk full), :class:`MirrorBusyError` (locked too long) or
:class:`CatalogueError`.
"""

from __future__ import annotations

from llmgw.errors import LlmgwError

__all__ = [
    "CORRUPT_TRANSFER",
    "CatalogueAccessError",
    "CatalogueError",
    "CorruptBlobError",
    "DigestMismatchError",
    "FetchError",
    "FileTooLargeError",
    "GGUFFormatError",
    "InvalidNameError",
    "MirrorBusyError",
    "MirrorError",
    "ModelExistsError",
    "ModelNotFoundError",
    "NoSpaceError",
    "NotGGUFError",
    "OllamaBlobError",
    "OllamaError",
    "OllamaManifestError",
    "OllamaMissingBlobError",
    "OllamaModelNotFoundError",
    "OllamaStoreNotFoundError",
    "OllamaUnsupportedError",
    "SourceChangedError",
    "SourceError",
    "StoreLayoutError",
]


class MirrorError(LlmgwError):
    """Root of the mirror's errors."""


class InvalidNameError(MirrorError, ValueError):
    """A model name or tag is malformed, or tries to leave its directory."""


class SourceError(MirrorError, ValueError):
    """A file given to import cannot be used (not a regular file, a link out of its store, ...)."""


class NotGGUFError(SourceError):
    """The file does not start with the GGUF magic."""


class GGUFFormatError(SourceError):
    """The file claims to be GGUF but its header is corrupt, truncated or unsupported."""


class SourceChangedError(SourceError):
    """The source file changed while it was being copied."""


class DigestMismatchError(SourceError):
    """A file's SHA-256 is not the one it was named or announced by."""


class NoSpaceError(MirrorError, OSError):
    """The mirror's file system is full (or too small for the file)."""


class FileTooLargeError(MirrorError, OSError):
    """A file is larger than this process may write (``ulimit -f``) or than the file system takes."""


class CatalogueError(MirrorError):
    """The catalogue database is unreadable, damaged, from a newer llmgw, or failed (an I/O error)."""


class CatalogueAccessError(CatalogueError, PermissionError):
    """This user cannot write (or read) the catalogue: its file or its directory, or a read-only file system.

    Commands that only read still work on a read-only mirror; this is raised when one would write.
    """


class StoreLayoutError(MirrorError):
    """Something llmgw did not make is in the way inside the mirror (a directory at a blob's path)."""


class MirrorBusyError(MirrorError):
    """Another llmgw process holds the mirror (an import is running during ``gc``), or the catalogue stayed locked."""


class ModelNotFoundError(MirrorError, LookupError):
    """The mirror has no model by that name."""


class ModelExistsError(MirrorError):
    """The name is already used by a model with different files; nothing is overwritten."""


class CorruptBlobError(MirrorError):
    """A stored blob no longer matches its digest (found by ``verify``)."""


class FetchError(MirrorError):
    """A blob could not be fetched from the control plane's mirror (refused, unreachable, corrupt every time)."""


class OllamaError(MirrorError):
    """Root of the errors about an Ollama store."""


class OllamaStoreNotFoundError(OllamaError, FileNotFoundError):
    """No Ollama model store was found where Ollama keeps one."""


class OllamaModelNotFoundError(OllamaError, LookupError):
    """The Ollama store has no manifest for that model and tag."""


class OllamaBlobError(OllamaError, SourceError):
    """A blob an Ollama manifest names is missing, the wrong size, corrupt or a link out of the store."""


class OllamaMissingBlobError(OllamaBlobError):
    """A blob an Ollama manifest names is not in the store's ``blobs/`` at all."""


class OllamaManifestError(OllamaError, ValueError):
    """An Ollama manifest or a small layer it names is malformed."""


class OllamaUnsupportedError(OllamaError):
    """The Ollama model has no GGUF weights to mirror (tensor layers, a cloud model, ...)."""


CORRUPT_TRANSFER = "the transfer was corrupt"
"""What a node's failed replica says when the bytes the control plane's mirror sent did not hash to the blob
asked for (:mod:`llmgw.mirror.fetch`): the control plane then checks its own copy."""
