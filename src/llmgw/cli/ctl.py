"""``llmgw ctl``: drive a running gateway through its admin API.

    llmgw ctl endpoints                 every replica, its state and the numbers routing uses
    llmgw ctl drain gpu0-llama          no new requests to it (in-flight ones finish)
    llmgw ctl undrain gpu0-llama
    llmgw ctl reload                    re-read the config file (like SIGHUP)
    llmgw ctl queues                    admission queues per priority band
    llmgw ctl nodes                     the control plane's nodes: state, heartbeat age, GPUs
    llmgw ctl gpus                      every GPU of every node: memory, utilisation, power, health
    llmgw ctl cordon NODE / uncordon NODE   no new replicas to a node / again
    llmgw ctl logs REPLICA [--lines N]  the end of a replica's log file, from its node
    llmgw ctl deploy chat --model tiny:1b --engine llamacpp --replicas 2
    llmgw ctl deployments               desired and ready replicas, where each runs, why one is not placed
    llmgw ctl scale chat 3              (a config deployment's scale holds until its entry changes)
    llmgw ctl undeploy chat             its replicas drain, then stop
    llmgw ctl engine-check llamacpp     can this node run the engine as llmgw launches it?
    llmgw ctl tokens create --name rack-1 --expires 7d   a join token for agents (list, revoke ID)

``--admin URL`` (``$LLMGW_ADMIN``, default ``http://127.0.0.1:9090``) and
``--token`` (``$LLMGW_ADMIN_TOKEN``) pick the gateway; ``--json`` prints the API's
JSON instead of a table. Only the standard library speaks HTTP here, so the
command starts fast and works wherever llmgw is installed.

What agents and engines report (a GPU's name, a node's errors, a log) is shown as
written: never read as rich markup, its control characters escaped (``printable``).
"""

from __future__ import annotations

import http.client
import json
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import click

from ..errors import unsendable_secret
from ._common import DEFAULT_ADMIN, MAX_REPLICAS, admin_url, grpc_port, printable, replica_count, tls_mismatch

__all__ = ["ctl"]

ABSENT = "–"  # an en dash: absent is not 0


class CtlError(click.ClickException):
    """A one-line error: ``llmgw: error: ...``; one such line per line of the message (a reload the
    API refused lists every problem of the file, as ``llmgw check-config`` does)."""

    def show(self, file: Any = None) -> None:
        from ._common import echo_err

        for line in self.message.splitlines() or [""]:
            # (a message may quote what a node reported: never a raw control character on the terminal)
            echo_err(f"llmgw: error: {printable(line)}", level="error")


