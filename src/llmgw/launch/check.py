"""``llmgw ctl engine-check ENGINE``: can this node run ENGINE the way llmgw launches it?

Static checks first (seconds, no model needed): the binary or module is found,
its version, every flag llmgw passes is in its ``--help``, a GPU driver is
visible (informational for llama.cpp, which runs on CPUs), and for TensorRT-LLM
that ``engines.trtllm.python`` imports ``tensorrt_llm`` and runs llmgw's launcher
file. Then, when a model is at hand (llama.cpp: a tiny GGUF llmgw writes itself),
live checks through the real supervisor and launcher: start, ready, the metrics
page has the names llmgw reads (with the key where the engine guards it), a
request without the key gets 401, and a clean stop that frees the port.

Every check is one :class:`Check`: passed, failed (with the fix), or information.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config.agent import AgentEngineConfig
from ..engines import ENGINES
from . import llamacpp, sglang, trtllm, vllm
from .base import LaunchError, find_binary, find_python
from .spec import FAILED, READY, STOPPED, ReplicaSpec
from .supervisor import ReplicaSupervisor, http_status, process_start_time

__all__ = ["CHECK_ENGINES", "Check", "engine_check", "render"]

CHECK_ENGINES = ("vllm", "llamacpp", "trtllm", "sglang")
PASS, FAIL, INFO = "pass", "fail", "info"
_HELP_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome."""

    name: str
    status: str
    """``pass``, ``fail`` or ``info`` (told, never failing: llama.cpp's GPU, a live check skipped)."""
    detail: str
    fix: str = ""

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def line(self) -> str:
        text = f"{self.status.upper():<4}  {self.name:<8} {self.detail}"
        return f"{text}\n      fix: {self.fix}" if self.failed and self.fix else text

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.name, "status": self.status, "detail": self.detail, "fix": self.fix or None}


def render(checks: Sequence[Check]) -> str:
    """One line per check (a failed one with its fix beneath), then a summary line."""
    failed = sum(c.failed for c in checks)
    tail = f"{failed} check(s) failed" if failed else "all checks passed"
    return "\n".join([*(c.line() for c in checks), tail])


def _run(argv: Sequence[str], env: Mapping[str, str] | None = None,
         timeout: float = _HELP_TIMEOUT) -> tuple[int | None, str]:
    """Run ``argv``: ``(exit status or None when it could not run or timed out, stdout + stderr)``."""
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, errors="replace",
                             env=dict(env) if env is not None else None, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:g}s"
    except OSError as exc:
        return None, exc.strerror or str(exc)
    return out.returncode, (out.stdout or "") + (out.stderr or "")


def _first_line(text: str, limit: int = 160) -> str:
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line[:limit]


def _has_flag(help_text: str, flag: str) -> bool:
    # A flag as a whole word: "--metrics" is not found in "--metrics-port".
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", help_text) is not None


def _flags_check(what: str, help_cmd: Sequence[str], flags: Sequence[str], upgrade: str, label: str) -> Check:
    code, text = _run(help_cmd)
    shown = " ".join([label, *help_cmd[1:]])
    if code is None or code != 0:
        return Check("flags", FAIL, f"`{shown}` failed ({'exit status ' + str(code) if code is not None else text})",
                     f"run `{shown}` by hand: the {what} install is broken")
    missing = [f for f in flags if not _has_flag(text, f)]
    if missing:
        return Check("flags", FAIL, f"`{shown}` lacks {', '.join(missing)}, which llmgw passes",
                     f"{upgrade} (llmgw passes {', '.join(flags)})")
    return Check("flags", PASS, f"`{shown}` has every flag llmgw passes ({', '.join(flags)})")


