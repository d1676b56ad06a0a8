"""From a mirror reference (``tiny:1b``) to what a replica needs and what placement must know.

:func:`resolve` returns the blobs a node fetches (:class:`~llmgw.launch.spec.ModelBlob`,
for ``ReplicaSpec.blobs``) and the model's :class:`ModelFacts`: its file sizes, and
from the GGUF header the context length and the attention shape, so that
:func:`kv_cache_bytes` and :func:`memory_needed` can say how much memory a replica
with a given context and slot count takes.

The header is read from the blob itself (bounded: :mod:`.gguf`) once per digest
per process; blobs never change, so the facts are cached by digest.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import CorruptBlobError, InvalidNameError, MirrorError, ModelNotFoundError
from .gguf import read_gguf
from .names import format_ref, parse_ref
from .store import MirrorStore

if TYPE_CHECKING:
    from ..launch.spec import ModelBlob

__all__ = ["ModelFacts", "find", "kv_cache_bytes", "memory_needed", "resolve"]

# bytes per element of an f16 KV cache (llama.cpp's and vLLM's default cache type)
_F16 = 2.0
_CACHE_MAX = 256
_cache: OrderedDict[str, dict[str, Any]] = OrderedDict()
_cache_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What placement needs to know about a mirror model; ``None`` where the GGUF does not say.

    Attributes:
        ref: ``name:tag`` as the mirror spells it.
        size: bytes of every blob (what a node must store).
        model_size: bytes of the ``model`` file (what the engine loads as weights).
        projector_size: bytes of the vision projector, ``None`` without one.
        architecture: the GGUF ``general.architecture``.
        parameter_count: parameters, from the tensor shapes.
        quantization: e.g. ``Q4_K_M``.
        context_length: the training context (``<arch>.context_length``).
        block_count: layers (``<arch>.block_count``).
        head_count: attention (query) heads.
        head_count_kv: KV heads: one number, or one per layer when the model varies them.
        embedding_length: the hidden size.
        key_length: per-head key size (``<arch>.attention.key_length``, else hidden / heads).
        value_length: per-head value size (likewise).
    """

    ref: str
    size: int
    model_size: int
    projector_size: int | None = None
    architecture: str | None = None
    parameter_count: int | None = None
    quantization: str | None = None
    context_length: int | None = None
    block_count: int | None = None
    head_count: int | None = None
    head_count_kv: int | tuple[int, ...] | None = None
    embedding_length: int | None = None
    key_length: int | None = None
    value_length: int | None = None

    def kv_bytes_per_token(self, bytes_per_element: float = _F16) -> int | None:
        """Bytes of KV cache one token takes over all layers; ``None`` when the header lacks the shape."""
        if self.block_count is None or self.key_length is None or self.value_length is None:
            return None
        kv = self.head_count_kv if self.head_count_kv is not None else self.head_count
        if kv is None:
            return None
        if isinstance(kv, tuple):
            if len(kv) != self.block_count:
                return None
            heads = sum(kv)
        else:
            heads = kv * self.block_count
        return int(heads * (self.key_length + self.value_length) * bytes_per_element)


def kv_cache_bytes(
    facts: ModelFacts, context: int | None = None, slots: int = 1, *, bytes_per_element: float = _F16
) -> int | None:
    """The KV cache of ``slots`` sequences of ``context`` tokens each, in bytes (f16 by default).

    ``context`` defaults to the model's training context. llama.cpp's ``-c`` is the
    total over its ``-np`` slots: for ``-c C -np N`` ask for ``context=C, slots=1``.
    An upper bound for models with sliding-window layers.

    Returns:
        Bytes, or ``None`` when the GGUF header does not give the attention shape
        (then use the deployment's stated need).
    """
    per_token = facts.kv_bytes_per_token(bytes_per_element)
    ctx = context if context is not None else facts.context_length
    if per_token is None or ctx is None:
        return None
    if ctx < 0 or slots < 1:
        raise ValueError(f"context must be >= 0 and slots >= 1, got {ctx} and {slots}")
    return per_token * ctx * slots


def memory_needed(
    facts: ModelFacts, context: int | None = None, slots: int = 1, *, bytes_per_element: float = _F16
) -> int | None:
    """Weights (model and projector files) plus :func:`kv_cache_bytes`; ``None`` when the KV part is unknown.

    The engine's compute buffers come on top (a few hundred MiB): placement keeps a margin
    (:func:`llmgw.control.resolve.compute_margin`).
    """
    kv = kv_cache_bytes(facts, context, slots, bytes_per_element=bytes_per_element)
    if kv is None:
        return None
    return facts.model_size + (facts.projector_size or 0) + kv


