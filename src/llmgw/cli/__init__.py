"""The ``llmgw`` command.

Subcommands live in their own modules and are imported only when used, so
``llmgw --help`` stays fast and one broken optional part cannot take down the rest.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
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
    "console": ("llmgw.cli.console", "console", "A live terminal console for the fleet (over the admin API)."),
}


def interrupted() -> None:
    """Ctrl-C: one line, exit status 130 (whatever was being done or imported then)."""
    common = sys.modules.get("llmgw.cli._common")
    if common is not None and hasattr(common, "echo_err"):
        common.echo_err("llmgw: interrupted", level="error")
    else:
        sys.stderr.write("llmgw: interrupted\n")
    sys.exit(130)


# -- --log-level / --log-format / --log-config, before or after the subcommand --

_LOG_META = "llmgw.log"
_LOG_HELP = {
    "log_level": "How much llmgw logs to stderr.",
    "log_format": "text: 'time level logger: message' lines; json: one JSON object a line (stderr and access log).",
    "log_config": "A logging.config.dictConfig file (YAML or JSON), applied after the above.",
}


def _log_options(group: bool) -> list[click.Option]:
    """The three logging options: with defaults and env vars on the group, plain (None) on subcommands."""

    def cb(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and not group:
            _apply_logging(ctx, **{str(param.name): value})
        return value

    kw: dict[str, Any] = {} if group else {"expose_value": False, "callback": cb}
    return [
        click.Option(
            ["--log-level"], type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
            default="info" if group else None, show_default=group, envvar="LLMGW_LOG_LEVEL" if group else None,
            show_envvar=group, help=_LOG_HELP["log_level"], **kw,
        ),
        click.Option(
            ["--log-format"], type=click.Choice(["text", "json"], case_sensitive=False),
            default="text" if group else None, show_default=group, envvar="LLMGW_LOG_FORMAT" if group else None,
            show_envvar=group, help=_LOG_HELP["log_format"], **kw,
        ),
        click.Option(
            ["--log-config"], metavar="FILE", default=None, envvar="LLMGW_LOG_CONFIG" if group else None,
            show_envvar=group, help=_LOG_HELP["log_config"], **kw,
        ),
    ]


def _apply_logging(ctx: click.Context, **changes: Any) -> None:
    """Merge ``changes`` into the run's logging settings and (re)apply them."""
    from ._common import apply_logging

    root = ctx.find_root()
    settings: dict[str, Any] = root.meta.setdefault(_LOG_META, {"log_level": "info", "log_format": "text",
                                                                 "log_config": None})
    settings.update(changes)
    apply_logging(settings)


def _add_log_options(cmd: click.Command) -> None:
    """Give ``cmd`` (and, for a group, every command under it) the subcommand form of the logging options."""
    if getattr(cmd, "_llmgw_log_options", False):
        return
    names = {p.name for p in cmd.params}
    cmd.params.extend(o for o in _log_options(group=False) if o.name not in names)
    cmd._llmgw_log_options = True  # type: ignore[attr-defined]
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _add_log_options(sub)


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use.

    Every subcommand (and every command of a subgroup) also takes ``--log-level``,
    ``--log-format`` and ``--log-config``, so they work after the subcommand as well;
    errors are llmgw's one-line errors with exit status 1, and a bare ``llmgw`` prints help.
    """

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            from ._common import report_error

            rv = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            # A bare `llmgw` (or `llmgw ctl`): help on stdout, success.
            click.echo(exc.ctx.get_help())
            sys.exit(0)
        except click.ClickException as exc:
            sys.exit(report_error(exc, argv))
        except (click.exceptions.Abort, KeyboardInterrupt):
            # (KeyboardInterrupt: a Ctrl-C while a subcommand's modules are still being
            # imported, before click would have turned it into Abort)
            interrupted()
        sys.exit(rv if isinstance(rv, int) else 0)

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
        _add_log_options(cmd)
        return cmd

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help without importing every subcommand module.
        rows = [(name, spec[2]) for name, spec in sorted(COMMANDS.items())]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _group_log_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed(_log_options(group=True)):
        f.__click_params__ = [*getattr(f, "__click_params__", []), opt]  # type: ignore[attr-defined]
    return f


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
@_group_log_options
@click.pass_context
def main(ctx: click.Context, log_level: str, log_format: str, log_config: str | None) -> None:
    """llmgw: one OpenAI-compatible address in front of your own LLM fleet.

    \b
    Start here:
      llmgw serve                 run the gateway on a built-in demo fleet
      llmgw serve -c llmgw.yaml   run it in front of your engines
      llmgw sim-engine --help     a stand-in engine for tests and benchmarks
    """
    _apply_logging(ctx, log_level=log_level, log_format=log_format, log_config=log_config)
    ctx.ensure_object(dict)


def run() -> Any:  # pragma: no cover - console entry for `python -m llmgw`
    return main()
