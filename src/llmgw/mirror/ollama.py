"""``llmgw mirror import-ollama``: mirror a model from a local Ollama store.

Ollama keeps ``manifests/<host>/<namespace>/<model>/<tag>`` (JSON) and
``blobs/sha256-<hex>`` (content-addressed) under its models directory. This module
finds that directory the way Ollama does, resolves a name with Ollama's defaults
(host ``registry.ollama.ai``, namespace ``library``, tag ``latest``), validates the
manifest, and copies the GGUF weights (and projectors and adapters), each verified
against the digest its blob is named by. The small text layers (template, system
prompt, parameters, licenses) are verified too and kept with the model's record.

The Ollama store is only ever read. Facts: ``shared/reference/engines.md`` section 5.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import (
    DigestMismatchError,
    GGUFFormatError,
    InvalidNameError,
    NotGGUFError,
    OllamaBlobError,
    OllamaManifestError,
    OllamaMissingBlobError,
    OllamaModelNotFoundError,
    OllamaStoreNotFoundError,
    OllamaUnsupportedError,
)
from .importer import ImportResult, SourceFile, check_gguf, import_sources, open_source
from .names import parse_ref
from .progress import Progress
from .store import MirrorStore

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_NAMESPACE",
    "DEFAULT_TAG",
    "MAX_CHECKED_BLOBS",
    "SERVICE_MODELS_DIR",
    "Layer",
    "Manifest",
    "OllamaName",
    "candidate_roots",
    "check_blobs",
    "find_manifest",
    "import_ollama",
    "parse_config",
    "parse_manifest",
    "parse_ollama_name",
    "parse_params",
]

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
# The Linux installer runs Ollama as user `ollama` with this home.
SERVICE_MODELS_DIR = Path("/usr/share/ollama/.ollama/models")

MEDIA_PREFIX = "application/vnd.ollama.image."
_ROLE_OF = {"model": "model", "projector": "projector", "adapter": "adapter"}
_TEXT_KINDS = ("template", "prompt", "system", "params", "license")
_CONFIG_KEEP = (
    "model_format",
    "model_family",
    "model_families",
    "model_type",
    "file_type",
    "renderer",
    "parser",
    "requires",
)

MAX_MANIFEST_BYTES = 1 << 20
MAX_SMALL_LAYER_BYTES = 4 << 20
MAX_CHECKED_BLOBS = 64
""":func:`check_blobs` looks at no more blobs than this per manifest. A pulled model has a handful;
a 1 MiB manifest could name thousands, and a listing of many models must stay quick."""
# Ollama's BlobsPath accepts this; the file name uses '-', older stores ':'.
_LAYER_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")
_PART_LIMITS = {"host": 350, "namespace": 80, "model": 80, "tag": 80}
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_NAMESPACE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")


@dataclass(frozen=True, slots=True)
class OllamaName:
    """A fully qualified Ollama model name."""

    host: str
    namespace: str
    model: str
    tag: str

    @property
    def display(self) -> str:
        """The name as ``ollama list`` shows it: ``model:tag``, with the namespace and host when not default."""
        base = f"{self.model}:{self.tag}"
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{base}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{base}"
        return base

    @property
    def parts(self) -> tuple[str, str, str, str]:
        """``(host, namespace, model, tag)``: the manifest's path under ``manifests/``."""
        return (self.host, self.namespace, self.model, self.tag)