def _gpu_check(engine: str, gpu_source: str) -> tuple[Check, tuple[str, ...]]:
    from ..agent.discovery import open_source

    needs = engine != "llamacpp"
    try:
        src = open_source(gpu_source)
    except (ImportError, ValueError) as exc:
        reading = None
        why = str(exc)
    else:
        try:
            reading = src.read()
            why = "; ".join(reading.errors)
        finally:
            src.close()
    gpus = tuple(g.uuid for g in reading.gpus) if reading is not None else ()
    if gpus:
        assert reading is not None
        driver = reading.facts.driver_version
        cuda = reading.facts.cuda_driver_version
        names = sorted({g.name or "?" for g in reading.gpus})
        where = f" (driver {driver}, CUDA {cuda})" if driver or cuda else ""
        return Check("gpu", PASS, f"{len(gpus)} GPU(s) visible through {reading.source}{where}: {', '.join(names)}"), gpus
    detail = f"no GPU visible ({why or 'no NVIDIA driver found: NVML and nvidia-smi both absent'})"
    if not needs:
        return Check("gpu", INFO, detail + "; llama.cpp runs on the CPU"), ()
    return Check("gpu", FAIL, detail,
                 "install the NVIDIA driver (nvidia-smi must list the GPUs), or run this engine on a GPU node"), ()


def _static_llamacpp(cfg: AgentEngineConfig | None) -> tuple[list[Check], str | None]:
    try:
        binary = find_binary(cfg, llamacpp.BINARY, "llamacpp")
    except LaunchError as exc:
        return [Check("found", FAIL, str(exc).split(";")[0],
                      "install llama.cpp's llama-server, or set engines.llamacpp.binary in the agent's config")], None
    checks = [Check("found", PASS, binary)]
    code, text = _run([binary, "--version"])  # (llama-server prints it on stderr)
    m = re.search(r"version:\s*(\S+)(?:\s*\(([^)]*)\))?", text)
    if code == 0 and m:
        checks.append(Check("version", PASS, m.group(1) + (f" ({m.group(2)})" if m.group(2) else "")))
    else:
        checks.append(Check("version", FAIL, f"`llama-server --version` said: {_first_line(text) or code}",
                            "the binary does not run here; rebuild llama.cpp for this node"))
    checks.append(_flags_check("llama.cpp", [binary, "--help"], llamacpp.FLAGS,
                               "use a newer llama.cpp build (llama-server)", llamacpp.BINARY))
    code, text = _run([binary, "--list-devices"])
    devices = [ln.strip() for ln in text.splitlines()[1:] if ln.strip() and ln.strip() != "(none)"]
    checks.append(Check("devices", INFO, f"llama-server --list-devices: {', '.join(devices) or 'none (CPU only)'}"))
    return checks, binary


def _static_vllm(cfg: AgentEngineConfig | None) -> tuple[list[Check], str | None]:
    try:
        binary = vllm.binary(cfg)
    except LaunchError as exc:
        return [Check("found", FAIL, str(exc).split(";")[0],
                      "pip install vllm into an environment, then set engines.vllm.binary (or .python)")], None
    checks = [Check("found", PASS, binary)]
    code, text = _run([binary, "--version"])
    if code == 0 and text.strip():
        checks.append(Check("version", PASS, _first_line(text)))
    else:
        checks.append(Check("version", FAIL, f"`vllm --version` said: {_first_line(text) or code}",
                            "the vllm install is broken; reinstall it"))
    checks.append(_flags_check("vLLM", [binary, "serve", "--help=all"], vllm.FLAGS, "upgrade vLLM", vllm.BINARY))
    return checks, binary


def _python_module(python: str, module: str, what: str) -> Check:
    code, text = _run([python, "-c", f"import {module}, sys; sys.stdout.write('\\n' + {module}.__version__)"])
    if code == 0:
        return Check("version", PASS, f"{module} {text.strip().splitlines()[-1]} in {python}")
    last = text.strip().splitlines()[-1] if text.strip() else str(code)
    return Check("version", FAIL, f"{python} cannot import {module}: {last[:200]}",
                 f"set engines.{what}.python to the interpreter whose environment has {module}")


def _static_sglang(cfg: AgentEngineConfig | None) -> tuple[list[Check], str | None]:
    try:
        python = find_python(cfg, "sglang")
    except LaunchError as exc:
        return [Check("found", FAIL, str(exc).split(";")[0],
                      "set engines.sglang.python to the interpreter that has SGLang")], None
    checks = [Check("found", PASS, python), _python_module(python, "sglang", "sglang")]
    if checks[-1].failed:
        return checks, None
    checks.append(_flags_check("SGLang", [python, "-m", sglang.MODULE, "--help"], sglang.FLAGS, "upgrade SGLang",
                                 "python"))
    return checks, python


