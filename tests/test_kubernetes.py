"""deploy/kubernetes: the llmgw configs its ConfigMaps carry load with llmgw's own loaders, and the
ServiceMonitor fits the schema kept beside it (.ci/run also checks every resource with kubernetes-validate)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from llmgw.config import load, load_agent

K8S = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"


def _docs() -> list[dict[str, Any]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def _configmap(name: str) -> dict[str, Any]:
    return next(d for d in _docs() if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)


def test_the_configmaps_hold_valid_llmgw_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("LLMGW_JOIN_TOKEN", "LLMGW_ADMIN_TOKEN", "LLMGW_ROUTER_TOKEN"):
        monkeypatch.setenv(var, var.lower() + "-" + "x" * 20)  # (one secret in two roles is refused)
    monkeypatch.setenv("LLMGW_DATABASE_URL", "postgresql://llmgw:pw@llmgw-postgres:5432/llmgw")
    control = load(yaml.safe_load(_configmap("llmgw-control")["data"]["llmgw.yaml"]))
    assert control.control is not None and control.control.database is not None
    assert control.control.database.startswith("postgresql://") and control.control.lease == 15.0
    assert control.control.tls_cert is not None  # off loopback: TLS, never plaintext
    router = load(yaml.safe_load(_configmap("llmgw-router")["data"]["llmgw.yaml"]))
    assert router.control is None and router.follow is not None
    assert control.control.router_tokens and router.follow.tls_ca is not None  # (the table carries replica keys)
    agent = load_agent(yaml.safe_load(_configmap("llmgw-agent")["data"]["agent.yaml"]))
    assert len(agent.control) == 3 and agent.tls_ca is not None
    # every control-plane pod is named (the StatefulSet's replicas, through its headless Service)
    sts = next(d for d in _docs() if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "llmgw-control")
    pods = [f"llmgw-control-{i}.llmgw-control.llmgw.svc.cluster.local" for i in range(sts["spec"]["replicas"])]
    assert [h for h, _ in agent.control] == pods and [h for h, _ in router.follow.control] == pods
    # the agent's state (fetched models, the replicas it runs) is on the host: a new pod adopts them
    ds = next(d for d in _docs() if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "llmgw-agent")
    pod = ds["spec"]["template"]["spec"]
    on_host = {v["name"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: m["name"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
    assert agent.state_dir is not None and mounts.get(agent.state_dir) in on_host, (agent.state_dir, mounts)


def test_the_servicemonitor_fits_its_schema() -> None:
    schema = json.loads((K8S / "schemas" / "servicemonitor.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    sm = next(d for d in _docs() if d["kind"] == "ServiceMonitor")
    jsonschema.validate(sm, schema)
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError, match="intervall"):
        jsonschema.validate(bad, schema)
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    # what it selects exists: Services with an "admin" port
    services = {d["metadata"]["labels"]["app.kubernetes.io/name"]: d for d in _docs() if d["kind"] == "Service"}
    for name in sm["spec"]["selector"]["matchExpressions"][0]["values"]:
        assert "admin" in [p["name"] for p in services[name]["spec"]["ports"]], name
