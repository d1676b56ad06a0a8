"""The mirror on the admin listener: what it holds, what the local Ollama store holds, import jobs.

Routes (under the admin token like the rest of ``/admin/v1``)::

    GET  /admin/v1/mirror/models         the models in the mirror (name, tag, size, architecture,
                                         quantisation, digest, projector)
    GET  /admin/v1/mirror/ollama         the models in the Ollama store of this machine (``in_mirror``: the
                                         mirror's models imported from each, null when the mirror is unreadable)
    POST /admin/v1/mirror/imports        start an import: {"ollama": "llama3.2:1b", "name": "NAME[:TAG]"?}
                                         -> 202 and the job
    GET  /admin/v1/mirror/imports        every recent job
    GET  /admin/v1/mirror/imports/{id}   one job: state, progress, the error or the model imported

The mirror is the gateway's (``mirror.root`` in the config, else
:func:`llmgw.mirror.store.default_root`: ``$LLMGW_MIRROR``, ``$XDG_DATA_HOME/llmgw/mirror``,
``~/.local/share/llmgw/mirror``); the Ollama store is found the way ``llmgw mirror import-ollama`` finds it
(``$OLLAMA_MODELS``, ``~/.ollama/models``, the Linux service's). The caller never names a
path: the API reads and writes only those two places, as the user the gateway runs as.

An import runs in a worker thread with the same importer as the CLI (:func:`llmgw.mirror.import_ollama`),
one at a time, never on the event loop; the copy and its SHA-256 run at disk speed while the
gateway keeps serving. A refusal (a corrupt blob, a safetensors-only model, a bad name, a name
taken) ends the job ``failed`` with the importer's one-line message and a ``code``; a bad name is
refused at once with a 400. Reading the catalogue and the Ollama manifests also runs off the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from ..errors import BadRequestError, HTTPError, NotFoundError
from ..http.parser import Request
from ..http.server import ResponseWriter
from ..log import admin_logger as log
from ..mirror import errors as merr
from ..mirror.progress import Progress
from .manage import json_body, method_not_allowed

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["MAX_JOBS_KEPT", "MAX_PENDING", "MirrorAPI", "error_code"]

PREFIX = b"/admin/v1/mirror"
MAX_PENDING = 8
"""Imports queued or running at once; past that a new one is refused with 429."""
MAX_JOBS_KEPT = 64
"""Finished jobs kept for ``GET`` (the oldest go first)."""
_MAX_BODY_NAME = 400

# The importer's errors, most specific first: a stable `code` for scripts and the console.
_CODES: tuple[tuple[type[BaseException], str], ...] = (
    (merr.InvalidNameError, "invalid_name"),
    (merr.OllamaStoreNotFoundError, "ollama_store_not_found"),
    (merr.OllamaModelNotFoundError, "ollama_model_not_found"),
    (merr.OllamaUnsupportedError, "unsupported_model"),
    (merr.OllamaMissingBlobError, "missing_blob"),
    (merr.OllamaBlobError, "corrupt_blob"),
    (merr.DigestMismatchError, "corrupt_blob"),
    (merr.OllamaManifestError, "bad_manifest"),
    (merr.GGUFFormatError, "corrupt_gguf"),
    (merr.ModelExistsError, "model_exists"),
    (merr.NoSpaceError, "no_space"),
    (merr.MirrorError, "mirror_error"),
    (PermissionError, "permission_denied"),
    (OSError, "os_error"),
)


def error_code(exc: BaseException) -> str:
    """The ``code`` a failed import reports for ``exc``."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return "internal_error"


class ImportCancelledError(Exception):
    """The gateway is stopping: the import stops at its next chunk (nothing is recorded)."""