@dataclass
class Target:
    """Where and how to reach the admin API."""

    admin: str
    token: str | None
    as_json: bool
    timeout: float = 30.0
    token_from: str = "--token"  # where the token came from, for its errors (never the token)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """One API call; the decoded JSON answer.

        Raises:
            CtlError: the API cannot be reached or answered an error (the message says what to do).
        """
        try:
            parts = admin_url(self.admin)
        except ValueError as exc:
            raise CtlError(str(exc)) from None
        conn_cls = http.client.HTTPSConnection if parts.https else http.client.HTTPConnection
        try:
            conn = conn_cls(parts.host, parts.port, timeout=self.timeout)
        except (ValueError, http.client.InvalidURL):  # spaces, control characters
            raise CtlError(f"--admin {parts.url!r} is not a URL like {DEFAULT_ADMIN}") from None
        headers: dict[str, str | bytes] = {"accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        if self.token:
            why = unsendable_secret(self.token)
            if why is not None:
                # SECURITY: refused before sending: http.client's error would quote the header, token and all
                raise CtlError(f"{self.token_from} {why}")
            # (UTF-8, the bytes the gateway compares admin_token by; http.client would encode latin-1, or fail)
            headers["authorization"] = f"Bearer {self.token}".encode()
        base = parts.base
        where = parts.url
        try:
            conn.request(method, base + path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as exc:
            tls = tls_mismatch(exc, parts)
            if tls is not None:
                raise CtlError(tls) from None
            if isinstance(exc, ConnectionRefusedError):
                reason = "connection refused"
            elif isinstance(exc, TimeoutError):
                reason = f"no answer within {self.timeout:g}s"
            elif isinstance(exc, socket.gaierror):
                reason = f"unknown host {parts.host}"
            elif isinstance(exc, http.client.RemoteDisconnected):
                reason = "it closed the connection without an answer"
            elif isinstance(exc, http.client.BadStatusLine):  # (its message is the bytes that came: never shown)
                if str(getattr(exc, "line", "")).startswith("\x00"):  # (an HTTP/2 frame header: a length's high byte)
                    # (reached and answering: "cannot reach ... is llmgw serve running?" would send one looking
                    # for a stopped gateway)
                    raise CtlError(grpc_port(where)) from None
                reason = "what it answered is not HTTP"
            else:
                reason = str(exc) or type(exc).__name__
            raise CtlError(
                f"cannot reach the admin API at {where} ({reason}; is llmgw serve running? pass --admin URL)"
            ) from None
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = None
        if resp.status >= 400:
            raise CtlError(_explain(resp.status, payload, where, self.token is not None))
        if payload is None:
            raise CtlError(f"{where} did not answer JSON; is it llmgw's admin address? (pass --admin URL)")
        return payload


def _explain(status: int, payload: Any, where: str, had_token: bool) -> str:
    err = payload.get("error") if isinstance(payload, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    if status == 401:
        if not had_token:
            return "the admin API needs a token: pass --token or set LLMGW_ADMIN_TOKEN"
        return "the admin API refused the token: check --token or LLMGW_ADMIN_TOKEN"
    if status == 404 and code == "not_found" and message and "OpenAI API" in message:
        return f"{where} is the client port, not the admin port; pass the admin address with --admin URL"
    if message:
        return message
    return f"the admin API at {where} answered HTTP {status}"


def _options(group: bool) -> Callable[[Any], Any]:
    """``--admin``, ``--token`` and ``--json``, on the group (with env defaults) and on each command."""

    def deco(f: Any) -> Any:
        f = click.option("--json", "as_json", is_flag=True, default=None, help="Print the API's JSON.")(f)
        f = click.option(
            "--token", metavar="TOKEN", envvar="LLMGW_ADMIN_TOKEN" if group else None, default=None,
            show_envvar=group, help="The gateway's admin_token.",
        )(f)
        f = click.option(
            "--admin", metavar="URL", envvar="LLMGW_ADMIN" if group else None, default=None, show_envvar=group,
            help=f"The admin API's address (default {DEFAULT_ADMIN}).",
        )(f)
        return f

    return deco


def _target(ctx: click.Context, admin: str | None, token: str | None, as_json: bool | None) -> Target:
    base: Target = ctx.obj if isinstance(ctx.obj, Target) else Target(DEFAULT_ADMIN, None, False)
    return Target(
        admin=admin if admin is not None else base.admin,  # ('' is refused as the console refuses it, not the default)
        token=token if token is not None else base.token,
        as_json=as_json if as_json is not None else base.as_json,
        token_from="--token" if token is not None else base.token_from,
    )


class _FiniteFloat(click.FloatRange):
    """A float option that must be a number: click's ``float`` takes ``nan`` and ``inf`` (and ``FloatRange``'s
    bounds let ``nan`` through), which JSON cannot carry and a timeout cannot be."""

    name = "float"  # (FloatRange's "float range" reads oddly in "'abc' is not a valid float range")

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return rv


class _ReplicaCount(click.ParamType):
    """A replica count: ASCII digits, 0 to 1024, as the console's ``s`` takes it (click's ``int`` would take
    ``٣``); with ``ignore_unknown_options`` on the command, ``-1`` is a bad count, not an unknown option."""

    name = "count"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        try:
            return replica_count(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


# (json.dumps escapes C0 controls; these it leaves raw in a string without ensure_ascii: DEL and the C1
# controls, 0x9b among them a CSI to some terminals, and the invisible and bidi ones that reorder a line)
_JSON_UNSAFE = {c: f"\\u{c:04x}" for c in (*range(0x7F, 0xA0), *range(0x200B, 0x2010), *range(0x202A, 0x202F),
                                            *range(0x2066, 0x206A), 0xFEFF)}


def _print_json(obj: Any) -> None:
    """The API's JSON, UTF-8 as it came but for the characters that would act on a terminal (``\\u`` escaped:
    still the same JSON)."""
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False).translate(_JSON_UNSAFE))


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        # Piped or captured: don't squeeze the table into 80 columns.
        console = Console(highlight=False, width=max(console.width, 160), soft_wrap=False)
    return console


def print_table(console: Any, table: Any) -> None:
    from ._common import print_table as show

    show(console, table)


def _text(value: Any, style: str = "") -> Any:
    """What the API said, for rich: shown as written (``[/link]`` in a GPU's name is no markup to rich),
    control characters escaped (:func:`~llmgw.cli._common.printable`)."""
    from rich.text import Text

    return Text(printable(value), style=style)


def _add_row(table: Any, *cells: Any) -> None:
    """A table row whose ``str`` cells are shown as written (styled ones come as ``Text``)."""
    table.add_row(*(_text(c) if isinstance(c, str) else c for c in cells))


def _fmt(value: Any, kind: str = "") -> str:
    if value is None:
        return ABSENT
    if kind == "pct":
        return f"{value * 100:.0f}%"
    if kind == "rate":
        return f"{value:.2f}/s"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


_STATE_STYLE = {
    "ok": "green", "draining": "yellow", "stale": "magenta", "unreachable": "red", "open": "red", "half-open": "red",
    "auth_failed": "red", "loading": "yellow", "unavailable": "red",
}


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@_options(group=True)
@click.pass_context
def ctl(ctx: click.Context, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Drive a running gateway through its admin API.

    \b
      llmgw ctl endpoints             replicas, their state and what routing scores them on
      llmgw ctl drain ID / undrain ID stop / resume sending new requests to a replica
      llmgw ctl reload                re-read the config file without dropping connections
      llmgw ctl queues                admission queues per priority band
      llmgw ctl nodes / gpus          the control plane's nodes and their GPUs
      llmgw ctl cordon NODE           no new replicas to a node (uncordon NODE: again)
      llmgw ctl forget NODE           remove a node nothing hears from (unhealthy)
      llmgw ctl deploy NAME --model M run a model on the cluster (scale NAME N, undeploy NAME)
      llmgw ctl deployments           desired/ready replicas, where they run, why one is not placed
      llmgw ctl logs REPLICA          the end of a replica's engine log, from its node
      llmgw ctl engine-check ENGINE   can this node (or --node NODE) run ENGINE as llmgw launches it
      llmgw ctl tokens create / list / revoke ID   join tokens for agents
    """
    from_env = ctx.get_parameter_source("token") is click.core.ParameterSource.ENVIRONMENT
    ctx.obj = Target(admin if admin is not None else DEFAULT_ADMIN, token or None, bool(as_json),
                     token_from="LLMGW_ADMIN_TOKEN" if from_env else "--token")


@ctl.command()
@_options(group=False)
@click.pass_context
def endpoints(ctx: click.Context, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """List the replicas and their live state.

    Absent numbers (never scraped, stale, not reported by the engine) show as –, never 0.
    """
    t = _target(ctx, admin, token, as_json)
    data = t.call("GET", "/admin/v1/endpoints")
    if t.as_json:
        _print_json(data)
        return
    from rich.table import Table

    eps = data.get("endpoints", [])
    # (the DEPLOYMENT column only where the control plane runs replicas; their POOL is their node)
    deployed = any(ep.get("deployment") for ep in eps)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col, justify in (
        ("ID", "left"), ("MODEL", "left"), ("ENGINE", "left"), ("POOL", "left"),
        *((("DEPLOYMENT", "left"),) if deployed else ()), ("STATE", "left"),
        ("INFLIGHT", "right"), ("WAITING", "right"), ("RUNNING", "right"), ("KV", "right"), ("DRAIN RATE", "right"),
    ):
        table.add_column(col, justify=justify, no_wrap=True)
    for ep in eps:
        state = str(ep.get("state", "?"))
        _add_row(
            table,
            str(ep.get("id")),
            ",".join(map(str, ep.get("models") or [])),
            str(ep.get("engine") or ABSENT),
            str(ep.get("pool") or ABSENT),
            *((str(ep.get("deployment") or ABSENT),) if deployed else ()),
            _text(state, _STATE_STYLE.get(state, "white")),
            _fmt(ep.get("inflight")),
            _fmt(ep.get("waiting")),
            _fmt(ep.get("running")),
            _fmt(ep.get("kv_cache_usage"), "pct"),
            _fmt(ep.get("drain_rate"), "rate"),
        )
    console = _console()
    if not eps:
        console.print("no endpoints (add them to the config file and run llmgw ctl reload)")
        return
    print_table(console, table)


def _drain(ctx: click.Context, endpoint_id: str, draining: bool, t: Target) -> None:
    verb = "drain" if draining else "undrain"
    data = t.call("POST", f"/admin/v1/endpoints/{quote(endpoint_id, safe='')}/{verb}")
    if t.as_json:
        _print_json(data)
        return
    inflight = data.get("inflight", 0)
    if draining:
        tail = f"; {inflight} request(s) in flight finish" if inflight else ""
        what = "draining" if data.get("changed") else "already draining"
        click.echo(f"{endpoint_id}: {what}: no new requests{tail}")
    else:
        what = "undrained" if data.get("changed") else "was not draining"
        click.echo(f"{endpoint_id}: {what}: taking requests (state {printable(data.get('state'))})")


@ctl.command()
@click.argument("endpoint_id", metavar="ID")
@_options(group=False)
@click.pass_context
def drain(ctx: click.Context, endpoint_id: str, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Stop sending new requests to replica ID.

    Requests in flight to it finish; the scrape poller keeps reading its metrics.
    """
    _drain(ctx, endpoint_id, True, _target(ctx, admin, token, as_json))


@ctl.command()
@click.argument("endpoint_id", metavar="ID")
@_options(group=False)
@click.pass_context
def undrain(ctx: click.Context, endpoint_id: str, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Send requests to replica ID again."""
    _drain(ctx, endpoint_id, False, _target(ctx, admin, token, as_json))


@ctl.command()
@_options(group=False)
@click.pass_context
def reload(ctx: click.Context, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Re-read the config file (like SIGHUP).

    Endpoints are added, removed or replaced by id, the file's deployments applied;
    connections are not dropped. Prints which endpoints and deployments changed.
    """
    from ..admin.summary import reload_summary

    t = _target(ctx, admin, token, as_json)
    data = t.call("POST", "/admin/v1/reload")
    if t.as_json:
        _print_json(data)
        return
    click.echo(printable(reload_summary(data), lines=True))
    if data.get("restart_needed_for"):
        from ._common import echo_err

        echo_err(f"note: {printable(', '.join(map(str, data['restart_needed_for'])))} changed; that needs a restart",
                 level="warning")


@ctl.command()
@_options(group=False)
@click.pass_context
def queues(ctx: click.Context, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Show the admission queues per priority band."""
    t = _target(ctx, admin, token, as_json)
    data = t.call("GET", "/admin/v1/queues")
    if t.as_json:
        _print_json(data)
        return
    if not data.get("admission"):
        click.echo("admission control is off: requests go straight to replicas")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("BAND", "DEPTH", "ADMITTED", "QUEUED", "REJECTED"):
        table.add_column(col, justify="left" if col == "BAND" else "right", no_wrap=True)
    for b in data.get("bands", []):
        d = b.get("decisions", {})
        _add_row(
            table, str(b.get("band")), _fmt(b.get("depth")),
            *(_fmt(d.get(k, 0)) for k in ("admitted", "queued", "rejected")),
        )
    console = _console()
    print_table(console, table)
    sat = data.get("pool_saturation") or {}
    if sat:
        console.print(_text("saturation: " + ", ".join(f"{m} {_saturation(v)}" for m, v in sat.items())))


def _saturation(v: Any) -> str:
    """A pool's saturation as ``ctl queues`` shows it. JSON has no +Inf, the state of a pool without a usable
    replica, so the API sends null for it (a model with no estimate at all is left out of the mapping)."""
    if v is None or v == math.inf:
        return "no usable replica"
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return ABSENT
    return f"{v * 100:.0f}%"


_NODE_STYLE = {"up": "green", "unhealthy": "red"}
_GIB = 1024**3


def _age(v: Any) -> str:
    return ABSENT if v is None else f"{v:.1f}s"


def _gib(v: Any) -> str:
    return ABSENT if v is None else f"{v / _GIB:.1f}"


def _unit(v: Any, unit: str, digits: int = 0) -> str:
    return ABSENT if v is None else f"{v:.{digits}f}{unit}"


@ctl.command()
@click.argument("node", required=False)
@_options(group=False)
@click.pass_context
def nodes(ctx: click.Context, node: str | None, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """List the control plane's nodes: state, heartbeat age, GPUs, versions, errors; with NODE, that
    node whole: its errors (what discovery failed on), labels, GPUs and replicas.

    A node is unhealthy when nothing was heard from it within the heartbeat grace. ERRORS counts
    the node's own errors and its GPUs' (as the console's Nodes view does), – for a node past its
    grace (its last ones: llmgw ctl nodes NODE).
    """
    t = _target(ctx, admin, token, as_json)
    if node is not None:
        _one_node(t, node)
        return
    data = t.call("GET", "/admin/v1/nodes")
    if t.as_json:
        _print_json(data)
        return
    from rich.table import Table

    rows = data.get("nodes", [])
    console = _console()
    if not rows:
        console.print("no nodes registered (start llmgw agent on a node)")
        return
    # (a node's GPUs' errors are in /gpus: the node list carries only the node's own)
    gpu_errors: dict[str, int] = {}
    for g in t.call("GET", "/admin/v1/gpus").get("gpus") or []:
        gpu_errors[str(g.get("node"))] = gpu_errors.get(str(g.get("node")), 0) + len(g.get("errors") or [])
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col, justify in (("NODE", "left"), ("STATE", "left"), ("HOST", "left"), ("GPUS", "right"),
                         ("SOURCE", "left"), ("HEARTBEAT", "right"), ("AGENT", "left"), ("DRIVER", "left"),
                         ("CUDA", "left"), ("ERRORS", "right")):
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    errors = 0
    for n in rows:
        facts = n.get("facts") or {}
        # (past its grace, its errors are as old as its readings: no current count, as the console says)
        count = (len(n.get("errors") or []) + gpu_errors.get(str(n.get("name")), 0)
                 if n.get("state") == "up" else None)
        errors += count or 0
        _add_row(
            table, str(n.get("name")), _node_state(n), str(n.get("hostname") or ABSENT), _fmt(n.get("gpu_count")),
            str(n.get("gpu_source") or ABSENT), _age(n.get("heartbeat_age_s")), str(n.get("agent_version") or ABSENT),
            str(facts.get("driver_version") or ABSENT), str(facts.get("cuda_driver_version") or ABSENT), _fmt(count),
        )
    print_table(console, table)
    if errors:
        console.print("(llmgw ctl nodes NODE shows a node's errors)", style="dim")


def _node_state(n: dict[str, Any]) -> Any:
    state = str(n.get("state", "?"))
    shown = _text(state, _NODE_STYLE.get(state, "white"))
    if n.get("cordoned"):
        shown.append(" cordoned", style="yellow")
    if n.get("leaving"):
        shown.append(" leaving", style="yellow")
    return shown


def _one_node(t: Target, name: str) -> None:
    data = t.call("GET", f"/admin/v1/nodes/{quote(name, safe='')}")
    if t.as_json:
        _print_json(data)
        return
    from rich.text import Text

    console = _console()
    state = str(data.get("state", "?"))
    facts = data.get("facts") or {}
    labels = ", ".join(f"{k}={v}" for k, v in sorted((data.get("labels") or {}).items())) or ABSENT
    age = data.get("heartbeat_age_s")
    lines = [
        ("state", _node_state(data)),
        ("host", data.get("hostname") or ABSENT),
        ("address", data.get("address") or ABSENT),
        ("heartbeat", f"{_age(age)} ago" if age is not None
         else f"{ABSENT} (not heard from since this control plane took over)"),
        ("agent", f"{data.get('agent_version') or ABSENT} (protocol {data.get('protocol') or ABSENT})"),
        ("gpu source", data.get("gpu_source") or ABSENT),
        ("driver", f"{facts.get('driver_version') or ABSENT} (CUDA {facts.get('cuda_driver_version') or ABSENT})"),
        ("labels", labels),
    ]
    console.print(_text(data.get("name"), "bold"))
    for k, v in lines:
        console.print(Text.assemble(f"  {k + ':':<12}", v if isinstance(v, Text) else _text(v)), highlight=False)
    errors = [str(e) for e in data.get("errors") or []]
    errors += [f"GPU {g.get('index')} ({g.get('uuid')}): {e}" for g in data.get("gpus") or [] for e in g.get("errors") or []]
    console.print(f"  {'errors:':<12}{ABSENT if not errors else ''}")
    for e in errors:
        console.print(Text.assemble("    ", _text(e, "red")), soft_wrap=True)
    gpus = [{**g, "node": data.get("name"), "node_state": state} for g in data.get("gpus") or []]
    if gpus:
        console.print()
        print_table(console, _gpu_table(gpus))
    reps = data.get("replicas") or []
    if reps:
        console.print()
        console.print(_text("  replicas: " + ", ".join(f"{r.get('id')} ({r.get('state')})" for r in reps)),
                      soft_wrap=True)


@ctl.command()
@_options(group=False)
@click.pass_context
def gpus(ctx: click.Context, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """List every GPU of every node with its latest readings.

    Readings not reported (e.g. utilisation on a MIG-enabled GPU) show as –, never 0; so do
    those of a node past its heartbeat grace (its last readings are not current: --json has
    them null, its GPUs' health too).
    """
    t = _target(ctx, admin, token, as_json)
    data = t.call("GET", "/admin/v1/gpus")
    if t.as_json:
        _print_json(data)
        return

    rows = data.get("gpus", [])
    console = _console()
    if not rows:
        console.print("no GPUs reported (no nodes, or nodes without GPUs)")
        return
    print_table(console, _gpu_table(rows))


def _gpu_table(rows: list[dict[str, Any]]) -> Any:
    """The GPUs table of ``ctl gpus`` (and of ``ctl nodes NODE``): a node past its grace shows no readings."""
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for col, justify in (("NODE", "left"), ("IDX", "right"), ("UUID", "left"), ("MODEL", "left"),
                         ("MEM USED GiB", "right"), ("MEM TOTAL GiB", "right"), ("UTIL", "right"),
                         ("TEMP", "right"), ("POWER", "right"), ("HEALTH", "left")):
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for g in rows:
        current = g.get("node_state") == "up"

        def cur(key: str, g: dict[str, Any] = g, current: bool = current) -> Any:
            return g.get(key) if current else None

        health = str(g.get("health") or ABSENT) if current else _text(f"node {g.get('node_state')}", "red")
        _add_row(
            table, str(g.get("node")), _fmt(g.get("index")), str(g.get("uuid")), str(g.get("name") or ABSENT),
            _gib(cur("memory_used_bytes")), _gib(g.get("memory_total_bytes")),
            _fmt(cur("utilization_gpu_ratio"), "pct") if cur("utilization_gpu_ratio") is not None else ABSENT,
            _unit(cur("temperature_celsius"), "°C"), _unit(cur("power_watts"), " W"), health,
        )
    return table


def _cordon(ctx: click.Context, node: str, cordoned: bool, t: Target) -> None:
    verb = "cordon" if cordoned else "uncordon"
    data = t.call("POST", f"/admin/v1/nodes/{quote(node, safe='')}/{verb}")
    if t.as_json:
        _print_json(data)
        return
    if cordoned:
        click.echo(f"{node}: {'cordoned' if data.get('changed') else 'already cordoned'}: no new replicas go there")
    else:
        click.echo(f"{node}: {'uncordoned' if data.get('changed') else 'was not cordoned'}: replicas may go there")


@ctl.command()
@click.argument("node", metavar="NODE")
@_options(group=False)
@click.pass_context
def cordon(ctx: click.Context, node: str, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Cordon NODE: no new replicas are placed there (running ones stay)."""
    _cordon(ctx, node, True, _target(ctx, admin, token, as_json))


@ctl.command()
@click.argument("node", metavar="NODE")
@_options(group=False)
@click.pass_context
def uncordon(ctx: click.Context, node: str, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Uncordon NODE: replicas may be placed there again."""
    _cordon(ctx, node, False, _target(ctx, admin, token, as_json))


@ctl.command()
@click.argument("node", metavar="NODE")
@_options(group=False)
@click.pass_context
def forget(ctx: click.Context, node: str, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Forget NODE, which nothing hears from (unhealthy: its agent killed, its machine gone).

    As its agent's deregistration would: the node, its GPUs' series and its place in the
    database go; its replicas are placed elsewhere. A node that is up is refused (stop its
    agent first: SIGTERM deregisters it). Its agent, started again, registers it anew.
    """
    t = _target(ctx, admin, token, as_json)
    data = t.call("DELETE", f"/admin/v1/nodes/{quote(node, safe='')}")
    if t.as_json:
        _print_json(data)
        return
    gone = data.get("forgotten") or {}
    click.echo(f"{node}: forgotten (it was {printable(gone.get('state', 'not up'))}); its agent, started again, "
               "registers it anew")


@ctl.command()
@click.argument("replica", metavar="REPLICA")
@click.option("-n", "--lines", type=click.IntRange(1, 10_000), default=100, show_default=True,
              help="How many lines from the end.")
@_options(group=False)
@click.pass_context
def logs(
    ctx: click.Context, replica: str, lines: int, admin: str | None, token: str | None, as_json: bool | None
) -> None:
    """Print the end of REPLICA's log file (the engine's output), asked of the node that runs it."""
    t = _target(ctx, admin, token, as_json)
    data = t.call("GET", f"/admin/v1/replicas/{quote(replica, safe='')}/logs?lines={lines}")
    if t.as_json:
        _print_json(data)
        return
    text = data.get("text") if isinstance(data, dict) else None
    if isinstance(text, str):
        # (the engine's own output: its line breaks kept, any other control character escaped)
        text = printable(text, lines=True)
        click.echo(text, nl=not text.endswith("\n") and bool(text))
# -- deployments --

_DEPLOY_STATE_STYLE = {"ready": "green", "starting": "yellow", "fetching": "yellow", "pending": "yellow",
                       "draining": "magenta", "failed": "red", "stopped": "red"}


def _kv_pairs(values: tuple[str, ...], what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for v in values:
        k, sep, val = v.partition("=")
        if not sep or not k:
            raise CtlError(f"{what} {v!r}: write KEY=VALUE")
        out[k] = val
    return out


@ctl.command()
@click.argument("name")
@click.option("--model", required=True, help="A mirror reference (tiny:1b), a file path on the nodes, or an id the "
              "engine downloads itself.")
@click.option("--engine", default=None, help="vllm (default), llamacpp, trtllm or sglang.")
@click.option("--replicas", type=_ReplicaCount(), default=None, help=f"How many, 0 to {MAX_REPLICAS} (default 1).")
@click.option("--gpus", type=click.IntRange(0, 64), default=None, help="GPUs per replica (default 1; 0 for llamacpp).")
@click.option("--gpu-memory", metavar="SIZE", default=None, help="GPU memory each replica needs per GPU (40GiB).")
@click.option("--gpu-model", default=None, help="Only GPUs whose name contains this (H100).")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="Only nodes with this label (repeat).")
@click.option("--share-gpus", is_flag=True, default=False, help="Replicas may share a GPU (needs its memory known).")
@click.option("--slots", type=click.IntRange(1, 4096), default=None, help="Parallel sequences (llama.cpp -np).")
@click.option("--context", type=click.IntRange(1), default=None, help="Context length in tokens (llama.cpp -c).")
@click.option("--memory", metavar="SIZE", default=None, help="Node memory a CPU replica needs.")
@click.option("--cpu-cores", type=_FiniteFloat(0, 4096), default=None, help="CPU cores a CPU replica claims.")
@click.option("--served-name", default=None, help="The model name clients use (default NAME).")
@click.option("--ready-timeout", metavar="DURATION", default=None,
              help="How long an engine may take to load (2h); default the agent's ready_timeout (30m).")
@click.option("--arg", "args", multiple=True, metavar="ARG", help="An extra engine argument (repeat).")
@click.option("--env", "envs", multiple=True, metavar="KEY=VALUE", help="An engine environment variable (repeat).")
@click.option("--update", is_flag=True, default=False,
              help="Change NAME, made with ctl deploy before, to this whole entry: a rolling update when what its "
                   "replicas run changes.")
@_options(group=False)
@click.pass_context
def deploy(ctx: click.Context, name: str, model: str, engine: str | None, replicas: int | None, gpus: int | None,
           gpu_memory: str | None, gpu_model: str | None, labels: tuple[str, ...], share_gpus: bool,
           slots: int | None, context: int | None, memory: str | None, cpu_cores: float | None,
           served_name: str | None, ready_timeout: str | None, args: tuple[str, ...], envs: tuple[str, ...], update: bool, admin: str | None,
           token: str | None, as_json: bool | None) -> None:
    """Run NAME on the cluster: the control plane places its replicas and keeps them running.

    The deployment lives in the control plane's store (deployments in the config file are
    managed there instead). With --update, NAME exists and takes this entry (every option
    not given takes its default again, as in a new deployment).
    """
    t = _target(ctx, admin, token, as_json)
    body: dict[str, Any] = {"name": name, "model": model}
    for key, v in (("engine", engine), ("replicas", replicas), ("gpus", gpus), ("gpu_memory", gpu_memory),
                   ("gpu_model", gpu_model), ("slots", slots), ("context", context), ("memory", memory),
                   ("cpu_cores", cpu_cores), ("served_name", served_name), ("ready_timeout", ready_timeout)):
        if v is not None:
            body[key] = v
    if labels:
        body["node_labels"] = _kv_pairs(labels, "--label")
    if share_gpus:
        body["share_gpus"] = True
    if args:
        body["args"] = list(args)
    if envs:
        body["env"] = _kv_pairs(envs, "--env")
    if update:
        data = t.call("PUT", f"/admin/v1/deployments/{quote(name, safe='')}", body)
    else:
        data = t.call("POST", "/admin/v1/deployments", body)
    if t.as_json:
        _print_json(data)
        return
    _say_deployment(data, "updated" if update else "deployed")


def _say_deployment(d: dict[str, Any], verb: str) -> None:
    from ..launch.spec import reason_line

    placed, desired = d.get("placed", 0), d.get("desired")
    on = f" on {', '.join(map(str, d['nodes']))}" if d.get("nodes") else ""
    if isinstance(placed, int) and isinstance(desired, int) and placed > desired:
        # (scaled down after a takeover: the extra are drained once their nodes report)
        click.echo(printable(f"{d.get('name')}: {verb}: {placed} replica(s) placed{on}, {placed - desired} more than"
                             " wanted: they drain, then stop"))
    else:
        click.echo(printable(f"{d.get('name')}: {verb}: {placed} of {desired} replica(s) placed{on}"))
    why = reason_line(d.get("message") if isinstance(d.get("message"), str) else None)
    if why:
        from ._common import echo_err

        echo_err(printable(f"{d.get('name')}: {why}"), level="warning")
    elif isinstance(d.get("placed"), int) and isinstance(d.get("desired"), int) and d["placed"] < d["desired"]:
        # (nothing stands in the way: the control plane places many in passes, the loop having its turn between)
        click.echo(printable(f"{d.get('name')}: the rest are being placed (llmgw ctl deployments shows them)"))


@ctl.command(context_settings={"ignore_unknown_options": True})  # (-1: a bad REPLICAS, said so; not an option)
@click.argument("name")
@click.argument("replicas", type=_ReplicaCount())
@_options(group=False)
@click.pass_context
def scale(ctx: click.Context, name: str, replicas: int, admin: str | None, token: str | None,
          as_json: bool | None) -> None:
    """Set deployment NAME to REPLICAS replicas, 0 to 1024 (0: none; requests then get 503 model_unavailable).

    Scaling down drains the replicas it removes first: their requests in flight finish. On a
    deployment from the config file the scale holds until that entry changes in the file.
    """
    t = _target(ctx, admin, token, as_json)
    data = t.call("POST", f"/admin/v1/deployments/{quote(name, safe='')}/scale", {"replicas": replicas})
    if t.as_json:
        _print_json(data)
        return
    _say_deployment(data, f"scaled to {replicas}")


@ctl.command()
@click.argument("name")
@_options(group=False)
@click.pass_context
def undeploy(ctx: click.Context, name: str, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """Remove deployment NAME: its replicas drain (requests in flight finish), then stop."""
    t = _target(ctx, admin, token, as_json)
    data = t.call("DELETE", f"/admin/v1/deployments/{quote(name, safe='')}")
    if t.as_json:
        _print_json(data)
        return
    n = len(data.get("draining") or [])
    click.echo(f"{name}: undeployed" + (f"; {n} replica(s) draining, then stopping" if n else ""))


@ctl.command()
@click.option("--show-secrets", is_flag=True, default=False, help="Show each replica's API key.")
@_options(group=False)
@click.pass_context
def deployments(ctx: click.Context, show_secrets: bool, admin: str | None, token: str | None,
                as_json: bool | None) -> None:
    """List the deployments: desired and ready replicas, where each runs, why one is not placed or ready.

    WHY NOT is one line: the reason, and the most telling line of the engine's log where the
    reason carries its end (--json has the whole message; llmgw ctl logs REPLICA the log); with
    no reason, what a replica not ready yet does (fetching the model, started: ...).
    Values nobody reported (a replica's port before it started) show as –.
    """
    t = _target(ctx, admin, token, as_json)
    data = t.call("GET", "/admin/v1/deployments" + ("?show_secrets=1" if show_secrets else ""))
    if t.as_json:
        _print_json(data)
        return
    from rich.table import Table

    from ..launch.spec import deployment_reason

    rows = data.get("deployments", [])
    console = _console()
    if not rows:
        console.print("no deployments (add deployments: to the config file, or run llmgw ctl deploy)")
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col, justify in (("DEPLOYMENT", "left"), ("MODEL", "left"), ("ENGINE", "left"), ("READY", "right"),
                         ("DESIRED", "right"), ("SOURCE", "left"), ("NODES", "left"), ("WHY NOT", "left")):
        table.add_column(col, justify=justify, no_wrap=col != "WHY NOT")  # type: ignore[arg-type]
    for d in rows:
        desired = _fmt(d.get("desired")) + ("*" if d.get("scaled") else "")
        why = deployment_reason(d)
        _add_row(
            table, str(d.get("name")), str(d.get("model")), str(d.get("engine")), _fmt(d.get("ready")), desired,
            str(d.get("source")), ", ".join(map(str, d.get("nodes") or [])) or ABSENT, why or ABSENT,
        )
    print_table(console, table)
    reps = [r for d in rows for r in d.get("replicas", [])]
    if reps:
        rt = Table(box=None, pad_edge=False, header_style="bold")
        cols = ["REPLICA", "DEPLOYMENT", "NODE", "STATE", "ADDRESS", "GPUS", "RESTARTS", "ROUTED"]
        if show_secrets:
            cols.append("API KEY")
        for col in cols:
            rt.add_column(col, justify="right" if col == "RESTARTS" else "left", no_wrap=True)
        for r in reps:
            state = str(r.get("state"))
            addr = f"{r['address']}:{r['port']}" if r.get("address") and r.get("port") else ABSENT
            row = [str(r.get("id")), str(r.get("deployment")), str(r.get("node")),
                   _text(state, _DEPLOY_STATE_STYLE.get(state, "white")), addr,
                   str(len(r.get("gpus") or [])) if r.get("gpus") else "cpu", _fmt(r.get("restarts")),
                   "yes" if r.get("in_router") else "no"]
            if show_secrets:
                row.append(str(r.get("api_key") or ABSENT))
            _add_row(rt, *row)
        console.print()
        print_table(console, rt)
    if any(d.get("scaled") for d in rows):
        console.print("* scaled with llmgw ctl scale: holds until the deployment's entry in the config file changes")


# -- engine-check (issue 18): runs here, on this node; the logic is llmgw.launch.check --


def _engine_check_on(ctx: click.Context, node: str, engine: str, model: str | None, static_only: bool, timeout: float,
                     as_json: bool | None, *local: str | None) -> None:
    """``--node``: the node's agent runs the checks with its own config; the control plane relays them."""
    if any(v is not None for v in local):
        raise click.UsageError("--agent-config, --binary and --python describe this machine; with --node the "
                               "node's agent uses its own config file")
    from ..launch.check import Check, render

    t = _target(ctx, None, None, as_json)
    t.timeout = (0.0 if static_only else timeout) + 240.0  # (the control plane's own bound is shorter)
    body: dict[str, Any] = {"engine": engine, "static": static_only, "timeout": timeout}
    if model is not None:
        body["model"] = model
    data = t.call("POST", f"/admin/v1/nodes/{quote(node, safe='')}/engine-check", body)
    if t.as_json:
        _print_json(data)
    else:
        # (the node's agent wrote them: shown as written, control characters escaped)
        checks = [Check(printable(c.get("check", "")), printable(c.get("status", "")), printable(c.get("detail", "")),
                        printable(c.get("fix") or "")) for c in data.get("checks") or []]
        click.echo(f"on node {node}:")
        click.echo(render(checks))
    if not data.get("ok", False):
        ctx.exit(1)


@ctl.command("engine-check")
@click.argument("engine", type=click.Choice(["vllm", "llamacpp", "trtllm", "sglang"]))
@click.option("--model", metavar="PATH-OR-ID",
              help="The model for the live checks (llamacpp: default, a tiny GGUF llmgw writes).")
@click.option("--static", "static_only", is_flag=True, help="Only the static checks (no engine is started).")
@click.option("--agent-config", type=click.Path(dir_okay=False), metavar="FILE",
              help="The node agent's config file: its engines: section says where the engine is.")
@click.option("--binary", metavar="PATH", help="The engine's executable (overrides engines.<engine>.binary).")
@click.option("--python", metavar="PATH", help="The engine's interpreter (overrides engines.<engine>.python).")
@click.option("--gpu-source", type=click.Choice(["auto", "nvml", "nvidia-smi", "none", "simulated"]),
              default="auto", show_default=True, help="Where GPUs are read from.")
@click.option("--timeout", type=_FiniteFloat(1, 86_400), default=600.0, show_default=True,
              help="Seconds the engine may take to become ready.")
@click.option("--node", metavar="NODE", help="Run the check on that node, through the control plane.")
@click.option("--json", "as_json", is_flag=True, default=None, help="Print the checks as JSON.")
@click.pass_context
def engine_check(ctx: click.Context, engine: str, model: str | None, static_only: bool, agent_config: str | None,
                 binary: str | None, python: str | None, gpu_source: str, timeout: float, node: str | None,
                 as_json: bool | None) -> None:
    """Check that this node can run ENGINE as llmgw launches it.

    Static checks (found, version, the flags llmgw passes in its --help, GPU
    driver), then live ones when a model is at hand: start, ready, the metrics
    llmgw reads, 401 without the key, clean stop. One line per check, with the
    fix when it fails; exit status 1 when any check fails.

    \b
    Example:
      llmgw ctl engine-check llamacpp
      llmgw ctl engine-check vllm --model facebook/opt-125m --agent-config agent.yaml
    """
    import asyncio
    import logging

    from ..config.agent import AgentEngineConfig, load_agent_file
    from ..errors import ConfigError
    from ..launch.check import engine_check as run_checks
    from ..launch.check import render

    if node is not None:
        return _engine_check_on(ctx, node, engine, model, static_only, timeout, as_json, agent_config, binary, python)
    engines: dict[str, AgentEngineConfig] = {}
    if agent_config is not None:
        try:
            engines = dict(load_agent_file(agent_config, require_control=False).engines)
        except ConfigError as exc:
            raise CtlError(str(exc)) from None
    if binary is not None or python is not None:
        base = engines.get(engine) or AgentEngineConfig()
        engines[engine] = AgentEngineConfig(binary=binary if binary is not None else base.binary,
                                            python=python if python is not None else base.python)
    # (the supervisor's info lines would repeat what the checks say)
    logging.getLogger("llmgw.agent.launch").setLevel(logging.WARNING)
    checks = asyncio.run(run_checks(engine, engines=engines, model=model, live=not static_only,
                                    gpu_source=gpu_source, timeout=timeout))
    json_out = as_json if as_json is not None else (ctx.obj.as_json if isinstance(ctx.obj, Target) else False)
    if json_out:
        _print_json({"engine": engine, "ok": not any(c.failed for c in checks),
                     "checks": [c.as_dict() for c in checks]})
    else:
        click.echo(render(checks))
    if any(c.failed for c in checks):
        ctx.exit(1)


# -- join tokens made through the API (control/tokens.py) --


@ctl.group("tokens", context_settings={"help_option_names": ["-h", "--help"]})
def tokens() -> None:
    """Join tokens for agents, made at run time (the config file's keep working beside them).

    \b
      llmgw ctl tokens create --name rack-1 --expires 7d   the secret is printed once
      llmgw ctl tokens list                                id, name, state, created, expires, last used
      llmgw ctl tokens revoke ID                           agents with it are refused at their next call
    """


def _when(v: Any) -> str:
    if v is None:
        return ABSENT
    import datetime

    return datetime.datetime.fromtimestamp(float(v), datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


_TOKEN_STYLE = {"active": "green", "expired": "yellow", "revoked": "red"}


@tokens.command("create")
@click.option("--name", metavar="NAME", default=None, help="What it is for (shown by list).")
@click.option("--expires", metavar="DURATION", default=None,
              help="Refused after this long: 30m, 12h, 7d, 2w (default: never).")
@_options(group=False)
@click.pass_context
def tokens_create(ctx: click.Context, name: str | None, expires: str | None, admin: str | None, token: str | None,
                  as_json: bool | None) -> None:
    """Make a join token; its secret is printed once (on stdout), and cannot be shown again."""
    t = _target(ctx, admin, token, as_json)
    body: dict[str, Any] = {}
    if name is not None:
        body["name"] = name
    if expires is not None:
        body["expires"] = expires
    data = t.call("POST", "/admin/v1/join-tokens", body)
    if t.as_json:
        _print_json(data)
        return
    from ._common import echo_err

    click.echo(data["token"])
    echo_err(f"join token {printable(data.get('id'))}{f' ({name})' if name else ''} made"
             + (f", expires {_when(data.get('expires_at'))}" if data.get("expires_at") else ", never expires")
             + ": give it to agents (llmgw agent --token-env NAME); it is not shown again", level="info")


@tokens.command("list")
@_options(group=False)
@click.pass_context
def tokens_list(ctx: click.Context, admin: str | None, token: str | None, as_json: bool | None) -> None:
    """List the join tokens made through the API (never their secrets); times in UTC, – for never."""
    t = _target(ctx, admin, token, as_json)
    data = t.call("GET", "/admin/v1/join-tokens")
    if t.as_json:
        _print_json(data)
        return
    from rich.table import Table

    rows = data.get("tokens", [])
    console = _console()
    n_config = data.get("config_tokens")
    if not rows:
        console.print("no join tokens made through the API (llmgw ctl tokens create makes one)")
    else:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for col in ("ID", "NAME", "STATE", "CREATED", "EXPIRES", "LAST USED"):
            table.add_column(col, no_wrap=True)
        for r in rows:
            state = str(r.get("state"))
            _add_row(table, str(r.get("id")), str(r.get("name") or ABSENT),
                     _text(state, _TOKEN_STYLE.get(state, "white")), _when(r.get("created_at")),
                     _when(r.get("expires_at")), _when(r.get("last_used_at")))
        print_table(console, table)
    if n_config is not None:
        console.print(f"and {n_config} token(s) from the configuration (control.join_token_env / join_token; "
                      "the demo makes its own)")


@tokens.command("revoke")
@click.argument("token_id", metavar="ID")
@_options(group=False)
@click.pass_context
def tokens_revoke(ctx: click.Context, token_id: str, admin: str | None, token: str | None,
                  as_json: bool | None) -> None:
    """Revoke join token ID on every control plane: agents presenting it are refused at their next call."""
    t = _target(ctx, admin, token, as_json)
    data = t.call("DELETE", f"/admin/v1/join-tokens/{quote(token_id, safe='')}")
    if t.as_json:
        _print_json(data)
        return
    if not data.get("changed"):
        click.echo(f"join token {token_id} was already revoked")
        return
    nodes = [_printable(n) for n in data.get("nodes") or []]
    click.echo(f"join token {token_id} revoked" + (
        f"; {len(nodes)} node(s) joined with it ({', '.join(nodes)}): refused at their next heartbeat" if nodes
        else ""))


def _printable(value: Any, limit: int = 100) -> str:
    """A name from the server, safe for a terminal: as is when printable, else escaped (never raw control bytes)."""
    text = str(value)[:limit]
    return text if text.isprintable() and not any(c.isspace() for c in text) else repr(text)


def main() -> None:  # pragma: no cover - `python -m llmgw.cli.ctl`
    ctl(prog_name="llmgw ctl")


if __name__ == "__main__":  # pragma: no cover
    main()