def parse_ollama_name(ref: str) -> OllamaName:
    """Parse ``[host/][namespace/]model[:tag]`` the way Ollama does.

    Missing parts take Ollama's defaults. Every part is checked against Ollama's
    alphabet, so no part can be empty, ``.``, ``..`` or hold a path separator.

    Raises:
        InvalidNameError: the name is malformed or names a digest.
    """
    s = ref.strip()
    if "@" in s:
        raise InvalidNameError(f"{ref!r} names a digest; name the model by tag instead (e.g. llama3.2:3b)")
    # Like Ollama, a separator that is present must have something on both
    # sides ("m:", "/m" and "ns//m" are invalid); only absent parts take defaults.
    tag = ""
    if s.rfind(":") > s.rfind("/"):
        s, _, tag = s.rpartition(":")
        if not tag:
            raise InvalidNameError(f"{ref!r} has an empty tag; write model:tag or leave the tag out")
    parts = s.split("/")
    if len(parts) > 2:
        parts = ["/".join(parts[:-2]), *parts[-2:]]
    if any(not p for p in parts):
        raise InvalidNameError(f"{ref!r} has an empty part; write [host/][namespace/]model[:tag]")
    model = parts[-1]
    namespace = parts[-2] if len(parts) >= 2 else ""
    host = parts[0].split("://", 1)[-1] if len(parts) == 3 else ""
    name = OllamaName(host or DEFAULT_HOST, namespace or DEFAULT_NAMESPACE, model, tag or DEFAULT_TAG)
    for kind, value in zip(("host", "namespace", "model", "tag"), name.parts, strict=True):
        pattern = _HOST if kind == "host" else _NAMESPACE if kind == "namespace" else _PART
        if not value or len(value) > _PART_LIMITS[kind] or not pattern.fullmatch(value):
            raise InvalidNameError(
                f"{ref!r} is not a valid Ollama model name: bad {kind} {value!r}"
                " (write [host/][namespace/]model[:tag], e.g. llama3.2 or hf.co/user/repo:Q4_K_M)"
            )
    return name


def candidate_roots(environ: Mapping[str, str] | None = None, home: Path | None = None) -> list[Path]:
    """Return where Ollama keeps its models, most likely first.

    ``$OLLAMA_MODELS``, then ``~/.ollama/models``, then the Linux service's
    ``/usr/share/ollama/.ollama/models``.
    """
    env = os.environ if environ is None else environ
    roots: list[Path] = []
    if env.get("OLLAMA_MODELS"):
        roots.append(Path(env["OLLAMA_MODELS"]).expanduser())
    roots.append((home or Path.home()) / ".ollama" / "models")
    roots.append(SERVICE_MODELS_DIR)
    unique: list[Path] = []
    for r in roots:
        if r not in unique:
            unique.append(r)
    return unique


