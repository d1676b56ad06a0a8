"""``llmgw mirror import``: copy model files into the mirror and record them.

Shared with the Ollama importer: opening a source safely, checking it is a GGUF
fit for its role, and recording a model only after all of its blobs are in place.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .catalogue import FileEntry, ModelRecord
from .errors import GGUFFormatError, ModelExistsError, NotGGUFError, SourceChangedError, SourceError
from .gguf import GGUFInfo, read_gguf_fd
from .names import DEFAULT_TAG, format_ref, name_from_filename, parse_ref
from .progress import Progress
from .store import BlobResult, MirrorStore

__all__ = ["ImportResult", "SourceFile", "check_gguf", "import_file", "import_sources", "open_source"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK so that opening a FIFO by mistake does not hang; it changes nothing for regular files.
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


@dataclass(frozen=True, slots=True)
class ImportResult:
    """The outcome of an import.

    Attributes:
        record: the model as the catalogue now has it.
        created: a new catalogue entry was made (``False``: the same model was already there).
        blobs: each file's blob, in the order of ``record.files``' sources.
    """

    record: ModelRecord
    created: bool
    blobs: tuple[BlobResult, ...]

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-friendly dict."""
        out = self.record.to_json()
        out["created"] = self.created
        out["copied"] = [not b.reused for b in self.blobs]
        return out


@dataclass(slots=True)
class SourceFile:
    """A file about to be imported, open for reading.

    Attributes:
        role: ``model``, ``projector`` or ``adapter``.
        label: how messages and progress name it.
        path: where it is.
        fd: open for reading.
        stat: its ``fstat`` when opened (the copy must find it unchanged).
        gguf: its checked header, ``None`` for a raw file.
        expected_digest: the digest it must have, if known.
        filename: the name to record.
    """

    role: str
    label: str
    path: Path
    fd: int
    stat: os.stat_result
    gguf: GGUFInfo | None = None
    expected_digest: str | None = None
    filename: str | None = None


