"""The content-addressed store and catalogue, and plain-file imports, in process."""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from mirror_helpers import blob_files, catalogue_models, expected_parameters, file_sha, temp_files, write_gguf

import llmgw.mirror.store as store_mod
from llmgw.mirror import MirrorStore, default_root, import_file
from llmgw.mirror.catalogue import FileEntry
from llmgw.mirror.errors import (
    CatalogueError,
    DigestMismatchError,
    GGUFFormatError,
    InvalidNameError,
    MirrorBusyError,
    ModelExistsError,
    ModelNotFoundError,
    NoSpaceError,
    NotGGUFError,
    SourceChangedError,
    SourceError,
)
from llmgw.mirror.names import name_from_filename, parse_ref

# --- roots and names -------------------------------------------------------------------


def test_default_root_precedence(tmp_path: Path) -> None:
    home = Path.home()
    assert default_root({}) == home / ".local" / "share" / "llmgw" / "mirror"
    assert default_root({"XDG_DATA_HOME": "/data"}) == Path("/data/llmgw/mirror")
    # A relative XDG_DATA_HOME is invalid per the spec and ignored.
    assert default_root({"XDG_DATA_HOME": "rel"}) == home / ".local" / "share" / "llmgw" / "mirror"
    assert default_root({"XDG_DATA_HOME": "/data", "LLMGW_MIRROR": str(tmp_path)}) == tmp_path
    assert default_root({"LLMGW_MIRROR": "~/m"}) == home / "m"


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("qwen2.5", ("qwen2.5", "latest")),
        ("qwen2.5:7b", ("qwen2.5", "7b")),
        ("bartowski/Qwen2.5-7B-GGUF:Q4_K_M", ("bartowski/Qwen2.5-7B-GGUF", "Q4_K_M")),
        ("hf.co/user/repo:Q8_0", ("hf.co/user/repo", "Q8_0")),
    ],
)
def test_parse_ref(ref: str, expected: tuple[str, str]) -> None:
    assert parse_ref(ref) == expected


@pytest.mark.parametrize(
    "ref", ["", ":tag", "a:", "../x", "a/../b", "a/b/c/d", "-x", "a b", "x:../y", "a//b", "é"]
)
def test_parse_ref_refuses(ref: str) -> None:
    with pytest.raises(InvalidNameError):
        parse_ref(ref)


def test_name_from_filename() -> None:
    assert name_from_filename("/x/Qwen2.5-0.5B-Instruct-Q4_K_M.gguf") == "Qwen2.5-0.5B-Instruct-Q4_K_M"
    assert name_from_filename("my model (v2).GGUF") == "my-model-v2"
    assert name_from_filename(".hidden") == "hidden"
    for unnamed in ("...", "模型.gguf", "мой.gguf", "-_-.gguf"):
        with pytest.raises(InvalidNameError, match=r"cannot name a model after the file name .*give it one with --name"):
            name_from_filename(unnamed)
    assert name_from_filename("мой-v2.gguf") == "v2"


# --- importing a file ----------------------------------------------------------------------


def test_import_file_stores_blob_and_records_header(store: MirrorStore, model_file: Path) -> None:
    before = file_sha(model_file)
    result = import_file(store, model_file)
    rec = result.record
    assert result.created
    assert rec.ref == "Tiny-Llama-F16:latest"
    assert rec.source_kind == "file"
    assert rec.source == str(model_file)
    (f,) = rec.files
    assert f.role == "model"
    assert f.digest == before
    assert f.size == model_file.stat().st_size
    assert f.filename == model_file.name
    assert f.gguf is not None
    assert f.gguf["architecture"] == "llama"
    assert f.gguf["name"] == "Tiny"
    assert f.gguf["context_length"] == 2048
    assert f.gguf["quantization"] == "F16"
    assert f.gguf["parameter_count"] == expected_parameters()
    # Layout: blobs/sha256/<2 hex>/<64 hex>, read-only, same bytes.
    hexd = before[7:]
    assert f.path == store.root / "blobs" / "sha256" / hexd[:2] / hexd
    assert file_sha(f.path) == before
    assert stat.S_IMODE(f.path.stat().st_mode) == 0o444
    assert temp_files(store.root) == []
    # The source is untouched.
    assert file_sha(model_file) == before
    # Reading back through a fresh store gives the same record.
    with MirrorStore(store.root, create=False) as again:
        assert again.get_model("tiny-llama-f16", "LATEST").to_json() == rec.to_json()


