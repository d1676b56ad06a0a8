"""deploy/grafana/llmgw.json parses, and every metric and label it queries exists."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from admin_helpers import Engine, admin_of, admin_port, chat, client_port, http, running, wait_for

from canary import secret
from ports import free_port as _free_port

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "llmgw.json"
METRIC = re.compile(r"\b((?:llmgw|process|python)_[a-zA-Z0-9_]+)\b")
SELECTOR = re.compile(r"\b((?:llmgw|process|python)_[a-zA-Z0-9_]+)\{([^}]*)\}")
BY = re.compile(r"\b(?:by|on)\s*\(([^)]*)\)")
ALWAYS = {"instance", "job"}


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in panels(dash) for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            exprs.append(v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
    return exprs


def documented_labels() -> dict[str, set[str]]:
    """Family -> label names, from docs/metrics.md's tables."""
    out: dict[str, set[str]] = {}
    for name, labels in re.findall(r"^\| `(llmgw_[a-z0-9_]+)` \| \w+ \|([^|]*)\|", (ROOT / "docs/metrics.md").read_text(), re.M):
        out[name] = set(re.findall(r"`([a-z_]+)`", labels))
    return out


async def _register_a_node(target: str) -> None:
    """One node with a fully reported GPU and ECC/XID counts, so the Cluster row's families have samples."""
    import grpc

    from llmgw._proto.agent.v1 import agent_pb2_grpc
    from llmgw.agent.model import GPU, Discovery, NodeFacts
    from llmgw.agent.wire import PROTOCOL, discovery_to_proto, pb

    gpu = GPU("GPU-1", index=0, name="H100", memory_total_bytes=80, memory_used_bytes=40, utilization_gpu_ratio=0.5,
              ecc_corrected_volatile=0, ecc_uncorrected_volatile=0, xid_errors=((79, 1),))
    d = Discovery(facts=NodeFacts(hostname="h"), gpus=(gpu,), source="nvml")
    async with grpc.aio.insecure_channel(target) as ch:
        await agent_pb2_grpc.AgentServiceStub(ch).Register(
            pb.RegisterRequest(node_name="n1", protocol=pb.ProtocolVersion(major=PROTOCOL[0]),
                               discovery=discovery_to_proto(d)),
            metadata=[("authorization", f"Bearer {secret('join')}")], timeout=5,
        )


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] == "llmgw" and dash["uid"]
    ps = panels(dash)
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = " ".join(p["title"] for p in ps).lower()
    for topic in ("requests", "time to first byte", "saturation", "queue", "breaker", "gpu utilisation",
                  "gpu memory", "nodes up", "heartbeat age", "ecc"):
        assert topic in titles, topic
    for p in ps:
        g = p["gridPos"]
        assert 0 <= g["x"] < 24 and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"], p["title"]
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model", "replica"} <= names
    # an import input nothing uses makes Grafana's import dialog ask for a data source it then ignores
    text = DASHBOARD.read_text()
    for inp in dash.get("__inputs", []):
        assert "${" + inp["name"] + "}" in text, inp["name"]


async def test_every_queried_metric_exists() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = queries(dash)
    a, b = Engine("a"), Engine("b")
    control = {"listen": f"127.0.0.1:{_free_port()}", "join_token": secret("join")}
    async with running([a, b], control=control) as rt:
        await _register_a_node(control["listen"])
        assert rt.registry is not None
        await wait_for(lambda: all(ep.scrape_ok > 0 for ep in rt.registry.endpoints.values()))
        for stream in (False, True, False):
            assert await chat(client_port(rt), stream=stream) == 200
        obs = admin_of(rt).observer  # what the routing layer reports, until it exists
        obs.admission("interactive", "rejected", "queue_full")
        obs.breaker_transition("a", "open")
        _, _, body = await http(admin_port(rt), "GET", "/metrics")
    text = body.decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M))
    samples = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", text, re.M))

    def exists(name: str) -> bool:
        if name in samples or name in types:
            return True
        for suffix in ("_bucket", "_sum", "_count"):
            base = name.removesuffix(suffix)
            if base != name and types.get(base) in ("histogram", "summary"):
                return True
        return False

    used = {m for e in exprs for m in METRIC.findall(e)}
    assert len(used) >= 20
    missing = sorted(m for m in used if not exists(m))
    assert not missing, f"the dashboard queries metrics /metrics does not have: {missing}"

    labels = documented_labels()

    def family(name: str) -> str | None:
        for n in (name, name.removesuffix("_bucket"), name.removesuffix("_sum"), name.removesuffix("_count")):
            if n in labels:
                return n
        return None

    for e in exprs:
        known = set(ALWAYS)
        for name, sel in SELECTOR.findall(e):
            fam = family(name)
            if fam is None:
                continue
            allowed = labels[fam] | ALWAYS | ({"le"} if name.endswith("_bucket") else set())
            for label in re.findall(r"([a-zA-Z_]+)\s*(?:=~|!~|!=|=)", sel):
                assert label in allowed, f"{label!r} is not a label of {name} in: {e}"
        for name in METRIC.findall(e):
            fam = family(name)
            if fam is not None:
                known |= labels[fam] | ({"le"} if name.endswith("_bucket") else set())
        for group in BY.findall(e):
            for label in (x.strip() for x in group.split(",") if x.strip()):
                assert label in known, f"grouping by {label!r}, which no metric in the query has: {e}"
