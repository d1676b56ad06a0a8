"""Fuzz target: the GGUF header reader (``llmgw.mirror.gguf.read_gguf_fd``).

The input is the file (in a memfd; with the first byte odd, the rest follows a
version 3 magic, so that mutations spend their time past the magic). The reader
may only raise ``NotGGUFError`` or ``GGUFFormatError``; a header it accepts must
give a summary the catalogue can store (``json.dumps``), hold its own invariants,
and be read by the reference reader (``gguf``-py's ``GGUFReader``, llama.cpp's own
Python reader) to the same version, tensor count and scalar or string metadata.
"""

from __future__ import annotations

import json
import math
import os
import struct
import warnings
from typing import Any

from _harness import Disagreement, explained, main

NAME = "gguf"
INSTRUMENT = ["llmgw.mirror.gguf"]

_fd = -1
_g: Any = None
_errors: tuple[type[BaseException], ...] = ()
_ref: Any = None


def setup() -> None:
    global _fd, _g, _errors, _ref
    from llmgw.mirror import gguf
    from llmgw.mirror.errors import GGUFFormatError, NotGGUFError

    _g = gguf
    _errors = (GGUFFormatError, NotGGUFError)
    _fd = os.memfd_create("fuzz-gguf")
    import gguf as ref

    _ref = ref


def _same_value(ours: Any, theirs: Any) -> bool:
    if isinstance(ours, float):
        return (math.isnan(ours) and math.isnan(theirs)) or ours == theirs
    return bool(ours == theirs)


def one_input(data: bytes) -> None:
    body = b"GGUF\x03\x00\x00\x00" + data[1:] if data and data[0] & 1 else data
    os.ftruncate(_fd, 0)
    os.pwrite(_fd, body, 0)
    try:
        info = _g.read_gguf_fd(_fd, what="fuzz")
    except _errors:
        return
    summary = info.summary()
    json.dumps(summary, sort_keys=True)
    for prop in ("name", "quantization", "context_length", "split_count", "is_projector"):
        getattr(info, prop)
    if info.data_offset % info.alignment or info.tensors.data_bytes > info.file_size:
        raise AssertionError(f"broken invariant: offset {info.data_offset}, alignment {info.alignment}, "
                             f"data {info.tensors.data_bytes} of {info.file_size}")
    _against_reference(info, body)


def _against_reference(info: Any, body: bytes) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = _ref.GGUFReader(f"/proc/self/fd/{_fd}")
    except (ValueError, struct.error, IndexError, OverflowError, KeyError, TypeError, MemoryError) as exc:
        # gguf-py maps the whole file and builds every tensor's array view: it refuses
        # headers llmgw accepts on purpose (a tensor of a ggml type llmgw does not
        # size, extents it does not check for types without a block size).
        explained(f"gguf-py refuses what llmgw accepts: {type(exc).__name__}")
        return
    theirs_version = int(r.fields["GGUF.version"].parts[-1][0])
    if theirs_version != info.version or len(r.tensors) != info.tensors.count:
        raise Disagreement(f"gguf-py reads version {theirs_version}, {len(r.tensors)} tensors; llmgw "
                           f"{info.version}, {info.tensors.count}", "version or tensor count")
    for key, value in info.metadata.items():
        field = r.fields.get(key)
        if field is None:
            raise Disagreement(f"gguf-py has no key {key!r}", "keys")
        if isinstance(value, (list, _g.ArrayInfo)):
            continue
        if isinstance(value, str):
            theirs: Any = bytes(field.parts[-1]).decode("utf-8")
        else:
            theirs = field.parts[-1].tolist()[0]
        if not _same_value(value, theirs):
            raise Disagreement(f"{key!r}: llmgw {value!r}, gguf-py {theirs!r}", "metadata value")


if __name__ == "__main__":
    import sys

    main(sys.modules[__name__])
