"""Fuzz target: the Ollama manifest reader (``llmgw.mirror.ollama``).

Every input is read as a manifest (``parse_manifest``), as a config blob
(``parse_config``), as a ``params`` layer (``parse_params``) and, decoded, as a
model name (``parse_ollama_name``). Each may only raise its documented errors
(``OllamaManifestError``, ``OllamaUnsupportedError``, ``InvalidNameError``). What
is accepted must be safe to use: a layer's digest is ``sha256:`` and 64 lowercase
hex digits and its blob name a plain file name; a name's parts can be path parts
under ``manifests/`` (no empty part, no ``.`` or ``..``, no separator).

When the input's first byte is odd, the rest is wrapped in a schema-2 manifest as
its first layer, so mutations reach the layer checks.
"""

from __future__ import annotations

import re
from typing import Any

from _harness import main

NAME = "ollama"
INSTRUMENT = ["llmgw.mirror.ollama"]

_o: Any = None
_errors: tuple[type[BaseException], ...] = ()
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_CFG = b'{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"sha256:' + b"a" * 64 + b'","size":1}'


def setup() -> None:
    global _o, _errors
    from llmgw.mirror import ollama
    from llmgw.mirror.errors import InvalidNameError, OllamaManifestError, OllamaUnsupportedError

    _o = ollama
    _errors = (OllamaManifestError, OllamaUnsupportedError, InvalidNameError)


def one_input(data: bytes) -> None:
    body = b'{"schemaVersion":2,"config":' + _CFG + b',"layers":[' + data[1:] + b"]}" if data and data[0] & 1 else data
    try:
        m = _o.parse_manifest(body, "fuzz")
    except _errors:
        pass
    else:
        for layer in (m.config, *m.layers):
            if not _DIGEST.fullmatch(layer.digest) or "/" in layer.blob_name or layer.size < 0:
                raise AssertionError(f"unsafe layer accepted: {layer!r}")
            _ = layer.kind
        m.of_kind("model")
    try:
        _o.parse_config(body, "fuzz")
    except _errors:
        pass
    _o.parse_params(body.decode("utf-8", errors="replace"))
    try:
        name = _o.parse_ollama_name(body.decode("utf-8", errors="replace"))
    except _errors:
        return
    for part in name.parts:
        if not part or part in (".", "..") or "/" in part or "\\" in part or "\0" in part:
            raise AssertionError(f"unsafe name part accepted: {name!r}")
    _ = name.display


if __name__ == "__main__":
    import sys

    main(sys.modules[__name__])
