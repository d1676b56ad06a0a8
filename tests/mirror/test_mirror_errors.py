"""What the mirror says when the catalogue or the disk fails it: a read-only mirror (still
readable), a catalogue this user cannot write, a full disk at COMMIT, a file size limit, things in
the way inside the store. Every refusal is one ``llmgw: error:`` line that names the fix.

A read-only file is read-only only to a process without root's capabilities: as root (CI), the
commands run under ``setpriv`` with every capability dropped, as the same uid; as any other user,
as they are. A test that cannot create the condition is skipped, never passed.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from mirror_helpers import blob_files, file_sha, temp_files, write_gguf

import llmgw.mirror.catalogue as cat
import llmgw.mirror.store as store_mod
from llmgw.cli.mirror import mirror
from llmgw.mirror import MirrorStore, import_file
from llmgw.mirror.errors import NoSpaceError, StoreLayoutError
from tools import need, need_tool

# --- helpers ---------------------------------------------------------------------------------


def _unprivileged(tmp_path: Path) -> list[str]:
    """A command prefix under which a read-only file is read-only (skip where there is none)."""
    if os.geteuid() != 0:
        prefix: list[str] = []
    else:
        prefix = [need_tool("setpriv", install="util-linux"), "--inh-caps=-all", "--bounding-set=-all"]
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    probe.chmod(0o444)
    code = f"try: open({str(probe)!r}, 'ab')\nexcept PermissionError: raise SystemExit(3)"
    try:
        p = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True)
    finally:
        probe.unlink()
    # (3: refused, as wanted; anything else: setpriv could not drop the capabilities, or they stayed)
    need(p.returncode == 3, "a process that a read-only file refuses (root without capabilities)")
    return prefix


def _llmgw(prefix: list[str], root: Path, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "llmgw", "mirror", "--root", str(root), *map(str, args)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _one_line(p: subprocess.CompletedProcess[str] | Result, *needles: str) -> str:
    """The one ``llmgw: error:`` line of a failed command; it holds each of ``needles``."""
    rc = p.returncode if isinstance(p, subprocess.CompletedProcess) else p.exit_code
    assert rc == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("llmgw: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "move it aside" not in lines[0]  # (only for what is not an llmgw catalogue)
    return lines[0]


def _chmod_tree(root: Path, dirs: int, files: int) -> None:
    for d, _, names in os.walk(root):
        for n in names:
            os.chmod(os.path.join(d, n), files)
        os.chmod(d, dirs)


@pytest.fixture
def mirrored(root: Path, model_file: Path, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A mirror with one model (``tiny``) and one unused blob; made writable again afterwards."""
    other = write_gguf(tmp_path / "src" / "other.gguf", vocab=301)
    with MirrorStore(root) as s:
        import_file(s, model_file, name="tiny")
        import_file(s, other, name="other")
        s.remove_model("other", "latest")
    yield root, file_sha(other)
    _chmod_tree(root, 0o755, 0o644)


def _state(root: Path) -> tuple[list[str], list[str]]:
    """Blobs on disk, and the models the catalogue has (read as the test's own user)."""
    # (read-write: a read-only connection would leave -wal and -shm files behind, writable ones)
    db = sqlite3.connect(root / "catalogue.sqlite3")
    try:
        models = [f"{n}:{t}" for n, t in db.execute("SELECT name, tag FROM models ORDER BY name")]
    finally:
        db.close()
    return sorted(p.name for p in blob_files(root)), models


# --- 1. a catalogue this user cannot write ---------------------------------------------------


def test_a_catalogue_the_user_cannot_write_is_one_line_and_loses_nothing(
    mirrored: tuple[Path, str], tmp_path: Path
) -> None:
    """The catalogue file read-only, its directory writable: every write is refused before it
    does anything (import copies nothing, gc deletes nothing), and verify still shows its results."""
    root, unused = mirrored
    prefix = _unprivileged(tmp_path)
    before = _state(root)
    (root / "catalogue.sqlite3").chmod(0o444)

    second = write_gguf(tmp_path / "src" / "second.gguf", vocab=302)
    _one_line(_llmgw(prefix, root, "import", second), "cannot write to the catalogue", "nothing was imported",
              "chmod u+w", "or run this as")  # fmt: skip
    _one_line(
        _llmgw(prefix, root, "rm", "tiny"), "cannot write to the catalogue", "tiny:latest was not removed"
    )
    _one_line(_llmgw(prefix, root, "gc"), "cannot write to the catalogue", "nothing was removed")
    assert _state(root) == before  # (the unused blob is still there: gc checked first)
    assert unused[7:] in before[0]

    v = _llmgw(prefix, root, "verify")
    assert v.returncode == 0, v.stderr
    assert "1 blob(s) verified, all intact" in v.stdout
    (warning,) = v.stderr.strip().splitlines()
    assert warning.startswith("llmgw: warning: cannot write to the catalogue")
    assert "the results were not recorded" in warning
    ls = _llmgw(prefix, root, "ls", "--json")
    assert ls.returncode == 0 and [m["ref"] for m in json.loads(ls.stdout)] == ["tiny:latest"]