def _lookup(directory: Path, part: str) -> Path | None:
    """Return ``directory/part``, matching case-insensitively as Ollama does, or ``None``."""
    exact = directory / part
    if os.path.lexists(exact):
        return exact
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return None
    lowered = part.lower()
    for n in sorted(names):
        if n.lower() == lowered:
            return directory / n
    return None


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def find_manifest(
    name: OllamaName, *, ollama_dir: Path | None = None, roots: Sequence[Path] | None = None
) -> tuple[Path, Path]:
    """Find the manifest of ``name``.

    Args:
        name: the model.
        ollama_dir: the one Ollama models directory to look in (``--ollama-dir``).
        roots: where to look otherwise (:func:`candidate_roots` by default).

    Returns:
        ``(models directory, manifest path)``.

    Raises:
        OllamaStoreNotFoundError: no Ollama store exists where it was looked for.
        OllamaModelNotFoundError: none of them has the model.
        PermissionError: the only stores found cannot be read.
    """
    if ollama_dir is not None:
        if not ollama_dir.is_dir():
            raise OllamaStoreNotFoundError(
                f"--ollama-dir {ollama_dir} is not a directory; give Ollama's models directory"
            )
        if not (ollama_dir / "manifests").is_dir() and (ollama_dir / "models" / "manifests").is_dir():
            ollama_dir = ollama_dir / "models"
        if not (ollama_dir / "manifests").is_dir():
            raise OllamaStoreNotFoundError(
                f"{ollama_dir} is not an Ollama models directory (it has no manifests/);"
                " give the directory Ollama's OLLAMA_MODELS points to, e.g. ~/.ollama/models"
            )
        search = [ollama_dir]
    else:
        search = list(roots if roots is not None else candidate_roots())
    existing: list[Path] = []
    denied: list[Path] = []
    for root in search:
        manifests = root / "manifests"
        try:
            if not manifests.is_dir():
                continue
            os.listdir(manifests)
        except PermissionError:
            denied.append(root)
            continue
        existing.append(root)
        current: Path | None = manifests
        for part in name.parts:
            assert current is not None
            current = _lookup(current, part)
            if current is None:
                break
        if current is None:
            continue
        # SECURITY: names are validated, but a link inside the store could still
        # point the manifest elsewhere.
        real_root = os.path.realpath(root)
        if not _within(os.path.realpath(current), real_root):
            raise OllamaManifestError(
                f"the manifest of {name.display} ({current}) is a link out of the Ollama store {root}"
            )
        if not current.is_file():
            raise OllamaManifestError(f"the manifest of {name.display} ({current}) is not a file")
        return root, current
    where = ", ".join(str(r) for r in search)
    if denied and not existing:
        raise PermissionError(
            f"cannot read the Ollama store at {', '.join(map(str, denied))} (permission denied);"
            " run as a user who can read it (e.g. one in the ollama group) or copy the model elsewhere"
        )
    if not existing:
        raise OllamaStoreNotFoundError(
            f"no Ollama model store found (looked in {where}); pull the model with Ollama first,"
            " or point to the store with --ollama-dir or OLLAMA_MODELS"
        )
    hint = f" (also could not read {', '.join(map(str, denied))})" if denied else ""
    raise OllamaModelNotFoundError(
        f"Ollama has no model {name.display} in {', '.join(map(str, existing))}{hint};"
        f" check the name with `ollama list`, or pull it: ollama pull {name.display}"
    )


@dataclass(frozen=True, slots=True)
class Layer:
    """One layer of a manifest: media type, digest (``sha256:<hex>``, lowercase) and size."""

    media_type: str
    digest: str
    size: int

    @property
    def kind(self) -> str:
        """The media type's last part: ``model``, ``projector``, ``template``, ``tensor``, ..."""
        if self.media_type.startswith(MEDIA_PREFIX):
            return self.media_type[len(MEDIA_PREFIX) :]
        return self.media_type

    @property
    def blob_name(self) -> str:
        """The blob's file name in Ollama's store, ``sha256-<hex>``."""
        return "sha256-" + self.digest[7:]


@dataclass(frozen=True, slots=True)
class Manifest:
    """A validated Ollama manifest."""

    config: Layer
    layers: tuple[Layer, ...]
    digest: str

    def of_kind(self, kind: str) -> list[Layer]:
        """Return the layers whose media type ends in ``kind``."""
        return [layer for layer in self.layers if layer.kind == kind]


