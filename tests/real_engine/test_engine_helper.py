"""Where the real-engine tests get ``llama-server`` and their model.

The finder is exercised in fake environments (fake binaries, fake shared
directories, an empty ``PATH``), so nothing here runs or builds an engine.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from llmgw.mirror.gguf import read_gguf
from llmgw.testing import llamacpp
from llmgw.testing.gguf_model import write_tiny_llama
from llmgw.testing.llamacpp import (
    EngineIntegrityError,
    EngineUnavailableError,
    LlamaServer,
    built_path,
    find_llama_server,
    parse_metrics,
)

from .conftest import acquire_engine

pytestmark = pytest.mark.real_engine

FAKE_BINARY = b"#!/bin/sh\necho fake llama-server\n"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_shared(root: Path, binary: bytes = FAKE_BINARY, *, gz_sha: str | None = None, bin_sha: str | None = None) -> Path:
    """A shared directory laid out like ``../shared`` with ``engines/llama-server.gz`` and its checksums."""
    engines = root / "engines"
    engines.mkdir(parents=True)
    gz = gzip.compress(binary)
    (engines / "llama-server.gz").write_bytes(gz)
    (engines / "llama-server.gz.sha256").write_text(f"{gz_sha or _sha(gz)}  llama-server.gz\n")
    (engines / "llama-server.sha256").write_text(f"{bin_sha or _sha(binary)}  llama-server\n")
    return root


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No engine anywhere: LLAMA_SERVER unset, an empty cache, no build tools on PATH."""
    monkeypatch.delenv("LLAMA_SERVER", raising=False)
    monkeypatch.delenv("LLMGW_SHARED_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    empty_bin = tmp_path / "empty-bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    return tmp_path


def test_env_variable_wins(fake_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = fake_env / "my-llama-server"
    mine.write_bytes(FAKE_BINARY)
    mine.chmod(0o755)
    monkeypatch.setenv("LLAMA_SERVER", str(mine))
    shared = make_shared(fake_env / "shared")
    assert find_llama_server(shared=shared) == mine
    assert not list((fake_env / "cache").rglob("llama-server*"))  # the shared copy was not even looked at


def test_env_variable_must_be_an_executable(fake_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = make_shared(fake_env / "shared")
    monkeypatch.setenv("LLAMA_SERVER", str(fake_env / "nope"))
    with pytest.raises(EngineUnavailableError, match=r"LLAMA_SERVER=.*nope does not exist; point it at"):
        find_llama_server(shared=shared)
    (fake_env / "nope").write_text("#!/bin/sh\n")  # there, but without the execute bit
    with pytest.raises(EngineUnavailableError, match=r"LLAMA_SERVER=.*nope is not an executable file"):
        find_llama_server(shared=shared)


def test_shared_binary_is_verified_and_cached(fake_env: Path) -> None:
    shared = make_shared(fake_env / "shared")
    found = find_llama_server(shared=shared, build=False)
    assert found == fake_env / "cache" / "llmgw" / f"llama-server-{_sha(FAKE_BINARY)}"
    assert found.read_bytes() == FAKE_BINARY
    assert os.access(found, os.X_OK)
    assert subprocess.run([str(found)], capture_output=True, check=True).stdout == b"fake llama-server\n"
    # Found again from the cache; a damaged cache entry is replaced, not used.
    assert find_llama_server(shared=shared, build=False) == found
    found.write_bytes(b"#!/bin/sh\necho tampered\n")
    assert find_llama_server(shared=shared, build=False) == found
    assert found.read_bytes() == FAKE_BINARY


def test_wrong_gz_sha256_is_refused(fake_env: Path) -> None:
    shared = make_shared(fake_env / "shared", gz_sha="0" * 64)
    with pytest.raises(EngineIntegrityError, match=r"refusing .*llama-server\.gz: its SHA-256 is [0-9a-f]{64}, but"):
        find_llama_server(shared=shared)
    assert not list((fake_env / "cache").rglob("llama-server*"))


def test_wrong_binary_sha256_is_refused(fake_env: Path) -> None:
    shared = make_shared(fake_env / "shared", bin_sha="1" * 64)
    with pytest.raises(EngineIntegrityError, match=r"decompresses to a binary with SHA-256"):
        find_llama_server(shared=shared)
    # Nothing half-verified is left in the cache.
    assert not [p for p in (fake_env / "cache").rglob("*") if p.is_file()]


def test_malformed_checksum_file_is_refused(fake_env: Path) -> None:
    shared = make_shared(fake_env / "shared")
    (shared / "engines" / "llama-server.sha256").write_text("not a digest\n")
    with pytest.raises(EngineIntegrityError, match="does not hold a SHA-256 digest"):
        find_llama_server(shared=shared)


def test_unwritable_cache_falls_back_to_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setattr(llamacpp.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert llamacpp.cache_dir() == tmp_path / "tmp" / f"llmgw-cache-{os.getuid()}"


def test_an_earlier_build_is_used(fake_env: Path) -> None:
    built = built_path(fake_env / "cache" / "llmgw")
    built.parent.mkdir(parents=True)
    built.write_bytes(FAKE_BINARY)
    built.chmod(0o755)
    assert find_llama_server(shared=fake_env / "no-shared") == built


def test_no_engine_fails_the_tests_saying_how_to_provide_one(fake_env: Path) -> None:
    """With nothing to be had, the fixture fails (not skips) and explains the three ways."""
    with pytest.raises(pytest.fail.Exception) as info:
        acquire_engine(shared=fake_env / "no-shared", cache=fake_env / "cache")
    message = str(info.value)
    assert "real-engine tests need llama.cpp's llama-server" in message
    assert "set LLAMA_SERVER=" in message
    assert "../shared/engines/llama-server.gz" in message
    assert f"{llamacpp.SDIST_PACKAGE}=={llamacpp.SDIST_VERSION}" in message
    # The build was attempted and stopped at once: no cmake on this PATH.
    assert "cmake" in message


def test_no_engine_without_building(fake_env: Path) -> None:
    with pytest.raises(EngineUnavailableError, match="LLAMA_SERVER is unset"):
        find_llama_server(shared=fake_env / "no-shared", build=False)


def test_build_runs_the_readme_steps_once(fake_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's orchestration, with each command simulated (no network, no compiler)."""
    ran: list[list[str]] = []
    version = llamacpp.SDIST_VERSION

    def fake_run(cmd: list[str], cwd: Path, log_file: object, on_line: Any = None) -> None:
        ran.append(list(cmd))
        if on_line is not None:
            for pct in (0, 3, 3, 50, 100):
                on_line(f"[{pct:3d}%] Building CXX object x.o\n".encode())
        if "download" in cmd:
            dest = Path(cmd[cmd.index("-d") + 1])
            dest.mkdir(parents=True)
            src = fake_env / "sdist-src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
            src.mkdir(parents=True)
            (src / "CMakeLists.txt").write_text("project(llama.cpp)\n")
            with tarfile.open(dest / f"llama_cpp_python-{version}.tar.gz", "w:gz") as tar:
                tar.add(fake_env / "sdist-src" / f"llama_cpp_python-{version}", f"llama_cpp_python-{version}")
        elif cmd[:2] == ["cmake", "--build"]:
            (cwd / "build" / "bin").mkdir(parents=True)
            (cwd / "build" / "bin" / "llama-server").write_bytes(FAKE_BINARY)
        elif cmd[0] == "strip":
            Path(cmd[2]).write_bytes(Path(cmd[3]).read_bytes())

    monkeypatch.setattr(llamacpp, "_run", fake_run)
    monkeypatch.setattr(llamacpp, "_missing_tools", lambda: [])
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: "/usr/bin/" + name)
    cache = fake_env / "cache" / "llmgw"
    said: list[str] = []
    built = find_llama_server(shared=fake_env / "no-shared", cache=cache, log=said.append)
    # Progress: what is happening and how long it takes, how to skip it, a line per stage and per percent.
    assert "7-16 minutes" in said[0] and "LLAMA_SERVER=/path/to/llama-server" in said[0]
    stages = [s for s in said if "] " in s and "%" not in s and s.startswith("llama-server build [")]
    assert [s.split("]")[0] for s in stages] == ["llama-server build [1/4", "llama-server build [2/4",
                                                  "llama-server build [3/4", "llama-server build [4/4"]
    percents = [s.rsplit(": ", 1)[1].split("%")[0] for s in said if "%" in s and "compiling" in s]
    assert percents == ["0", "3", "50", "100"], said
    assert said[-1].startswith(f"built {built_path(cache)} in ")
    assert built == built_path(cache) and built.read_bytes() == FAKE_BINARY and os.access(built, os.X_OK)
    assert [c[0] for c in ran] == [sys.executable, "cmake", "cmake", "strip"]
    assert f"llama-cpp-python=={version}" in ran[0] and "--no-binary" in ran[0]
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in ran[1] and "-DBUILD_SHARED_LIBS=OFF" in ran[1]
    assert ran[2][:5] == ["cmake", "--build", "build", "--target", "llama-server"]
    # The work directory is gone; a second call (another worker after the lock) builds nothing.
    assert [p.name for p in cache.iterdir() if p.name.startswith("build-")] == []
    ran.clear()
    assert llamacpp.build_llama_server(cache) == built
    assert ran == []


def test_run_streams_output_to_the_log_and_the_callback(tmp_path: Path) -> None:
    lines: list[bytes] = []
    with open(tmp_path / "log", "wb") as log_file:
        llamacpp._run(["sh", "-c", "echo '[ 12%] Building a'; echo 'plain'; echo '[100%] Linking'"], tmp_path,
                      log_file, on_line=lines.append)
    assert lines == [b"[ 12%] Building a\n", b"plain\n", b"[100%] Linking\n"]
    assert (tmp_path / "log").read_bytes().endswith(b"[100%] Linking\n")
    with open(tmp_path / "log", "wb") as log_file, pytest.raises(llamacpp.EngineUnavailableError, match="exit status 3"):
        llamacpp._run(["sh", "-c", "exit 3"], tmp_path, log_file)


def test_replica_argv_has_the_flags_that_matter(tmp_path: Path) -> None:
    r = LlamaServer("/x/llama-server", tmp_path / "m.gguf", port=1234, api_key="k", parallel=2, ctx=2048, alias="tiny")
    argv = r.argv()
    for flag in (["--metrics"], ["--api-key", "k"], ["-np", "2"], ["-c", "2048"], ["--alias", "tiny"], ["--port", "1234"]):
        assert any(argv[i:i + len(flag)] == flag for i in range(len(argv))), (flag, argv)
    assert "--metrics" not in LlamaServer("/x", "m", metrics=False).argv()


def test_parse_metrics() -> None:
    page = (
        "# HELP llamacpp:requests_processing Number of requests processing.\n"
        "# TYPE llamacpp:requests_processing gauge\n"
        "llamacpp:requests_processing 2\n"
        "llamacpp:requests_deferred 6\n"
        'other{label="x"} 1\n'
    )
    assert parse_metrics(page) == {"llamacpp:requests_processing": 2.0, "llamacpp:requests_deferred": 6.0}


# -- the model --


def test_tiny_model_is_a_deterministic_llama_gguf(tmp_path: Path) -> None:
    a = write_tiny_llama(tmp_path / "a.gguf", ctx=1024, seed=3)
    b = write_tiny_llama(tmp_path / "b.gguf", ctx=1024, seed=3)
    assert a.read_bytes() == b.read_bytes()
    assert a.stat().st_size < 1_000_000
    info = read_gguf(a)
    assert info.architecture == "llama"
    assert info.context_length == 1024
    assert info.block_count == 2
    assert not info.is_projector


def test_tiny_model_imports_into_the_mirror(tmp_path: Path) -> None:
    """``llmgw mirror import`` takes the same file the engine loads."""
    model = write_tiny_llama(tmp_path / "tiny.gguf")
    proc = subprocess.run(
        [sys.executable, "-m", "llmgw", "mirror", "--root", str(tmp_path / "mirror"), "import", str(model),
         "--json", "-q"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["ref"] == "tiny:latest"
    assert record["architecture"] == "llama"
    assert record["files"][0]["digest"] == "sha256:" + _sha(model.read_bytes())
