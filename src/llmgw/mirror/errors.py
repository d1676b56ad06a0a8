"""The model mirror's errors.

Every message is meant to be shown to a user as is, on one line: it says what is
wrong and what to do about it. OS failures (permissions, I/O errors) stay builtin
:class:`OSError`\\ s, except "disk full", which the mirror turns into
:class:`NoSpaceError` because it knows the fix.
"""

from __future__ import annotations

from llmgw.errors import LlmgwError

__all__ = [
    "CatalogueError",
    "CorruptBlobError",
    "DigestMismatchError",
    "FetchError",
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


class CatalogueError(MirrorError):
    """The catalogue database is unreadable or from a newer llmgw."""


class MirrorBusyError(MirrorError):
    """Another llmgw process holds the mirror (an import is running during ``gc``)."""


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