def test_same_blob_is_stored_once(store: MirrorStore, model_file: Path) -> None:
    first = import_file(store, model_file, name="a")
    second = import_file(store, model_file, name="b:q")
    assert second.blobs[0].reused and not first.blobs[0].reused
    assert len(blob_files(store.root)) == 1
    assert [m.ref for m in store.list_models()] == ["a:latest", "b:q"]


def test_reimport_is_idempotent(store: MirrorStore, model_file: Path) -> None:
    import_file(store, model_file, name="m")
    again = import_file(store, model_file, name="m")
    assert not again.created
    assert catalogue_models(store.root) == ["m:latest"]


def test_name_taken_by_other_files_is_refused_and_kept(
    store: MirrorStore, model_file: Path, tmp_path: Path
) -> None:
    import_file(store, model_file, name="m")
    other = write_gguf(tmp_path / "other.gguf", name="Other", vocab=301)
    with pytest.raises(ModelExistsError, match="already in the mirror with different files"):
        import_file(store, other, name="m")
    # Same size, different bytes: caught by digest when recording.
    same_size = write_gguf(tmp_path / "same.gguf", name="Tinx")
    assert same_size.stat().st_size == model_file.stat().st_size
    with pytest.raises(ModelExistsError):
        import_file(store, same_size, name="m")
    assert store.get_model("m", "latest").files[0].digest == file_sha(model_file)


def test_projector_is_kept_with_the_model(store: MirrorStore, model_file: Path, projector_file: Path) -> None:
    rec = import_file(store, model_file, name="vis", projectors=[projector_file]).record
    assert [f.role for f in rec.files] == ["model", "projector"]
    proj = rec.files[1]
    assert proj.digest == file_sha(projector_file)
    assert proj.gguf is not None and proj.gguf["is_projector"] and proj.gguf["architecture"] == "clip"


def test_projector_and_model_swapped_are_refused(
    store: MirrorStore, model_file: Path, projector_file: Path
) -> None:
    with pytest.raises(SourceError, match="is a vision projector"):
        import_file(store, projector_file)
    with pytest.raises(SourceError, match="is not a projector"):
        import_file(store, model_file, projectors=[model_file])
    assert store.list_models() == []


def test_non_gguf_is_refused_unless_raw(store: MirrorStore, tmp_path: Path) -> None:
    raw = tmp_path / "weights.bin"
    raw.write_bytes(os.urandom(5000))
    with pytest.raises(NotGGUFError, match="pass --raw"):
        import_file(store, raw)
    assert blob_files(store.root) == []
    rec = import_file(store, raw, raw=True).record
    assert rec.ref == "weights.bin:latest"
    assert rec.files[0].gguf is None
    assert rec.files[0].digest == file_sha(raw)


def test_corrupt_gguf_is_refused_before_copying(store: MirrorStore, model_file: Path) -> None:
    with open(model_file, "r+b") as f:
        f.truncate(model_file.stat().st_size - 100)
    with pytest.raises(GGUFFormatError, match="truncated"):
        import_file(store, model_file)
    assert blob_files(store.root) == [] and temp_files(store.root) == []
    assert store.list_models() == []


def test_split_gguf_is_refused(store: MirrorStore, tmp_path: Path) -> None:
    shard = write_gguf(tmp_path / "m-00001-of-00003.gguf", extra={"split.count": 3, "split.no": 0})
    with pytest.raises(GGUFFormatError, match="llama-gguf-split --merge"):
        import_file(store, shard)


@pytest.mark.parametrize("kind", ["missing", "directory", "fifo", "empty"])
def test_bad_sources_are_refused(store: MirrorStore, tmp_path: Path, kind: str) -> None:
    path = tmp_path / "src.gguf"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)  # must not hang waiting for a writer
    elif kind == "empty":
        path.touch()
    with pytest.raises(SourceError, match={"missing": "does not exist", "directory": "is a directory",
                                           "fifo": "not a regular file", "empty": "is empty"}[kind]):  # fmt: skip
        import_file(store, path)


