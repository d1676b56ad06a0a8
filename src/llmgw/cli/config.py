"""``llmgw check-config`` and ``llmgw config``: validate a config file, export its schema.

``check-config`` loads the file exactly as ``llmgw serve`` does (``serve=True``),
so what one refuses the other refuses with the same words; it prints every
problem at once, one line each.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..config import Config, config_schema, find_config, load_file
from ..errors import ConfigError, ConfigProblem
from ._common import Fail

__all__ = ["check_config", "config"]


def _summary(cfg: Config) -> dict[str, Any]:
    aliases: dict[str, list[str]] = {}
    for alias, name in cfg.aliases().items():
        aliases.setdefault(name, []).append(alias)
    return {
        "listen": f"{cfg.listen[0]}:{cfg.listen[1]}",
        "admin": f"{cfg.admin[0]}:{cfg.admin[1]}",
        "models": [
            {
                "name": m,
                "aliases": aliases.get(m, []),
                "endpoints": [
                    {"id": ep.id, "url": ep.url, "engine": ep.engine, "draining": ep.draining}
                    for ep in cfg.endpoints
                    if m in ep.models
                ],
            }
            for m in cfg.model_names()
        ],
    }


def _check(path: str | None) -> tuple[Path | None, Config | None, tuple[ConfigProblem, ...]]:
    try:
        p = find_config(path)
    except ConfigError as exc:
        return None, None, exc.problems
    if p is None:
        return None, None, (ConfigProblem("", "no config file: pass FILE or create ./llmgw.yaml"),)
    try:
        return p, load_file(p, serve=True), ()
    except ConfigError as exc:
        return p, None, exc.problems


def _run_agent_check(path: str | None, as_json: bool) -> None:
    """``--agent``: the node agent's file, read as ``llmgw agent --config FILE`` reads it."""
    from ..config.agent import load_agent_file

    if not path:
        raise Fail("--agent: give the agent's file (llmgw check-config --agent FILE)")
    try:
        cfg = load_agent_file(path, require_control=False)  # (llmgw agent --control may give it)
        problems: tuple[ConfigProblem, ...] = ()
    except ConfigError as exc:
        cfg, problems = None, exc.problems
    control = [] if cfg is None else [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in cfg.control]
    summary: dict[str, Any] | None = None if cfg is None else {
        "control": control,
        "name": cfg.name, "gpu_source": cfg.gpu_source, "tls": bool(cfg.tls or cfg.tls_ca or cfg.tls_cert),
        "engines": sorted(cfg.engines), "labels": dict(cfg.labels), "advertise": cfg.advertise,
        "replica_ports": None if cfg.replica_ports is None else f"{cfg.replica_ports[0]}-{cfg.replica_ports[1]}",
        "state_dir": cfg.state_dir,
    }
    if as_json:
        click.echo(json.dumps({"ok": cfg is not None, "file": path, "problems": [pr.as_dict() for pr in problems],
                               "summary": summary}, indent=2))
        sys.exit(0 if cfg is not None else 1)
    if cfg is None or summary is None:
        raise Fail("\n".join(str(pr) for pr in problems))
    click.echo(f"{path}: OK (the node agent's file)")
    click.echo(f"  control {', '.join(control) or 'none here (give llmgw agent --control HOST:PORT)'}"
               f"{', TLS' if summary['tls'] else ''}; name {cfg.name or '(the host name)'}; gpu_source {cfg.gpu_source}")
    if cfg.engines:
        click.echo(f"  engines {', '.join(sorted(cfg.engines))}")
    if cfg.replica_ports is not None:
        click.echo(f"  replica ports {summary['replica_ports']}")


def _run_check(path: str | None, as_json: bool) -> None:
    p, cfg, problems = _check(path)
    if as_json:
        doc = {
            "ok": cfg is not None,
            "file": str(p) if p is not None else None,
            "problems": [pr.as_dict() for pr in problems],
            "summary": _summary(cfg) if cfg is not None else None,
        }
        click.echo(json.dumps(doc, indent=2))
        sys.exit(0 if cfg is not None else 1)
    if cfg is None:
        raise Fail("\n".join(str(pr) for pr in problems))
    click.echo(f"{p}: OK")
    click.echo(f"  listen {cfg.listen[0]}:{cfg.listen[1]}, admin {cfg.admin[0]}:{cfg.admin[1]}")
    for m in cfg.model_names():
        eps = [ep.id for ep in cfg.endpoints if m in ep.models]
        click.echo(f"  model {m}: {len(eps)} endpoint(s): {', '.join(eps)}")


_JSON_HELP = "Print a JSON document on stdout (ok, problems, summary) instead of text."


_AGENT_HELP = "The node agent's file (llmgw agent --config FILE) instead of llmgw.yaml."


@click.command("check-config")
@click.argument("path", metavar="[FILE]", required=False)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@click.option("--agent", is_flag=True, help=_AGENT_HELP)
def check_config(path: str | None, as_json: bool, agent: bool) -> None:
    """Validate a config file (default ./llmgw.yaml) as `llmgw serve` would, and summarise it.

    Every problem is printed, one line each (FILE:LINE: KEY: what is wrong);
    the exit status is 1 when there is any. --agent: the node agent's file, as
    `llmgw agent --config FILE` reads it.
    """
    (_run_agent_check if agent else _run_check)(path, as_json)


@click.group("config")
def config() -> None:
    """Check llmgw.yaml, or export its JSON Schema for editors."""


@config.command("check")
@click.argument("path", metavar="[FILE]", required=False)
@click.option("--json", "as_json", is_flag=True, help=_JSON_HELP)
@click.option("--agent", is_flag=True, help=_AGENT_HELP)
def check(path: str | None, as_json: bool, agent: bool) -> None:
    """The same as `llmgw check-config`."""
    (_run_agent_check if agent else _run_check)(path, as_json)


@config.command("schema")
@click.option("--agent", is_flag=True, help="The node agent's file instead of llmgw.yaml.")
def schema(agent: bool) -> None:
    """Print the JSON Schema (draft 2020-12) of llmgw.yaml.

    \b
    Save it and point an editor at it, e.g. with yaml-language-server:
      llmgw config schema > llmgw.schema.json
      # yaml-language-server: $schema=./llmgw.schema.json   (first line of llmgw.yaml)
    """
    click.echo(json.dumps(config_schema(agent=agent), indent=2))