def test_a_full_disk_at_commit_is_one_line(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLITE_FULL, for real: the catalogue may not grow by a page (``max_page_count``), and the
    model's row needs one (a long name in its header)."""
    setup = cat.Catalogue._setup_once

    def no_room(self: cat.Catalogue) -> None:
        setup(self)
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        self._db.execute(f"PRAGMA max_page_count={pages}")

    big = write_gguf(tmp_path / "long-name.gguf", name="N" * 6000)
    MirrorStore(root).close()
    monkeypatch.setattr(cat.Catalogue, "_setup_once", no_room)
    result = CliRunner().invoke(mirror, ["--root", str(root), "import", str(big)], catch_exceptions=False)
    _one_line(result, "is full", "long-name:latest was not recorded", "Free some space")
    monkeypatch.undo()
    with MirrorStore(root) as s:
        assert s.list_models() == []
    assert [p.name for p in blob_files(root)] == [file_sha(big)[7:]]  # (complete: the next import reuses it)


# --- 2. a read-only mirror can be read -------------------------------------------------------


@pytest.mark.parametrize("how", ["chmod -R a-w", "root 555"])
def test_a_read_only_mirror_can_be_read(mirrored: tuple[Path, str], model_file: Path, tmp_path: Path,
                                        how: str) -> None:  # fmt: skip
    root, unused = mirrored
    prefix = _unprivileged(tmp_path)
    before = _state(root)
    if how == "chmod -R a-w":
        _chmod_tree(root, 0o555, 0o444)
    else:
        root.chmod(0o555)

    ls = _llmgw(prefix, root, "ls", "--json")
    assert ls.returncode == 0, ls.stderr
    assert [m["ref"] for m in json.loads(ls.stdout)] == ["tiny:latest"]
    show = _llmgw(prefix, root, "show", "tiny", "--json")
    assert show.returncode == 0 and json.loads(show.stdout)["files"][0]["digest"] == file_sha(model_file)
    v = _llmgw(prefix, root, "verify", "--json")
    assert v.returncode == 0 and json.loads(v.stdout)["ok"], v.stderr
    assert "the results were not recorded" in v.stderr and "Traceback" not in v.stderr
    dry = _llmgw(prefix, root, "gc", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert [b["digest"] for b in json.loads(dry.stdout)["blobs"]] == [unused]

    # what writes is one line naming permissions, never "move it aside"
    _one_line(_llmgw(prefix, root, "import", model_file, "--name", "again"), "cannot write to the catalogue",
              f"may not write its directory {root}")  # fmt: skip
    _one_line(_llmgw(prefix, root, "rm", "tiny"), "cannot write to the catalogue")
    _one_line(_llmgw(prefix, root, "gc"), "cannot write to the catalogue", "nothing was removed")
    _chmod_tree(root, 0o755, 0o644)  # (so that this test's own user can open it read-write again)
    assert _state(root) == before


def test_a_wal_a_read_only_mirror_cannot_read_is_explained(
    mirrored: tuple[Path, str], tmp_path: Path
) -> None:
    """Changes still in the -wal file, and no -shm (which SQLite needs to read them) can be made in
    a read-only directory: reading the main file alone would lose models, so it is refused, saying how."""
    root, _ = mirrored
    prefix = _unprivileged(tmp_path)
    catalogue = root / "catalogue.sqlite3"
    # a writer that dies before its last close leaves its changes in the WAL
    subprocess.run([sys.executable, "-c", (
        "import os, sqlite3\n"
        f"db = sqlite3.connect({str(catalogue)!r}, isolation_level=None)\n"
        "db.execute(\"UPDATE blobs SET verified_at = 'x'\")\n"
        "os._exit(0)\n"
    )], check=True)  # fmt: skip
    Path(f"{catalogue}-shm").unlink()
    assert os.path.getsize(f"{catalogue}-wal") > 0
    _chmod_tree(root, 0o555, 0o444)
    _one_line(
        _llmgw(prefix, root, "ls"), "cannot read the catalogue", "-wal", "-shm", "llmgw mirror ls once as"
    )


# --- 4. gc --dry-run during a live import ----------------------------------------------------


def test_gc_dry_run_reports_what_gc_would_do_during_an_import(store: MirrorStore, model_file: Path) -> None:
    import_file(store, model_file)
    live = store.tmp_dir / f"{os.getpid()}-{secrets.token_hex(8)}.partial"  # (this process: alive)
    dead = store.tmp_dir / f"{(1 << 22) + 1}-{secrets.token_hex(8)}.partial"  # (above any pid_max)
    with store.importing():  # (an import: it holds the mirror, and its partial file is live)
        live.write_bytes(b"x" * 10)
        dead.write_bytes(b"y" * 20)  # (left by one killed earlier: gc would remove it)
        report = store.gc(dry_run=True)
        assert report.busy and report.to_json()["busy"]
        assert [p for p, _ in report.temp_files] == [dead]
        result = CliRunner().invoke(
            mirror, ["--root", str(store.root), "gc", "--dry-run"], catch_exceptions=False
        )
        assert result.exit_code == 0
        assert str(live) not in result.stdout and str(dead) in result.stdout
        assert "gc would refuse" in result.stderr
    live.unlink()
    report = store.gc(dry_run=True)
    assert not report.busy and [p for p, _ in report.temp_files] == [dead]


# --- 5. messages ------------------------------------------------------------------------------


def test_a_file_size_limit_names_the_file_and_the_fix(root: Path, tmp_path: Path) -> None:
    big = write_gguf(tmp_path / "big.gguf", big_tensor_elements=200_000)  # ~800 KB

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    MirrorStore(root).close()  # (the catalogue exists before the limit)
    p = subprocess.run(
        [sys.executable, "-m", "llmgw", "mirror", "--root", str(root), "import", str(big)],
        capture_output=True, text=True, timeout=60, preexec_fn=limit,
    )  # fmt: skip
    _one_line(
        p, "cannot store model big.gguf", "300.0 KB (ulimit -f)", "Raise the limit", "nothing was recorded"
    )
    assert temp_files(root) == [] and blob_files(root) == []


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["import", "{nowhere}"], ["does not exist", "check the path"]),
        (["import", "{model}", "--name", "a b"], ["may only hold", "write NAME[:TAG] like"]),
        (["import", "{model}", "--name", "a/b/c/d"], ["more than three", "write NAME[:TAG] like"]),
        (["import", "{model}", "--name", "x" * 81], ["longer than 80 characters; shorten it"]),
    ],
)
def test_refusals_of_what_was_typed_name_the_fix(
    root: Path, model_file: Path, tmp_path: Path, args: list[str], needles: list[str]
) -> None:
    subst = {"{nowhere}": str(tmp_path / "nowhere.gguf"), "{model}": str(model_file)}
    result = CliRunner().invoke(mirror, ["--root", str(root), *(subst.get(a, a) for a in args)])
    _one_line(result, *needles)