def _header_facts(path: Path, digest: str) -> dict[str, Any]:
    with _cache_lock:
        hit = _cache.get(digest)
        if hit is not None:
            _cache.move_to_end(digest)
            return hit
    info = read_gguf(path)  # (outside the lock: a big header takes tens of ms)
    arch = info.architecture

    def num(key: str) -> int | None:
        v = info.get(f"{arch}.{key}")
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    heads = num("attention.head_count")
    raw_kv = info.get(f"{arch}.attention.head_count_kv")
    kv: int | tuple[int, ...] | None
    if isinstance(raw_kv, int) and not isinstance(raw_kv, bool):
        kv = raw_kv
    elif isinstance(raw_kv, list | tuple) and raw_kv and all(isinstance(x, int) for x in raw_kv):
        kv = tuple(raw_kv)
    else:
        kv = None
    hidden = num("embedding_length")
    per_head = hidden // heads if hidden and heads else None
    facts = {
        "architecture": arch,
        "parameter_count": info.tensors.parameter_count,
        "quantization": info.quantization,
        "context_length": info.context_length,
        "block_count": info.block_count,
        "head_count": heads,
        "head_count_kv": kv,
        "embedding_length": hidden,
        "key_length": num("attention.key_length") or per_head,
        "value_length": num("attention.value_length") or per_head,
    }
    with _cache_lock:
        _cache[digest] = facts
        while len(_cache) > _CACHE_MAX:
            _cache.popitem(last=False)
    return facts


def resolve(store: MirrorStore | str | os.PathLike[str], ref: str) -> tuple[tuple[ModelBlob, ...], ModelFacts]:
    """The blobs of mirror model ``ref`` (``NAME[:TAG]``) and its :class:`ModelFacts`.

    Reads the catalogue and the main file's GGUF header (cached by digest): call it
    off the event loop the first time for a model (``asyncio.to_thread``). Given a
    root instead of a store, it opens one for the call (SQLite connections belong
    to the thread that opened them).

    Returns:
        ``(blobs, facts)``: the ``model`` blob first, then the projector and any others.

    Raises:
        InvalidNameError: ``ref`` is not a valid model name.
        ModelNotFoundError: the mirror has no such model (the message says how to list them).
        CorruptBlobError: a blob is missing from the store (or ``verify`` quarantined it) or has the wrong size.
        MirrorError: the model has no ``model`` file.
    """
    from ..launch.spec import ModelBlob

    if not isinstance(store, MirrorStore):
        with MirrorStore(store, create=False) as opened:
            return resolve(opened, ref)
    name, tag = parse_ref(ref)
    record = store.get_model(name, tag)
    main = record.main
    if main is None:
        raise MirrorError(f"mirror model {record.ref} has no model file (only {', '.join(f.role for f in record.files)})")
    blobs = []
    for f in record.files:
        try:
            on_disk = os.stat(f.path).st_size
        except FileNotFoundError:
            on_disk = None
        if on_disk != f.size:
            quarantined = store.quarantine_path(f.digest)
            if on_disk is None and quarantined.exists():
                raise CorruptBlobError(
                    f"mirror model {record.ref}: its {f.role} blob {f.digest} was found corrupt and moved to "
                    f"{quarantined}; import the model again from its source"
                )
            raise CorruptBlobError(
                f"mirror model {record.ref}: its {f.role} blob {f.digest} is "
                f"{'missing' if on_disk is None else f'{on_disk} bytes, not {f.size}'}; run llmgw mirror verify"
                f" and import the model again"
            )
        blobs.append(ModelBlob(digest=f.digest, size=f.size, role=f.role))
    projector = next((f for f in record.files if f.role == "projector"), None)
    header: dict[str, Any] = {}
    if main.gguf is not None:
        header = _header_facts(main.path, main.digest)
    facts = ModelFacts(
        ref=format_ref(record.name, record.tag),
        size=record.size,
        model_size=main.size,
        projector_size=projector.size if projector is not None else None,
        **header,
    )
    return tuple(blobs), facts


def find(
    store: MirrorStore | str | os.PathLike[str], model: str
) -> tuple[tuple[ModelBlob, ...], ModelFacts] | None:
    """:func:`resolve`, or ``None`` when ``model`` is not a mirror reference here (not a valid name,
    no mirror at that root, or no such model in it): then it is a path or an id the engine knows.

    Raises:
        CorruptBlobError, MirrorError: as :func:`resolve`, for a model the mirror has but cannot serve.
    """
    if not isinstance(store, MirrorStore) and not MirrorStore.exists(store):
        return None
    try:
        return resolve(store, model)
    except (InvalidNameError, ModelNotFoundError):
        return None
