"""The ``llmgw`` command.

Subcommands live in their own modules and are imported only when used, so
``llmgw --help`` stays fast and one broken optional part cannot take down the rest.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

from .. import __version__

__all__ = ["main"]

# name -> (module, attribute, one-line help shown by `llmgw --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("llmgw.cli.serve", "serve", "Run the gateway (a built-in demo fleet when no config is found)."),
    "sim-engine": ("llmgw.cli.sim", "sim_engine", "Run a simulated inference engine (vLLM, llama.cpp, TensorRT-LLM, SGLang)."),
    "check-config": ("llmgw.cli.config", "check_config", "Validate a config file as serve would; every problem at once."),
    "config": ("llmgw.cli.config", "config", "Check llmgw.yaml, or print its JSON Schema for editors."),
    "mirror": ("llmgw.cli.mirror", "mirror", "Keep model files in a verified, content-addressed mirror."),
    "ctl": ("llmgw.cli.ctl", "ctl", "Drive a running gateway: endpoints, nodes and GPUs, drain, cordon, reload."),
    "agent": ("llmgw.cli.agent", "agent", "Run the node agent: report this node's GPUs to a control plane."),
}


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = COMMANDS.get(cmd_name)
        if spec is None:
            return None
        module = importlib.import_module(spec[0])
        cmd = getattr(module, spec[1])
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{spec[0]}.{spec[1]} is not a click command")
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help without importing every subcommand module.
        rows = [(name, spec[2]) for name, spec in sorted(COMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _version_message() -> str:
    from .._accel import NO_EXTENSIONS

    if NO_EXTENSIONS:
        ext = "pure Python (LLMGW_NO_EXTENSIONS)"
    else:
        try:
            importlib.import_module("llmgw._fast.httpproto")
        except ImportError:
            ext = "pure Python (compiled extensions missing)"
        else:
            ext = "compiled extensions"
    return f"llmgw {__version__} (Python {sys.version.split()[0]}, {ext})"


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", message=_version_message())
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
    envvar="LLMGW_LOG_LEVEL",
    help="How much llmgw logs to stderr.",
)
@click.pass_context
def main(ctx: click.Context, log_level: str) -> None:
    """llmgw: one OpenAI-compatible address in front of your own LLM fleet.

    \b
    Start here:
      llmgw serve                 run the gateway on a built-in demo fleet
      llmgw serve -c llmgw.yaml   run it in front of your engines
      llmgw sim-engine --help     a stand-in engine for tests and benchmarks
    """
    from ..log import setup

    setup(log_level)
    ctx.ensure_object(dict)


def run() -> Any:  # pragma: no cover - console entry for `python -m llmgw`
    return main()
