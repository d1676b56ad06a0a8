"""A real llama.cpp ``llama-server`` for tests and benchmarks: find it, run it, stop it.

Where the binary comes from, in this order (:func:`find_llama_server`):

1. ``$LLAMA_SERVER``, a path to any ``llama-server`` you built or installed;
2. ``engines/llama-server.gz`` in the shared directory next to the repository
   (``../shared``, or ``$LLMGW_SHARED_DIR``), checked against its published
   SHA-256 before and after it is decompressed into the cache directory;
3. a binary built earlier by step 4, in the cache directory;
4. a build from the PyPI sdist of ``llama-cpp-python`` (which vendors llama.cpp),
   the same steps as ``engines/README.md`` describes, about 7-16 minutes on two
   cores the first time. A lock file makes parallel test workers wait for one
   build; the ``log`` callback gets a line per stage and per cmake percentage.

The cache directory is ``$XDG_CACHE_HOME/llmgw`` (``~/.cache/llmgw``).

:class:`LlamaServer` runs one replica as a child process on a free port and
waits for ``/health`` to answer 200; :meth:`LlamaServer.stop` always reaps it.
This module uses only the standard library.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import http.client
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from ..errors import LlmgwError

__all__ = [
    "SDIST_PACKAGE",
    "SDIST_VERSION",
    "EngineIntegrityError",
    "EngineUnavailableError",
    "LlamaServer",
    "build_llama_server",
    "built_path",
    "cache_dir",
    "find_llama_server",
    "free_port",
    "how_to_provide",
    "parse_metrics",
    "shared_dir",
]

SDIST_PACKAGE = "llama-cpp-python"
SDIST_VERSION = "0.3.36"

_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
    # NOTE: without this the build tries to download a web UI.
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DGGML_NATIVE=OFF",
    "-DGGML_CCACHE=OFF",
)


def how_to_provide(cache: Path | None = None) -> str:
    """What a user can do to give the tests a ``llama-server`` (used in error messages)."""
    return (
        "To provide llama.cpp's llama-server, do one of:\n"
        "  * set LLAMA_SERVER=/path/to/llama-server (any build of llama.cpp's server);\n"
        "  * put the shared engines directory next to the repository (../shared/engines/llama-server.gz"
        " with its .sha256 files), or point LLMGW_SHARED_DIR at the directory holding engines/;\n"
        f"  * let llmgw build it from the PyPI sdist {SDIST_PACKAGE}=={SDIST_VERSION}: needs network access to"
        f" PyPI, cmake, a C++ compiler and about 16 minutes on 2 cores (cached afterwards in {cache or cache_dir()})."
    )


class EngineUnavailableError(LlmgwError, RuntimeError):
    """No ``llama-server`` binary could be found or built."""


class EngineIntegrityError(EngineUnavailableError):
    """A ``llama-server`` file does not have its published SHA-256; it is refused."""


# -- where things live --


def cache_dir() -> Path:
    """Where decompressed and built engines are kept: ``$XDG_CACHE_HOME/llmgw`` or ``~/.cache/llmgw``.

    If that cannot be created or written (a read-only home in a CI sandbox), a
    per-user directory under the system's temporary directory is used instead.
    """
    base = os.environ.get("XDG_CACHE_HOME")
    preferred = (Path(base) if base else Path.home() / ".cache") / "llmgw"
    try:
        preferred.mkdir(parents=True, exist_ok=True)
        if os.access(preferred, os.W_OK | os.X_OK):
            return preferred
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"llmgw-cache-{os.getuid()}"


def shared_dir() -> Path | None:
    """The shared directory (``engines/`` lives in it), or ``None``.

    ``$LLMGW_SHARED_DIR`` if set, otherwise ``../shared`` next to the repository
    this module sits in (a source checkout, editable install).
    """
    env = os.environ.get("LLMGW_SHARED_DIR")
    if env:
        return Path(env)
    # src/llmgw/testing/llamacpp.py -> the repository root is three levels up.
    repo = Path(__file__).resolve().parents[3]
    cand = repo.parent / "shared"
    return cand if cand.is_dir() else None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _read_sha_file(path: Path) -> str:
    """The hex digest from a ``sha256sum``-style file."""
    try:
        text = path.read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineIntegrityError(f"cannot read the checksum file {path}: {exc}") from exc
    digest = text[0].lower() if text else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise EngineIntegrityError(f"{path} does not hold a SHA-256 digest")
    return digest


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


# -- the three sources --


def _from_env() -> Path | None:
    value = os.environ.get("LLAMA_SERVER")
    if not value:
        return None
    path = Path(value).expanduser()
    if not _is_executable(path):
        why = "is not an executable file" if path.exists() else "does not exist"
        raise EngineUnavailableError(f"LLAMA_SERVER={value} {why}; point it at a llama-server binary or unset it")
    return path


def _from_shared(shared: Path, cache: Path) -> Path | None:
    """Verify ``engines/llama-server.gz`` and decompress it into ``cache`` (once)."""
    gz = shared / "engines" / "llama-server.gz"
    if not gz.is_file():
        return None
    want_gz = _read_sha_file(gz.with_name("llama-server.gz.sha256"))
    want_bin = _read_sha_file(gz.with_name("llama-server.sha256"))
    target = cache / f"llama-server-{want_bin}"
    if target.is_file():
        if _sha256_file(target) == want_bin:
            if not os.access(target, os.X_OK):
                target.chmod(0o755)
            return target
        # A damaged cache entry is replaced, not trusted.
        target.unlink()
    got_gz = _sha256_file(gz)
    if got_gz != want_gz:
        raise EngineIntegrityError(
            f"refusing {gz}: its SHA-256 is {got_gz}, but llama-server.gz.sha256 says {want_gz}."
            " The file is damaged or was replaced; fetch the shared directory again or set LLAMA_SERVER"
        )
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".llama-server-", dir=cache)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, gzip.open(gz, "rb") as src:
            for block in iter(lambda: src.read(1 << 20), b""):
                h.update(block)
                out.write(block)
        got_bin = h.hexdigest()
        if got_bin != want_bin:
            raise EngineIntegrityError(
                f"refusing {gz}: it decompresses to a binary with SHA-256 {got_bin}, but llama-server.sha256"
                f" says {want_bin}. Fetch the shared directory again or set LLAMA_SERVER"
            )
        tmp.chmod(0o755)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return target


def built_path(cache: Path | None = None) -> Path:
    """Where :func:`build_llama_server` puts its binary."""
    return (cache or cache_dir()) / f"llama-server-sdist-{SDIST_VERSION}"


def find_llama_server(
    *,
    shared: Path | None = None,
    cache: Path | None = None,
    build: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Find (or make) a ``llama-server`` binary; see the module docstring for the order.

    Args:
        shared: the shared directory holding ``engines/``; default :func:`shared_dir`.
        cache: the cache directory; default :func:`cache_dir`.
        build: build from the PyPI sdist when nothing else is there.
        log: called with progress lines while building.

    Returns:
        An executable ``llama-server``.

    Raises:
        EngineIntegrityError: the shared binary does not match its SHA-256.
        EngineUnavailableError: nothing found and building is off or failed; the
            message says how to provide one.
    """
    cache = cache or cache_dir()
    env = _from_env()
    if env is not None:
        return env
    shared = shared if shared is not None else shared_dir()
    if shared is not None:
        found = _from_shared(shared, cache)
        if found is not None:
            return found
    built = built_path(cache)
    if _is_executable(built):
        return built
    how = how_to_provide(cache)
    where = f"{shared}/engines/llama-server.gz" if shared is not None else "../shared/engines (no shared directory)"
    if not build:
        raise EngineUnavailableError(f"no llama-server: LLAMA_SERVER is unset and {where} is missing.\n{how}")
    try:
        return build_llama_server(cache, log=log)
    except EngineUnavailableError as exc:
        raise EngineUnavailableError(
            f"no llama-server: LLAMA_SERVER is unset, {where} is missing, and building it failed: {exc}\n{how}"
        ) from exc


