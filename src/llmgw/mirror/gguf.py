"""A bounded reader for GGUF headers.

It reads what the mirror records about a model (architecture, name, context
length, quantisation, parameter count, projector or not) from the header alone,
without loading tensor data, and checks the header is sound: the magic, a
supported version, every count, length and type in range, and every tensor's data
inside the file (a truncated download is caught here).

SECURITY: files are untrusted. Every length and count is checked against the
bytes left in the file and a hard cap *before* anything is allocated; large arrays
(``tokenizer.ggml.tokens`` holds 150k+ strings) are skipped without being
materialised, and the total work is capped, so a hostile header cannot make the
reader allocate or loop without bound.

Format reference: ``shared/reference/engines.md`` section 5.5 (llama.cpp's
``gguf.h`` and ``docs/gguf.md``).
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .errors import GGUFFormatError, NotGGUFError

__all__ = [
    "FILE_TYPES",
    "GGML_TYPES",
    "GGUF_MAGIC",
    "ArrayInfo",
    "GGUFInfo",
    "TensorSummary",
    "format_parameter_count",
    "is_gguf",
    "read_gguf",
    "read_gguf_fd",
]

GGUF_MAGIC = b"GGUF"
# A big-endian file written by gguf-py packs the magic constant big-endian.
_GGUF_MAGIC_BE = b"FUGG"

# Hard bounds. Real files are far below them: a 150k-token vocabulary with its
# merges is a header of ~10 MiB; GGML allows 4 dimensions and 64-byte tensor names.
MAX_HEADER_BYTES = 256 << 20
MAX_KV_COUNT = 1 << 16
MAX_TENSOR_COUNT = 1 << 20
MAX_KEY_LENGTH = 1 << 16
MAX_STRING_LENGTH = 64 << 20
MAX_TENSOR_NAME_LENGTH = 1 << 12
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 4
# Elements of arrays the reader steps through one by one (arrays of strings or of
# arrays); numeric arrays are skipped in one seek and do not count.
MAX_ARRAY_WORK = 1 << 25
# Arrays up to this many elements are kept in ``metadata``; longer ones become an
# :class:`ArrayInfo` (element type and count only).
KEEP_ARRAY_ELEMENTS = 64

_READ_CHUNK = 1 << 20

# GGUF value types: id -> (name, struct format or None).
_T_STRING = 8
_T_ARRAY = 9
_VALUE_TYPES: dict[int, tuple[str, struct.Struct | None]] = {
    0: ("u8", struct.Struct("<B")),
    1: ("i8", struct.Struct("<b")),
    2: ("u16", struct.Struct("<H")),
    3: ("i16", struct.Struct("<h")),
    4: ("u32", struct.Struct("<I")),
    5: ("i32", struct.Struct("<i")),
    6: ("f32", struct.Struct("<f")),
    7: ("bool", struct.Struct("<?")),
    8: ("string", None),
    9: ("array", None),
    10: ("u64", struct.Struct("<Q")),
    11: ("i64", struct.Struct("<q")),
    12: ("f64", struct.Struct("<d")),
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# ggml tensor types: id -> (name, elements per block, bytes per block). A size of
# 0 means the block layout is not one a file stores (or not known here): such a
# tensor is accepted but its extent is not checked.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 0),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
# ggml's type ids are small; anything beyond this is corruption, not a new type.
_MAX_GGML_TYPE = 1024

# general.file_type (llama_ftype) -> the name people use for the quantisation.
FILE_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
    1024: "GUESSED",
}


@dataclass(frozen=True, slots=True)
class ArrayInfo:
    """A metadata array that was skipped rather than kept: its element type and length."""

    elem_type: str
    count: int

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-friendly description."""
        return {"array": self.elem_type, "count": self.count}


