"""Helpers for the mirror tests: GGUF files (with the gguf package and by hand) and Ollama stores.

Run as a script, it is ``llmgw`` with a breakpoint that stops an import at a chosen
point of the real code (set with the tracer; nothing is replaced by a copy), so a
test can kill it there (see :func:`hooked_main`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

# --- GGUF written by the gguf package ------------------------------------------


def write_gguf(
    path: Path,
    *,
    arch: str = "llama",
    name: str = "Tiny",
    context_length: int = 2048,
    file_type: int | None = 1,
    block_count: int = 2,
    vocab: int = 300,
    width: int = 32,
    general_type: str | None = None,
    extra: dict[str, Any] | None = None,
    big_tensor_elements: int = 0,
) -> Path:
    """Write a small, valid GGUF model with the gguf package; return ``path``."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(context_length)
    w.add_block_count(block_count)
    w.add_embedding_length(width)
    w.add_head_count(4)
    if file_type is not None:
        w.add_file_type(file_type)
    if general_type is not None:
        w.add_type(general_type)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"tok{i}" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    for key, value in (extra or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    w.add_tensor("token_embd.weight", np.ones((vocab, width), dtype=np.float32))
    for b in range(block_count):
        w.add_tensor(f"blk.{b}.attn_q.weight", np.full((width, width), b, dtype=np.float16))
    if big_tensor_elements:
        w.add_tensor("output.weight", np.arange(big_tensor_elements, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expected_parameters(*, vocab: int = 300, width: int = 32, block_count: int = 2, big: int = 0) -> int:
    """The parameter count of a :func:`write_gguf` model."""
    return vocab * width + block_count * width * width + big


def write_projector(path: Path, *, style: str = "clip") -> Path:
    """Write a small vision projector GGUF the way llama.cpp's mmproj files look."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("Tiny Vision")
    if style == "mmproj":
        w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.block_count", 1)
    w.add_file_type(1)
    w.add_tensor("v.patch_embd.weight", np.ones((16, 48), dtype=np.float16))
    w.add_tensor("mm.0.weight", np.ones((32, 16), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- GGUF by hand ---------------------------------------------------------------

T_U8, T_I8, T_U16, T_I16, T_U32, T_I32, T_F32, T_BOOL, T_STR, T_ARR, T_U64, T_I64, T_F64 = range(13)
_FMT = {T_U8: "<B", T_I8: "<b", T_U16: "<H", T_I16: "<h", T_U32: "<I", T_I32: "<i", T_F32: "<f",
        T_BOOL: "<?", T_U64: "<Q", T_I64: "<q", T_F64: "<d"}  # fmt: skip


def gstr(s: str | bytes) -> bytes:
    """A GGUF string: u64 length and the bytes."""
    raw = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(raw)) + raw


def gvalue(vtype: int, value: Any) -> bytes:
    """Encode a value; an array value is ``(elem_type, [values])``."""
    if vtype == T_STR:
        return gstr(value)
    if vtype == T_ARR:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(gvalue(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


def gkv(key: str, vtype: int, value: Any) -> bytes:
    """One metadata key/value."""
    return gstr(key) + struct.pack("<I", vtype) + gvalue(vtype, value)


def gtensor(name: str, dims: Sequence[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    """One tensor info."""
    return (
        gstr(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def gguf_bytes(
    kvs: Sequence[bytes],
    tensors: Sequence[bytes] = (),
    *,
    data: bytes = b"",
    version: int = 3,
    magic: bytes = b"GGUF",
    alignment: int = 32,
    n_kv: int | None = None,
    n_tensors: int | None = None,
) -> bytes:
    """A GGUF file from encoded parts; counts may lie (``n_kv``, ``n_tensors``)."""
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)  # fmt: skip
    body = head + b"".join(kvs) + b"".join(tensors)
    pad = (-len(body)) % alignment
    return body + b"\0" * pad + data


def minimal_gguf(*, arch: str = "llama", elements: int = 8, extra_kvs: Sequence[bytes] = ()) -> bytes:
    """A tiny valid GGUF: one F32 tensor of ``elements``."""
    return gguf_bytes(
        [gkv("general.architecture", T_STR, arch), gkv(f"{arch}.context_length", T_U32, 512), *extra_kvs],
        [gtensor("w", [elements], 0, 0)],
        data=b"\1" * (4 * elements),
    )


# --- Ollama stores -----------------------------------------------------------------

MT = "application/vnd.ollama.image."
CONFIG_MT = "application/vnd.docker.container.image.v1+json"
MANIFEST_MT = "application/vnd.docker.distribution.manifest.v2+json"


def sha(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


class OllamaStore:
    """Builds a models directory laid out exactly as Ollama lays it out."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "blobs").mkdir(parents=True, exist_ok=True)
        (root / "manifests").mkdir(parents=True, exist_ok=True)

    def blob(self, data: bytes) -> dict[str, Any]:
        """Store ``data`` as a blob; return its descriptor (digest and size)."""
        digest = sha(data)
        (self.root / "blobs" / ("sha256-" + digest[7:])).write_bytes(data)
        return {"digest": digest, "size": len(data)}

    def blob_path(self, digest: str) -> Path:
        """The blob file of ``digest``."""
        return self.root / "blobs" / ("sha256-" + digest[7:])

    def layer(self, kind: str, data: bytes) -> dict[str, Any]:
        """Store a blob and return its manifest layer of media type ``kind``."""
        return {"mediaType": MT + kind, **self.blob(data)}

    def manifest_path(self, model: str, tag: str = "latest", namespace: str = "library",
                      host: str = "registry.ollama.ai") -> Path:  # fmt: skip
        """Where the manifest of ``host/namespace/model:tag`` lives."""
        return self.root / "manifests" / host / namespace / model / tag

    def write_manifest(self, layers: list[dict[str, Any]], config: dict[str, Any] | None = None, *,
                       model: str, tag: str = "latest", namespace: str = "library",
                       host: str = "registry.ollama.ai", raw: bytes | None = None) -> Path:  # fmt: skip
        """Write a manifest (``raw`` bytes verbatim if given); return its path."""
        cfg = {"model_format": "gguf", "model_family": "llama", "model_families": ["llama"],
               "model_type": "5K", "file_type": "F16", "architecture": "amd64", "os": "linux",
               "rootfs": {"type": "layers", "diff_ids": []}}  # fmt: skip
        cfg.update(config or {})
        doc = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MT,
            "config": {"mediaType": CONFIG_MT, **self.blob(json.dumps(cfg).encode())},
            "layers": layers,
        }
        path = self.manifest_path(model, tag, namespace, host)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw if raw is not None else json.dumps(doc).encode())
        return path

    def add_model(self, model: str = "tiny", tag: str = "latest", *, gguf: bytes, projector: bytes | None = None,
                  namespace: str = "library", host: str = "registry.ollama.ai",
                  template: str = "{{ .Prompt }}", params: dict[str, Any] | None = None,
                  license: str = "MIT License\n\nCopyright", system: str | None = None) -> Path:  # fmt: skip
        """Add a GGUF model (optionally with a projector) the way ``ollama pull`` leaves it."""
        layers = [self.layer("model", gguf)]
        if projector is not None:
            layers.append(self.layer("projector", projector))
        layers.append(self.layer("template", template.encode()))
        if system is not None:
            layers.append(self.layer("system", system.encode()))
        layers.append(self.layer("license", license.encode()))
        layers.append(
            self.layer("params", json.dumps(params or {"stop": ["<|end|>"], "temperature": 0.6}).encode())
        )
        return self.write_manifest(layers, model=model, tag=tag, namespace=namespace, host=host)

    def snapshot(self) -> dict[str, tuple[int, int, str]]:
        """Every file with its size, mtime and hash: to prove the store was not touched."""
        out = {}
        for p in sorted(self.root.rglob("*")):
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                out[str(p)] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        return out


# --- the mirror, inspected from outside ----------------------------------------------


def blob_files(root: Path) -> list[Path]:
    """Every file under the mirror's ``blobs/``."""
    return sorted(p for p in (root / "blobs").rglob("*") if p.is_file())


def temp_files(root: Path) -> list[Path]:
    """Every file under the mirror's ``tmp/``."""
    return sorted((root / "tmp").iterdir()) if (root / "tmp").exists() else []


def catalogue_models(root: Path) -> list[str]:
    """The ``name:tag`` of every model, read with plain sqlite3."""
    import sqlite3

    db = sqlite3.connect(root / "catalogue.sqlite3")
    try:
        return [f"{n}:{t}" for n, t in db.execute("SELECT name, tag FROM models ORDER BY name, tag")]
    finally:
        db.close()


def file_sha(path: Path) -> str:
    """``sha256:<hex>`` of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


# --- a hooked llmgw for interruption and concurrency tests ---------------------------


def _touch(path: str) -> None:
    with open(path, "a"):
        pass


def _break_in(
    func: Any, at: str | None, then: Callable[[], None], when: Callable[[FrameType], bool] | None = None
) -> None:
    """Call ``then()`` when the real ``func`` reaches the line holding ``at`` (when it is
    called, for ``None``) and ``when(frame)`` holds: a breakpoint set with the tracer, so
    the process stops inside the project's own code, not in a copy of it.

    Raises:
        AssertionError: ``at`` is not on exactly one line of ``func`` (the code changed:
            the test must follow it).
    """
    code = inspect.unwrap(func).__code__
    line = -1
    if at is not None:
        lines, first = inspect.getsourcelines(code)
        hits = [first + i for i, text in enumerate(lines) if at in text]
        assert len(hits) == 1, f"{at!r} is on {len(hits)} lines of {code.co_qualname}"
        line = hits[0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == line and (when is None or when(frame)):
            then()
        return local

    def global_(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None  # (no line events anywhere else: the rest runs at full speed)
        if at is None and (when is None or when(frame)):
            then()
        return local

    sys.settrace(global_)
    threading.settrace(global_)


def hooked_main(argv: list[str]) -> None:
    """Run ``llmgw ARGV`` with hooks set by environment variables.

    * ``MIRROR_TEST_PAUSE``: where to stop, touching ``MIRROR_TEST_MARKER`` and
      sleeping so the test can kill the process there: ``copy`` (after the first
      chunk of the ``MIRROR_TEST_NTH`` file is written), ``place`` (copied and
      fsync'd, not yet linked), ``record`` (blobs placed, catalogue not written),
      ``commit`` (inside the catalogue transaction, before COMMIT).
    * ``MIRROR_TEST_BARRIER``: a directory; each process waits before placing its
      blob until ``MIRROR_TEST_PARTIES`` processes have arrived, so all of them
      race for the same name at once.
    """
    import llmgw.mirror.catalogue as cat
    import llmgw.mirror.store as st
    from llmgw.cli import main

    pause = os.environ.get("MIRROR_TEST_PAUSE", "")
    marker = os.environ.get("MIRROR_TEST_MARKER", "")
    nth = int(os.environ.get("MIRROR_TEST_NTH", "1"))

    def stop() -> None:
        _touch(marker)
        time.sleep(60)

    if pause == "copy":
        st.COPY_CHUNK = 64 << 10
        st._PIPELINE_MIN = 3 * st.COPY_CHUNK
        orig_write = st._write_all
        seen: list[int] = []  # inodes: fd numbers are reused from one file to the next

        def slow_write(fd: int, view: memoryview) -> None:
            orig_write(fd, view)
            ino = os.fstat(fd).st_ino
            if ino not in seen:
                seen.append(ino)
                if len(seen) == nth:
                    stop()

        st._write_all = slow_write
    elif pause == "place":
        _break_in(st.MirrorStore._place, None, stop)
    elif pause == "record":
        _break_in(cat.Catalogue.add, None, stop)
    elif pause == "commit":
        # in the real transaction, at its COMMIT, once the block has recorded a model
        _break_in(
            cat.Catalogue.transaction,
            'db.execute("COMMIT")',
            stop,
            when=lambda frame: bool(frame.f_locals["db"].execute("SELECT count(*) FROM models").fetchone()[0]),
        )

    barrier = os.environ.get("MIRROR_TEST_BARRIER")
    if barrier:
        parties = int(os.environ["MIRROR_TEST_PARTIES"])
        orig_place2 = st.MirrorStore._place

        def racing_place(self: Any, *args: Any, **kwargs: Any) -> Any:
            _touch(os.path.join(barrier, str(os.getpid())))
            deadline = time.monotonic() + 20
            while len(os.listdir(barrier)) < parties and time.monotonic() < deadline:
                time.sleep(0.005)
            return orig_place2(self, *args, **kwargs)

        st.MirrorStore._place = racing_place  # type: ignore[method-assign]

    main(argv, prog_name="llmgw")


if __name__ == "__main__":
    hooked_main(sys.argv[1:])