def _layer(obj: Any, where: str, what: str) -> Layer:
    if not isinstance(obj, dict):
        raise OllamaManifestError(f"{where}: {what} is not an object")
    media = obj.get("mediaType")
    digest = obj.get("digest")
    size = obj.get("size")
    if not isinstance(media, str) or not media:
        raise OllamaManifestError(f"{where}: {what} has no mediaType")
    if not isinstance(digest, str) or not (m := _LAYER_DIGEST.fullmatch(digest)):
        raise OllamaManifestError(f"{where}: {what} has a malformed digest {digest!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise OllamaManifestError(f"{where}: {what} has a malformed size {size!r}")
    return Layer(media, "sha256:" + m.group(1).lower(), size)


def _json(data: bytes | str) -> Any:
    """``json.loads``, with every way it refuses untrusted text a ``ValueError``.

    Besides ``JSONDecodeError`` and ``UnicodeDecodeError`` (both ``ValueError``\\ s),
    ``json.loads`` raises ``RecursionError`` for arrays or objects nested about a
    thousand deep, and a plain ``ValueError`` for an integer of more than 4300 digits
    (both found by bench/fuzz/fuzz_ollama.py); neither may escape as a crash.
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def parse_config(data: bytes, display: str) -> dict[str, Any]:
    """The config blob's bytes as a dict (``{}`` when it is JSON but not an object).

    Raises:
        OllamaManifestError: it is not JSON.
        OllamaUnsupportedError: it describes a cloud model, or weights that are not GGUF.
    """
    try:
        parsed = _json(data)
    except ValueError as exc:
        raise OllamaManifestError(
            f"the config blob of {display} is not valid JSON; pull the model again (ollama pull {display})"
        ) from exc
    config: dict[str, Any] = parsed if isinstance(parsed, dict) else {}
    if config.get("remote_host") or config.get("remote_model"):
        raise OllamaUnsupportedError(
            f"{display} is a cloud model (served by {config.get('remote_host') or 'a remote host'}); it has"
            " no local weights to mirror"
        )
    model_format = config.get("model_format")
    if model_format not in (None, "", "gguf"):
        raise OllamaUnsupportedError(
            f"{display} is in {model_format!r} format, not GGUF; llmgw mirrors GGUF models"
        )
    return config


def parse_params(text: str) -> Any:
    """A ``params`` layer: its JSON value, or the text itself when it is not JSON."""
    try:
        return _json(text)
    except ValueError:
        return text


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Validate a manifest's bytes.

    Raises:
        OllamaManifestError: it is not JSON, not schema version 2, or a layer is malformed.
    """
    fix = "; pull the model again with Ollama"
    try:
        doc = _json(data)
    except ValueError as exc:
        raise OllamaManifestError(f"{where} is not valid JSON ({exc}){fix}") from exc
    if not isinstance(doc, dict):
        raise OllamaManifestError(f"{where} is not a JSON object{fix}")
    version = doc.get("schemaVersion", 2)
    if version != 2:
        raise OllamaManifestError(f"{where} has schemaVersion {version!r}; llmgw reads version 2{fix}")
    layers = doc.get("layers")
    if not isinstance(layers, list):
        raise OllamaManifestError(f"{where} has no layers list{fix}")
    if "config" not in doc:
        raise OllamaManifestError(f"{where} has no config{fix}")
    try:
        config = _layer(doc["config"], where, "config")
        parsed = tuple(_layer(layer, where, f"layer {i}") for i, layer in enumerate(layers))
    except OllamaManifestError as exc:
        raise OllamaManifestError(f"{exc}{fix}") from exc
    return Manifest(config=config, layers=parsed, digest="sha256:" + hashlib.sha256(data).hexdigest())


class _OllamaStore:
    """Read-only access to one Ollama models directory."""

    def __init__(self, root: Path, display: str) -> None:
        self.root = root
        self.real_root = os.path.realpath(root)
        self.display = display

    def blob_path(self, layer: Layer) -> Path:
        """Return the blob's real path, checked to be a regular file inside the store.

        Raises:
            OllamaBlobError: missing, a link out of the store, or not a regular file.
        """
        blobs = self.root / "blobs"
        path = blobs / layer.blob_name
        if not os.path.lexists(path):
            legacy = blobs / ("sha256:" + layer.digest[7:])
            if not os.path.lexists(legacy):
                raise OllamaMissingBlobError(
                    f"the {layer.kind} blob {layer.blob_name} of {self.display} is missing from {blobs};"
                    f" pull the model again (ollama pull {self.display})"
                )
            path = legacy
        real = os.path.realpath(path)
        if not _within(real, self.real_root):
            raise OllamaBlobError(
                f"the {layer.kind} blob {path} of {self.display} is a symbolic link to {real}, outside the"
                f" Ollama store {self.root}; llmgw does not follow links out of the store."
                " Replace the link with the file or pull the model again"
            )
        return Path(real)

    def _check_size(self, layer: Layer, st: os.stat_result) -> None:
        if st.st_size != layer.size:
            raise OllamaBlobError(
                f"the {layer.kind} blob {layer.blob_name} of {self.display} has {st.st_size} bytes but the"
                f" manifest says {layer.size}: it is incomplete or corrupt; pull the model again"
                f" (ollama pull {self.display})"
            )

    def stat_blob(self, layer: Layer, *, small: bool = False) -> None:
        """Check a blob as :meth:`open_blob` (``small``: :meth:`read_small`) does, from its metadata
        alone (``lstat``/``stat``, never a read).

        Raises:
            OllamaMissingBlobError: it is not in ``blobs/`` (or is a link to nothing).
            OllamaBlobError: a link out of the store, not a regular file, empty, or the wrong size.
            OllamaManifestError: ``small`` and the layer claims more than a small layer may have.
            OSError: it cannot be looked at (permissions).
        """
        if small:
            self._check_small_claim(layer)
        path = self.blob_path(layer)
        label = f"{layer.kind} blob {layer.blob_name} of {self.display}"
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise OllamaMissingBlobError(
                f"the {label} is a link to {path}, which does not exist; pull the model again"
                f" (ollama pull {self.display})"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise OllamaBlobError(f"the {label} ({path}) is not a regular file; pull the model again")
        if st.st_size == 0:
            raise OllamaBlobError(f"the {label} is empty; pull the model again (ollama pull {self.display})")
        self._check_size(layer, st)

    def open_blob(self, layer: Layer) -> tuple[Path, int, os.stat_result]:
        """Open a blob for reading and check its size against the manifest."""
        path = self.blob_path(layer)
        label = f"{layer.kind} blob {layer.blob_name} of {self.display}"
        fd, st = open_source(
            path, label, nofollow=True, missing_fix=f"pull the model again (ollama pull {self.display})"
        )
        try:
            self._check_size(layer, st)
        except BaseException:
            os.close(fd)
            raise
        return path, fd, st

    def _check_small_claim(self, layer: Layer) -> None:
        if layer.size > MAX_SMALL_LAYER_BYTES:
            raise OllamaManifestError(
                f"the {layer.kind} layer of {self.display} claims {layer.size} bytes, more than"
                f" {MAX_SMALL_LAYER_BYTES} for its kind; the manifest is malformed"
            )

    def read_small(self, layer: Layer) -> bytes:
        """Read a small layer (config, template, ...) whole and verify its digest."""
        self._check_small_claim(layer)
        _, fd, _ = self.open_blob(layer)
        try:
            data = os.pread(fd, layer.size + 1, 0)
        finally:
            os.close(fd)
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if len(data) != layer.size or actual != layer.digest:
            raise OllamaBlobError(
                f"the {layer.kind} blob {layer.blob_name} of {self.display} is corrupt (its bytes hash to"
                f" {actual}); pull the model again (ollama pull {self.display})"
            )
        return data


def check_blobs(
    root: Path, manifest: Manifest, display: str, *, known_good: set[tuple[str, int, bool]] | None = None
) -> None:
    """Check, from file metadata only, that the blobs an import of ``manifest`` reads are in place.

    The config, the weights (model, projectors, adapters) and the text layers must each be a
    regular file inside the store ``root`` with the manifest's size, and a small layer must be
    within its bound: all an import checks before it reads a byte. Nothing is read or hashed
    (blobs are gigabytes), so a blob of the right size but damaged bytes passes here and is
    caught by the import's digest check. At most :data:`MAX_CHECKED_BLOBS` distinct blobs are
    looked at; an import checks every one anyway.

    Args:
        root: the Ollama models directory the manifest is in.
        manifest: the parsed manifest.
        display: the model's name, for messages.
        known_good: ``(digest, size, small)`` of the layers found sound in ``root`` already
            (tags share blobs); filled in as layers pass.

    Raises:
        OllamaMissingBlobError: a blob is not in ``blobs/``.
        OllamaBlobError: a blob is the wrong size, empty, not a regular file, or a link out of the store.
        OllamaManifestError: a small layer claims more bytes than its kind may have.
        OSError: a blob cannot be looked at (permissions).
    """
    good = known_good if known_good is not None else set()
    ostore = _OllamaStore(root, display)
    checked = 0
    for i, layer in enumerate((manifest.config, *manifest.layers)):
        small = i == 0 or layer.kind in _TEXT_KINDS
        if not small and layer.kind not in _ROLE_OF:
            continue  # an import does not read it
        key = (layer.digest, layer.size, small)
        if key in good:
            continue
        if checked >= MAX_CHECKED_BLOBS:
            break
        checked += 1
        ostore.stat_blob(layer, small=small)
        good.add(key)


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def import_ollama(
    store: MirrorStore,
    ref: str,
    *,
    ollama_dir: str | os.PathLike[str] | None = None,
    name: str | None = None,
    roots: Sequence[Path] | None = None,
    progress: Progress | None = None,
) -> ImportResult:
    """Mirror an Ollama model: its GGUF weights, projectors and adapters, and what Ollama knows about it.

    Args:
        store: the mirror.
        ref: the Ollama name, ``[host/][namespace/]model[:tag]``.
        ollama_dir: Ollama's models directory (default: :func:`candidate_roots`).
        name: ``NAME[:TAG]`` in the mirror; by default the name ``ollama list`` shows.
        roots: where to look when ``ollama_dir`` is not given (tests).
        progress: where to report copy progress.

    Returns:
        What was imported.

    Raises:
        InvalidNameError: ``ref`` or ``name`` is malformed (or tries to leave the store).
        OllamaStoreNotFoundError, OllamaModelNotFoundError: nothing to import.
        OllamaManifestError: the manifest (or a small layer) is malformed.
        OllamaUnsupportedError: the model has no GGUF weights (tensor layers, a cloud model).
        OllamaMissingBlobError: a blob the manifest names is not in the store.
        OllamaBlobError: a blob is the wrong size, corrupt, or a link out of the store.
        DigestMismatchError: a weights blob does not hash to its digest.
        GGUFFormatError: a weights blob is not a sound GGUF.
        ModelExistsError: the mirror name is taken by a model with different files.
        NoSpaceError: the mirror's disk is full.
    """
    oname = parse_ollama_name(ref)
    if name is not None:
        mname, mtag = parse_ref(name)
    root, manifest_path = find_manifest(  # (absolute: the record's paths mean something from anywhere)
        oname, ollama_dir=Path(ollama_dir).expanduser().absolute() if ollama_dir is not None else None, roots=roots
    )
    # the name as the store has it (found case-insensitively): what `ollama list` shows
    with contextlib.suppress(ValueError):
        stored = manifest_path.relative_to(root / "manifests").parts
        if len(stored) == 4:
            oname = OllamaName(*stored)
    if name is None:
        try:
            mname, mtag = parse_ref(oname.display)
        except InvalidNameError:
            # A host with a port (host:8080) is a fine Ollama name but not a mirror name.
            mname, mtag = parse_ref(oname.display.replace(":", "_", oname.display.count(":") - 1))
    display = oname.display
    where = f"the manifest of {display} ({manifest_path})"
    try:
        with open(manifest_path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise OllamaManifestError(f"cannot read {where}: {exc.strerror}") from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise OllamaManifestError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes; it is not a manifest")
    manifest = parse_manifest(data, where)
    ostore = _OllamaStore(root, display)

    if manifest.of_kind("tensor"):
        raise OllamaUnsupportedError(
            f"{display} is stored as safetensors tensor layers (Ollama's newer engine), not GGUF, so"
            " llama.cpp cannot load it; pull a GGUF build of the model, or import a GGUF file with"
            " llmgw mirror import"
        )
    config = parse_config(ostore.read_small(manifest.config), display)
    # A blob listed twice in one role is one file, kept once (`import` refuses a file given
    # twice; here the manifest is not the user's to fix). One blob in two roles is malformed.
    unique: dict[str, Layer] = {}
    for layer in manifest.layers:
        if layer.kind not in _ROLE_OF:
            continue
        seen = unique.setdefault(layer.digest, layer)
        if seen.kind != layer.kind:
            raise OllamaManifestError(
                f"{where} lists the blob {layer.digest} as both a {seen.kind} and a {layer.kind} layer;"
                " pull the model again"
            )
    weights = list(unique.values())
    models = [layer for layer in weights if layer.kind == "model"]
    if not models:
        raise OllamaUnsupportedError(f"{display} has no model layer: there are no local weights to mirror")
    if len(models) > 1:
        raise OllamaManifestError(
            f"{where} has {len(models)} model layers; llmgw expects one. Pull the model again"
        )
    # Every blob is looked at before any is read, as the store's listing does, so both name the same one.
    check_blobs(root, manifest, display)

    info: dict[str, Any] = {
        "name": display,
        "store": str(root),
        "manifest": str(manifest_path),
        "manifest_digest": manifest.digest,
        "config": {k: config[k] for k in _CONFIG_KEEP if k in config},
        "vision": any(layer.kind == "projector" for layer in weights),
        "licenses": [],
    }
    for layer in manifest.layers:
        kind = layer.kind
        if kind not in _TEXT_KINDS:
            continue
        text = _text(ostore.read_small(layer))
        if kind == "license":
            info["licenses"].append(text)
        elif kind in ("template", "prompt"):
            info.setdefault("template", text)
        elif kind == "system":
            info["system"] = text
        elif kind == "params":
            info["params"] = parse_params(text)

    sources: list[SourceFile] = []
    try:
        # Weights last in role order so the model comes first, as Ollama lists it.
        for layer in sorted(weights, key=lambda la: ("model", "projector", "adapter").index(la.kind)):
            path, fd, st = ostore.open_blob(layer)
            label = f"{layer.kind} blob {layer.blob_name} of {display}"
            src = SourceFile(
                role=_ROLE_OF[layer.kind],
                label=label,
                path=path,
                fd=fd,
                stat=st,
                expected_digest=layer.digest,
                filename=layer.blob_name,
            )
            sources.append(src)
            try:
                src.gguf = check_gguf(fd, label, None)
            except NotGGUFError as exc:
                raise OllamaUnsupportedError(
                    f"the {layer.kind} layer of {display} is not GGUF ({exc}); llmgw mirrors GGUF models only"
                ) from exc
            except GGUFFormatError as exc:  # (truncated, corrupt: what Ollama holds is broken)
                raise GGUFFormatError(f"{exc}; pull the model again (ollama pull {display})") from exc
            # The roles `import` checks (check_gguf's), in words for a manifest rather than a command line.
            if layer.kind == "model" and src.gguf.is_projector:
                raise OllamaManifestError(
                    f"the model layer of {display} is a vision projector ({src.gguf.architecture}), not a"
                    " model; llama.cpp cannot run it. Pull the model again, or import its GGUF files with"
                    " llmgw mirror import MODEL.gguf --projector MMPROJ.gguf"
                )
            if layer.kind == "projector" and not src.gguf.is_projector:
                raise OllamaManifestError(
                    f"the projector layer of {display} is not a projector"
                    f" (general.architecture={src.gguf.architecture}); pull the model again, or import its"
                    " GGUF files with llmgw mirror import MODEL.gguf --projector MMPROJ.gguf"
                )
            src.label = f"{layer.kind} {display}"
        try:
            return import_sources(
                store,
                mname,
                mtag,
                sources,
                source_kind="ollama",
                source=f"ollama:{display}",
                info={"ollama": info},
                progress=progress,
            )
        except DigestMismatchError as exc:  # (the store's words are for any file: these are Ollama's blobs)
            why = str(exc).split("; nothing was recorded", 1)[0]
            raise DigestMismatchError(
                f"{why}; nothing was recorded. Pull the model again (ollama pull {display}) and retry"
            ) from exc
    finally:
        for src in sources:
            os.close(src.fd)