class _Job:
    """One import: what was asked, where it is, how it ended."""

    def __init__(self, job_id: str, ref: str, name: str | None) -> None:
        self.id = job_id
        self.ref = ref
        self.name = name
        self.state = "queued"  # -> running -> done | failed
        self.step: str | None = None
        self.step_done = 0
        self.step_total: int | None = None
        self.steps = 0
        self.error: dict[str, str] | None = None
        self.model: dict[str, Any] | None = None
        self.created = time.time()
        self.started: float | None = None
        self.finished: float | None = None

    def view(self) -> dict[str, Any]:
        total = self.step_total
        return {
            "id": self.id,
            "ollama": self.ref,
            "name": self.name,
            "state": self.state,
            "step": self.step,
            "steps": self.steps,
            "done_bytes": self.step_done if self.step is not None else None,
            "total_bytes": total,
            # of the current step (copy or verification of one file); null before the first
            "progress": (min(1.0, self.step_done / total) if total else 1.0) if total is not None else None,
            "error": self.error,
            "model": self.model,
            "created_at": self.created,
            "started_at": self.started,
            "finished_at": self.finished,
        }


class _JobProgress(Progress):
    """The importer's progress, written into the job (plain attribute stores: readers on the loop
    see a recent value; nothing needs to be exact)."""

    def __init__(self, job: _Job, cancelled: threading.Event) -> None:
        self.job = job
        self.cancelled = cancelled

    def start(self, description: str, total: int) -> None:
        job = self.job
        job.steps += 1
        job.step = description
        job.step_done = 0
        job.step_total = total

    def advance(self, nbytes: int) -> None:
        if self.cancelled.is_set():
            raise ImportCancelledError("the gateway is stopping; the import was cancelled and nothing was recorded")
        self.job.step_done += nbytes


def _model_row(rec: Any) -> dict[str, Any]:
    main = rec.main
    projectors = [f for f in rec.files if f.role == "projector"]
    return {
        "ref": rec.ref,
        "name": rec.name,
        "tag": rec.tag,
        "size": rec.size,
        "architecture": rec.header("architecture"),
        "quantization": rec.header("quantization"),
        "parameter_count": rec.header("parameter_count"),
        "context_length": rec.header("context_length"),
        "digest": main.digest if main is not None else None,
        "projector": projectors[0].digest if projectors else None,
        "source_kind": rec.source_kind,
        "source": rec.source,
        "created_at": rec.created_at,
    }


