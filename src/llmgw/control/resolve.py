"""A deployment's model as the control plane's mirror knows it: blobs for the agent, facts for placement.

NOTE: :func:`resolve_mirror` is the minimal lookup against the mirror store's
catalogue. Where ``llmgw.mirror.resolve`` (i18-fetch's resolver: the header read
from the blob, per-layer KV heads, key/value lengths) is present,
:func:`mirror_resolver` uses its ``find`` instead; either way
:class:`~.deployments.DeploymentController` takes the resolver as an argument.

A model is a *mirror reference* when the mirror has it (``tiny:1b``; a bare name
means ``:latest``). A path (``/models/x.gguf``, ``./x.gguf``) or anything the
mirror lacks (``meta-llama/Llama-3.1-8B-Instruct``) is passed to the engine as it is.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..launch.spec import ModelBlob
from ..mirror.progress import Progress

__all__ = ["MirrorModel", "Resolver", "Verifier", "compute_margin", "is_model_path", "kv_cache_bytes", "memory_need",
           "mirror_resolver", "mirror_verifier", "resolve_mirror"]


@dataclass(frozen=True, slots=True)
class MirrorModel:
    """What the mirror says about a model."""

    ref: str
    blobs: tuple[ModelBlob, ...]
    size: int
    """Bytes of the model file(s) the engine loads (the projector included)."""
    context_length: int | None = None
    block_count: int | None = None
    embedding_length: int | None = None
    head_count: int | None = None
    head_count_kv: int | None = None
    kv_bytes_per_token: int | None = None
    """Bytes of f16 KV cache per token over all layers, where the resolver computed it (else from the shape)."""


Resolver = Callable[[str], "MirrorModel | None"]
"""A model string -> the mirror's model, or ``None`` when it is not a mirror reference."""


def is_model_path(model: str) -> bool:
    return model.startswith(("/", "./", "../", "~")) or model.lower().endswith(".gguf")


def resolve_mirror(root: str | os.PathLike[str], model: str) -> MirrorModel | None:
    """Look ``model`` up in the mirror at ``root``; ``None`` when it is not there (or not a name at all)."""
    if is_model_path(model):
        return None
    from ..mirror.errors import MirrorError
    from ..mirror.names import parse_ref
    from ..mirror.store import MirrorStore

    try:
        name, tag = parse_ref(model)
    except MirrorError:
        return None
    if not MirrorStore.exists(root):
        return None
    try:
        store = MirrorStore(root, create=False)
    except (MirrorError, OSError):
        return None
    try:
        rec = store.catalogue.get(name, tag)
    finally:
        store.close()
    if rec is None:
        return None
    blobs = tuple(ModelBlob(f.digest, f.size, f.role) for f in rec.files if f.role in ("model", "projector"))
    main = rec.main
    g = (main.gguf if main is not None else None) or {}

    def num(key: str) -> int | None:
        v = g.get(key)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    return MirrorModel(
        ref=rec.ref, blobs=blobs, size=sum(b.size for b in blobs), context_length=num("context_length"),
        block_count=num("block_count"), embedding_length=num("embedding_length"), head_count=num("head_count"),
        head_count_kv=num("head_count_kv"),
    )


def mirror_resolver(root: str | os.PathLike[str] | None) -> Resolver:
    """A resolver over the mirror at ``root`` (default: :func:`llmgw.mirror.store.default_root`)."""
    import importlib

    from ..mirror.store import default_root

    where = Path(root).expanduser() if root else default_root()
    try:
        fetch_resolve = importlib.import_module("llmgw.mirror.resolve")  # (i18-fetch's, where merged)
    except ImportError:
        return lambda model: resolve_mirror(where, model)
    find = fetch_resolve.find

    def resolver(model: str) -> MirrorModel | None:
        if is_model_path(model):
            return None
        got = find(where, model)
        if got is None:
            return None
        blobs, f = got
        return MirrorModel(
            ref=f.ref, blobs=tuple(blobs), size=f.model_size + (f.projector_size or 0),
            context_length=f.context_length, block_count=f.block_count, embedding_length=f.embedding_length,
            head_count=f.head_count, head_count_kv=f.head_count_kv if isinstance(f.head_count_kv, int) else None,
            kv_bytes_per_token=f.kv_bytes_per_token(),
        )

    return resolver


Verifier = Callable[[frozenset[str], threading.Event], Mapping[str, str]]
"""Blob digests and a stop flag -> each one's state in the mirror: ``ok``, ``moved`` (corrupt, moved out of the
mirror), ``corrupt`` (and could not be moved), ``missing``, ``wrong-size``, ``not-a-file``; a digest the mirror
does not hold, or a check stopped, is left out. Blocking: run it in a thread."""


class _Stopped(Exception):
    """The check was asked to stop (the control plane stopping)."""


class _StopWatch(Progress):
    """Ends a re-hash between two chunks once ``stop`` is set (a blob of 100 GB takes minutes)."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def advance(self, nbytes: int) -> None:
        if self.stop.is_set():
            raise _Stopped


def mirror_verifier(root: str | os.PathLike[str] | None) -> Verifier:
    """A verifier over the mirror at ``root``: re-hashes the blobs asked for (``llmgw mirror verify``'s check,
    quarantine included: a corrupt blob is moved out) and says what it found of each. A mirror that cannot be
    opened, or blobs it does not hold, give nothing."""
    from ..mirror.errors import MirrorError
    from ..mirror.store import MirrorStore, default_root

    where = Path(root).expanduser() if root else default_root()

    def verifier(digests: frozenset[str], stop: threading.Event) -> Mapping[str, str]:
        if not MirrorStore.exists(where):
            return {}
        try:
            with MirrorStore(where, create=False) as store:
                models = [m for m in store.list_models() if any(f.digest in digests for f in m.files)]
                if not models:
                    return {}
                checks = store.verify(models, _StopWatch(stop), record=False, quarantine=True, only=digests)
        except (MirrorError, OSError, _Stopped):
            return {}
        return {c.digest: "moved" if c.quarantined is not None else c.status for c in checks}

    return verifier


def kv_cache_bytes(m: MirrorModel, context: int | None) -> int | None:
    """The f16 KV cache for ``context`` tokens in all (llama.cpp's ``-c``, shared by its slots):
    ``2 (K and V) x layers x context x head_dim x kv_heads x 2 bytes``; ``None`` when a fact is missing."""
    ctx = context or m.context_length
    if ctx and m.kv_bytes_per_token is not None:
        return m.kv_bytes_per_token * ctx
    if not (ctx and m.block_count and m.embedding_length and m.head_count):
        return None
    kv_heads = m.head_count_kv or m.head_count
    head_dim = m.embedding_length // m.head_count
    return 2 * m.block_count * ctx * head_dim * kv_heads * 2


COMPUTE_MARGIN_MIN = 256 << 20


def compute_margin(files: int) -> int:
    """What an engine holds beyond weights and KV cache (compute buffers; on a GPU its CUDA context too),
    as placement reserves it: a tenth of the files, at least 256 MiB (llama.cpp's logits buffer alone is
    vocabulary x batch x 4 bytes: about 250 MiB for a 128k vocabulary at its default batch of 512)."""
    return max(COMPUTE_MARGIN_MIN, files // 10)


def memory_need(m: MirrorModel, context: int | None) -> int:
    """The memory a replica of ``m`` needs: its files, the KV cache (when the facts give it) and
    :func:`compute_margin`."""
    return m.size + (kv_cache_bytes(m, context) or 0) + compute_margin(m.size)
