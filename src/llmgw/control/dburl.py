"""``control.database``: the URL forms llmgw accepts, and the default when it is unset.

SQLAlchemy's forms, so a URL written for other tools means the same here:

* ``postgresql://USER[:PASSWORD]@HOST:PORT/DB`` (or ``postgres://``): shared by several
  ``llmgw serve`` processes, which elect a leader (:mod:`llmgw.control.leader`);
* ``sqlite:///RELATIVE/PATH`` (three slashes: relative to the working directory) and
  ``sqlite:////ABSOLUTE/PATH`` (four: an absolute path); ``~`` is expanded;
* ``sqlite::memory:``: nothing kept (the demo, tests).

Unset: an SQLite file where llmgw's earlier deployments store was, so an upgrade finds
it: ``deployments.sqlite3`` beside ``control.state_file`` when that is set, else
``$STATE_DIRECTORY/control.sqlite3`` under systemd's ``StateDirectory=`` (the unit in
``deploy/systemd`` sets it: its home is not writable there), else
``$XDG_STATE_HOME/llmgw/control.sqlite3`` (``~/.local/state/llmgw/``).

Pure (stdlib only): the config loader checks a URL with it before anything starts.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import ConfigError

__all__ = ["MEMORY", "DatabaseURL", "check_database_url", "default_database", "parse_database_url", "redact"]

MEMORY = ":memory:"
FORMS = "postgresql://USER@HOST:PORT/DB, sqlite:///RELATIVE/PATH, sqlite:////ABSOLUTE/PATH or sqlite::memory:"


@dataclass(frozen=True, slots=True)
class DatabaseURL:
    dialect: str
    """``postgresql`` or ``sqlite``."""
    url: str
    """As written (or made for the default): log it through :func:`redact`."""
    path: str | None = None
    """SQLite: the file (``:memory:`` for none)."""


def redact(url: str) -> str:
    """The URL without its password (for logs and errors), whatever its shape.

    SECURITY: not only well-formed URLs: a mistyped one (``postgresql//u:pw@h/db``,
    ``postgresql:///u:pw@h``) or a password with an unencoded ``@`` must not show either.
    Whatever stands between the scheme and the last ``@`` is the user information; what
    follows its first ``:`` is masked.
    """
    # (libpq and asyncpg take the password as a query parameter too: ?password=..., ?sslpassword=...)
    url = _QUERY_PASSWORD.sub(r"\g<1>***", url)
    m = _USERINFO.match(url)
    if m is None:
        scheme = _SCHEME.match(url)
        if "@" not in url or (scheme is not None and scheme.group(1).lower() in ("postgresql", "postgres")):
            return url  # (no password in it)
        return "***@" + url.rpartition("@")[2]  # no scheme to go by: nothing before the last "@" shows
    user, _, password = m.group("userinfo").partition(":")
    if not password:
        return url
    return f"{m.group('scheme')}{user}:***@{m.group('rest')}"


_QUERY_PASSWORD = re.compile(r"(?i)([?&](?:ssl)?password=)[^&#]*")
# the scheme (its colon and slashes, mistyped or not), the user information up to the last "@", the rest
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)(?::/*|/+)")
_USERINFO = re.compile(rf"(?P<scheme>{_SCHEME.pattern})(?P<userinfo>[^/:@]*:.*)@(?P<rest>[^@]*)\Z", re.S)


def parse_database_url(url: str) -> DatabaseURL:
    """The database ``control.database`` names.

    Raises:
        ConfigError: a URL in none of the forms (the message names them).
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme in ("postgresql", "postgres"):
        if not url[len(scheme):].startswith("://"):
            raise ConfigError("control.database", f"{redact(url)[:80]!r}: write postgresql://USER@HOST:PORT/DB")
        try:
            netloc = urlsplit(url).netloc
        except ValueError:  # ("Invalid IPv6 URL", or a host it cannot take: never its words, they quote the URL)
            raise ConfigError(
                "control.database",
                f"{redact(url)[:80]!r}: not a URL of the form postgresql://USER:PASSWORD@HOST:PORT/DB; a password "
                "with special characters must be percent-encoded ('[' is %5B, ']' %5D, '/' %2F, '@' %40)",
            ) from None
        if netloc.count("@") > 1:
            raise ConfigError(
                "control.database",
                f"{redact(url)[:80]!r}: the user or password holds an '@': percent-encode it (%40; ':' in the "
                "user is %3A, '/' %2F)",
            )
        hostport = netloc.rpartition("@")[2]
        port = hostport.rpartition("]")[2] if hostport.startswith("[") else hostport
        if ":" in port:
            digits = port.rpartition(":")[2]
            if not (digits.isdigit() and 0 < int(digits) < 65536):
                raise ConfigError(
                    "control.database",
                    # SECURITY: not the "port" itself: with an unencoded '/' or '?' in the password, it is a
                    # piece of the password
                    f"{redact(url)[:80]!r}: the port is no port number (1-65535); a password with special "
                    "characters must be percent-encoded (%40 for '@', %2F for '/', %3F for '?', %23 for '#')",
                )
        return DatabaseURL("postgresql", url)
    if scheme == "sqlite":
        rest = url[len("sqlite:"):]
        if rest == MEMORY:
            return DatabaseURL("sqlite", url, MEMORY)
        if not rest.startswith("///") or len(rest) == 3:
            raise ConfigError(
                "control.database",
                f"{redact(url)[:80]!r}: an SQLite URL is sqlite:///RELATIVE/PATH, sqlite:////ABSOLUTE/PATH (four slashes) "
                "or sqlite::memory:",
            )
        return DatabaseURL("sqlite", url, os.path.expanduser(rest[3:]))
    raise ConfigError("control.database", f"expected {FORMS}, got {redact(url)[:80]!r}")


def check_database_url(url: str) -> str | None:
    """What is wrong with ``url`` (``None``: nothing), for the config loader's ``file:line: key: message``."""
    try:
        parse_database_url(url)
    except ConfigError as exc:
        return exc.message
    return None


def _state_home() -> Path:
    base = os.environ.get("XDG_STATE_HOME")
    return Path(base) if base else Path.home() / ".local" / "state"


def default_database(state_file: str | None) -> DatabaseURL:
    """The SQLite file used when ``control.database`` is unset (module docstring)."""
    systemd = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if state_file:
        path = Path(state_file).expanduser().absolute().parent / "deployments.sqlite3"
    elif systemd:
        path = (Path(systemd) / "control.sqlite3").absolute()
    else:
        path = (_state_home() / "llmgw" / "control.sqlite3").absolute()
    return DatabaseURL("sqlite", f"sqlite:///{path}", str(path))