class MirrorAPI:
    """``/admin/v1/mirror/...`` (the admin app checks the token first).

    Args:
        config: the running configuration (``mirror_root`` is read per request).
        ollama_roots: where to look for the Ollama store (default: as ``import-ollama`` does, read
            per request so ``$OLLAMA_MODELS`` counts).
    """

    def __init__(self, config: Callable[[], Config], *, ollama_roots: list[Path] | None = None) -> None:
        self.config = config
        self.ollama_roots = ollama_roots
        self._jobs: OrderedDict[str, _Job] = OrderedDict()
        self._ids = itertools.count(1)
        self._cancelled = threading.Event()
        self._pool: ThreadPoolExecutor | None = None

    def root(self) -> Path:
        from ..mirror import default_root

        configured = self.config().mirror_root
        return Path(configured).expanduser() if configured else default_root()

    def close(self) -> None:
        """Cancel queued imports and stop a running one at its next chunk (nothing half-done is recorded)."""
        self._cancelled.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for job in self._jobs.values():
            if job.state == "queued":
                self._fail(job, "cancelled", "the gateway stopped before the import began")

    # -- routing --

    def handle(self, req: Request, w: ResponseWriter) -> Awaitable[None] | None:
        path = req.path.rstrip(b"/")
        method = req.method
        parts = path[len(PREFIX):].strip(b"/").split(b"/") if path.startswith(PREFIX) else []
        if parts == [b"models"]:
            if method not in (b"GET", b"HEAD"):
                raise method_not_allowed(method, path, "GET")
            return self._list_models(w)
        if parts == [b"ollama"]:
            if method not in (b"GET", b"HEAD"):
                raise method_not_allowed(method, path, "GET")
            return self._list_ollama(w)
        if parts[:1] == [b"imports"]:
            if len(parts) == 1:
                if method == b"POST":
                    self._start(req, w)
                    return None
                if method in (b"GET", b"HEAD"):
                    w.send_json(200, {"imports": [j.view() for j in reversed(self._jobs.values())]})
                    return None
                raise method_not_allowed(method, path, "GET or POST")
            if len(parts) == 2:
                if method not in (b"GET", b"HEAD"):
                    raise method_not_allowed(method, path, "GET")
                job = self._jobs.get(unquote(parts[1].decode("latin-1")))
                if job is None:
                    raise NotFoundError(
                        "no such import job (finished jobs are kept for a while); GET /admin/v1/mirror/imports "
                        "lists them", code="import_not_found",
                    )
                w.send_json(200, job.view())
                return None
        raise NotFoundError(
            f"no admin route {path.decode('latin-1')[:200]}; mirror routes: GET /admin/v1/mirror/models, "
            "GET /admin/v1/mirror/ollama, POST|GET /admin/v1/mirror/imports, GET /admin/v1/mirror/imports/{id}"
        )

    # -- reading --

    async def _list_models(self, w: ResponseWriter) -> None:
        root = self.root()

        def read() -> list[dict[str, Any]]:
            from ..mirror import MirrorStore

            if not MirrorStore.exists(root):
                return []
            with MirrorStore(root, create=False) as store:
                return [_model_row(r) for r in store.list_models()]

        try:
            rows = await asyncio.to_thread(read)
        except merr.MirrorError as exc:
            raise HTTPError(str(exc), status=500, type="server_error", code="mirror_unreadable") from exc
        except OSError as exc:
            raise HTTPError(
                f"cannot read the mirror at {root}: {exc.strerror or exc}", status=500, type="server_error",
                code="mirror_unreadable",
            ) from exc
        w.send_json(200, {"root": str(root), "models": rows})

    async def _list_ollama(self, w: ResponseWriter) -> None:
        from ..mirror.ollama_list import list_ollama

        roots = self.ollama_roots
        root = self.root()

        def read() -> dict[str, Any]:
            doc = list_ollama(roots)
            # each Ollama model's imports into this mirror (by the source they recorded), so a picker
            # can tell what is there already; null: the mirror could not be read (not: none)
            mirrored: dict[str, list[str]] | None = {}
            try:
                from ..mirror import MirrorStore

                if MirrorStore.exists(root):
                    with MirrorStore(root, create=False) as store:
                        for rec in store.list_models():
                            if rec.source.startswith("ollama:"):
                                mirrored.setdefault(rec.source[7:].lower(), []).append(rec.ref)  # type: ignore[union-attr]
            except (merr.MirrorError, OSError):
                mirrored = None
            for m in doc["models"]:
                m["in_mirror"] = None if mirrored is None else sorted(mirrored.get(str(m["name"]).lower(), []))
            return doc

        w.send_json(200, await asyncio.to_thread(read))

    # -- imports --

    def _start(self, req: Request, w: ResponseWriter) -> None:
        from ..mirror.names import parse_ref
        from ..mirror.ollama import parse_ollama_name

        body = _json_object(req)
        ref = body.get("ollama")
        name = body.get("name")
        if not isinstance(ref, str) or not ref.strip():
            raise BadRequestError(
                'give the Ollama model to import: {"ollama": "llama3.2:1b"} (GET /admin/v1/mirror/ollama lists them)',
                param="ollama", code="invalid_request",
            )
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise BadRequestError('"name" must be NAME[:TAG] or left out', param="name", code="invalid_name")
        if len(ref) > _MAX_BODY_NAME or (name is not None and len(name) > _MAX_BODY_NAME):
            raise BadRequestError("the name is too long", param="ollama", code="invalid_name")
        try:
            parse_ollama_name(ref)
        except merr.InvalidNameError as exc:
            raise BadRequestError(str(exc), param="ollama", code="invalid_name") from None
        try:
            if name is not None:
                parse_ref(name)
        except merr.InvalidNameError as exc:
            raise BadRequestError(str(exc), param="name", code="invalid_name") from None
        if self._cancelled.is_set():
            raise HTTPError("the gateway is stopping", status=503, type="service_unavailable_error",
                            code="service_unavailable")
        pending = sum(1 for j in self._jobs.values() if j.state in ("queued", "running"))
        if pending >= MAX_PENDING:
            raise HTTPError(
                f"{pending} imports are already queued or running; wait for one to finish",
                status=429, type="rate_limit_error", code="too_many_imports", retry_after=5,
            )
        job = _Job(f"imp-{next(self._ids)}-{int(time.time() * 1000) % 100000:05d}", ref.strip(),
                   name.strip() if name else None)
        self._jobs[job.id] = job
        self._trim()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmgw-mirror-import")
        root = self.root()
        roots = self.ollama_roots
        fut = asyncio.get_running_loop().run_in_executor(self._pool, self._run, job, root, roots)
        fut.add_done_callback(_consume)
        w.send_json(202, job.view())

    def _run(self, job: _Job, root: Path, roots: list[Path] | None) -> None:
        """The import, in the worker thread."""
        from ..mirror import MirrorStore, import_ollama
        from ..mirror.ollama import find_manifest, parse_ollama_name

        if self._cancelled.is_set():
            self._fail(job, "cancelled", "the gateway stopped before the import began")
            return
        job.state = "running"
        job.started = time.time()
        try:
            # (the model looked for first: an import with nothing to import creates no mirror)
            find_manifest(parse_ollama_name(job.ref), roots=roots)
            with MirrorStore(root) as store:
                result = import_ollama(store, job.ref, name=job.name, roots=roots,
                                       progress=_JobProgress(job, self._cancelled))
        except ImportCancelledError as exc:
            self._fail(job, "cancelled", str(exc))
        except Exception as exc:
            code = error_code(exc)
            if code == "internal_error":
                log.exception("mirror import %s of %s failed", job.id, job.ref)
                message = f"the import failed inside llmgw ({type(exc).__name__}); see the gateway's log"
            elif isinstance(exc, OSError) and not isinstance(exc, merr.MirrorError):
                message = f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
            else:
                message = str(exc)
            if isinstance(exc, merr.OllamaStoreNotFoundError):
                # (a caller of the API has no --ollama-dir: the gateway's environment names the store)
                message = message.replace("point to the store with --ollama-dir or OLLAMA_MODELS",
                                          "start the gateway with OLLAMA_MODELS naming the store")
            self._fail(job, code, message)
        else:
            job.model = {**_model_row(result.record), "created": result.created}
            job.finished = time.time()
            job.state = "done"
            log.info("mirror import %s: %s -> %s", job.id, job.ref, result.record.ref)

    def _fail(self, job: _Job, code: str, message: str) -> None:
        job.error = {"code": code, "message": message}
        job.finished = time.time()
        job.state = "failed"

    def _trim(self) -> None:
        while len(self._jobs) > MAX_JOBS_KEPT:
            oldest = next((k for k, j in self._jobs.items() if j.state in ("done", "failed")), None)
            if oldest is None:
                return
            del self._jobs[oldest]


def _consume(fut: asyncio.Future[None]) -> None:
    # (a cancelled future at shutdown is expected; anything else was already turned into the job's error)
    with contextlib.suppress(asyncio.CancelledError):
        exc = fut.exception()
        if exc is not None:
            log.error("mirror import worker failed: %r", exc)


def _json_object(req: Request) -> dict[str, Any]:
    body = json_body(req, 'the request needs a JSON body: {"ollama": "NAME[:TAG]"}')
    if not isinstance(body, dict):
        raise BadRequestError('the body must be a JSON object: {"ollama": "NAME[:TAG]"}', code="invalid_json")
    unknown = sorted(set(body) - {"ollama", "name"})
    if unknown:
        raise BadRequestError(f"unknown field {unknown[0]!r}; give ollama and optionally name",
                              param=unknown[0], code="invalid_request")
    return body
