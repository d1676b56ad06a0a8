"""``llmgw console``: a live terminal console for the fleet, over the admin API.

    llmgw console                          the gateway at $LLMGW_ADMIN (default http://127.0.0.1:9090)
    llmgw console --admin http://gw:9090 --token T --refresh 1s --read-only

Same ``--admin`` / ``--token`` and environment fallback as ``llmgw ctl``. Keys: ``?``.
"""

from __future__ import annotations

import click

from ..config import parse_duration
from ..errors import ConfigError
from ._common import DEFAULT_ADMIN, Fail

__all__ = ["console"]


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    try:
        seconds = parse_duration(value, "--refresh")
    except ConfigError as exc:
        raise click.BadParameter(exc.message) from None
    if not 0.1 <= seconds <= 3600:
        raise click.BadParameter(f"must be between 0.1s and 1h, got {value}")
    return seconds


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--admin", metavar="URL", envvar="LLMGW_ADMIN", default=DEFAULT_ADMIN, show_envvar=True,
              help=f"The admin API's address (default {DEFAULT_ADMIN}).")
@click.option("--token", metavar="TOKEN", envvar="LLMGW_ADMIN_TOKEN", default=None, show_envvar=True,
              help="The gateway's admin_token.")
@click.option("--refresh", metavar="DURATION", default="2s", show_default=True, callback=_duration,
              help="How often the current view is polled (e.g. 500ms, 2s).")
@click.option("--timeout", metavar="DURATION", default="5s", show_default=True, callback=_duration,
              help="How long one admin API call may take before the console says disconnected.")
@click.option("--read-only", is_flag=True, help="Hide every action that changes something (drain, cordon, ...).")
@click.option("--view", type=click.Choice(["endpoints", "models", "nodes", "gpus", "deployments", "mirror"]),
              default="endpoints", show_default=True, help="The view to start on.")
@click.option("--name", metavar="TEXT", default=None, help="What the header calls this gateway (default: its URL).")
def console(admin: str, token: str | None, refresh: float, timeout: float, read_only: bool, view: str,
            name: str | None) -> None:
    """A live terminal console for the fleet: endpoints, models, nodes, GPUs, deployments, the mirror.

    \b
    Keys (? shows them all):  :view  switch view (:endpoints :models :nodes :gpus :deployments :mirror)
      /  filter    < >  sort    enter  drill down    esc  back    d/u  drain/undrain
      c  cordon    s  scale     r  reload config     I  import from Ollama (Mirror view)    q  quit
    """
    import sys

    from ..console.app import ConsoleApp
    from ..console.client import AdminClient

    try:
        client = AdminClient(admin, token or None, timeout=timeout)
    except ValueError as exc:
        raise Fail(str(exc)) from None
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        # (drawn into a pipe, the screen is escapes nobody reads, and keys never come)
        raise Fail("llmgw console needs a terminal on stdin and stdout; "
                   "from a script, use llmgw ctl (endpoints, nodes, gpus, deployments, ... --json)")
    import os

    for var in ("COLUMNS", "LINES"):
        # (rich, under Textual, takes these over the terminal's own size, and keeps them through every
        # resize: an exported COLUMNS=80, a script's or another terminal's, drew the console 80 wide in a
        # terminal of 200. The terminal on stdout says its size, and says when it changes)
        os.environ.pop(var, None)
    app = ConsoleApp(client, refresh=refresh, read_only=read_only, name=name, start=view)
    app.run()
    if app.return_code:
        # (Textual has printed what went wrong; a script or a supervisor must see that it did)
        sys.exit(app.return_code)