@dataclass(frozen=True, slots=True)
class TensorSummary:
    """What the tensor list says in aggregate.

    Attributes:
        count: number of tensors.
        parameter_count: the sum of their element counts (what Ollama shows as the
            model's size; GGUF has no standard key for it).
        types: element count per ggml type name, to tell the quantisation mix.
        data_bytes: bytes of tensor data the header accounts for (known types only).
    """

    count: int
    parameter_count: int
    types: dict[str, int]
    data_bytes: int


@dataclass(frozen=True, slots=True)
class GGUFInfo:
    """A GGUF file's header, read and checked.

    Attributes:
        version: GGUF version (2 or 3).
        metadata: every key/value; arrays longer than ``KEEP_ARRAY_ELEMENTS`` (and
            arrays of arrays) appear as :class:`ArrayInfo`.
        tensors: the tensor list in aggregate.
        alignment: ``general.alignment`` (default 32).
        data_offset: where tensor data begins.
        file_size: the size of the file that was read.
    """

    version: int
    metadata: dict[str, Any]
    tensors: TensorSummary
    alignment: int
    data_offset: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        """Return metadata value ``key`` or ``default``."""
        return self.metadata.get(key, default)

    def _int(self, key: str) -> int | None:
        value = self.metadata.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            return None
        return value

    def _str(self, key: str) -> str | None:
        value = self.metadata.get(key)
        return value if isinstance(value, str) else None

    @property
    def architecture(self) -> str:
        """``general.architecture`` (always present: the reader requires it)."""
        return str(self.metadata["general.architecture"])

    @property
    def name(self) -> str | None:
        """``general.name``, if any."""
        return self._str("general.name")

    @property
    def general_type(self) -> str | None:
        """``general.type`` (``model``, ``adapter``, ``mmproj``, ...), if any."""
        return self._str("general.type")

    @property
    def file_type(self) -> int | None:
        """``general.file_type`` (a ``llama_ftype``), if any."""
        return self._int("general.file_type")

    @property
    def quantization(self) -> str | None:
        """The quantisation's usual name.

        From ``general.file_type`` when present, else the ggml type holding most
        of the parameters.
        """
        ftype = self.file_type
        if ftype is not None:
            return FILE_TYPES.get(ftype, f"ftype {ftype}")
        if self.tensors.types:
            return max(self.tensors.types.items(), key=lambda kv: kv[1])[0]
        return None

    def arch_key(self, suffix: str) -> Any:
        """Return ``<architecture>.<suffix>`` or ``None``."""
        return self.metadata.get(f"{self.architecture}.{suffix}")

    @property
    def context_length(self) -> int | None:
        """``<arch>.context_length`` (the training context), if any."""
        return self._int(f"{self.architecture}.context_length")

    @property
    def block_count(self) -> int | None:
        """``<arch>.block_count``, if any."""
        return self._int(f"{self.architecture}.block_count")

    @property
    def is_projector(self) -> bool:
        """Whether this is a vision/audio projector (Ollama's rule).

        ``general.type`` is ``projector`` or ``mmproj``; or the text model has no
        blocks but a vision tower does; or the architecture is ``clip`` with no
        block count and a vision or audio encoder.
        """
        if self.general_type in ("projector", "mmproj"):
            return True
        arch = self.architecture
        vision_blocks = self._int(f"{arch}.vision.block_count") or 0
        if self.block_count == 0 and vision_blocks > 0:
            return True
        if arch == "clip" and self.block_count is None:
            return bool(
                self.metadata.get("clip.has_vision_encoder") or self.metadata.get("clip.has_audio_encoder")
            )
        return False

    @property
    def split_count(self) -> int:
        """``split.count`` for a sharded file, else 1."""
        return self._int("split.count") or 1

    def summary(self) -> dict[str, Any]:
        """Return what the catalogue records: a JSON-friendly dict."""
        arch = self.architecture
        out: dict[str, Any] = {
            "gguf_version": self.version,
            "architecture": arch,
            "name": self.name,
            "basename": self._str("general.basename"),
            "size_label": self._str("general.size_label"),
            "finetune": self._str("general.finetune"),
            "license": self._str("general.license"),
            "type": self.general_type,
            "file_type": self.file_type,
            "quantization": self.quantization,
            "quantization_version": self._int("general.quantization_version"),
            "context_length": self.context_length,
            "embedding_length": self._int(f"{arch}.embedding_length"),
            "block_count": self.block_count,
            "head_count": self._int(f"{arch}.attention.head_count"),
            "head_count_kv": self._int(f"{arch}.attention.head_count_kv"),
            "expert_count": self._int(f"{arch}.expert_count"),
            "expert_used_count": self._int(f"{arch}.expert_used_count"),
            "parameter_count": self.tensors.parameter_count,
            "tensor_count": self.tensors.count,
            "tensor_types": self.tensors.types,
            "is_projector": self.is_projector,
            "chat_template": self._str("tokenizer.chat_template"),
        }
        return out


