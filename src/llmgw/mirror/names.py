"""Model names in the mirror: ``NAME[:TAG]``.

A name is one to three ``/``-separated parts of letters, digits, ``.``, ``_`` and
``-`` (``qwen2.5``, ``bartowski/Qwen2.5-7B-GGUF``); a tag is one such part
(``latest``, ``Q4_K_M``). Names are catalogue keys, never paths, but they are kept
to this alphabet anyway so they print, sort and type well. Matching ignores case.
"""

from __future__ import annotations

import re
from pathlib import PurePath

from .errors import InvalidNameError

__all__ = ["DEFAULT_TAG", "format_ref", "name_from_filename", "parse_ref"]

DEFAULT_TAG = "latest"
MAX_PART = 80
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")


# (every refusal ends with what to write instead)
_FIX = "; write NAME[:TAG] like qwen2.5:7b or team/model:q4"


def _check_part(part: str, what: str, ref: str) -> None:
    if not part:
        raise InvalidNameError(f"model name {ref!r} has an empty {what}{_FIX}")
    if len(part) > MAX_PART:
        raise InvalidNameError(
            f"model name {ref!r}: the {what} is longer than {MAX_PART} characters; shorten it{_FIX}"
        )
    if not _PART.fullmatch(part):
        raise InvalidNameError(
            f"model name {ref!r}: the {what} {part!r} may only hold letters, digits, '.', '_' and '-'"
            f" and must start with a letter, digit or '_'{_FIX}"
        )


def parse_ref(ref: str, *, default_tag: str = DEFAULT_TAG) -> tuple[str, str]:
    """Split ``NAME[:TAG]`` into a checked name and tag.

    Args:
        ref: what the user typed.
        default_tag: the tag when none is given.

    Returns:
        ``(name, tag)``.

    Raises:
        InvalidNameError: the name or tag is malformed.
    """
    name, sep, tag = ref.rpartition(":")
    if not sep or "/" in tag:
        name, tag = ref, default_tag
    parts = name.split("/")
    if len(parts) > 3:
        raise InvalidNameError(f"model name {ref!r} has more than three '/'-separated parts{_FIX}")
    for part in parts:
        _check_part(part, "name part", ref)
    _check_part(tag, "tag", ref)
    return name, tag


def format_ref(name: str, tag: str) -> str:
    """Return ``name:tag``."""
    return f"{name}:{tag}"


def name_from_filename(path: str | PurePath) -> str:
    """Derive a model name from a file name: the stem, with other characters made ``-``.

    ``Qwen2.5-0.5B-Instruct-Q4_K_M.gguf`` becomes ``Qwen2.5-0.5B-Instruct-Q4_K_M``.

    Raises:
        InvalidNameError: nothing of the name is left (``模型.gguf``, ``....gguf``): every such file
            would get one made-up name, the second refused as taken with no word of where it came from.
    """
    file = PurePath(path).name
    stem = file[: -len(".gguf")] if file.lower().endswith(".gguf") else file
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).lstrip(".-")[:MAX_PART].rstrip(".-")
    if not re.search(r"[A-Za-z0-9]", cleaned):
        raise InvalidNameError(
            f"cannot name a model after the file name {file!r}: a model name takes ASCII letters, digits, '.', "
            "'_' and '-'; give it one with --name NAME[:TAG]"
        )
    return cleaned
