"""Importing from real Ollama-style stores: discovery, names, manifests, every refusal."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from mirror_helpers import (
    CONFIG_MT,
    MT,
    OllamaStore,
    blob_files,
    file_sha,
    minimal_gguf,
    sha,
    temp_files,
    write_gguf,
    write_projector,
)

from llmgw.mirror import MirrorStore, import_ollama
from llmgw.mirror.errors import (
    DigestMismatchError,
    GGUFFormatError,
    InvalidNameError,
    ModelExistsError,
    OllamaBlobError,
    OllamaManifestError,
    OllamaMissingBlobError,
    OllamaModelNotFoundError,
    OllamaStoreNotFoundError,
    OllamaUnsupportedError,
)
from llmgw.mirror.ollama import (
    MAX_CHECKED_BLOBS,
    SERVICE_MODELS_DIR,
    OllamaName,
    candidate_roots,
    parse_ollama_name,
)
from llmgw.mirror.ollama_list import list_ollama


@pytest.fixture
def tiny(tmp_path: Path) -> bytes:
    return write_gguf(tmp_path / "tiny.gguf").read_bytes()


@pytest.fixture
def proj(tmp_path: Path) -> bytes:
    return write_projector(tmp_path / "proj.gguf").read_bytes()


def _nothing_stored(store: MirrorStore) -> None:
    assert store.list_models() == []
    assert blob_files(store.root) == []
    assert temp_files(store.root) == []


# --- names and discovery ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("ref", "parts", "display"),
    [
        ("llama3.2", ("registry.ollama.ai", "library", "llama3.2", "latest"), "llama3.2:latest"),
        ("llama3.2:3b", ("registry.ollama.ai", "library", "llama3.2", "3b"), "llama3.2:3b"),
        ("jmorgan/tiny:q4", ("registry.ollama.ai", "jmorgan", "tiny", "q4"), "jmorgan/tiny:q4"),
        (
            "hf.co/bartowski/X-GGUF:Q4_K_M",
            ("hf.co", "bartowski", "X-GGUF", "Q4_K_M"),
            "hf.co/bartowski/X-GGUF:Q4_K_M",
        ),
        ("https://hf.co/u/m", ("hf.co", "u", "m", "latest"), "hf.co/u/m:latest"),
        ("localhost:8080/ns/m:t", ("localhost:8080", "ns", "m", "t"), "localhost:8080/ns/m:t"),
    ],
)
def test_parse_ollama_name(ref: str, parts: tuple[str, ...], display: str) -> None:
    name = parse_ollama_name(ref)
    assert name.parts == parts
    assert name.display == display


@pytest.mark.parametrize(
    "ref",
    ["../../etc/passwd", "..", "../x:latest", "library/..", "x:..", "a/b/c/d", "m:../../x", "/abs", "m@sha256:abc",
     "", "m:", "a\\b", "ns./m", ".hidden", "m:t/x"],
)  # fmt: skip
def test_names_that_escape_or_are_malformed_are_refused(ref: str) -> None:
    with pytest.raises(InvalidNameError):
        parse_ollama_name(ref)


def test_escaping_name_never_reaches_a_file_outside(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes
) -> None:
    # A manifest a naive path join would find from manifests/registry.ollama.ai/library/.
    outside = ollama.root.parent / "evil"
    outside.mkdir()
    ollama.add_model("tiny", gguf=tiny)
    manifest = ollama.manifest_path("tiny").read_bytes()
    (outside / "latest").write_bytes(manifest)
    with pytest.raises(InvalidNameError):
        import_ollama(store, "../../../../evil", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_candidate_roots(tmp_path: Path) -> None:
    home = tmp_path / "h"
    assert candidate_roots({}, home) == [home / ".ollama" / "models", SERVICE_MODELS_DIR]
    assert candidate_roots({"OLLAMA_MODELS": "/srv/ollama"}, home)[0] == Path("/srv/ollama")


def test_found_through_ollama_models_env(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    ollama.add_model("tiny", gguf=tiny)
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama.root))
    assert import_ollama(store, "tiny").record.ref == "tiny:latest"


def test_found_in_home(store: MirrorStore, tiny: bytes) -> None:
    home_store = OllamaStore(Path.home() / ".ollama" / "models")
    home_store.add_model("tiny", "q", gguf=tiny)
    assert import_ollama(store, "tiny:q").record.info["ollama"]["store"] == str(home_store.root)


def test_later_roots_are_searched(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, tmp_path: Path
) -> None:
    empty = OllamaStore(tmp_path / "empty")
    ollama.add_model("tiny", gguf=tiny)
    rec = import_ollama(store, "tiny", roots=[tmp_path / "nowhere", empty.root, ollama.root]).record
    assert rec.info["ollama"]["store"] == str(ollama.root)


def test_ollama_dir_may_be_the_dot_ollama_directory(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes
) -> None:
    ollama.add_model("tiny", gguf=tiny)
    assert import_ollama(store, "tiny", ollama_dir=ollama.root.parent).created


def test_a_relative_ollama_dir_is_recorded_absolute(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's store and manifest paths mean the same from any directory."""
    ollama.add_model("tiny", gguf=tiny)
    monkeypatch.chdir(ollama.root.parent)
    info = import_ollama(store, "tiny", ollama_dir=Path(ollama.root.name)).record.info["ollama"]
    assert info["store"] == str(ollama.root) and Path(info["manifest"]).is_absolute()
    assert info["manifest"].startswith(str(ollama.root) + os.sep)