def _static_trtllm(cfg: AgentEngineConfig | None) -> tuple[list[Check], str | None]:
    try:
        python = find_python(cfg, "trtllm")
    except LaunchError as exc:
        return [Check("found", FAIL, str(exc).split(";")[0],
                      "set engines.trtllm.python to the interpreter that has tensorrt_llm")], None
    checks = [Check("found", PASS, python), _python_module(python, "tensorrt_llm", "trtllm")]
    code, text = _run([python, "-I", "-S", str(trtllm.GUARD), "--help"])
    if code == 0:
        checks.append(Check("launcher", PASS, f"llmgw's launcher runs with {python} -I -S"))
    else:
        checks.append(Check("launcher", FAIL, f"llmgw's launcher does not run with {python}: {_first_line(text)}",
                            "engines.trtllm.python must be a Python 3.9 or newer"))
    try:
        serve = trtllm.binary(cfg)
    except LaunchError as exc:
        checks.append(Check("serve", FAIL, str(exc).split(";")[0],
                            "install TensorRT-LLM (it brings trtllm-serve), or set engines.trtllm.binary"))
        return checks, None
    checks.append(Check("serve", PASS, serve))
    checks.append(_flags_check("TensorRT-LLM", [serve, "serve", "--help"], trtllm.FLAGS, "upgrade TensorRT-LLM",
                                 trtllm.BINARY))
    return checks, serve


_STATIC = {"llamacpp": _static_llamacpp, "vllm": _static_vllm, "sglang": _static_sglang, "trtllm": _static_trtllm}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # (the engine's closed connections sit in TIME_WAIT on its port: not a listener)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def _http(port: int, method: str, path: str, key: str | None, body: bytes = b"",
                timeout: float = 30.0) -> tuple[int | None, bytes]:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        return None, str(exc).encode()
    try:
        head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
        if key:
            head.append(f"Authorization: Bearer {key}")
        if method == "POST":
            head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        raw = await asyncio.wait_for(reader.read(-1), timeout)
    except (OSError, asyncio.TimeoutError, RuntimeError) as exc:  # (RuntimeError: uvloop, the peer closed)
        return None, str(exc).encode()
    finally:
        writer.close()
    status_line, _, rest = raw.partition(b"\r\n")
    parts = status_line.split()
    status = int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
    return status, rest.partition(b"\r\n\r\n")[2]


