#!/usr/bin/env python3
"""Data-plane benchmark: CPU per proxied request / relayed stream, added latency, RSS.

Puts each proxy under test (nginx, llmgw, optionally a pure-Python byte relay)
in front of the same nginx "engine" and measures, side by side in one run:

* CPU per proxied request: the proxy's utime+stime (``/proc/<pid>/stat``, summed
  over the process and its children, e.g. nginx master + 1 worker) before and
  after ``wrk -t1 -c16 -d10s -s post.lua``, divided by the requests wrk completed;
* CPU per relayed stream: the same with ``stream.lua`` (65-event SSE answers);
* added p50 latency at one connection: ``wrk -c1 --latency`` p50 through the
  proxy minus p50 straight to the upstream, measured in the same round;
* RSS (VmRSS, summed like CPU) after each run;
* errors: wrk's non-2xx and socket errors plus answers the Lua scripts reject.

The proxy runs pinned to ``--proxy-core`` (0); wrk and the upstream nginx to
``--load-core`` (1). Rounds are interleaved (nginx, llmgw, relay, nginx, ...)
and the table shows the median of ``--rounds`` (3) with min-max.

    .venv/bin/python bench/dataplane/run.py /tmp/dataplane.json
    .venv/bin/python bench/dataplane/run.py out.json --proxies nginx,llmgw --rounds 5
    .venv/bin/python bench/dataplane/run.py out.json --profile /tmp/prof   # + py-spy of llmgw
    .venv/bin/python bench/dataplane/run.py out.json --proxies nginx,llmgw --cluster 1000  # + a fleet of agents
    .venv/bin/python bench/dataplane/run.py out.json --proxies nginx,llmgw --cluster 1000 --follow-cluster
        # + a router following a control plane (in a process of its own) with that fleet
    .venv/bin/python bench/dataplane/run.py out.json --proxies nginx,llmgw --prefix  # + llmgw routing by prefix

Every process it starts is stopped on exit (also on Ctrl-C).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")

# ---------------------------------------------------------------- fixed answers

_CONTENT = (
    "Day one: start in Alfama in the morning and walk up to the castle; lunch at a small tasca near "
    "the cathedral; in the evening hear fado in the old town. Day two: take tram 15 to Belem for the "
    "monastery and the tower, eat pasteis nearby, then dinner in Cais do Sodre. Day three: explore "
    "Chiado and Bairro Alto, lunch at the Time Out market, and watch the sunset from a miradouro. "
    "Metro green and blue lines plus tram 28 cover most sights. Book the castle tickets in advance."
)


def chat_json() -> str:
    """A vLLM-style chat.completion (~0.8 KB)."""
    return json.dumps(
        {
            "id": "chatcmpl-8f1c2a6b9d4e4f0a9b7c3d2e1f0a9b8c",
            "object": "chat.completion",
            "created": 1764000000,
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": _CONTENT,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ],
            "service_tier": None,
            "system_fingerprint": None,
            "usage": {"prompt_tokens": 212, "total_tokens": 318, "completion_tokens": 106, "prompt_tokens_details": None},
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        },
        separators=(",", ":"),
    )


def sse_events(n: int = 65) -> list[str]:
    """``n`` vLLM-style SSE events: role chunk, content chunks, finish chunk, [DONE]."""
    words = _CONTENT.split(" ")
    head = '{"id":"chatcmpl-8f1c2a6b9d4e4f0a9b7c3d2e1f0a9b8c","object":"chat.completion.chunk","created":1764000000,"model":"m","choices":[{"index":0,'
    events = ['data: ' + head + '"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n']
    for i in range(n - 3):
        tok = (" " if i else "") + words[i % len(words)]
        events.append("data: " + head + '"delta":{"content":' + json.dumps(tok) + '},"logprobs":null,"finish_reason":null}]}\n\n')
    events.append("data: " + head + '"delta":{"content":""},"logprobs":null,"finish_reason":"stop","stop_reason":null}]}\n\n')
    events.append("data: [DONE]\n\n")
    assert len(events) == n
    return events


METRICS = (
    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'
    "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
    "# TYPE vllm:num_requests_waiting gauge\n"
    'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0\n'
    "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
    "# TYPE vllm:kv_cache_usage_perc gauge\n"
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0\n'
)


def _nginx_str(s: str) -> str:
    # Inside '...' in nginx.conf: escape backslash and quote; newlines as \n.
    # "$" would start a variable in echo/return: the fixed answers have none.
    assert "$" not in s and "'" not in s, "fixed answers must not contain $ or '"
    return s.replace("\\", "\\\\").replace("\n", "\\n")


def render(tmpl: str, **kw: object) -> str:
    text = (HERE / tmpl).read_text()
    for k, v in kw.items():
        text = text.replace(f"@@{k}@@", str(v))
    left = re.findall(r"@@[A-Z0-9_]+@@", text)
    assert not left, left
    return text


# ---------------------------------------------------------------- processes

_procs: list[subprocess.Popen] = []  # type: ignore[type-arg]


def _stop_all() -> None:
    for p in reversed(_procs):
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    for p in reversed(_procs):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    _procs.clear()


atexit.register(_stop_all)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:  # type: ignore[type-arg]
    with open(log, "ab") as f:  # the child keeps its own copy of the descriptor
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    _procs.append(p)
    return p


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on {port} within {timeout:g}s")


def start_engine(d: Path, up: tuple[int, int], gap: float = 0.0, core: int | None = None) -> subprocess.Popen:  # type: ignore[type-arg]
    """The nginx "engine" on ports ``up`` (config and logs in ``d``), ready to answer.

    ``gap``: seconds between SSE events (0: back to back, each still flushed).
    ``core``: pin it there with taskset.
    """
    lines = []
    for i, ev in enumerate(sse_events()):
        lines.append(f"            echo -n '{_nginx_str(ev)}';")
        lines.append("            echo_flush;")
        if gap > 0 and i < 64:
            lines.append(f"            echo_sleep {gap:g};")
    conf = d / "upstream.conf"
    conf.write_text(render("nginx_upstream.conf.tmpl", DIR=d, UP0=up[0], UP1=up[1], CHAT_JSON=_nginx_str(chat_json()),
                           METRICS=_nginx_str(METRICS), SSE_DIRECTIVES="\n".join(lines), SSE_GAP_S=f"{gap:g}"))
    pin = ["taskset", "-c", str(core)] if core is not None else []
    upstream = start([*pin, "nginx", "-p", str(d), "-c", str(conf)], d / "upstream.out")
    wait_port(up[0], upstream, "upstream nginx")
    wait_port(up[1], upstream, "upstream nginx")
    return upstream


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT from a previous run is fine
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (nginx: master + workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                kids = Path(f"/proc/{p}/task/{tid}/children").read_text().split()
                todo.extend(int(k) for k in kids)
        except OSError:
            pass
    return out


def cpu_split(pid: int) -> tuple[float, float]:
    """(utime, stime) of ``pid`` and its descendants (all threads), seconds."""
    user = sys_ = 0
    for p in tree(pid):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        user += int(fields[11])  # utime (field 14)
        sys_ += int(fields[12])  # stime (field 15)
    return user / CLK_TCK, sys_ / CLK_TCK


def cpu_seconds(pid: int) -> float:
    """utime+stime of ``pid`` and its descendants (all threads), seconds."""
    return sum(cpu_split(pid))


def main_thread_cpu(pid: int) -> float:
    """utime+stime of ``pid``'s main thread alone, seconds: llmgw's data path (its loop) runs there,
    the control plane's gRPC on threads of its own."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def thread_stats(pid: int) -> dict[str, list[float]]:
    """Per thread name (``comm``; the main thread as ``main``): [CPU seconds, voluntary and involuntary
    context switches], summed over threads of that name: which of llmgw's threads the CPU went to."""
    out: dict[str, list[float]] = {}
    for t in Path(f"/proc/{pid}/task").glob("*"):
        try:
            fields = (t / "stat").read_text().rsplit(")", 1)[1].split()
            status = (t / "status").read_text().splitlines()
            name = "main" if t.name == str(pid) else (t / "comm").read_text().strip()
        except OSError:
            continue
        cs = {k: int(v) for k, _, v in (line.partition(":\t") for line in status)
              if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")}
        row = out.setdefault(name, [0.0, 0.0, 0.0])
        row[0] += (int(fields[11]) + int(fields[12])) / CLK_TCK
        row[1] += cs.get("voluntary_ctxt_switches", 0)
        row[2] += cs.get("nonvoluntary_ctxt_switches", 0)
    return out


def rss_mib(pid: int) -> float:
    kib = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    kib += int(line.split()[1])
        except OSError:
            continue
    return kib / 1024


# ---------------------------------------------------------------- wrk

_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6}