def test_no_store_anywhere(store: MirrorStore, tmp_path: Path) -> None:
    with pytest.raises(OllamaStoreNotFoundError, match="no Ollama model store found"):
        import_ollama(store, "tiny", roots=[tmp_path / "a", tmp_path / "b"])
    with pytest.raises(OllamaStoreNotFoundError, match="not a directory"):
        import_ollama(store, "tiny", ollama_dir=tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(OllamaStoreNotFoundError, match="no manifests/"):
        import_ollama(store, "tiny", ollama_dir=tmp_path / "plain")


def test_model_not_pulled(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", gguf=tiny)
    with pytest.raises(OllamaModelNotFoundError, match="ollama pull other:7b"):
        import_ollama(store, "other:7b", ollama_dir=ollama.root)
    with pytest.raises(OllamaModelNotFoundError):
        import_ollama(store, "tiny:7b", ollama_dir=ollama.root)


def test_names_match_case_insensitively(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", "latest", gguf=tiny)
    rec = import_ollama(store, "TINY:Latest", ollama_dir=ollama.root)
    assert rec.created
    assert (rec.record.name, rec.record.tag) == ("tiny", "latest")  # as the store (and ollama list) has it
    ollama.add_model("Qwen-GGUF", "Q4_K_M", gguf=tiny, namespace="bartowski", host="hf.co")
    rec = import_ollama(store, "hf.co/bartowski/qwen-gguf:q4_k_m", ollama_dir=ollama.root)
    assert (rec.record.name, rec.record.tag) == ("hf.co/bartowski/Qwen-GGUF", "Q4_K_M")


# --- imports that work ----------------------------------------------------------------------


def test_text_model(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    manifest = ollama.add_model(
        "tiny", "1b", gguf=tiny, template="{{ .System }} {{ .Prompt }}", system="Be brief.",
        params={"stop": ["<end>"], "num_ctx": 4096}, license="Apache License 2.0\nfull text",
    )  # fmt: skip
    before = ollama.snapshot()
    result = import_ollama(store, "tiny:1b", ollama_dir=ollama.root)
    rec = result.record
    assert result.created and rec.ref == "tiny:1b"
    assert rec.source_kind == "ollama" and rec.source == "ollama:tiny:1b"
    (f,) = rec.files
    assert f.role == "model" and f.digest == sha(tiny) and f.size == len(tiny)
    assert f.filename == "sha256-" + sha(tiny)[7:]
    assert file_sha(f.path) == sha(tiny)
    assert f.gguf is not None and f.gguf["architecture"] == "llama"
    info = rec.info["ollama"]
    assert info["name"] == "tiny:1b"
    assert info["manifest"] == str(manifest)
    assert info["manifest_digest"] == sha(manifest.read_bytes())
    assert info["template"] == "{{ .System }} {{ .Prompt }}"
    assert info["system"] == "Be brief."
    assert info["params"] == {"stop": ["<end>"], "num_ctx": 4096}
    assert info["licenses"] == ["Apache License 2.0\nfull text"]
    assert info["vision"] is False
    assert info["config"]["model_format"] == "gguf" and "architecture" not in info["config"]
    # Ollama's store is only read.
    assert ollama.snapshot() == before


def test_vision_model_brings_its_projector(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, proj: bytes
) -> None:
    ollama.add_model("llava", gguf=tiny, projector=proj)
    rec = import_ollama(store, "llava", ollama_dir=ollama.root).record
    assert [(f.role, f.digest) for f in rec.files] == [("model", sha(tiny)), ("projector", sha(proj))]
    assert rec.files[1].gguf is not None and rec.files[1].gguf["is_projector"]
    assert rec.info["ollama"]["vision"] is True


def test_hugging_face_names(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("Qwen-GGUF", "Q4_K_M", gguf=tiny, namespace="bartowski", host="hf.co")
    rec = import_ollama(store, "hf.co/bartowski/Qwen-GGUF:Q4_K_M", ollama_dir=ollama.root).record
    assert (rec.name, rec.tag) == ("hf.co/bartowski/Qwen-GGUF", "Q4_K_M")


def test_custom_mirror_name(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", gguf=tiny)
    assert (
        import_ollama(store, "tiny", ollama_dir=ollama.root, name="fleet/tiny:v1").record.ref
        == "fleet/tiny:v1"
    )


def test_host_with_port_becomes_a_valid_mirror_name(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes
) -> None:
    ollama.add_model("m", "t", gguf=tiny, namespace="ns", host="localhost:8080")
    assert (
        import_ollama(store, "localhost:8080/ns/m:t", ollama_dir=ollama.root).record.ref
        == "localhost_8080/ns/m:t"
    )


def test_reimport_reuses_blobs_without_copying(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", gguf=tiny)
    import_ollama(store, "tiny", ollama_dir=ollama.root)
    again = import_ollama(store, "tiny", ollama_dir=ollama.root)
    assert not again.created and again.blobs[0].reused
    other = import_ollama(store, "tiny", ollama_dir=ollama.root, name="copy")
    assert other.created and other.blobs[0].reused
    assert len(blob_files(store.root)) == 1


def test_same_blob_as_a_file_import_is_shared(
    ollama: OllamaStore, store: MirrorStore, tmp_path: Path
) -> None:
    from llmgw.mirror import import_file

    path = write_gguf(tmp_path / "m.gguf")
    import_file(store, path)
    ollama.add_model("tiny", gguf=path.read_bytes())
    assert import_ollama(store, "tiny", ollama_dir=ollama.root).blobs[0].reused
    assert len(blob_files(store.root)) == 1


def test_legacy_colon_blob_names(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", gguf=tiny)
    blob = ollama.blob_path(sha(tiny))
    blob.rename(blob.with_name("sha256:" + sha(tiny)[7:]))
    assert import_ollama(store, "tiny", ollama_dir=ollama.root).record.files[0].digest == sha(tiny)


def test_symlink_inside_the_store_is_fine(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", gguf=tiny)
    blob = ollama.blob_path(sha(tiny))
    moved = ollama.root / "elsewhere-in-store"
    blob.rename(moved)
    blob.symlink_to(moved)
    assert import_ollama(store, "tiny", ollama_dir=ollama.root).created


def test_name_taken_in_the_mirror(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, tmp_path: Path
) -> None:
    ollama.add_model("tiny", gguf=tiny)
    ollama.add_model("tiny", "other", gguf=write_gguf(tmp_path / "o.gguf", vocab=333).read_bytes())
    import_ollama(store, "tiny", ollama_dir=ollama.root)
    with pytest.raises(ModelExistsError):
        import_ollama(store, "tiny:other", ollama_dir=ollama.root, name="tiny")
    assert store.get_model("tiny", "latest").files[0].digest == sha(tiny)


# --- refusals ----------------------------------------------------------------------------------


def test_tensor_layers_are_not_gguf(ollama: OllamaStore, store: MirrorStore) -> None:
    layers = [
        {**ollama.layer("tensor", b"\x08\x00" * 50), "name": "model.embed_tokens.weight"},
        {**ollama.layer("json", b"{}"), "name": "config.json"},
    ]
    ollama.write_manifest(layers, {"model_format": "safetensors"}, model="newengine")
    with pytest.raises(OllamaUnsupportedError, match="safetensors tensor layers"):
        import_ollama(store, "newengine", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_cloud_models_have_no_local_weights(ollama: OllamaStore, store: MirrorStore) -> None:
    cfg = {
        "remote_host": "https://ollama.com:443",
        "remote_model": "gpt-oss:120b",
        "capabilities": ["completion"],
    }
    ollama.write_manifest([], cfg, model="gpt-oss", tag="120b-cloud")
    with pytest.raises(OllamaUnsupportedError, match="cloud model"):
        import_ollama(store, "gpt-oss:120b-cloud", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_manifest_without_model_layer(ollama: OllamaStore, store: MirrorStore) -> None:
    ollama.write_manifest([ollama.layer("template", b"{{ .Prompt }}")], model="empty")
    with pytest.raises(OllamaUnsupportedError, match="no model layer"):
        import_ollama(store, "empty", ollama_dir=ollama.root)


def test_non_gguf_model_layer(ollama: OllamaStore, store: MirrorStore) -> None:
    ollama.write_manifest([ollama.layer("model", b"\x00safetensors?" * 100)], model="odd")
    with pytest.raises(OllamaUnsupportedError, match="not GGUF"):
        import_ollama(store, "odd", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_other_model_format_in_config(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.write_manifest([ollama.layer("model", tiny)], {"model_format": "safetensors"}, model="st")
    with pytest.raises(OllamaUnsupportedError, match="not GGUF"):
        import_ollama(store, "st", ollama_dir=ollama.root)


def test_missing_blob(ollama: OllamaStore, store: MirrorStore, tiny: bytes, proj: bytes) -> None:
    ollama.add_model("llava", gguf=tiny, projector=proj)
    ollama.blob_path(sha(proj)).unlink()
    with pytest.raises(OllamaBlobError, match=r"projector blob .* is missing.*ollama pull llava:latest"):
        import_ollama(store, "llava", ollama_dir=ollama.root)
    assert store.list_models() == [] and temp_files(store.root) == []


def test_missing_template_blob(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", gguf=tiny, template="T")
    ollama.blob_path(sha(b"T")).unlink()
    with pytest.raises(OllamaBlobError, match=r"template blob .* is missing"):
        import_ollama(store, "tiny", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_mismatching_blob_is_caught_before_anything_is_recorded(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes
) -> None:
    ollama.add_model("tiny", gguf=tiny)
    blob = ollama.blob_path(sha(tiny))
    data = bytearray(tiny)
    data[-3] ^= 0x01  # a flipped bit in tensor data: the header still reads fine
    blob.write_bytes(bytes(data))
    with pytest.raises(DigestMismatchError, match="is corrupt: its bytes hash to"):
        import_ollama(store, "tiny", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_mismatching_projector_after_a_good_model(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, proj: bytes
) -> None:
    ollama.add_model("llava", gguf=tiny, projector=proj)
    blob = ollama.blob_path(sha(proj))
    data = bytearray(proj)
    data[-1] ^= 0x80
    blob.write_bytes(bytes(data))
    with pytest.raises(DigestMismatchError):
        import_ollama(store, "llava", ollama_dir=ollama.root)
    # The model's blob is complete (gc can reclaim it); no row, no partial file.
    assert store.list_models() == [] and temp_files(store.root) == []
    assert [file_sha(p) for p in blob_files(store.root)] == [sha(tiny)]
    assert store.gc().blobs


def test_truncated_blob(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", gguf=tiny)
    blob = ollama.blob_path(sha(tiny))
    blob.write_bytes(tiny[:-10])
    with pytest.raises(OllamaBlobError, match=r"manifest says .*incomplete or corrupt"):
        import_ollama(store, "tiny", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_corrupt_small_layer(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.add_model("tiny", gguf=tiny, license="MIT")
    ollama.blob_path(sha(b"MIT")).write_bytes(b"BSD")
    with pytest.raises(OllamaBlobError, match=r"license blob .* is corrupt"):
        import_ollama(store, "tiny", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_corrupt_gguf_header_with_matching_digest(ollama: OllamaStore, store: MirrorStore) -> None:
    # Ollama's digest is right, but the file itself is a truncated GGUF.
    bad = minimal_gguf(elements=64)[:-4]
    ollama.write_manifest([ollama.layer("model", bad)], model="bad")
    with pytest.raises(GGUFFormatError, match="truncated"):
        import_ollama(store, "bad", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_blob_symlink_out_of_the_store(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, tmp_path: Path
) -> None:
    ollama.add_model("tiny", gguf=tiny)
    blob = ollama.blob_path(sha(tiny))
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(tiny)
    blob.unlink()
    blob.symlink_to(outside)
    with pytest.raises(OllamaBlobError, match=r"symbolic link to .*outside the Ollama store"):
        import_ollama(store, "tiny", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_manifest_symlink_out_of_the_store(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, tmp_path: Path
) -> None:
    path = ollama.add_model("tiny", gguf=tiny)
    outside = tmp_path / "manifest.json"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)
    with pytest.raises(OllamaManifestError, match="link out of the Ollama store"):
        import_ollama(store, "tiny", ollama_dir=ollama.root)


def _layer_dict(
    digest: str = "sha256:" + "a" * 64, size: object = 1, media: object = MT + "model"
) -> dict[str, object]:
    return {"mediaType": media, "digest": digest, "size": size}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[]", "not a JSON object"),
        (json.dumps({"schemaVersion": 1, "layers": []}).encode(), "schemaVersion 1"),
        (json.dumps({"schemaVersion": 2, "config": _layer_dict()}).encode(), "no layers list"),
        (json.dumps({"schemaVersion": 2, "layers": []}).encode(), "no config"),
        (json.dumps({"schemaVersion": 2, "config": _layer_dict(), "layers": ["x"]}).encode(), "not an object"),
        (json.dumps({"schemaVersion": 2, "config": _layer_dict(), "layers": [_layer_dict("md5:abc")]}).encode(),
         "malformed digest"),
        (json.dumps({"schemaVersion": 2, "config": _layer_dict(), "layers": [_layer_dict("sha256:../../x")]}).encode(),
         "malformed digest"),
        (json.dumps({"schemaVersion": 2, "config": _layer_dict(), "layers": [_layer_dict(size=-1)]}).encode(),
         "malformed size"),
        (json.dumps({"schemaVersion": 2, "config": _layer_dict(), "layers": [_layer_dict(size="12")]}).encode(),
         "malformed size"),
        (json.dumps({"schemaVersion": 2, "config": _layer_dict(), "layers": [_layer_dict(media=None)]}).encode(),
         "no mediaType"),
        (b" " * (1 << 20) + b"{}", "larger than"),
        # bench/fuzz/fuzz_ollama.py: json.loads raised RecursionError and a plain ValueError here
        (b"[" * 100_000, "not valid JSON"),
        (b'{"schemaVersion": ' + b"7" * 5000 + b"}", "not valid JSON"),
    ],
)  # fmt: skip
def test_malformed_manifests(ollama: OllamaStore, store: MirrorStore, doc: bytes, message: str) -> None:
    ollama.write_manifest([], model="broken", raw=doc)
    with pytest.raises(OllamaManifestError, match=message):
        import_ollama(store, "broken", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_two_model_layers_are_malformed(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, tmp_path: Path
) -> None:
    second = write_gguf(tmp_path / "2.gguf", vocab=301).read_bytes()
    ollama.write_manifest([ollama.layer("model", tiny), ollama.layer("model", second)], model="two")
    with pytest.raises(OllamaManifestError, match="2 model layers"):
        import_ollama(store, "two", ollama_dir=ollama.root)


def test_a_projector_as_the_model_layer_is_refused(ollama: OllamaStore, store: MirrorStore, proj: bytes) -> None:
    """The role checks `import` makes: a clip projector is no model, whatever the manifest says."""
    ollama.write_manifest([ollama.layer("model", proj)], model="mislabeled")
    with pytest.raises(OllamaManifestError, match=r"model layer of mislabeled:latest is a vision projector \(clip\)"):
        import_ollama(store, "mislabeled", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_a_model_as_the_projector_layer_is_refused(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, tmp_path: Path
) -> None:
    second = write_gguf(tmp_path / "2.gguf", vocab=301).read_bytes()
    ollama.write_manifest([ollama.layer("model", tiny), ollama.layer("projector", second)], model="mislabeled")
    with pytest.raises(OllamaManifestError, match="projector layer of mislabeled:latest is not a projector"):
        import_ollama(store, "mislabeled", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_a_layer_listed_twice_is_recorded_once(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, proj: bytes
) -> None:
    twice = ollama.layer("projector", proj)
    model = ollama.layer("model", tiny)
    ollama.write_manifest([model, twice, model, twice], model="twice")
    rec = import_ollama(store, "twice", ollama_dir=ollama.root).record
    assert [(f.role, f.digest) for f in rec.files] == [("model", sha(tiny)), ("projector", sha(proj))]
    assert rec.size == len(tiny) + len(proj)


def test_one_blob_in_two_roles_is_malformed(ollama: OllamaStore, store: MirrorStore, proj: bytes) -> None:
    ollama.write_manifest([ollama.layer("model", proj), ollama.layer("projector", proj)], model="both")
    with pytest.raises(OllamaManifestError, match="as both a model and a projector layer"):
        import_ollama(store, "both", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_config_that_is_not_json(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    cfg = ollama.blob(b"\x00 not json")
    doc = {
        "schemaVersion": 2,
        "config": {"mediaType": CONFIG_MT, **cfg},
        "layers": [ollama.layer("model", tiny)],
    }
    ollama.write_manifest([], model="cfg", raw=json.dumps(doc).encode())
    with pytest.raises(OllamaManifestError, match=r"config blob .* not valid JSON"):
        import_ollama(store, "cfg", ollama_dir=ollama.root)


@pytest.mark.parametrize("raw", [b"[" * 100_000, b'{"x": ' + b"1" * 5000 + b"}"])
def test_config_and_params_json_that_json_cannot_read(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, raw: bytes
) -> None:
    # bench/fuzz/fuzz_ollama.py: nesting and integer digits past what json.loads
    # reads escaped as RecursionError / ValueError instead of the mirror's errors
    cfg = ollama.blob(raw)
    doc = {"schemaVersion": 2, "config": {"mediaType": CONFIG_MT, **cfg}, "layers": [ollama.layer("model", tiny)]}
    ollama.write_manifest([], model="cfg", raw=json.dumps(doc).encode())
    with pytest.raises(OllamaManifestError, match=r"config blob .* not valid JSON"):
        import_ollama(store, "cfg", ollama_dir=ollama.root)
    from llmgw.mirror.ollama import parse_params

    assert parse_params(raw.decode()) == raw.decode()  # a params layer that is not JSON is kept as text


def test_oversized_small_layer_claim(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    tmpl = ollama.layer("template", b"x")
    tmpl["size"] = 1 << 30
    ollama.write_manifest([ollama.layer("model", tiny), tmpl], model="huge")
    with pytest.raises(OllamaManifestError, match="claims"):
        import_ollama(store, "huge", ollama_dir=ollama.root)


def test_unreadable_store(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    ollama.add_model("tiny", gguf=tiny)
    manifests = ollama.root / "manifests"
    if os.geteuid() == 0:
        # root reads a mode-0 directory anyway: refuse the listing as the kernel
        # would for any other user.
        real_listdir = os.listdir

        def listdir(path: Any = ".") -> list[str]:
            if os.fspath(path) == os.fspath(manifests):
                raise PermissionError(13, "Permission denied", os.fspath(path))
            return real_listdir(path)

        monkeypatch.setattr(os, "listdir", listdir)
    os.chmod(manifests, 0)
    try:
        with pytest.raises(PermissionError, match="permission denied"):
            import_ollama(store, "tiny", roots=[ollama.root])
    finally:
        os.chmod(manifests, 0o755)


def test_ollama_name_display_rules() -> None:
    assert OllamaName("registry.ollama.ai", "library", "m", "t").display == "m:t"
    assert OllamaName("registry.ollama.ai", "me", "m", "t").display == "me/m:t"
    assert OllamaName("hf.co", "library", "m", "t").display == "hf.co/library/m:t"


# --- the store's listing (GET /admin/v1/mirror/ollama) ------------------------------------


def _listed(ollama: OllamaStore) -> dict[str, Any]:
    return {m["name"]: m for m in list_ollama([ollama.root])["models"]}


def test_listing_names_a_missing_or_wrong_size_blob(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, proj: bytes
) -> None:
    ollama.add_model("good", gguf=tiny)
    ollama.add_model("missing", gguf=minimal_gguf(elements=16))
    missing = ollama.blob_path(sha(minimal_gguf(elements=16)))
    missing.unlink()
    ollama.add_model("wrongsize", gguf=minimal_gguf(elements=24))
    short = ollama.blob_path(sha(minimal_gguf(elements=24)))
    short.write_bytes(short.read_bytes()[:-7])
    ollama.add_model("llava", gguf=tiny, projector=proj, license="proj-license")
    ollama.blob_path(sha(b"proj-license")).unlink()  # a small layer the import reads

    rows = _listed(ollama)
    assert rows["good:latest"]["problem"] is None
    blobs = ollama.root / "blobs"
    assert rows["missing:latest"]["problem"].startswith(
        f"the model blob {missing.name} of missing:latest is missing from {blobs}; pull the model again")
    size = len(minimal_gguf(elements=24))
    assert rows["wrongsize:latest"]["problem"].startswith(
        f"the model blob {short.name} of wrongsize:latest has {size - 7} bytes but the manifest says {size}")
    assert "license blob sha256-" in rows["llava:latest"]["problem"]
    assert "is missing from" in rows["llava:latest"]["problem"]
    # the rest of each row is as for a sound model
    assert rows["missing:latest"]["format"] == "gguf" and rows["missing:latest"]["size"] > 0

    # what the list says is what the import says
    for name in ("missing", "wrongsize", "llava"):
        with pytest.raises(OllamaBlobError) as exc:
            import_ollama(store, name, ollama_dir=ollama.root)
        assert str(exc.value) == rows[f"{name}:latest"]["problem"]
    with pytest.raises(OllamaMissingBlobError):
        import_ollama(store, "missing", ollama_dir=ollama.root)
    _nothing_stored(store)


def test_listing_checks_the_config_blob_and_finds_legacy_names(ollama: OllamaStore, tiny: bytes) -> None:
    path = ollama.write_manifest([ollama.layer("model", tiny)], {"model_type": "own config"}, model="noconfig")
    ollama.blob_path(json.loads(path.read_bytes())["config"]["digest"]).unlink()
    ollama.add_model("legacy", gguf=minimal_gguf(elements=40))
    blob = ollama.blob_path(sha(minimal_gguf(elements=40)))
    blob.rename(blob.with_name("sha256:" + blob.name[7:]))
    rows = _listed(ollama)
    assert "is missing from" in rows["noconfig:latest"]["problem"]
    assert rows["legacy:latest"]["problem"] is None


def test_listing_never_reads_a_blob(ollama: OllamaStore, tiny: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only stat: a blob of the right size with damaged bytes is listed, and the import's digest check refuses it."""
    ollama.add_model("flipped", gguf=tiny)
    blob = ollama.blob_path(sha(tiny))
    data = bytearray(tiny)
    data[-3] ^= 0x01
    blob.write_bytes(bytes(data))
    blobs = str(ollama.root / "blobs")
    real_open, real_os_open = open, os.open

    def guarded_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        assert not os.fspath(path).startswith(blobs), f"the listing read {path}"
        return real_open(path, *args, **kwargs)

    def guarded_os_open(path: Any, *args: Any, **kwargs: Any) -> int:
        assert not os.fspath(path).startswith(blobs), f"the listing opened {path}"
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", guarded_open)
    monkeypatch.setattr(os, "open", guarded_os_open)
    assert _listed(ollama)["flipped:latest"]["problem"] is None


def test_listing_stays_bounded_on_huge_manifests(
    ollama: OllamaStore, tiny: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # many tags sharing one model blob, one manifest naming far more license blobs than a pull makes
    for tag in ("a", "b", "c"):
        ollama.add_model("shared", tag, gguf=tiny)
    licenses = [ollama.layer("license", f"license {i}".encode()) for i in range(3 * MAX_CHECKED_BLOBS)]
    ollama.write_manifest([ollama.layer("model", tiny), *licenses], model="many")
    stats: list[str] = []
    real_stat = os.stat

    def counting_stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if "blobs" in os.fspath(path):
            stats.append(os.fspath(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counting_stat)
    rows = _listed(ollama)
    assert all(rows[n]["problem"] is None for n in ("shared:a", "shared:b", "shared:c", "many:latest"))
    # the shared blobs once each (config, model, template, license, params), the big manifest up to the bound
    assert len(stats) <= 5 + MAX_CHECKED_BLOBS
    assert len(set(stats)) == len(stats)


def test_listing_explains_two_model_layers(ollama: OllamaStore, store: MirrorStore, tiny: bytes) -> None:
    ollama.write_manifest([ollama.layer("model", tiny), ollama.layer("model", minimal_gguf())], model="two")
    assert "2 model layers" in _listed(ollama)["two:latest"]["problem"]


def test_listing_shows_manifest_links_and_why_one_leaving_the_store_is_refused(
    ollama: OllamaStore, store: MirrorStore, tiny: bytes, tmp_path: Path
) -> None:
    # a link inside the store is fine (the import follows it), one out of it is refused
    real = ollama.add_model("target", gguf=tiny)
    inside = ollama.manifest_path("alias")
    inside.parent.mkdir(parents=True)
    inside.symlink_to(real)
    outside = tmp_path / "manifest.json"
    outside.write_bytes(real.read_bytes())
    escaping = ollama.manifest_path("escape")
    escaping.parent.mkdir(parents=True)
    escaping.symlink_to(outside)

    rows = _listed(ollama)
    assert rows["alias:latest"]["problem"] is None and rows["alias:latest"]["digest"] == sha(tiny)
    problem = rows["escape:latest"]["problem"]
    assert f"symbolic link to {outside}, outside the Ollama store" in problem
    assert rows["escape:latest"]["digest"] is None  # nothing was read through the link
    assert import_ollama(store, "alias", ollama_dir=ollama.root).record.ref == "alias:latest"
    with pytest.raises(OllamaManifestError, match="link out of the Ollama store"):
        import_ollama(store, "escape", ollama_dir=ollama.root)
