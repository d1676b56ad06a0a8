"""``llmgw mirror``: keep model files in a verified, content-addressed mirror.

Thin: parse, call :mod:`llmgw.mirror`, print. User errors are one line on stderr,
``llmgw: error: <what is wrong; what to do>``, and a non-zero exit status; never a
traceback.
"""

from __future__ import annotations

import errno
import functools
import json
import signal
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeVar

import click

from ..mirror.errors import MirrorError, ModelNotFoundError
from ._common import echo_err, print_table

__all__ = ["mirror"]

F = TypeVar("F", bound=Callable[..., Any])

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130


class MirrorCliError(click.ClickException):
    """A user error, shown as one ``llmgw: error: ...`` line."""

    exit_code = EXIT_ERROR

    def show(self, file: IO[Any] | None = None) -> None:
        echo_err(f"llmgw: error: {self.format_message()}", level="error")


class MirrorInterruptedError(MirrorCliError):
    """Ctrl-C: exit 130, as a shell does for SIGINT (128 + the signal for SIGTERM or SIGHUP)."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum  # type: ignore[misc]  # (click reads it from the instance)


def _os_error_message(exc: OSError) -> str:
    what = exc.strerror or str(exc)
    where = f": {exc.filename}" if exc.filename else ""
    hint = {
        errno.EACCES: "; check its permissions, or choose another mirror root with --root",
        errno.EPERM: "; check its permissions, or choose another mirror root with --root",
        errno.EROFS: "; the file system is read-only: choose another mirror root with --root",
        errno.ENOSPC: "; free some space (llmgw mirror gc removes unused blobs) and run it again",
        errno.EDQUOT: "; you are over your disk quota: free some space (llmgw mirror gc removes unused blobs)"
        " or choose another mirror root with --root",
        errno.EFBIG: "; the file is larger than this process may write (ulimit -f) or the file system takes:"
        " raise the limit, or choose another mirror root with --root",
        errno.EIO: "; the disk reported an I/O error: check it (dmesg) before trying again",
    }.get(exc.errno or 0, "")
    return f"{what}{where}{hint}"


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (``timeout``, systemd, a closed terminal): stopped as Ctrl-C stops, cleaned up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _errors(func: F) -> F:
    """Turn the mirror's errors, OS errors and Ctrl-C (or SIGTERM, SIGHUP) into one-line messages."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        def stop(signum: int, frame: Any) -> None:
            raise _Stopped(signum)

        held = {}
        if threading.current_thread() is threading.main_thread():
            # (without this a SIGTERM ended the process at once, a partial copy left under tmp/)
            held = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
        try:
            return func(*args, **kwargs)
        except MirrorError as exc:
            raise MirrorCliError(str(exc)) from exc
        except BrokenPipeError:
            raise  # (stdout closed under `| head`: click ends quietly, status 1, as Python's docs advise)
        except OSError as exc:
            raise MirrorCliError(_os_error_message(exc)) from exc
        except sqlite3.Error as exc:  # (the catalogue turns these into MirrorErrors; a last resort)
            raise MirrorCliError(
                f"the mirror's catalogue failed: {exc}; run it again, and if it fails again check the disk"
                " (dmesg) and the permissions of the mirror root"
            ) from exc
        except KeyboardInterrupt as exc:
            signum = exc.signum if isinstance(exc, _Stopped) else signal.SIGINT
            raise MirrorInterruptedError(
                f"{'interrupted' if signum == signal.SIGINT else 'stopped by ' + signal.Signals(signum).name}"
                "; nothing was recorded and no partial file is left in the mirror. Run the same command again to "
                "finish",
                signum,
            ) from exc
        finally:
            for sig, old in held.items():
                signal.signal(sig, old)

    return wrapper  # type: ignore[return-value]