# -- building from the sdist --


def _missing_tools() -> list[str]:
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    return missing


_PERCENT = re.compile(rb"^\[\s*(\d{1,3})%\]")


def _run(
    cmd: Sequence[str], cwd: Path, log_file: IO[bytes], on_line: Callable[[bytes], None] | None = None
) -> None:
    """Run ``cmd``, its output into ``log_file``; each output line is also given to ``on_line``."""
    log_file.write(("$ " + " ".join(cmd) + "\n").encode())
    log_file.flush()
    proc = subprocess.Popen(list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    with proc.stdout:
        for line in proc.stdout:
            log_file.write(line)
            if on_line is not None:
                on_line(line)
    returncode = proc.wait()
    log_file.flush()
    if returncode != 0:
        raise EngineUnavailableError(f"`{' '.join(cmd)}` failed with exit status {returncode}")


class _BuildProgress:
    """Progress lines for a build that takes minutes: one per stage, one per new cmake percentage.

    Every line says the stage, the percentage where cmake reports one, and the time
    so far, so a terminal (or a CI log) shows the build is alive.
    """

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._say = say
        self._clock = clock
        self._t0 = clock()
        self._percent = -1
        self._stage = ""

    def elapsed(self) -> str:
        s = int(self._clock() - self._t0)
        return f"{s // 60}m{s % 60:02d}s"

    def stage(self, n: int, total: int, what: str) -> None:
        self._stage = f"[{n}/{total}] {what}"
        self._percent = -1
        self._say(f"llama-server build {self._stage} ({self.elapsed()} so far)")

    def line(self, raw: bytes) -> None:
        m = _PERCENT.match(raw)
        if m is None:
            return
        pct = int(m.group(1))
        if pct != self._percent:
            self._percent = pct
            self._say(f"llama-server build {self._stage}: {pct}% ({self.elapsed()} so far)")


def _safe_extract(archive: Path, dest: Path) -> None:
    root = dest.resolve()

    def inside(p: Path) -> bool:
        return p.resolve().is_relative_to(root)

    with tarfile.open(archive, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            path = dest / m.name
            # SECURITY: nothing may land, or point, outside dest.
            ok = inside(path)
            if m.issym():
                ok = ok and inside(path.parent / m.linkname)
            elif m.islnk():
                ok = ok and inside(dest / m.linkname)
            elif not (m.isfile() or m.isdir()):
                continue  # devices, FIFOs: the build needs none
            if not ok:
                raise EngineUnavailableError(f"{archive.name} has an unsafe member {m.name!r}")
            members.append(m)
        if sys.version_info >= (3, 12):
            tar.extractall(dest, members=members, filter="data")
        else:
            tar.extractall(dest, members=members)


def build_llama_server(
    cache: Path | None = None,
    *,
    jobs: int | None = None,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Build ``llama-server`` from the PyPI sdist of ``llama-cpp-python`` into ``cache``.

    Runs ``engines/README.md``'s steps: ``pip download`` the sdist, unpack it,
    configure and build the vendored llama.cpp with cmake, strip the binary. Holds
    ``cache/llama-server-build.lock`` throughout, so parallel callers build once;
    a caller that waited returns the binary the first one built.

    Args:
        cache: the cache directory; default :func:`cache_dir`.
        jobs: parallel compile jobs (default: the CPU count).
        log: called with progress lines.

    Returns:
        The built binary (:func:`built_path`).

    Raises:
        EngineUnavailableError: a tool is missing or a step failed (the build log's
            path is in the message).
    """
    import fcntl

    cache = cache or cache_dir()
    say = log or (lambda _msg: None)
    missing = _missing_tools()
    if missing:
        raise EngineUnavailableError(f"cannot build llama-server: {' and '.join(missing)} not found on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    target = built_path(cache)
    with open(cache / "llama-server-build.lock", "wb") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for another process that is building llama-server (log: {cache / 'llama-server-build.log'})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_executable(target):
            return target  # another worker built it while we waited
        work = Path(tempfile.mkdtemp(prefix="build-llama-server-", dir=cache))
        log_path = cache / "llama-server-build.log"
        say(
            f"no llama-server found: building it from {SDIST_PACKAGE}=={SDIST_VERSION}, about 7-16 minutes the"
            f" first time (cached in {target} afterwards). To use one you have instead, stop and set"
            f" LLAMA_SERVER=/path/to/llama-server. Full log: {log_path}"
        )
        progress = _BuildProgress(say)
        try:
            with open(log_path, "wb") as log_file:
                progress.stage(1, 4, f"downloading the {SDIST_PACKAGE} sdist from PyPI")
                _run(
                    [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                     f"{SDIST_PACKAGE}=={SDIST_VERSION}", "-d", str(work / "sdist")],
                    work, log_file,
                )
                archives = sorted((work / "sdist").glob("*.tar.gz"))
                if not archives:
                    raise EngineUnavailableError("pip download produced no sdist archive")
                _safe_extract(archives[0], work)
                src = work / f"llama_cpp_python-{SDIST_VERSION}" / "vendor" / "llama.cpp"
                if not (src / "CMakeLists.txt").is_file():
                    raise EngineUnavailableError(f"the sdist has no vendored llama.cpp at {src}")
                progress.stage(2, 4, "configuring (cmake)")
                _run(["cmake", "-B", "build", *_CMAKE_FLAGS], src, log_file)
                n = str(jobs or os.cpu_count() or 2)
                progress.stage(3, 4, f"compiling (cmake --build, {n} jobs; the long part)")
                _run(["cmake", "--build", "build", "--target", "llama-server", "-j", n], src, log_file,
                     on_line=progress.line)
                binary = src / "build" / "bin" / "llama-server"
                staged = cache / f".llama-server-sdist-{os.getpid()}"
                progress.stage(4, 4, "stripping and caching the binary")
                if shutil.which("strip"):
                    _run(["strip", "-o", str(staged), str(binary)], src, log_file)
                else:
                    shutil.copyfile(binary, staged)
                staged.chmod(0o755)
                os.replace(staged, target)
        except EngineUnavailableError as exc:
            raise EngineUnavailableError(f"{exc} (build log: {log_path})") from exc
        except OSError as exc:
            raise EngineUnavailableError(f"building llama-server failed: {exc} (build log: {log_path})") from exc
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"built {target} in {progress.elapsed()}; later runs use it at once")
        return target


# -- running a replica --


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the caller must cope with a race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page, by name (enough for llama-server's page)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) >= 2 and "{" not in parts[0]:
            with contextlib.suppress(ValueError):
                out[parts[0]] = float(parts[1])
    return out


def _set_pdeathsig() -> None:  # pragma: no cover - runs in the child
    # NOTE: Linux only: the child gets SIGKILL if the thread that started it dies,
    # so a crashed test run leaves no engine behind.
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class LlamaServer:
    """One ``llama-server`` child process.

    Args:
        binary: the executable (:func:`find_llama_server`).
        model: the GGUF file.
        host: the address to listen on.
        port: the port; ``0`` picks a free one (retried if it is taken meanwhile).
        api_key: ``--api-key`` (``None``: open).
        metrics: pass ``--metrics``.
        parallel: ``-np`` (slots).
        ctx: ``-c`` (total context, split between the slots).
        alias: ``--alias`` (the model name the engine reports).
        threads: ``-t``; ``None`` lets llama-server choose.
        extra_args: more flags.
        log_path: where the engine's output goes (default: a temporary file).
    """

    def __init__(
        self,
        binary: str | os.PathLike[str],
        model: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        metrics: bool = True,
        parallel: int = 2,
        ctx: int = 2048,
        alias: str | None = "tiny",
        threads: int | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.binary = Path(binary)
        self.model = Path(model)
        self.host = host
        self.port = port
        self._auto_port = port == 0
        self.api_key = api_key
        self.metrics_enabled = metrics
        self.parallel = parallel
        self.ctx = ctx
        self.alias = alias
        self.threads = threads
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def argv(self) -> list[str]:
        args = [str(self.binary), "-m", str(self.model), "--host", self.host, "--port", str(self.port),
                "-np", str(self.parallel), "-c", str(self.ctx), "--no-webui"]
        if self.alias:
            args += ["--alias", self.alias]
        if self.metrics_enabled:
            args.append("--metrics")
        if self.api_key:
            args += ["--api-key", self.api_key]
        if self.threads is not None:
            args += ["-t", str(self.threads)]
        return args + list(self.extra_args)

    def _spawn(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"llama-server already running (pid {self.proc.pid})")
        if self._auto_port:
            self.port = free_port(self.host)
        if self._log is None:
            if self.log_path is not None:
                self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
            else:
                self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self._log_start = self._log.seek(0, os.SEEK_END)
        self.proc = subprocess.Popen(
            self.argv(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
        )

    def log_tail(self, limit: int = 4000) -> str:
        """The end of the engine's output since its last start."""
        if self._log is None:
            return ""
        self._log.flush()
        end = self._log.seek(0, os.SEEK_END)
        start = max(self._log_start, end - limit)
        self._log.seek(start)
        data = self._log.read(end - start)
        self._log.seek(0, os.SEEK_END)
        return data.decode("utf-8", "replace")

    def _health_once(self, timeout: float) -> int | None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status
        except OSError:
            return None
        finally:
            conn.close()

    def _check_exited(self) -> bool:
        """Whether the process has exited (and so a start attempt failed)."""
        return self.proc is not None and self.proc.poll() is not None

    def start(self, timeout: float = 30.0) -> LlamaServer:
        """Start it and wait until ``/health`` is 200.

        Raises:
            RuntimeError: it exited or was not ready within ``timeout`` (the
                message carries the end of its output); it is stopped.
        """
        for attempt in range(3):
            self._spawn()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self._check_exited():
                    break
                if self._health_once(1.0) == 200:
                    return self
                time.sleep(0.05)
            if self._start_failed(attempt, timeout):
                continue
        raise AssertionError("unreachable")  # pragma: no cover

    async def start_async(self, timeout: float = 30.0) -> LlamaServer:
        """:meth:`start` without blocking the event loop while waiting."""
        for attempt in range(3):
            self._spawn()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self._check_exited():
                    break
                if await self._health_once_async(1.0) == 200:
                    return self
                await asyncio.sleep(0.05)
            if self._start_failed(attempt, timeout):
                continue
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_failed(self, attempt: int, timeout: float) -> bool:
        """Clean up a failed start; ``True`` to retry on another port, else raise."""
        exited = self._check_exited()
        tail = self.log_tail()
        self._reap()
        if exited and self._auto_port and attempt < 2 and "bind" in tail.lower():
            return True  # the free port was taken meanwhile
        self.close_log()
        what = f"exited with status {self.proc.returncode if self.proc else '?'}" if exited else (
            f"was not ready within {timeout:g}s")
        raise RuntimeError(f"llama-server ({' '.join(self.argv())}) {what}; its output ends:\n{tail}")

    async def _health_once_async(self, timeout: float) -> int | None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), timeout)
        except (OSError, asyncio.TimeoutError):
            return None
        try:
            writer.write(f"GET /health HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nConnection: close\r\n\r\n".encode())
            line = await asyncio.wait_for(reader.readline(), timeout)
            parts = line.split()
            return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
        except (OSError, asyncio.TimeoutError):
            return None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _reap(self, term_timeout: float = 5.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(term_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """SIGKILL it now (a crash) and reap it; :meth:`start` can run it again on the same port."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def stop(self, term_timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``term_timeout``; always reaped. Safe to call twice."""
        self._reap(term_timeout)
        self.close_log()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def restart(self, timeout: float = 30.0) -> LlamaServer:
        """Stop it if running and start it again on the same port."""
        self._reap()
        auto, self._auto_port = self._auto_port, False
        try:
            return self.start(timeout)
        finally:
            self._auto_port = auto

    async def restart_async(self, timeout: float = 30.0) -> LlamaServer:
        """:meth:`restart` without blocking the event loop while waiting."""
        self._reap()
        auto, self._auto_port = self._auto_port, False
        try:
            return await self.start_async(timeout)
        finally:
            self._auto_port = auto

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, *, key: bool = True, timeout: float = 5.0) -> tuple[int, bytes]:
        """``GET path`` on the engine (with its key unless ``key=False``): ``(status, body)``."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            conn.request("GET", path, headers=self._auth_headers() if key else {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """The engine's ``/metrics`` samples (read with its key).

        Raises:
            RuntimeError: ``/metrics`` did not answer 200 (``--metrics`` off, wrong key).
        """
        status, body = self.get("/metrics")
        if status != 200:
            raise RuntimeError(f"{self.url}/metrics answered {status}: {body[:200]!r}")
        return parse_metrics(body.decode("utf-8", "replace"))

    async def metrics_async(self) -> dict[str, float]:
        """:meth:`metrics` without blocking the event loop."""
        return await asyncio.to_thread(self.metrics)

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<LlamaServer {self.url} pid={self.pid}>"