def _dur_us(s: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", s)
    assert m, s
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(core: int, url: str, script: str, conns: int, duration: float, latency: bool = False) -> dict:
    cmd = ["taskset", "-c", str(core), "wrk", "-t1", f"-c{conns}", f"-d{duration:g}s", "--timeout", "10s",
           "-s", str(HERE / script)]
    if latency:
        cmd.append("--latency")
    cmd.append(url)
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    text = out.stdout + out.stderr
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", text)
    if out.returncode != 0 or not m:
        raise SystemExit(f"wrk failed ({out.returncode}):\n{text}")
    res: dict = {"requests": int(m.group(1)), "raw": text}
    se = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    res["socket_errors"] = sum(int(x) for x in se.groups()) if se else 0
    n2 = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    res["non2xx"] = int(n2.group(1)) if n2 else 0
    bad = re.search(r"BENCH_BAD (\d+)", text)
    res["bad_body"] = int(bad.group(1)) if bad else 0
    res["errors"] = res["socket_errors"] + res["non2xx"] + res["bad_body"]
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    res["rps"] = float(rps.group(1)) if rps else 0.0
    if latency:
        p = re.search(r"^\s+50%\s+(\S+)", text, re.M)
        res["p50_us"] = _dur_us(p.group(1)) if p else None
        p99 = re.search(r"^\s+99%\s+(\S+)", text, re.M)
        res["p99_us"] = _dur_us(p99.group(1)) if p99 else None
    return res


# ---------------------------------------------------------------- the proxies


class Proxy:
    name = ""

    def __init__(self, port: int) -> None:
        self.port = port
        self.proc: subprocess.Popen | None = None  # type: ignore[type-arg]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


class NginxProxy(Proxy):
    name = "nginx"

    def start(self, d: Path, core: int, up: tuple[int, int]) -> None:
        conf = d / "proxy.conf"
        conf.write_text(render("nginx_proxy.conf.tmpl", DIR=d, PORT=self.port, UP0=up[0], UP1=up[1]))
        self.proc = start(["taskset", "-c", str(core), "nginx", "-p", str(d), "-c", str(conf)], d / "nginx_proxy.out")
        wait_port(self.port, self.proc, "nginx proxy")


class Llmgw(Proxy):
    name = "llmgw"

    def __init__(self, port: int, admin: int, cmd: str, name: str = "llmgw", cluster: tuple[int, int, int] | None = None,
                 fleet_core: int = 1, scrape_every: float = 15.0, follow: tuple[int, int] | None = None,
                 strategy: str | None = None, grpc_server: str | None = None, scrape_gzip: bool = False) -> None:
        super().__init__(port)
        self.scrape_gzip = scrape_gzip
        """The fleet's scrapes ask for gzip, as Prometheus does."""
        self.grpc_server = grpc_server
        """control.grpc_server (None: llmgw's default, its own)."""
        self.admin = admin
        self.cmd = cmd
        self.name = name
        self.strategy = strategy
        """routing.strategy (None: llmgw's default, score)."""
        self.cluster = cluster
        """(control port, agents, GPUs each): also run the control plane, with that many agents heartbeating."""
        self.fleet_core = fleet_core
        self.scrape_every = scrape_every
        self.fleet: subprocess.Popen | None = None  # type: ignore[type-arg]
        self.follow = follow
        """(client port, admin port) of a control plane in a process of its own, on the fleet's core, with
        the agents (``cluster``); this llmgw follows it (``follow:``) instead of running it."""

    def start_control_plane(self, d: Path) -> None:
        assert self.cluster is not None and self.follow is not None
        conf = d / f"{self.name}-cp.yaml"
        conf.write_text(
            f"listen: 127.0.0.1:{self.follow[0]}\n"
            f"admin: 127.0.0.1:{self.follow[1]}\n"
            f"control:\n  listen: 127.0.0.1:{self.cluster[0]}\n  join_token_env: BENCH_JOIN\n"
            "  router_token_env: BENCH_ROUTER\n"
        )
        env = {**os.environ, "BENCH_JOIN": "bench-join-token", "BENCH_ROUTER": "bench-router-token"}
        proc = start(["taskset", "-c", str(self.fleet_core), self.cmd, "serve", "-c", str(conf)],
                     d / f"{self.name}-cp.out", env)
        wait_port(self.follow[0], proc, f"{self.name}'s control plane")

    def start(self, d: Path, core: int, up: tuple[int, int]) -> None:
        conf = d / f"{self.name}.yaml"
        text = (
            f"listen: 127.0.0.1:{self.port}\n"
            f"admin: 127.0.0.1:{self.admin}\n"
            "endpoints:\n"
            f'  - {{id: up0, url: "http://127.0.0.1:{up[0]}", model: m, engine: vllm}}\n'
            f'  - {{id: up1, url: "http://127.0.0.1:{up[1]}", model: m, engine: vllm}}\n'
        )
        if self.strategy:
            text += f"routing: {{strategy: {self.strategy}}}\n"
        env = None
        if self.cluster is not None and self.follow is not None:
            self.start_control_plane(d)
            text += f"follow:\n  control: [127.0.0.1:{self.cluster[0]}]\n  token_env: BENCH_ROUTER\n"
            env = {**os.environ, "BENCH_ROUTER": "bench-router-token"}
        elif self.cluster is not None:
            text += f"control:\n  listen: 127.0.0.1:{self.cluster[0]}\n  join_token_env: BENCH_JOIN\n"
            text += f"  database: sqlite:///{d}/{self.name}.sqlite3\n"  # (one SQLite file a process)
            if self.grpc_server:
                text += f"  grpc_server: {self.grpc_server}\n"
            env = {**os.environ, "BENCH_JOIN": "bench-join-token"}
        conf.write_text(text)
        self.proc = start(["taskset", "-c", str(core), self.cmd, "serve", "-c", str(conf)], d / f"{self.name}.out", env)
        wait_port(self.port, self.proc, self.name)
        if self.cluster is not None:
            # the agents and a Prometheus's scrapes (every 15 s) on the load core, as in life off the gateway's
            cmd = ["taskset", "-c", str(self.fleet_core), sys.executable, str(HERE.parent / "cluster_scale.py"),
                   "--fleet-only", f"127.0.0.1:{self.cluster[0]}", "--agents", str(self.cluster[1]),
                   "--gpus", str(self.cluster[2])]
            if self.scrape_every > 0:  # (the cluster families are on the control plane's /metrics)
                cmd += ["--admin", str(self.follow[1] if self.follow else self.admin), "--scrape-every",
                        str(self.scrape_every)]
                if self.scrape_gzip:
                    cmd.append("--gzip")
            self.fleet = start(cmd, d / f"{self.name}-fleet.out")
            time.sleep(max(5.0, self.cluster[1] / 200))  # every agent registered and heartbeating


class Relay(Proxy):
    name = "relay"

    def start(self, d: Path, core: int, up: tuple[int, int]) -> None:
        cmd = ["taskset", "-c", str(core), sys.executable, str(HERE / "relay.py"), "--listen", f"127.0.0.1:{self.port}",
               "--upstream", f"127.0.0.1:{up[0]}", "--upstream", f"127.0.0.1:{up[1]}"]
        self.proc = start(cmd, d / "relay.out")
        wait_port(self.port, self.proc, "relay")


# ---------------------------------------------------------------- measuring


def steal_ticks(core: int) -> int:
    """Ticks the hypervisor ran something else while ``core`` wanted to run (``/proc/stat``)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith(f"cpu{core} "):
                fields = line.split()
                return int(fields[8]) if len(fields) > 8 else 0
    return 0


def measure_load(p: Proxy, args: argparse.Namespace, script: str) -> dict:
    m0 = main_thread_cpu(p.pid)
    th0 = thread_stats(p.pid) if isinstance(p, Llmgw) else {}
    u0, s0 = cpu_split(p.pid)
    st0 = steal_ticks(args.proxy_core)
    t0 = time.monotonic()
    r = wrk(args.load_core, p.url, script, args.connections, args.duration)
    elapsed = time.monotonic() - t0
    u1, s1 = cpu_split(p.pid)
    main = main_thread_cpu(p.pid) - m0
    th1 = thread_stats(p.pid) if isinstance(p, Llmgw) else {}
    steal = (steal_ticks(args.proxy_core) - st0) / os.sysconf("SC_CLK_TCK") / elapsed
    cpu = (u1 - u0) + (s1 - s0)
    n = r["requests"]
    return {
        "requests": r["requests"],
        "rps": r["rps"],
        "cpu_s": round(cpu, 3),
        "util": round(cpu / elapsed, 3),
        "steal": round(steal, 3),  # share of the proxy core's time taken by the hypervisor
        "us_per": round(cpu / n * 1e6, 2) if n else None,
        "user_us_per": round((u1 - u0) / n * 1e6, 2) if n else None,
        "sys_us_per": round((s1 - s0) / n * 1e6, 2) if n else None,
        "main_thread_us_per": round(main / n * 1e6, 2) if n and isinstance(p, Llmgw) else None,
        # per thread name: CPU share of a core over the run, context switches per request (vol., invol.)
        "threads": {k: {"util": round((v[0] - th0.get(k, [0, 0, 0])[0]) / elapsed, 4),
                        "cs_per": [round((v[i] - th0.get(k, [0, 0, 0])[i]) / n, 3) for i in (1, 2)] if n else None}
                    for k, v in th1.items()},
        "errors": r["errors"],
        "error_detail": {k: r[k] for k in ("socket_errors", "non2xx", "bad_body")},
        "rss_mib": round(rss_mib(p.pid), 1),
    }


# nginx saturates its core on the request load; a round where it did not had the
# machine busy elsewhere (see "contended rounds" in the output).
CONTENDED_UTIL = 0.85
# ... as was one where the hypervisor took more than this share of the proxy's core.
CONTENDED_STEAL = 0.05


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def span(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None]
    return f"{min(xs):.0f}-{max(xs):.0f}" if xs else "-"


def py_spy(p: Proxy, args: argparse.Namespace, script: str, out: Path, seconds: float, native: bool = False) -> None:
    """Record ``p`` under load. Python-only profiles sample without stopping the
    process (--nonblocking); native ones (C frames of uvloop, httptools, CPython,
    the Cython modules) must stop it for each sample, which slows it several
    times: trust their proportions, not their throughput."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        print("py-spy not found (pip install py-spy); skipping the profile")
        return
    mode = ["--native", "-r", str(min(args.profile_rate, 200))] if native else ["--nonblocking", "-r", str(args.profile_rate)]
    rec = subprocess.Popen(
        [spy, "record", "-p", str(p.pid), *mode, "-d", str(int(seconds)), "-f", "raw", "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    _procs.append(rec)
    time.sleep(1.0)
    wrk(args.load_core, p.url, script, args.connections, seconds - 2)
    rec.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON results file")
    ap.add_argument("--proxies", default="nginx,llmgw,relay", help="comma list of nginx,llmgw,relay")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per load run")
    ap.add_argument("--lat-duration", type=float, default=5.0, help="seconds per 1-connection latency run")
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--proxy-core", type=int, default=0)
    ap.add_argument("--load-core", type=int, default=1)
    ap.add_argument("--port-base", type=int, default=28000)
    ap.add_argument("--sse-gap-ms", type=float, default=1.0,
                    help="upstream pause between SSE events (0: back to back, flushed one by one)")
    ap.add_argument("--no-stream", action="store_true", help="skip the SSE runs")
    ap.add_argument("--llmgw", default=str(REPO / ".venv" / "bin" / "llmgw"), help="llmgw executable")
    ap.add_argument("--baseline", metavar="EXE",
                    help="another llmgw executable (an older build, say), run as proxy 'baseline' in the same rounds")
    ap.add_argument("--profile", metavar="DIR", help="afterwards, py-spy record llmgw under each load into DIR")
    ap.add_argument("--profile-rate", type=int, default=500)
    ap.add_argument("--keep", action="store_true", help="keep the work directory (configs, logs)")
    ap.add_argument("--cluster", type=int, metavar="AGENTS",
                    help="also run proxy 'cluster': llmgw with a control plane and AGENTS simulated agents of 8 GPUs "
                         "heartbeating every 5 s, scraped every 15 s (the data path's ratio with and without a fleet)")
    ap.add_argument("--follow-cluster", action="store_true",
                    help="with --cluster, also run proxy 'follower': llmgw following (follow:) a control plane in a "
                         "process of its own on the load core, with the same agents and scrapes")
    ap.add_argument("--cluster-grpcio", action="store_true",
                    help="with --cluster, also run proxy 'cluster-grpcio': the same with control.grpc_server: grpcio "
                         "(grpc.aio's server instead of llmgw's own), in the same rounds")
    ap.add_argument("--cluster-scrape-every", type=float, default=15.0, metavar="S",
                    help="--cluster: seconds between the fleet's scrapes of /metrics (0: none)")
    ap.add_argument("--cluster-scrape-gzip", action="store_true",
                    help="--cluster: the fleet's scrapes ask for gzip, as Prometheus does (compressed on a worker "
                         "thread; default: not, the page written as it is)")
    ap.add_argument("--prefix", action="store_true",
                    help="also run proxy 'prefix': llmgw with routing.strategy prefix (hashing the prompt, the index "
                         "lookups), its ratio to nginx beside llmgw's (score) in the same rounds")
    args = ap.parse_args()

    base = args.port_base
    up = (base + 1, base + 2)
    all_proxies: dict[str, Proxy] = {
        "nginx": NginxProxy(base + 80),
        "llmgw": Llmgw(base + 81, base + 91, args.llmgw),
        "relay": Relay(base + 82),
    }
    if args.baseline:
        all_proxies["baseline"] = Llmgw(base + 83, base + 93, args.baseline, name="baseline")
    if args.cluster:
        all_proxies["cluster"] = Llmgw(base + 84, base + 94, args.llmgw, name="cluster",
                                       cluster=(base + 95, args.cluster, 8), fleet_core=args.load_core,
                                       scrape_every=args.cluster_scrape_every, scrape_gzip=args.cluster_scrape_gzip)
    if args.cluster and args.cluster_grpcio:
        all_proxies["cluster-grpcio"] = Llmgw(base + 87, base + 89, args.llmgw, name="cluster-grpcio",
                                              cluster=(base + 88, args.cluster, 8), fleet_core=args.load_core,
                                              scrape_every=args.cluster_scrape_every, grpc_server="grpcio")
    if args.cluster and args.follow_cluster:
        all_proxies["follower"] = Llmgw(base + 85, base + 96, args.llmgw, name="follower",
                                        cluster=(base + 97, args.cluster, 8), fleet_core=args.load_core,
                                        scrape_every=args.cluster_scrape_every, follow=(base + 98, base + 99))
    if args.prefix:
        all_proxies["prefix"] = Llmgw(base + 86, base + 90, args.llmgw, name="prefix", strategy="prefix")
    names = [n.strip() for n in args.proxies.split(",") if n.strip()]
    if args.prefix and "prefix" not in names:
        names.append("prefix")
    if args.baseline and "baseline" not in names:
        names.append("baseline")
    if args.cluster and "cluster" not in names:
        names.append("cluster")
    if args.cluster and args.cluster_grpcio and "cluster-grpcio" not in names:
        names.append("cluster-grpcio")
    if args.cluster and args.follow_cluster and "follower" not in names:
        names.append("follower")
    proxies = [all_proxies[n] for n in names]
    ports = [*up, *(p.port for p in proxies)] + [p.admin for p in proxies if isinstance(p, Llmgw)]
    busy = [p for p in ports if not port_free(p)]
    if busy:
        raise SystemExit(f"ports in use: {busy}; choose another --port-base")

    d = Path(tempfile.mkdtemp(prefix="llmgw-dataplane-"))
    (d / "tmp").mkdir()
    try:
        upstream = start_engine(d, up, args.sse_gap_ms / 1000.0, args.load_core)
        for p in proxies:
            p.start(d, args.proxy_core, up)  # type: ignore[attr-defined]
        direct = Proxy(up[0])

        print(f"work dir {d}; upstream nginx pid {upstream.pid}; "
              + ", ".join(f"{p.name} pid {p.pid} :{p.port}" for p in proxies), flush=True)
        # warm-up: connection pools, caches, first-use allocations
        for p in proxies:
            wrk(args.load_core, p.url, "post.lua", args.connections, 2)
            if not args.no_stream:
                wrk(args.load_core, p.url, "stream.lua", args.connections, 2)

        rounds: list[dict] = []
        for r in range(args.rounds):
            rd: dict = {"direct_p50_us": None, "proxies": {}}
            lat = wrk(args.load_core, direct.url, "post.lua", 1, args.lat_duration, latency=True)
            rd["direct_p50_us"] = lat["p50_us"]
            rd["direct_errors"] = lat["errors"]
            for p in proxies:
                res: dict = {"nonstream": measure_load(p, args, "post.lua")}
                if not args.no_stream:
                    res["stream"] = measure_load(p, args, "stream.lua")
                lat = wrk(args.load_core, p.url, "post.lua", 1, args.lat_duration, latency=True)
                res["p50_us"] = lat["p50_us"]
                res["p99_us"] = lat["p99_us"]
                res["added_p50_us"] = round(lat["p50_us"] - rd["direct_p50_us"], 1)
                res["lat_errors"] = lat["errors"]
                res["rss_mib"] = round(rss_mib(p.pid), 1)
                rd["proxies"][p.name] = res
                s = res.get("stream", {})
                print(f"round {r + 1} {p.name:6s} req {res['nonstream']['us_per']} us "
                      f"[user {res['nonstream']['user_us_per']} sys {res['nonstream']['sys_us_per']}] "
                      f"({res['nonstream']['rps']:.0f}/s, util {res['nonstream']['util']:.2f}, "
                      f"steal {res['nonstream']['steal']:.2f})  "
                      f"stream {s.get('us_per')} us ({s.get('rps', 0):.0f}/s, util {s.get('util', 0):.2f}, "
                      f"steal {s.get('steal', 0):.2f})  "
                      f"p50 +{res['added_p50_us']} us  rss {res['rss_mib']} MiB  "
                      f"errors {res['nonstream']['errors'] + s.get('errors', 0) + res['lat_errors']}", flush=True)
            rounds.append(rd)

        summary: dict = {}
        for p in proxies:
            rs = [rd["proxies"][p.name] for rd in rounds]
            summary[p.name] = {
                "us_per_request": med([x["nonstream"]["us_per"] for x in rs]),
                "us_per_request_all": [x["nonstream"]["us_per"] for x in rs],
                "us_per_stream": med([x["stream"]["us_per"] for x in rs]) if not args.no_stream else None,
                "us_per_stream_all": [x["stream"]["us_per"] for x in rs] if not args.no_stream else [],
                "added_p50_us": med([x["added_p50_us"] for x in rs]),
                "added_p50_us_all": [x["added_p50_us"] for x in rs],
                "rss_mib_max": max(x["rss_mib"] for x in rs),
                "main_thread_us_per_request": med([x["nonstream"]["main_thread_us_per"] for x in rs
                                                   if x["nonstream"].get("main_thread_us_per") is not None]),
                "main_thread_us_per_stream": med([x["stream"]["main_thread_us_per"] for x in rs
                                                  if x["stream"].get("main_thread_us_per") is not None])
                if not args.no_stream else None,
                # per thread name, median share of a core during the runs
                "thread_util": {kind: {t: med([x[kind]["threads"][t]["util"] for x in rs if t in x[kind].get("threads", {})])
                                       for t in rs[-1][kind].get("threads", {})}
                                for kind in ("nonstream", "stream") if kind in rs[-1]},
                "errors": sum(x["nonstream"]["errors"] + x.get("stream", {}).get("errors", 0) + x["lat_errors"] for x in rs),
            }
        # Rounds in which the load could not drive nginx to its core's limit, or the
        # hypervisor took a share of the proxy's core: the machine was busy
        # elsewhere, and every proxy's CPU per request reads high and noisy.
        contended = [
            i + 1 for i, rd in enumerate(rounds)
            if ("nginx" in rd["proxies"] and rd["proxies"]["nginx"]["nonstream"]["util"] < CONTENDED_UTIL)
            or any(v[k].get("steal", 0) > CONTENDED_STEAL for v in rd["proxies"].values()
                   for k in ("nonstream", "stream") if k in v)
        ]
        ref = summary.get("nginx")
        for name, s in summary.items():
            if ref:
                s["ratio_request"] = round(s["us_per_request"] / ref["us_per_request"], 2)
                if s["us_per_stream"] and ref["us_per_stream"]:
                    s["ratio_stream"] = round(s["us_per_stream"] / ref["us_per_stream"], 2)
                # The stricter figure: each round's CPU against nginx's in the same round
                # (over all rounds, and over the rounds that were not contended).
                for kind in ("nonstream", "stream"):
                    if kind == "stream" and args.no_stream:
                        continue
                    per = {i + 1: rd["proxies"][name][kind]["us_per"] / rd["proxies"]["nginx"][kind]["us_per"]
                           for i, rd in enumerate(rounds)
                           if rd["proxies"][name][kind]["us_per"] and rd["proxies"]["nginx"][kind]["us_per"]}
                    # clean for this pair: neither run lost its core to the hypervisor
                    # (and, on requests, nginx was driven to its core's limit)
                    clean = [x for r, x in per.items()
                             if all(rounds[r - 1]["proxies"][q][kind].get("steal", 0) <= CONTENDED_STEAL
                                    for q in ("nginx", name))
                             and (kind == "stream" or rounds[r - 1]["proxies"]["nginx"][kind]["util"] >= CONTENDED_UTIL)]
                    s[f"clean_rounds_{kind}"] = len(clean)
                    s[f"round_ratios_{kind}"] = [round(x, 3) for x in per.values()]
                    s[f"round_ratio_{kind}"] = round(statistics.median(per.values()), 2) if per else None
                    s[f"round_ratio_{kind}_clean"] = round(statistics.median(clean), 2) if clean else None

        print(f"\nmedian of {args.rounds} interleaved rounds (min-max); proxy on core {args.proxy_core}, "
              f"wrk -t1 -c{args.connections} + upstream nginx on core {args.load_core}; "
              f"direct p50 {med([rd['direct_p50_us'] for rd in rounds])} us")
        hdr = (f"{'proxy':8s} {'us/req':>8s} {'range':>9s} {'x nginx':>7s} {'/round':>6s} {'us/stream':>9s} {'range':>9s} "
               f"{'x nginx':>7s} {'/round':>6s} {'+p50 us':>8s} {'RSS MiB':>7s} {'errors':>6s}")
        print(hdr)
        for name, s in summary.items():
            print(f"{name:8s} {s['us_per_request']:8.1f} {span(s['us_per_request_all']):>9s} {s.get('ratio_request', 0):7.2f} "
                  f"{s.get('round_ratio_nonstream') or 0:6.2f} "
                  f"{(s['us_per_stream'] or 0):9.1f} {span(s['us_per_stream_all']):>9s} {s.get('ratio_stream', 0):7.2f} "
                  f"{s.get('round_ratio_stream') or 0:6.2f} "
                  f"{s['added_p50_us']:8.1f} {s['rss_mib_max']:7.1f} {s['errors']:6d}")
        print("x nginx: median CPU over nginx's median; /round: median of each round's ratio to nginx in that round")
        for unit, key, rkey in (("request", "main_thread_us_per_request", "us_per_request"),
                                ("stream", "main_thread_us_per_stream", "us_per_stream")):
            threads = {n: s[key] for n, s in summary.items() if s.get(key)}
            if threads:  # the data path's own thread, without the control plane's threads beside it
                print(f"main thread (the data path's loop) us/{unit}: " + ", ".join(
                    f"{n} {v:.1f}" + (f" (x nginx {v / ref[rkey]:.2f})" if ref and ref.get(rkey) else "")
                    for n, v in threads.items()))
        for name, s in summary.items():  # where a llmgw's CPU went, by thread
            for kind, per in s.get("thread_util", {}).items():
                if per:
                    print(f"{name} threads, share of a core ({kind}): "
                          + ", ".join(f"{t} {v:.3f}" for t, v in sorted(per.items(), key=lambda kv: -(kv[1] or 0))
                                      if v))
        if contended:
            print(f"contended rounds (nginx util < {CONTENDED_UTIL} on requests, or steal > {CONTENDED_STEAL} "
                  f"of the proxy core: the machine was busy elsewhere): {contended}")
            if ref:
                print("  /round over the rounds where neither that proxy's run nor nginx's was contended:")
                for name, s in summary.items():
                    print(f"  {name:8s} request {s.get('round_ratio_nonstream_clean')} "
                          f"({s.get('clean_rounds_nonstream', 0)} rounds)  stream {s.get('round_ratio_stream_clean')} "
                          f"({s.get('clean_rounds_stream', 0)} rounds)")

        result = {
            "config": {k: v for k, v in vars(args).items()},
            "machine": {"nproc": os.cpu_count(), "loadavg_end": os.getloadavg()},
            "rounds": rounds,
            "contended_rounds": contended,
            "summary": summary,
        }

        if args.profile and "llmgw" in all_proxies and any(p.name == "llmgw" for p in proxies):
            pdir = Path(args.profile)
            pdir.mkdir(parents=True, exist_ok=True)
            llm = all_proxies["llmgw"]
            for native in (False, True):
                sfx = "_native" if native else ""
                py_spy(llm, args, "post.lua", pdir / f"llmgw_nonstream{sfx}.raw", args.duration + 2, native)
                if not args.no_stream:
                    py_spy(llm, args, "stream.lua", pdir / f"llmgw_stream{sfx}.raw", args.duration + 2, native)
            result["profile_dir"] = str(pdir)
            print(f"py-spy raw profiles in {pdir} (summarise with bench/dataplane/pyspy_top.py)")

        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    finally:
        _stop_all()
        if args.keep:
            print(f"kept {d}")
        else:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