def _root_option(func: F) -> F:
    return click.option(
        "--root",
        "sub_root",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Mirror root (overrides the group's --root and LLMGW_MIRROR).",
    )(func)


def _json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


def _quiet_option(func: F) -> F:
    return click.option("-q", "--quiet", is_flag=True, help="No progress bar and no summary line.")(func)


def _resolve_root(ctx: click.Context, sub_root: Path | None) -> Path:
    from ..mirror import default_root

    if sub_root is not None:
        return sub_root.expanduser()
    group_root = (ctx.find_root().meta.get("llmgw.mirror.root") if ctx else None) or None
    return group_root if group_root is not None else default_root()


@contextmanager
def _open_store(root: Path, *, create: bool) -> Iterator[Any]:
    from ..mirror import MirrorStore

    store = MirrorStore(root, create=create)
    try:
        yield store
    finally:
        store.close()


def _console() -> Any:
    from rich.console import Console

    out = sys.stdout
    tty = out.isatty() if hasattr(out, "isatty") else False
    # Off a terminal rich would wrap tables at 80 columns; a pipe wants whole lines.
    return Console(file=out, width=None if tty else 1000, highlight=False, soft_wrap=False)


def _print_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")  # pragma: no cover


def _short(digest: str) -> str:
    return digest[7:19]


def _params(n: int | None) -> str:
    from ..mirror.gguf import format_parameter_count

    return format_parameter_count(n)


def _cell(value: Any) -> Any:
    from rich.text import Text

    return Text("-" if value is None or value == "" else str(value))


def _role_list(record: Any) -> str:
    roles: dict[str, int] = {}
    for f in record.files:
        roles[f.role] = roles.get(f.role, 0) + 1
    return "+".join(r if n == 1 else f"{n}×{r}" for r, n in roles.items())


@click.group("mirror", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="LLMGW_MIRROR",
    default=None,
    help="Mirror root. Default: $LLMGW_MIRROR, else $XDG_DATA_HOME/llmgw/mirror, else ~/.local/share/llmgw/mirror.",
)
@click.pass_context
def mirror(ctx: click.Context, root: Path | None) -> None:
    """Keep model files in a verified, content-addressed mirror.

    \b
      llmgw mirror import model.gguf [--projector mmproj.gguf] [--name NAME[:TAG]]
      llmgw mirror import-ollama llama3.2:3b
      llmgw mirror ls | show NAME | rm NAME | verify [NAME] | gc [--dry-run]
    """
    ctx.find_root().meta["llmgw.mirror.root"] = root.expanduser() if root is not None else None


@mirror.command("import", short_help="Copy a GGUF file (and its projectors) into the mirror.")
@click.argument("file", type=click.Path(path_type=Path, dir_okay=True))
@click.option(
    "--name",
    metavar="NAME[:TAG]",
    help="Name in the mirror (default: the file name without .gguf, tag latest).",
)
@click.option(
    "--projector",
    "projectors",
    multiple=True,
    type=click.Path(path_type=Path),
    metavar="FILE",
    help="A vision/audio projector (mmproj) GGUF to keep with the model; may repeat.",
)
@click.option("--raw", is_flag=True, help="Store the files without checking they are GGUF.")
@_quiet_option
@_json_option
@_root_option
@click.pass_context
@_errors
def import_cmd(
    ctx: click.Context,
    file: Path,
    name: str | None,
    projectors: tuple[Path, ...],
    raw: bool,
    quiet: bool,
    as_json: bool,
    sub_root: Path | None,
) -> None:
    """Copy a model FILE (GGUF) into the mirror, hashing it on the way.

    The copy is verified, made durable and only then recorded; an interrupted
    import leaves nothing behind and can simply be run again.
    """
    from ..mirror import import_file
    from ..mirror.progress import make_progress

    root = _resolve_root(ctx, sub_root)
    with _open_store(root, create=True) as store, make_progress(quiet=quiet) as progress:
        result = import_file(store, file, name=name, projectors=projectors, raw=raw, progress=progress)
    _report_import(result, root, quiet=quiet, as_json=as_json)


@mirror.command("import-ollama", short_help="Copy a model pulled by Ollama into the mirror.")
@click.argument("model", metavar="MODEL[:TAG]")
@click.option(
    "--ollama-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Ollama's models directory (default: $OLLAMA_MODELS, ~/.ollama/models, /usr/share/ollama/.ollama/models).",
)
@click.option(
    "--name", metavar="NAME[:TAG]", help="Name in the mirror (default: the name `ollama list` shows)."
)
@_quiet_option
@_json_option
@_root_option
@click.pass_context
@_errors
def import_ollama_cmd(
    ctx: click.Context,
    model: str,
    ollama_dir: Path | None,
    name: str | None,
    quiet: bool,
    as_json: bool,
    sub_root: Path | None,
) -> None:
    """Copy a model pulled by Ollama into the mirror, verifying every blob.

    MODEL is an Ollama name: [host/][namespace/]model[:tag], e.g. llama3.2:3b.
    The weights (and a vision model's projector) are checked against the digests
    Ollama named them by; the template, parameters and licenses are kept.
    """
    from ..mirror import import_ollama
    from ..mirror.progress import make_progress

    root = _resolve_root(ctx, sub_root)
    with _open_store(root, create=True) as store, make_progress(quiet=quiet) as progress:
        result = import_ollama(store, model, ollama_dir=ollama_dir, name=name, progress=progress)
    _report_import(result, root, quiet=quiet, as_json=as_json)


def _report_import(result: Any, root: Path, *, quiet: bool, as_json: bool) -> None:
    for b in result.blobs:
        if b.replaced:  # (on stderr, even with --quiet or --json: the mirror had a damaged blob)
            echo_err(
                f"llmgw: warning: blob {b.digest} ({b.path}) was corrupt; replaced it with the verified copy",
                level="warning",
            )
    if as_json:
        _print_json(result.to_json())
        return
    if quiet:
        return
    rec = result.record
    parts = []
    for f in rec.files:
        g = f.gguf or {}
        desc = " ".join(
            x
            for x in (
                g.get("architecture"),
                _params(g.get("parameter_count")) if g.get("parameter_count") else None,
                g.get("quantization"),
            )
            if x
        )
        parts.append(f"{f.role} {desc + ', ' if desc else ''}{_human(f.size)}, {_short(f.digest)}")
    reused = sum(b.reused for b in result.blobs)
    restored = len(result.blobs) - reused  # (a model already recorded whose blob was written again)
    what = ("imported" if result.created
            else f"already in the mirror; restored {restored} missing or corrupt blob(s):" if restored
            else "already in the mirror, unchanged:")
    note = f" ({reused} blob(s) already stored)" if reused and result.created else ""
    click.echo(f"{what} {rec.ref} ({'; '.join(parts)}) in {root}{note}")


def _load_models(root: Path) -> list[Any]:
    from ..mirror import MirrorStore

    if not MirrorStore.exists(root):
        return []
    with _open_store(root, create=False) as store:
        models: list[Any] = store.list_models()
        return models


@mirror.command("ls", short_help="List the models.")
@_json_option
@_root_option
@click.pass_context
@_errors
def ls_cmd(ctx: click.Context, as_json: bool, sub_root: Path | None) -> None:
    """List the models in the mirror."""
    from rich.table import Table

    root = _resolve_root(ctx, sub_root)
    models = _load_models(root)
    if as_json:
        _print_json([m.to_json() for m in models])
        return
    if not models:
        click.echo(f"no models in the mirror at {root}; add one with: llmgw mirror import FILE")
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col, justify in (
        ("NAME", "left"),
        ("ARCH", "left"),
        ("PARAMS", "right"),
        ("QUANT", "left"),
        ("CONTEXT", "right"),
        ("SIZE", "right"),
        ("FILES", "left"),
        ("SOURCE", "left"),
        ("IMPORTED", "left"),
    ):
        table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for m in models:
        table.add_row(
            _cell(m.ref),
            _cell(m.header("architecture")),
            _cell(_params(m.header("parameter_count")) if m.header("parameter_count") else None),
            _cell(m.header("quantization")),
            _cell(m.header("context_length")),
            _cell(_human(m.size)),
            _cell(_role_list(m)),
            _cell(m.source_kind),
            _cell(m.created_at.replace("T", " ").rstrip("Z")),
        )
    print_table(_console(), table)


def _get(store: Any, ref: str) -> Any:
    from ..mirror.names import parse_ref

    mname, tag = parse_ref(ref)
    try:
        return store.get_model(mname, tag)
    except ModelNotFoundError as exc:
        others = [m.ref for m in store.list_models() if m.name.lower() == mname.lower()]
        if others:
            raise ModelNotFoundError(
                f"no model {mname}:{tag} in the mirror; it has {', '.join(others)}"
            ) from exc
        raise


def _require_store(root: Path, ref: str) -> None:
    from ..mirror import MirrorStore
    from ..mirror.names import format_ref, parse_ref

    if not MirrorStore.exists(root):
        ref = format_ref(*parse_ref(ref))
        raise ModelNotFoundError(
            f"no model {ref} in the mirror at {root}: it is empty; see llmgw mirror import --help"
        )


@mirror.command("show", short_help="Show a model's files, blobs and header facts.")
@click.argument("name", metavar="NAME[:TAG]")
@_json_option
@_root_option
@click.pass_context
@_errors
def show_cmd(ctx: click.Context, name: str, as_json: bool, sub_root: Path | None) -> None:
    """Show a model: its files, their blobs and GGUF headers, and what its source said."""
    from rich.table import Table

    root = _resolve_root(ctx, sub_root)
    _require_store(root, name)
    with _open_store(root, create=False) as store:
        rec = _get(store, name)
    if as_json:
        _print_json(rec.to_json())
        return
    console = _console()
    about = Table(box=None, show_header=False, pad_edge=False)
    about.add_column(style="bold", no_wrap=True)
    about.add_column()
    main = rec.main.gguf if rec.main is not None and rec.main.gguf else {}
    rows = [
        ("name", rec.ref),
        ("source", rec.source),
        ("imported", rec.created_at),
        ("architecture", main.get("architecture")),
        ("model name", main.get("name")),
        (
            "parameters",
            f"{_params(main.get('parameter_count'))} ({main.get('parameter_count'):,})"
            if main.get("parameter_count")
            else None,
        ),
        ("quantization", main.get("quantization")),
        ("context length", main.get("context_length")),
        ("size", _human(rec.size)),
    ]
    for key, value in rows:
        if value is not None:
            about.add_row(_cell(key), _cell(value))
    console.print(about)
    files = Table(title=None, box=None, pad_edge=False, header_style="bold")
    for col in ("ROLE", "SIZE", "DIGEST", "ARCH", "QUANT", "PATH"):
        # Digests and paths are copied by hand: fold them on a narrow terminal, never cut them.
        long = col in ("DIGEST", "PATH")
        files.add_column(col, no_wrap=not long, overflow="fold" if long else "ellipsis")
    for f in rec.files:
        g = f.gguf or {}
        files.add_row(
            _cell(f.role),
            _cell(_human(f.size)),
            _cell(f.digest),
            _cell(g.get("architecture")),
            _cell(g.get("quantization")),
            _cell(f.path),
        )
    console.print()
    console.print(files)
    ollama = rec.info.get("ollama")
    if ollama:
        console.print()
        extra = Table(box=None, show_header=False, pad_edge=False)
        extra.add_column(style="bold", no_wrap=True)
        extra.add_column()
        extra.add_row(_cell("ollama name"), _cell(ollama.get("name")))
        extra.add_row(_cell("ollama store"), _cell(ollama.get("store")))
        if ollama.get("params") is not None:
            extra.add_row(_cell("parameters"), _cell(json.dumps(ollama["params"], sort_keys=True)))
        if ollama.get("system"):
            extra.add_row(_cell("system"), _cell(ollama["system"]))
        if ollama.get("template"):
            lines = ollama["template"].splitlines()
            shown = "\n".join(lines[:8]) + (
                f"\n… ({len(lines) - 8} more lines; see --json)" if len(lines) > 8 else ""
            )
            extra.add_row(_cell("template"), _cell(shown))
        for text in ollama.get("licenses") or []:
            first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
            extra.add_row(_cell("license"), _cell(f"{first[:100]} (full text: --json)"))
        console.print(extra)


@mirror.command("rm", short_help="Remove a model from the catalogue (blobs stay until gc).")
@click.argument("name", metavar="NAME[:TAG]")
@_json_option
@_root_option
@click.pass_context
@_errors
def rm_cmd(ctx: click.Context, name: str, as_json: bool, sub_root: Path | None) -> None:
    """Remove a model from the catalogue. Its blobs stay until `llmgw mirror gc`."""
    from ..mirror.names import parse_ref

    root = _resolve_root(ctx, sub_root)
    _require_store(root, name)
    mname, tag = parse_ref(name)
    with _open_store(root, create=False) as store:
        rec = store.remove_model(mname, tag)
        unused = store.unused_bytes()
    if as_json:
        out = rec.to_json()
        out["reclaimable"] = unused
        _print_json(out)
        return
    click.echo(f"removed {rec.ref}; llmgw mirror gc would free {_human(unused)}")


@mirror.command("verify", short_help="Re-hash blobs and name each corrupt one.")
@click.argument("name", metavar="[NAME[:TAG]]", required=False)
@_quiet_option
@_json_option
@_root_option
@click.pass_context
@_errors
def verify_cmd(
    ctx: click.Context, name: str | None, quiet: bool, as_json: bool, sub_root: Path | None
) -> None:
    """Re-hash every blob (or NAME's) and name each one that is corrupt or missing."""
    from rich.table import Table

    from ..mirror.progress import make_progress

    root = _resolve_root(ctx, sub_root)
    from ..mirror import MirrorStore

    unrecorded: Exception | None = None
    if not MirrorStore.exists(root):
        checks: list[Any] = []
        if name is not None:
            _require_store(root, name)
    else:
        with _open_store(root, create=False) as store:
            models = [_get(store, name)] if name is not None else None
            with make_progress(quiet=quiet) as progress:
                checks = store.verify(models, progress=progress, record=False, quarantine=True)
            # The results are shown even when they cannot be recorded (a read-only mirror).
            try:
                store.record_verified(checks)
            except MirrorError as exc:
                unrecorded = exc
    bad = [c for c in checks if not c.ok]
    if as_json:
        _print_json({"ok": not bad, "blobs": [c.to_json() for c in checks]})
    elif not quiet or bad:
        if checks:
            table = Table(box=None, pad_edge=False, header_style="bold")
            for col in ("DIGEST", "SIZE", "STATUS", "USED BY"):
                table.add_column(col, no_wrap=col != "DIGEST", overflow="fold")
            for c in checks:
                table.add_row(
                    _cell(c.digest),
                    _cell(_human(c.size)),
                    _cell(c.status.upper() if not c.ok else c.status),
                    _cell(", ".join(c.models)),
                )
            print_table(_console(), table)
        if not bad and not quiet:
            click.echo(f"{len(checks)} blob(s) verified, all intact")
    for c in bad:
        detail = f" (it hashes to {c.actual})" if c.status == "corrupt" else ""
        what = _not_a_file(c.path) if c.status == "not-a-file" else c.status
        fix = "move it out of the mirror and import" if c.status == "not-a-file" else "import"
        moved = ("" if c.quarantined is None else
                 f" (found corrupt before and moved to {c.quarantined})" if c.status == "quarantined" else
                 f"; moved it to {c.quarantined} (no node is sent it; deploying its models is refused)")
        echo_err(
            f"llmgw: error: blob {c.digest} ({c.path}) is {what}{detail}, used by"
            f" {', '.join(c.models) or 'no model'}{moved}; {fix} the model again from its source to replace it",
            level="error",
        )
    if unrecorded is not None:
        echo_err(f"llmgw: warning: {unrecorded}", level="warning")
    if bad:
        ctx.exit(EXIT_ERROR)


def _not_a_file(path: Path) -> str:
    import stat

    try:
        mode = path.lstat().st_mode
    except OSError:
        return "not a regular file"
    kind = ("a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
            else "a device, pipe or socket")
    return f"not a regular file ({kind})"


@mirror.command("gc", short_help="Delete unused blobs and leftovers of interrupted imports.")
@click.option("--dry-run", is_flag=True, help="Only list what would be removed.")
@_json_option
@_root_option
@click.pass_context
@_errors
def gc_cmd(ctx: click.Context, dry_run: bool, as_json: bool, sub_root: Path | None) -> None:
    """Remove blobs no model uses and leftovers of interrupted imports."""
    from rich.table import Table

    from ..mirror import GcReport, MirrorStore

    root = _resolve_root(ctx, sub_root)
    if not MirrorStore.exists(root):
        report = GcReport(dry_run=dry_run)
    else:
        with _open_store(root, create=False) as store:
            report = store.gc(dry_run=dry_run)
    if as_json:
        _print_json(report.to_json())
        return
    verb = "would remove" if dry_run else "removed"
    if report.blobs or report.temp_files:
        table = Table(box=None, pad_edge=False, header_style="bold")
        for col in ("KIND", "SIZE", "WHAT"):
            table.add_column(col, no_wrap=col != "WHAT", overflow="fold")
        for digest, size, _ in report.blobs:
            table.add_row(_cell("blob"), _cell(_human(size)), _cell(digest))
        for path, size in report.temp_files:
            table.add_row(_cell("partial"), _cell(_human(size)), _cell(path))
        print_table(_console(), table)
    click.echo(
        f"{verb} {len(report.blobs)} unused blob(s) and {len(report.temp_files)} partial file(s),"
        f" {_human(report.reclaimed)}"
    )
    if report.busy:
        echo_err(
            f"llmgw: note: an import (or a fetch) into {root} is running now: gc would refuse until it has"
            " finished; the list leaves out its files in progress",
            level="warning",
        )