def open_source(
    path: Path, label: str, *, nofollow: bool = False, missing_fix: str = "check the path"
) -> tuple[int, os.stat_result]:
    """Open a file to import; refuse anything but a non-empty regular file.

    Args:
        path: the file.
        label: how messages name it.
        nofollow: refuse a symbolic link as the last component.
        missing_fix: what to do about a file that does not exist, for its message.

    Returns:
        ``(fd, fstat)``.

    Raises:
        SourceError: it is missing, not a regular file, or empty.
        OSError: it cannot be opened (permissions, I/O).
    """
    flags = os.O_RDONLY | _O_CLOEXEC | _O_NONBLOCK | (getattr(os, "O_NOFOLLOW", 0) if nofollow else 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as exc:
        where = "" if str(path) in label else f" ({path})"
        raise SourceError(f"{label} does not exist{where}; {missing_fix}") from exc
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise SourceError(f"{label} is a directory; give the model file itself")
        if not stat.S_ISREG(st.st_mode):
            raise SourceError(f"{label} is not a regular file (a device, pipe or socket); give a model file")
        if st.st_size == 0:
            raise SourceError(f"{label} is empty; nothing to import")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def check_gguf(fd: int, label: str, role: str | None) -> GGUFInfo:
    """Read a source's GGUF header and check it fits ``role``.

    Args:
        fd: the open source.
        label: how messages name it.
        role: ``model`` (must not be a projector), ``projector`` (must be one), or
            ``None`` to check only the format.

    Returns:
        The header.

    Raises:
        NotGGUFError: not a GGUF file.
        GGUFFormatError: corrupt, truncated, unsupported, or one shard of a split model.
        SourceError: a projector given as the model, or a model given as the projector.
    """
    info = read_gguf_fd(fd, what=label)
    if info.split_count > 1:
        raise GGUFFormatError(
            f"{label} is one shard of a model split in {info.split_count} files; merge them first"
            " (llama-gguf-split --merge FIRST-SHARD.gguf MERGED.gguf) and import the merged file"
        )
    if role == "model" and info.is_projector:
        raise SourceError(
            f"{label} is a vision projector ({info.architecture}), not a model; import the model file"
            " and pass this one with --projector"
        )
    if role == "projector" and not info.is_projector:
        raise SourceError(
            f"{label} is not a projector (general.architecture={info.architecture}); --projector takes"
            " the mmproj GGUF that goes with the model"
        )
    return info


def _check_unchanged(src: SourceFile) -> None:
    st = os.fstat(src.fd)
    if st.st_size != src.stat.st_size or st.st_mtime_ns != src.stat.st_mtime_ns:
        raise SourceChangedError(
            f"{src.label} changed while it was imported; nothing was recorded."
            " Run the import again once nothing is writing to it"
        )


def import_sources(
    store: MirrorStore,
    name: str,
    tag: str,
    sources: Sequence[SourceFile],
    *,
    source_kind: str,
    source: str,
    info: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> ImportResult:
    """Copy opened, checked sources into the store, then record the model.

    The model is recorded in one transaction after every blob is in place; if
    anything fails before, the catalogue is untouched (blobs already placed are
    complete and verified, and ``gc`` reclaims them if no model ends up using them).

    Raises:
        ModelExistsError: ``name:tag`` exists with different files.
        CatalogueAccessError: the catalogue is read-only here (found before anything is copied).
        MirrorError: a copy failed (see :meth:`MirrorStore.add_blob`).
    """
    # Before gigabytes are copied for nothing: a catalogue this user cannot write.
    store.catalogue.check_writable("nothing was imported")
    existing = store.catalogue.get(name, tag)
    if existing is not None and [(f.role, f.size) for f in existing.files] != [
        (s.role, s.stat.st_size) for s in sources
    ]:
        # Fail before copying gigabytes; a same-size clash is caught by digest when recording.
        raise ModelExistsError(
            f"{existing.ref} is already in the mirror with different files; nothing was changed."
            f" Pick another name with --name, or remove it first (llmgw mirror rm {existing.ref})"
        )
    blobs: list[BlobResult] = []
    entries: list[FileEntry] = []
    with store.importing():
        for src in sources:
            result = store.add_blob_fd(
                src.fd, expected_digest=src.expected_digest, progress=progress, label=src.label
            )
            _check_unchanged(src)
            blobs.append(result)
            entries.append(
                FileEntry(
                    role=src.role,
                    digest=result.digest,
                    size=result.size,
                    filename=src.filename or src.path.name,
                    source=str(src.path),
                    gguf=src.gguf.summary() if src.gguf is not None else None,
                )
            )
        record, created = store.record_model(
            name, tag, entries, source_kind=source_kind, source=source, info=info
        )
    return ImportResult(record, created, tuple(blobs))


def import_file(
    store: MirrorStore,
    path: str | os.PathLike[str],
    *,
    name: str | None = None,
    projectors: Sequence[str | os.PathLike[str]] = (),
    raw: bool = False,
    progress: Progress | None = None,
) -> ImportResult:
    """Import a model file (and its projectors) into the mirror.

    Args:
        store: the mirror.
        path: the model file; symbolic links are followed.
        name: ``NAME[:TAG]``; by default the file's name without ``.gguf``, tag ``latest``.
        projectors: vision/audio projector files to keep with the model.
        raw: store the files without checking they are GGUF.
        progress: where to report copy progress.

    Returns:
        What was imported.

    Raises:
        InvalidNameError: ``name`` is malformed.
        SourceError: a file is missing, not a regular file, empty, not GGUF
            (:class:`NotGGUFError`, unless ``raw``), corrupt
            (:class:`GGUFFormatError`), in the wrong role, or changed during the copy.
        ModelExistsError: the name is taken by a model with different files.
        NoSpaceError: the mirror's disk is full.
        OSError: reading or writing failed otherwise.
    """
    model_path = Path(os.path.abspath(path))
    if name is not None:
        mname, tag = parse_ref(name)
    else:
        mname, tag = parse_ref(format_ref(name_from_filename(model_path), DEFAULT_TAG))
    wanted = [("model", model_path)] + [("projector", Path(os.path.abspath(p))) for p in projectors]
    sources: list[SourceFile] = []
    try:
        for role, p in wanted:
            label = f"{role} file {p}" if role != "model" else str(p)
            fd, st = open_source(p, label, missing_fix="check the path, and give the model file itself")
            src = SourceFile(role=role, label=label, path=p, fd=fd, stat=st)
            sources.append(src)
            if not raw:
                try:
                    src.gguf = check_gguf(fd, label, role)
                except NotGGUFError as exc:
                    raise NotGGUFError(
                        f"{exc}; import GGUF files, or pass --raw to store it unchecked"
                    ) from exc
            same = next((o for o in sources[:-1] if (o.stat.st_dev, o.stat.st_ino) == (st.st_dev, st.st_ino)), None)
            if same is not None:  # (the same file twice would be recorded twice, counted twice in the size)
                raise SourceError(f"{label} is given twice (as {same.label} too): give each file once")
            src.label = f"{role} {p.name}"
        return import_sources(
            store, mname, tag, sources, source_kind="file", source=str(model_path), progress=progress
        )
    finally:
        for src in sources:
            os.close(src.fd)