def test_symlinked_source_is_followed(store: MirrorStore, model_file: Path, tmp_path: Path) -> None:
    # Hugging Face's cache is all links; importing through one is normal.
    link = tmp_path / "link.gguf"
    link.symlink_to(model_file)
    rec = import_file(store, link).record
    assert rec.files[0].digest == file_sha(model_file)
    assert link.is_symlink() and model_file.exists()


# --- safety ----------------------------------------------------------------------------------


def test_disk_full_mid_copy_leaves_nothing(
    store: MirrorStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = write_gguf(tmp_path / "big.gguf", big_tensor_elements=4 << 20)  # 16 MiB: the threaded path
    calls = []
    orig = store_mod._write_all

    def full(fd: int, view: memoryview) -> None:
        calls.append(len(view))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        orig(fd, view)

    monkeypatch.setattr(store_mod, "_write_all", full)
    with pytest.raises(NoSpaceError, match=r"filled up.*nothing was recorded"):
        import_file(store, big)
    assert blob_files(store.root) == [] and temp_files(store.root) == []
    assert store.list_models() == []
    monkeypatch.setattr(store_mod, "_write_all", orig)
    assert import_file(store, big).created


def test_too_little_space_is_refused_up_front(
    store: MirrorStore, model_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_mod, "_free_bytes", lambda path: 1000)
    with pytest.raises(NoSpaceError, match="not enough space"):
        import_file(store, model_file)
    assert temp_files(store.root) == [] and blob_files(store.root) == []


def test_source_changing_during_copy_is_refused(
    store: MirrorStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_gguf(tmp_path / "grow.gguf")
    orig = store_mod._write_all

    def append_to_source(fd: int, view: memoryview) -> None:
        orig(fd, view)
        with open(src, "ab") as f:
            f.write(b"more")

    monkeypatch.setattr(store_mod, "_write_all", append_to_source)
    with pytest.raises(SourceChangedError, match="changed while"):
        import_file(store, src)
    assert blob_files(store.root) == [] and temp_files(store.root) == []
    assert store.list_models() == []


def test_expected_digest_mismatch_leaves_nothing(store: MirrorStore, model_file: Path) -> None:
    with store.importing(), pytest.raises(DigestMismatchError, match="is corrupt"):
        store.add_blob(model_file, expected_digest="sha256:" + "0" * 64)
    assert blob_files(store.root) == [] and temp_files(store.root) == []


def test_corrupt_existing_blob_is_replaced_by_a_verified_copy(store: MirrorStore, model_file: Path) -> None:
    rec = import_file(store, model_file, name="m").record
    blob = rec.files[0].path
    os.chmod(blob, 0o644)
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    (check,) = store.verify()
    assert check.status == "corrupt" and check.actual == file_sha(blob) and check.models == ("m:latest",)
    # Importing the same file again repairs the blob.
    again = import_file(store, model_file, name="m")
    assert not again.created and not again.blobs[0].reused
    assert file_sha(blob) == rec.files[0].digest
    assert [c.status for c in store.verify()] == ["ok"]


def test_wrong_size_existing_blob_is_replaced(store: MirrorStore, model_file: Path) -> None:
    rec = import_file(store, model_file, name="m").record
    blob = rec.files[0].path
    os.chmod(blob, 0o644)
    with open(blob, "ab") as f:
        f.write(b"junk")
    assert [c.status for c in store.verify()] == ["wrong-size"]
    import_file(store, model_file, name="m")
    assert [c.status for c in store.verify()] == ["ok"]


def test_temp_names_never_reuse_an_existing_file(
    store: MirrorStore, model_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    planted = store.tmp_dir / f"{os.getpid()}-{'a' * 16}.partial"
    planted.symlink_to(victim)
    names = iter(["a" * 16, "b" * 16])
    monkeypatch.setattr(store_mod.secrets, "token_hex", lambda n: next(names))
    assert import_file(store, model_file).created
    assert victim.read_text() == "precious"


def test_record_refuses_blobs_not_in_place(store: MirrorStore) -> None:
    entry = FileEntry("model", "sha256:" + "1" * 64, 10, "x", "/x")
    with pytest.raises(SourceError, match="not in the store"):
        store.record_model("x", "latest", [entry], source_kind="file", source="/x")
    assert store.list_models() == []


# --- rm, verify, gc --------------------------------------------------------------------------


def test_rm_keeps_blobs_until_gc(store: MirrorStore, model_file: Path) -> None:
    rec = import_file(store, model_file, name="m").record
    import_file(store, model_file, name="n")
    store.remove_model("m", "latest")
    with pytest.raises(ModelNotFoundError):
        store.get_model("m", "latest")
    with pytest.raises(ModelNotFoundError):
        store.remove_model("m", "latest")
    assert store.gc().blobs == []  # still used by n
    store.remove_model("n", "latest")
    assert store.unused_bytes() == rec.size
    dry = store.gc(dry_run=True)
    assert [d for d, _, _ in dry.blobs] == [rec.files[0].digest]
    assert blob_files(store.root) == [rec.files[0].path]
    report = store.gc()
    assert report.reclaimed == rec.size
    assert blob_files(store.root) == []


def test_gc_removes_stale_temp_files_but_nothing_foreign(store: MirrorStore, model_file: Path) -> None:
    import_file(store, model_file)
    stale = store.tmp_dir / "4242-0123456789abcdef.partial"
    stale.write_bytes(b"x" * 100)
    foreign = [store.root / "notes.txt", store.tmp_dir / "keep.me", store.blobs_dir / "ab" / "not-a-digest"]
    for p in foreign:
        p.parent.mkdir(exist_ok=True)
        p.write_text("mine")
    report = store.gc()
    assert report.temp_files == [(stale, 100)]
    assert report.blobs == []
    assert not stale.exists()
    assert all(p.read_text() == "mine" for p in foreign)
    assert len(store.list_models()) == 1


def test_gc_refuses_while_an_import_holds_the_mirror(store: MirrorStore, model_file: Path) -> None:
    import_file(store, model_file, name="m")
    store.remove_model("m", "latest")
    with MirrorStore(store.root) as other, other.importing():
        with pytest.raises(MirrorBusyError, match="importing"):
            store.gc()
        assert store.gc(dry_run=True).blobs  # a dry run only reads
    assert store.gc().blobs


def test_verify_reports_missing_blobs(store: MirrorStore, model_file: Path, projector_file: Path) -> None:
    rec = import_file(store, model_file, name="v", projectors=[projector_file]).record
    rec.files[1].path.unlink()
    checks = {c.digest: c for c in store.verify()}
    assert checks[rec.files[0].digest].ok
    assert checks[rec.files[1].digest].status == "missing"
    only = store.verify([store.get_model("v", "latest")])
    assert len(only) == 2


# --- the catalogue -----------------------------------------------------------------------------


def test_catalogue_from_a_newer_llmgw_is_refused(store: MirrorStore, model_file: Path) -> None:
    import_file(store, model_file)
    store.close()
    db = sqlite3.connect(store.catalogue_path)
    db.execute("PRAGMA user_version=99")
    db.close()
    with pytest.raises(CatalogueError, match="newer llmgw"):
        MirrorStore(store.root)


def test_unreadable_catalogue_is_refused(root: Path) -> None:
    root.mkdir()
    (root / "catalogue.sqlite3").write_bytes(b"this is not a database" * 100)
    with pytest.raises(CatalogueError, match=r"is damaged or not an llmgw catalogue .*Move it aside"):
        MirrorStore(root)


def test_catalogue_uses_wal(store: MirrorStore) -> None:
    db = sqlite3.connect(store.catalogue_path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        db.close()


def test_symlinked_layout_directory_is_refused(root: Path, tmp_path: Path) -> None:
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "tmp").symlink_to(elsewhere)
    with pytest.raises(SourceError, match="symbolic link"):
        MirrorStore(root)