async def _live(engine: str, engines: Mapping[str, AgentEngineConfig], model: str, gpus: tuple[str, ...],
                timeout: float, work: Path, replica_ports: tuple[int, int] | None = None) -> list[Check]:
    info = ENGINES[engine]
    key = "llmgw-check-" + secrets.token_urlsafe(18)
    spec = ReplicaSpec(id="engine-check", deployment="engine-check", engine=engine, model=model,
                       served_name="llmgw-check", gpus=gpus, api_key=key,
                       gpu_memory_fraction=0.2 if engine in ("vllm", "sglang") else None,
                       slots=1 if engine == "llamacpp" else None, context=1024 if engine == "llamacpp" else None)
    changed = asyncio.Event()
    ports: dict[str, Any] = {"port_range": replica_ports, "strict_ports": True} if replica_ports else {}
    sup = ReplicaSupervisor(work / "state", engines=engines, on_change=changed.set, ready_timeout=timeout,
                            max_crashes=1, stop_grace=30.0, **ports)
    checks: list[Check] = []
    t0 = time.monotonic()
    try:
        await sup.apply([spec])
        deadline = t0 + timeout + 5
        st = sup.statuses()[0]
        while st.state not in (READY, FAILED) and time.monotonic() < deadline:
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass
            st = sup.statuses()[0]
        if st.state != READY:
            checks.append(Check("start", FAIL, f"{st.state}: {st.message}",
                                f"see the engine's log ({st.log_path}); the first error in it is the cause"))
            return checks
        checks.append(Check("start", PASS, f"started, pid {st.pid}, port {st.port}"))
        checks.append(Check("ready", PASS, f"/health answered 200 after {time.monotonic() - t0:.1f}s"))
        port = st.port
        assert port is not None
        status, body = await _http(port, "GET", info.metrics_path, key)
        wanted = [names for names in (info.waiting.names, info.running.names) if names]
        text = body.decode("utf-8", "replace")
        missing = [n[0] for n in wanted if not any(re.search(r"^" + re.escape(x) + r"[{ ]", text, re.M) for x in n)]
        if status != 200:
            hint = info.notes[0] if info.notes else f"turn on the engine's {info.metrics_path}"
            checks.append(Check("metrics", FAIL, f"{info.metrics_path} answered {status} (with the key)",
                                f"{hint}; llmgw's launcher passes the flag: the engine build may ignore it"))
        elif missing:
            checks.append(Check("metrics", FAIL, f"{info.metrics_path} lacks {', '.join(missing)}",
                                "this engine version names its metrics differently from what llmgw reads "
                                "(see docs/engines.md); use a supported version"))
        else:
            guarded = ""
            if info.metrics_need_key or engine == "trtllm":
                plain, _ = await _http(port, "GET", info.metrics_path, None)
                guarded = f"; without the key: {plain}"
            names = ", ".join(n[0] for n in wanted)
            checks.append(Check("metrics", PASS, f"{info.metrics_path} has {names}{guarded}"))
        chat = b'{"model": "llmgw-check", "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}'
        status, _ = await _http(port, "POST", "/v1/chat/completions", None, chat)
        if status == 401:
            checks.append(Check("auth", PASS, "a request without the key got 401"))
        else:
            checks.append(Check("auth", FAIL, f"a request without the key got {status}, not 401",
                                "the engine did not take the API key llmgw passed; check its --api-key support"))
        pid = st.pid
        await sup.apply([])
        deadline = time.monotonic() + 45
        while sup.statuses()[0].state != STOPPED and time.monotonic() < deadline:
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                pass
        gone = pid is None or process_start_time(pid) is None
        if sup.statuses()[0].state == STOPPED and gone and _port_free(port) \
                and await http_status("127.0.0.1", port, "/health", 1.0) is None:
            checks.append(Check("stop", PASS, "SIGTERM: exited and released its port"))
        else:
            checks.append(Check("stop", FAIL, f"not stopped cleanly ({sup.statuses()[0].state}, port {port})",
                                "the engine ignores SIGTERM or leaves children behind; see its log"))
    finally:
        await sup.close()
    return checks


async def engine_check(
    engine: str,
    *,
    engines: Mapping[str, AgentEngineConfig] | None = None,
    model: str | None = None,
    live: bool = True,
    gpu_source: str = "auto",
    timeout: float = 600.0,
    replica_ports: tuple[int, int] | None = None,
) -> list[Check]:
    """Run the checks for ``engine``; see the module docstring.

    Args:
        engines: the agent config's ``engines:`` (where binaries and interpreters are).
        model: the model for the live checks (a path or an id the engine fetches);
            llama.cpp without one gets a tiny GGUF llmgw writes. Other engines
            without one skip the live checks (told as ``info``).
        live: run the live checks at all.
        gpu_source: where GPUs are read from (``auto``, ``nvml``, ``nvidia-smi``, ``none``, ``simulated``).
        timeout: seconds the engine may take to become ready.
        replica_ports: the agent's ``replica_ports``: the engine listens there, as its replicas do.
    """
    if engine not in _STATIC:
        raise ValueError(f"unknown engine {engine!r}: one of {', '.join(CHECK_ENGINES)}")
    engines = dict(engines or {})
    cfg = engines.get(engine)
    checks, runnable = await asyncio.to_thread(_STATIC[engine], cfg)
    gpu, gpus = await asyncio.to_thread(_gpu_check, engine, gpu_source)
    checks.append(gpu)
    if not live:
        return checks
    if runnable is None or any(c.failed for c in checks):
        checks.append(Check("live", INFO, "skipped: a static check failed"))
        return checks
    with tempfile.TemporaryDirectory(prefix="llmgw-engine-check-") as tmp:
        work = Path(tmp)
        if model is None and engine == "llamacpp":
            from ..testing.gguf_model import write_tiny_llama

            model = str(write_tiny_llama(work / "tiny.gguf", ctx=1024))
        if model is None:
            checks.append(Check("live", INFO, "skipped: no model given (--model PATH-OR-ID)"))
            return checks
        checks += await _live(engine, engines, model, gpus[:1], timeout, work, replica_ports)
    return checks