def format_parameter_count(count: int | None) -> str:
    """Format a parameter count the way model cards do: ``8.0B``, ``494.0M``, ``12.3K``."""
    if count is None:
        return "-"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{suffix}"
    return str(count)


class _Cursor:
    """Sequential reads from an fd through ``pread`` and a buffer, with bounds."""

    __slots__ = ("_base", "_buf", "_fd", "_limit", "_pos", "_size", "work")

    def __init__(self, fd: int, size: int) -> None:
        self._fd = fd
        self._size = size
        self._limit = min(size, MAX_HEADER_BYTES)
        self._buf = b""
        self._pos = 0
        self._base = 0
        self.work = 0

    @property
    def offset(self) -> int:
        return self._base + self._pos

    def fail(self, what: str) -> GGUFFormatError:
        return GGUFFormatError(f"{what} (at byte {self.offset})")

    def _need(self, n: int) -> None:
        avail = len(self._buf) - self._pos
        if avail >= n:
            return
        end = self.offset + n
        if end > self._limit:
            if end > self._size:
                raise self.fail(
                    f"file ends inside the header: {n} more bytes needed, {self._size - self.offset} left"
                )
            raise self.fail(f"header is larger than {MAX_HEADER_BYTES >> 20} MiB")
        start = self._base + len(self._buf)
        more = os.pread(self._fd, max(n - avail, _READ_CHUNK), start)
        self._buf = self._buf[self._pos :] + more
        self._base = self.offset
        self._pos = 0
        if len(self._buf) < n:
            raise self.fail("file shrank while its header was read")

    def take(self, n: int) -> bytes:
        self._need(n)
        pos = self._pos
        self._pos = pos + n
        return self._buf[pos : pos + n]

    def unpack(self, st: struct.Struct) -> Any:
        self._need(st.size)
        (value,) = st.unpack_from(self._buf, self._pos)
        self._pos += st.size
        return value

    def u32(self) -> int:
        return int(self.unpack(_U32))

    def u64(self) -> int:
        return int(self.unpack(_U64))

    def skip(self, n: int) -> None:
        avail = len(self._buf) - self._pos
        if n <= avail:
            self._pos += n
            return
        end = self.offset + n
        if end > self._limit:
            if end > self._size:
                raise self.fail(
                    f"file ends inside the header: {n} bytes to skip, {self._size - self.offset} left"
                )
            raise self.fail(f"header is larger than {MAX_HEADER_BYTES >> 20} MiB")
        self._base = end
        self._buf = b""
        self._pos = 0

    def string(self, limit: int, what: str) -> str:
        n = self.u64()
        if n > limit:
            raise self.fail(f"{what} is {n} bytes long, over the limit of {limit}")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8") from exc

    def skip_strings(self, count: int, what: str) -> None:
        # PERF: the hot loop for tokenizer arrays (150k+ strings); it works on the
        # buffer directly and only calls out to refill it.
        unpack = _U64.unpack_from
        for _ in range(count):
            if len(self._buf) - self._pos < 8:
                self._need(8)
            (n,) = unpack(self._buf, self._pos)
            self._pos += 8
            if n > MAX_STRING_LENGTH:
                raise self.fail(
                    f"a string in {what} is {n} bytes long, over the limit of {MAX_STRING_LENGTH}"
                )
            self.skip(n)

    def remaining(self) -> int:
        return self._size - self.offset


