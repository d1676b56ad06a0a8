"""``llmgw mirror`` through click's CliRunner and as a real process."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from mirror_helpers import OllamaStore, blob_files, file_sha, sha, write_gguf, write_projector

from llmgw.cli import main
from llmgw.cli.mirror import mirror
from llmgw.mirror.errors import CorruptBlobError
from llmgw.mirror.progress import NullProgress, RichProgress, make_progress
from llmgw.mirror.resolve import resolve


def run(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(mirror, [str(a) for a in args], env=env, catch_exceptions=False)


def _one_error_line(result: Result, *needles: str) -> None:
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("llmgw: error: ")
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0]


def test_import_ls_show_rm_gc_round_trip(root: Path, model_file: Path, projector_file: Path) -> None:
    r = run("--root", root, "import", model_file, "--name", "tiny:f16", "--projector", projector_file)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("imported tiny:f16 (model llama 11.6K F16")
    assert "projector clip" in r.stdout

    r = run("--root", root, "ls")
    assert r.exit_code == 0
    header, row = r.stdout.splitlines()
    assert header.split() == [
        "NAME",
        "ARCH",
        "PARAMS",
        "QUANT",
        "CONTEXT",
        "SIZE",
        "FILES",
        "SOURCE",
        "IMPORTED",
    ]
    assert row.split()[:5] == ["tiny:f16", "llama", "11.6K", "F16", "2048"]
    assert row.split()[7:9] == ["model+projector", "file"]

    listed = json.loads(run("--root", root, "ls", "--json").stdout)
    assert [m["ref"] for m in listed] == ["tiny:f16"]
    assert listed[0]["parameter_count"] == 11648 and listed[0]["architecture"] == "llama"

    r = run("--root", root, "show", "tiny:f16")
    assert r.exit_code == 0
    assert file_sha(model_file) in r.stdout and "context length" in r.stdout

    shown = json.loads(run("--root", root, "show", "tiny:f16", "--json").stdout)
    assert [f["role"] for f in shown["files"]] == ["model", "projector"]
    assert Path(shown["files"][0]["path"]).is_file()
    assert shown["files"][0]["gguf"]["context_length"] == 2048

    r = run("--root", root, "rm", "tiny:f16")
    assert r.exit_code == 0 and r.stdout.startswith("removed tiny:f16; llmgw mirror gc would free")
    assert json.loads(run("--root", root, "ls", "--json").stdout) == []

    dry = json.loads(run("--root", root, "gc", "--dry-run", "--json").stdout)
    assert dry["dry_run"] and len(dry["blobs"]) == 2
    assert len(blob_files(root)) == 2
    r = run("--root", root, "gc")
    assert r.exit_code == 0 and "removed 2 unused blob(s)" in r.stdout
    assert blob_files(root) == []


def test_import_json_and_quiet(root: Path, model_file: Path) -> None:
    r = run("--root", root, "import", model_file, "--json", "--quiet")
    out = json.loads(r.stdout)
    assert out["created"] and out["copied"] == [True]
    assert out["files"][0]["digest"] == file_sha(model_file)
    r = run("--root", root, "import", model_file, "-q")
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == ""
    r = run("--root", root, "import", model_file)
    assert r.stdout.startswith("already in the mirror, unchanged: Tiny-Llama-F16:latest")
    # its blob lost (or corrupt): importing again restores it, and says so
    (blob,) = blob_files(root)
    blob.unlink()
    r = run("--root", root, "import", model_file)
    assert r.stdout.startswith("already in the mirror; restored 1 missing or corrupt blob(s): Tiny-Llama-F16:latest")
    assert run("--root", root, "verify").exit_code == 0


def test_root_from_env_and_after_the_subcommand(tmp_path: Path, model_file: Path) -> None:
    env_root, sub_root = tmp_path / "env", tmp_path / "sub"
    assert run("import", model_file, "-q", env={"LLMGW_MIRROR": str(env_root)}).exit_code == 0
    assert (
        run("import", model_file, "-q", "--root", sub_root, env={"LLMGW_MIRROR": str(env_root)}).exit_code
        == 0
    )
    assert len(blob_files(env_root)) == 1 and len(blob_files(sub_root)) == 1


def test_default_root_is_under_xdg_data_home(tmp_path: Path, model_file: Path) -> None:
    assert run("import", model_file, "-q", env={"XDG_DATA_HOME": str(tmp_path / "xdg")}).exit_code == 0
    assert len(blob_files(tmp_path / "xdg" / "llmgw" / "mirror")) == 1


def test_registered_under_the_llmgw_command(root: Path, model_file: Path) -> None:
    r = CliRunner().invoke(main, ["mirror", "--root", str(root), "import", str(model_file), "-q"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["mirror", "--help"])
    assert "import-ollama" in r.stdout and "verify" in r.stdout and "gc" in r.stdout


def test_import_ollama(root: Path, tmp_path: Path) -> None:
    ollama = OllamaStore(tmp_path / "ollama")
    tiny = write_gguf(tmp_path / "t.gguf").read_bytes()
    proj = write_projector(tmp_path / "p.gguf").read_bytes()
    ollama.add_model("llava", "7b", gguf=tiny, projector=proj)
    r = run("--root", root, "import-ollama", "llava:7b", "--ollama-dir", ollama.root)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("imported llava:7b (model llama")
    shown = json.loads(run("--root", root, "show", "llava:7b", "--json").stdout)
    assert [f["digest"] for f in shown["files"]] == [sha(tiny), sha(proj)]
    assert shown["info"]["ollama"]["params"]["temperature"] == 0.6
    text = run("--root", root, "show", "llava:7b").stdout
    assert "ollama name" in text and "{{ .Prompt }}" in text and "MIT License" in text


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["import", "/does/not/exist.gguf"], ["does not exist"]),
        (["import", "{text}"], ["not a GGUF file", "--raw"]),
        (["import", "{model}", "--name", "../x"], ["model name", "'../x'"]),
        (["import", "{projector}"], ["is a vision projector", "--projector"]),
        (["show", "nothing"], ["no model nothing:latest", "empty"]),
        (["rm", "nothing:tag"], ["no model nothing:tag"]),
        (["import-ollama", "../../etc", "--ollama-dir", "{ollama}"], ["not a valid Ollama model name"]),
        (["import-ollama", "missing", "--ollama-dir", "{ollama}"], ["Ollama has no model missing:latest", "ollama pull"]),
        (["import-ollama", "x", "--ollama-dir", "{nowhere}"], ["not a directory"]),
    ],
)  # fmt: skip
def test_errors_are_one_line_naming_the_fix(
    root: Path, tmp_path: Path, model_file: Path, projector_file: Path, args: list[str], needles: list[str]
) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    OllamaStore(tmp_path / "ollama")
    subst = {"{text}": str(text), "{model}": str(model_file), "{projector}": str(projector_file),
             "{ollama}": str(tmp_path / "ollama"), "{nowhere}": str(tmp_path / "nowhere")}  # fmt: skip
    r = run("--root", root, *[subst.get(a, a) for a in args])
    _one_error_line(r, *needles)
    assert r.exit_code == 1


def test_show_suggests_other_tags(root: Path, model_file: Path) -> None:
    run("--root", root, "import", model_file, "--name", "m:q4", "-q")
    _one_error_line(run("--root", root, "show", "m"), "no model m:latest", "m:q4")


def test_name_clash_is_one_line(root: Path, model_file: Path, tmp_path: Path) -> None:
    run("--root", root, "import", model_file, "--name", "m", "-q")
    other = write_gguf(tmp_path / "o.gguf", vocab=400)
    _one_error_line(
        run("--root", root, "import", other, "--name", "m"),
        "already in the mirror",
        "llmgw mirror rm m:latest",
    )


def test_empty_mirror(root: Path) -> None:
    r = run("--root", root, "ls")
    assert r.exit_code == 0 and "no models in the mirror" in r.stdout
    assert not root.exists()  # reading creates nothing
    assert json.loads(run("--root", root, "verify", "--json").stdout) == {"ok": True, "blobs": []}
    assert json.loads(run("--root", root, "gc", "--json").stdout)["reclaimed"] == 0


def test_verify_names_each_corrupt_blob(root: Path, model_file: Path, projector_file: Path) -> None:
    run("--root", root, "import", model_file, "--name", "v", "--projector", projector_file, "-q")
    r = run("--root", root, "verify")
    assert r.exit_code == 0 and "2 blob(s) verified, all intact" in r.stdout
    shown = json.loads(run("--root", root, "show", "v", "--json").stdout)
    bad = Path(shown["files"][1]["path"])
    os.chmod(bad, 0o644)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    r = run("--root", root, "verify")
    assert r.exit_code == 1
    assert "CORRUPT" in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"llmgw: error: blob {shown['files'][1]['digest']} ({bad}) is corrupt")
    assert "used by v:latest" in lines[0] and "import the model again" in lines[0]
    # Its size is right: a deployment would still take it and nodes be sent it (each would refuse the
    # bytes, again and again). Moved out of the blobs, it is refused where it is asked for.
    digest = shown["files"][1]["digest"]
    moved = root / "quarantine" / digest[7:]
    assert f"moved it to {moved} (no node is sent it; deploying its models is refused)" in lines[0]
    assert not bad.exists() and moved.read_bytes() == bytes(data)
    with pytest.raises(CorruptBlobError, match=f"was found corrupt and moved to {moved}; "
                       "import the model again from its source"):
        resolve(root, "v")
    # verified again: set aside before, said so (not a blob merely missing)
    out = json.loads(run("--root", root, "verify", "v", "--json").stdout)
    assert not out["ok"] and [b["status"] for b in out["blobs"]].count("quarantined") == 1
    r = run("--root", root, "verify")
    assert r.exit_code == 1 and f"(found corrupt before and moved to {moved})" in r.stderr
    # the import that brought it in puts a verified copy back
    run("--root", root, "import", model_file, "--name", "v", "--projector", projector_file, "-q")
    assert run("--root", root, "verify").exit_code == 0
    assert resolve(root, "v")[0][1].digest == digest
    # corrupt again: set aside beside the first copy, never over it
    os.chmod(bad, 0o644)
    bad.write_bytes(bytes(data[:-1]) + b"\x00")
    assert run("--root", root, "verify").exit_code == 1
    aside = sorted(p.name for p in (root / "quarantine").iterdir() if not p.name.startswith("."))
    assert aside[0] == digest[7:] and len(aside) == 2 and aside[1].startswith(digest[7:] + ".")
    assert moved.read_bytes() == bytes(data)


def test_raw_import(root: Path, tmp_path: Path) -> None:
    blob = tmp_path / "adapter.bin"
    blob.write_bytes(os.urandom(1000))
    r = run("--root", root, "import", blob, "--raw", "--json")
    assert json.loads(r.stdout)["files"][0]["gguf"] is None


# --- progress ---------------------------------------------------------------------------------


def test_progress_is_quiet_off_a_terminal_and_with_quiet() -> None:
    assert isinstance(make_progress(file=io.StringIO()), NullProgress)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(make_progress(quiet=True, file=Tty()), NullProgress)
    bar = make_progress(file=Tty())
    assert isinstance(bar, RichProgress)
    bar.close()


def test_progress_bar_shows_bytes_rate_and_time_left() -> None:
    out = io.StringIO()
    bar = RichProgress(out, force_terminal=True)
    with bar:
        bar.start("model tiny.gguf", 10_000_000)
        bar.advance(1_500_000)
        time.sleep(0.05)
        bar.advance(1_000_000)
        bar._bar.refresh()
        bar.finish()
    text = out.getvalue()
    assert "model tiny.gguf" in text
    assert "2.5/10.0 MB" in text
    assert re.search(r"\d+(\.\d+)? [kMG]?B/s", text)  # the rate
    assert re.search(r"\d:\d\d:\d\d", text)  # time left


# --- a real process ---------------------------------------------------------------------------


def test_real_process(root: Path, model_file: Path) -> None:
    env = {**os.environ, "LLMGW_MIRROR": str(root)}
    cmd = [sys.executable, "-m", "llmgw", "mirror"]
    p = subprocess.run(
        [*cmd, "import", str(model_file), "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""  # stderr is not a terminal: no progress bar
    assert json.loads(p.stdout)["files"][0]["digest"] == file_sha(model_file)
    p = subprocess.run([*cmd, "ls", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert [m["ref"] for m in json.loads(p.stdout)] == ["Tiny-Llama-F16:latest"]
    p = subprocess.run(
        [*cmd, "import", "/nonexistent.gguf"], env=env, capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 1
    assert p.stderr == "llmgw: error: /nonexistent.gguf does not exist; check the path, and give the model file itself\n"


def test_a_projector_given_twice_is_refused(root: Path, model_file: Path, projector_file: Path, tmp_path: Path) -> None:
    """The same file twice (by any path: a link is the same file) is one line, and nothing is recorded."""
    link = tmp_path / "again.gguf"
    link.symlink_to(projector_file)
    for second in (projector_file, link):
        result = run("--root", root, "import", model_file, "--projector", projector_file, "--projector", second,
                     "--name", "dup", "-q")
        _one_error_line(result, "is given twice", "give each file once")
        assert result.exit_code == 1
    assert "dup" not in run("--root", root, "ls").output