def test_a_directory_or_a_link_at_a_blob_path(store: MirrorStore, model_file: Path, tmp_path: Path) -> None:
    digest = file_sha(model_file)
    path = store.blob_path(digest)
    path.mkdir(parents=True)
    (path / "mine").write_bytes(b"not llmgw's")
    with pytest.raises(
        StoreLayoutError, match=rf"^{path} is a directory where the mirror keeps a blob;.*Move it"
    ):
        import_file(store, model_file)
    assert (path / "mine").read_bytes() == b"not llmgw's" and temp_files(store.root) == []
    # verify (a model recorded, then its blob turned into a directory, or a link)
    (path / "mine").unlink()
    path.rmdir()
    import_file(store, model_file, name="tiny")
    for kind in ("directory", "symbolic link"):
        blob = store.blob_path(digest)
        blob.chmod(0o644)
        blob.unlink()
        if kind == "directory":
            blob.mkdir()
        else:
            blob.symlink_to(model_file)  # (the right bytes, but not a file the mirror owns)
        (check,) = store.verify()
        assert check.status == "not-a-file"
        result = CliRunner().invoke(mirror, ["--root", str(store.root), "verify"], catch_exceptions=False)
        assert result.exit_code == 1
        assert "NOT-A-FILE" in result.stdout
        (line,) = result.stderr.strip().splitlines()
        assert f"is not a regular file (a {kind})" in line and "move it out of the mirror" in line
        if kind == "directory":
            blob.rmdir()
            import_file(store, model_file, name="tiny")  # (puts the blob back)


def test_a_replaced_corrupt_blob_is_told_in_the_clis_words(root: Path, model_file: Path) -> None:
    cmd = [sys.executable, "-m", "llmgw", "mirror", "--root", str(root), "import"]
    assert subprocess.run([*cmd, str(model_file), "-q"], timeout=60).returncode == 0
    (blob,) = blob_files(root)
    blob.chmod(0o644)
    with open(blob, "r+b") as f:
        f.write(b"\0" * 64)
    p = subprocess.run([*cmd, str(model_file), "--name", "again"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("imported again:latest")
    assert p.stderr.splitlines() == [
        f"llmgw: warning: blob {file_sha(model_file)} ({blob}) was corrupt; replaced it with the verified copy"
    ]
    assert file_sha(blob) == file_sha(model_file)


# --- 8. units ---------------------------------------------------------------------------------


def test_no_space_is_told_in_the_units_of_every_other_size(
    store: MirrorStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    big = write_gguf(tmp_path / "big.gguf", big_tensor_elements=300_000)  # 1.2 MB
    monkeypatch.setattr(store_mod, "_free_bytes", lambda path: 1_500_000)
    with pytest.raises(NoSpaceError) as info:
        import_file(store, big)
    text = str(info.value)
    assert "1.5 MB is free" in text and "16.8 MB kept free" in text  # (16 MiB)
    assert "MiB" not in text and "KiB" not in text