def _min_size(vtype: int) -> int:
    st = _VALUE_TYPES[vtype][1]
    if st is not None:
        return st.size
    # A string is at least its length; an array at least its type and count.
    return 8 if vtype == _T_STRING else 12


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int) -> Any:
    if vtype not in _VALUE_TYPES:
        raise cur.fail(f"key {key!r} has unknown value type {vtype}")
    st = _VALUE_TYPES[vtype][1]
    if st is not None:
        return cur.unpack(st)
    if vtype == _T_STRING:
        return cur.string(MAX_STRING_LENGTH, f"the value of {key!r}")
    # An array.
    etype = cur.u32()
    count = cur.u64()
    if etype not in _VALUE_TYPES:
        raise cur.fail(f"array {key!r} has unknown element type {etype}")
    if count * _min_size(etype) > cur.remaining():
        raise cur.fail(f"array {key!r} claims {count} elements, more than the file can hold")
    if etype == _T_ARRAY and depth >= MAX_ARRAY_DEPTH:
        raise cur.fail(f"array {key!r} nests deeper than {MAX_ARRAY_DEPTH} levels")
    ename = _VALUE_TYPES[etype][0]
    est = _VALUE_TYPES[etype][1]
    if count <= KEEP_ARRAY_ELEMENTS and etype != _T_ARRAY:
        cur.work += count
        return [_read_value(cur, etype, key, depth + 1) for _ in range(count)]
    if est is not None:
        cur.skip(count * est.size)
    else:
        cur.work += count
        if cur.work > MAX_ARRAY_WORK:
            raise cur.fail(f"arrays hold more than {MAX_ARRAY_WORK} strings or sub-arrays in all")
        if etype == _T_STRING:
            cur.skip_strings(count, repr(key))
        else:
            for _ in range(count):
                _read_value(cur, _T_ARRAY, key, depth + 1)
    return ArrayInfo(ename, count)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Return whether the file starts with the GGUF magic (little- or big-endian)."""
    with open(path, "rb") as f:
        head = f.read(4)
    return head in (GGUF_MAGIC, _GGUF_MAGIC_BE)


def read_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Read and check the header of the GGUF file at ``path``.

    Args:
        path: the file; symbolic links are followed.

    Returns:
        The header, with the tensor list summarised.

    Raises:
        NotGGUFError: the file does not start with the GGUF magic.
        GGUFFormatError: the header is corrupt, truncated, unsupported (version 1,
            big-endian) or beyond the reader's bounds.
        OSError: the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return read_gguf_fd(fd, what=os.fspath(path))
    finally:
        os.close(fd)


def read_gguf_fd(fd: int, *, what: str = "file") -> GGUFInfo:
    """Read and check the header of the GGUF file open at ``fd``.

    The fd's offset is not moved (reads use ``pread``). See :func:`read_gguf`.

    Args:
        fd: an fd open for reading on a regular file.
        what: how messages name the file.

    Returns:
        The header, with the tensor list summarised.

    Raises:
        NotGGUFError: the file does not start with the GGUF magic.
        GGUFFormatError: the header is corrupt, truncated or unsupported.
        OSError: the file cannot be read.
    """
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    big_endian_version = len(head) == 8 and int.from_bytes(head[4:8], "big") in (1, 2, 3)
    if head[:4] == _GGUF_MAGIC_BE or (head[:4] == GGUF_MAGIC and big_endian_version):
        raise GGUFFormatError(
            f"{what} is a big-endian GGUF, which llmgw does not support; use a little-endian build of the model"
        )
    if head[:4] != GGUF_MAGIC:
        raise NotGGUFError(f"{what} is not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
    try:
        return _parse(fd, size)
    except GGUFFormatError as exc:
        raise GGUFFormatError(f"{what} is not a valid GGUF file: {exc}") from exc


def _parse(fd: int, size: int) -> GGUFInfo:
    cur = _Cursor(fd, size)
    cur.skip(4)
    version = cur.u32()
    if version == 1:
        raise cur.fail("GGUF version 1 is obsolete; convert the model again with a current llama.cpp")
    if version not in (2, 3):
        raise cur.fail(f"GGUF version {version} is not supported (llmgw reads versions 2 and 3)")
    tensor_count = cur.u64()
    kv_count = cur.u64()
    if tensor_count > MAX_TENSOR_COUNT:
        raise cur.fail(f"tensor count {tensor_count} is over the limit of {MAX_TENSOR_COUNT}")
    if kv_count > MAX_KV_COUNT:
        raise cur.fail(f"metadata count {kv_count} is over the limit of {MAX_KV_COUNT}")
    # Each key/value takes at least 13 bytes, each tensor info at least 24.
    if kv_count * 13 + tensor_count * 24 > cur.remaining():
        raise cur.fail(f"{kv_count} keys and {tensor_count} tensors cannot fit in a {size}-byte file")

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cur.string(MAX_KEY_LENGTH, "a metadata key")
        if not key:
            raise cur.fail("empty metadata key")
        if key in metadata:
            raise cur.fail(f"duplicate metadata key {key!r}")
        vtype = cur.u32()
        metadata[key] = _read_value(cur, vtype, key, 0)

    arch = metadata.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise cur.fail("no general.architecture: this is not a model llama.cpp can load")
    alignment = metadata.get("general.alignment", 32)
    if (
        isinstance(alignment, bool)
        or not isinstance(alignment, int)
        or alignment <= 0
        or alignment & (alignment - 1)
    ):
        raise cur.fail(f"general.alignment {alignment!r} is not a power of two")

    # Tensor infos: name, dims, type, offset. Extents are checked once the data
    # offset (the end of this list, aligned) is known.
    names: set[str] = set()
    types: Counter[str] = Counter()
    parameters = 0
    extents: list[tuple[str, int, int]] = []
    for _ in range(tensor_count):
        name = cur.string(MAX_TENSOR_NAME_LENGTH, "a tensor name")
        if name in names:
            raise cur.fail(f"duplicate tensor {name!r}")
        names.add(name)
        n_dims = cur.u32()
        if n_dims > MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")
        elements = 1
        dims = []
        for _ in range(n_dims):
            d = cur.u64()
            dims.append(d)
            elements *= d
            if elements >= 1 << 63:
                raise cur.fail(f"tensor {name!r} has too many elements")
        ggml_type = cur.u32()
        offset = cur.u64()
        if ggml_type > _MAX_GGML_TYPE:
            raise cur.fail(f"tensor {name!r} has unknown ggml type {ggml_type}")
        tname, block, bsize = GGML_TYPES.get(ggml_type, (f"type{ggml_type}", 0, 0))
        parameters += elements
        types[tname] += elements
        if bsize:
            if dims and dims[0] % block:
                raise cur.fail(
                    f"tensor {name!r}: row of {dims[0]} is not a multiple of the {tname} block of {block}"
                )
            extents.append((name, offset, elements // block * bsize))

    data_offset = -(-cur.offset // alignment) * alignment
    data_bytes = 0
    for name, offset, nbytes in extents:
        end = data_offset + offset + nbytes
        if end > size:
            raise GGUFFormatError(
                f"tensor {name!r} ends at byte {end} but the file has {size} bytes: the file is truncated"
            )
        data_bytes += nbytes
    return GGUFInfo(
        version=version,
        metadata=metadata,
        tensors=TensorSummary(
            count=tensor_count, parameter_count=parameters, types=dict(types), data_bytes=data_bytes
        ),
        alignment=alignment,
        data_offset=data_offset,
        file_size=size,
    )
