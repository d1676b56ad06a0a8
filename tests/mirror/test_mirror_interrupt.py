"""Imports killed at several points, interrupted with Ctrl-C, and racing each other, in real processes.

The processes run ``mirror_helpers.py`` (llmgw with a hook that parks the import
at a chosen point and touches a marker file), so each kill lands exactly where
the test means it to.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from mirror_helpers import (
    OllamaStore,
    blob_files,
    catalogue_models,
    file_sha,
    sha,
    temp_files,
    write_gguf,
    write_projector,
)

from llmgw.cli.mirror import mirror

HELPER = Path(__file__).with_name("mirror_helpers.py")


def _spawn(args: list[str], **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(HELPER), *args],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _wait_for(marker: Path, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            _, err = proc.communicate()
            pytest.fail(f"the import ended before the hook (rc {proc.returncode}): {err.decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail("the import never reached the hook")
        time.sleep(0.01)


def _kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> tuple[int, str]:
    os.kill(proc.pid, sig)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err.decode()


def _rerun(root: Path, *args: str | Path) -> None:
    result = CliRunner().invoke(mirror, ["--root", str(root), *map(str, args), "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture
def big_model(tmp_path: Path) -> Path:
    # 4 MiB of tensor data: with the hook's 64 KiB chunks, the copy is 60+ writes long.
    return write_gguf(tmp_path / "big.gguf", big_tensor_elements=1 << 20)


@pytest.mark.parametrize("point", ["copy", "place", "record", "commit"])
def test_kill_9_leaves_no_partial_blob_and_no_row(
    root: Path, tmp_path: Path, big_model: Path, point: str
) -> None:
    marker = tmp_path / "marker"
    args = ["mirror", "--root", str(root), "import", str(big_model), "--name", "m", "-q"]
    proc = _spawn(args, MIRROR_TEST_PAUSE=point, MIRROR_TEST_MARKER=str(marker))
    _wait_for(marker, proc)
    rc, _ = _kill(proc)
    assert rc == -signal.SIGKILL

    assert catalogue_models(root) == []
    blobs = blob_files(root)
    if point in ("copy", "place"):
        # The copy only ever lived under tmp/, never under a blob name.
        assert blobs == []
        (partial,) = temp_files(root)
        assert partial.name.endswith(".partial")
    else:
        # Placed before the kill: complete and correct, just not recorded yet.
        assert [file_sha(b) for b in blobs] == [file_sha(big_model)]
        assert temp_files(root) == []

    _rerun(root, "import", big_model, "--name", "m")
    assert catalogue_models(root) == ["m:latest"]
    assert [file_sha(b) for b in blob_files(root)] == [file_sha(big_model)]
    assert temp_files(root) == []  # the next import swept the leftover


def test_kill_9_between_model_and_projector_of_an_ollama_import(root: Path, tmp_path: Path) -> None:
    ollama = OllamaStore(tmp_path / "ollama")
    model = write_gguf(tmp_path / "m.gguf", big_tensor_elements=1 << 18).read_bytes()
    proj = write_projector(tmp_path / "p.gguf").read_bytes()
    ollama.add_model("llava", gguf=model, projector=proj)
    before = ollama.snapshot()
    marker = tmp_path / "marker"
    args = ["mirror", "--root", str(root), "import-ollama", "llava", "--ollama-dir", str(ollama.root), "-q"]
    proc = _spawn(args, MIRROR_TEST_PAUSE="copy", MIRROR_TEST_NTH="2", MIRROR_TEST_MARKER=str(marker))
    _wait_for(marker, proc)
    _kill(proc)
    assert catalogue_models(root) == []
    assert [file_sha(b) for b in blob_files(root)] == [sha(model)]
    assert len(temp_files(root)) == 1
    _rerun(root, "import-ollama", "llava", "--ollama-dir", ollama.root)
    assert catalogue_models(root) == ["llava:latest"]
    assert sorted(file_sha(b) for b in blob_files(root)) == sorted([sha(model), sha(proj)])
    assert temp_files(root) == []
    assert ollama.snapshot() == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ctrl_c_cleans_up_and_says_so(root: Path, tmp_path: Path, big_model: Path, sig: int) -> None:
    """Ctrl-C, and SIGTERM or SIGHUP (timeout, systemd, a closed terminal) alike."""
    marker = tmp_path / "marker"
    args = ["mirror", "--root", str(root), "import", str(big_model), "-q"]
    proc = _spawn(args, MIRROR_TEST_PAUSE="copy", MIRROR_TEST_MARKER=str(marker))
    _wait_for(marker, proc)
    rc, err = _kill(proc, sig)
    assert rc == 128 + sig
    said = "interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}"
    assert err.strip().splitlines() == [
        f"llmgw: error: {said}; nothing was recorded and no partial file is left in the mirror."
        " Run the same command again to finish"
    ]
    assert temp_files(root) == [] and blob_files(root) == []
    assert catalogue_models(root) == []
    _rerun(root, "import", big_model)
    assert catalogue_models(root) == ["big:latest"]


def test_concurrent_imports_of_the_same_blob(root: Path, tmp_path: Path) -> None:
    # 16 MiB: the threaded copy path. The barrier makes every process try to
    # place the same blob at the same moment.
    model = write_gguf(tmp_path / "same.gguf", big_tensor_elements=4 << 20)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    names = ["shared", "shared", "own-1", "own-2"]
    procs = [
        _spawn(
            ["mirror", "--root", str(root), "import", str(model), "--name", n, "-q"],
            MIRROR_TEST_BARRIER=str(barrier),
            MIRROR_TEST_PARTIES=str(len(names)),
        )
        for n in names
    ]
    results = [(p.wait(timeout=60), p.communicate()[1].decode()) for p in procs]
    assert [rc for rc, _ in results] == [0] * len(names), results
    assert len(os.listdir(barrier)) == len(names)  # they really met at the barrier
    blobs = blob_files(root)
    assert len(blobs) == 1
    assert file_sha(blobs[0]) == file_sha(model)
    assert catalogue_models(root) == ["own-1:latest", "own-2:latest", "shared:latest"]
    assert temp_files(root) == []
