"""Scans of JSON text that build no document (pure twin of ``jsonscan.pyx``).

**The request side: the body's ``model``.** The gateway needs one field of an
OpenAI request body, the top-level ``model``, and must answer 400 to a body that
is not JSON. Building the whole document (messages, tools, images as base64) to
read one string costs more than the rest of the request's handling, so the
compiled twin validates in one pass and builds nothing. The rules are orjson's,
which both twins follow exactly:

* RFC 8259 grammar, whitespace of space, tab, LF and CR only, one value per body;
* UTF-8 only (no byte order mark, no overlong forms, no encoded surrogates);
* escapes ``\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX``, a ``\\uD800``-``\\uDBFF`` escape only
  followed by a ``\\uDC00``-``\\uDFFF`` one, never a lone low surrogate;
* nesting at most :data:`MAX_DEPTH` (1024) arrays and objects deep;
* a number that overflows a double (``1e400``) is refused; large integers are not.

Duplicate keys are allowed and the last one wins, as in every JSON parser.

This twin validates with orjson itself (the reference) and scans for the span
only when asked (:func:`model_span`, used for rewriting the name).

**The prompt's blocks, for the prefix strategy.** :func:`json_route` is
:func:`json_model` plus, read in the same pass, what cache-aware routing needs:

* the *stream*: the raw JSON text of the top-level ``messages`` array (every
  message in order, with its role, content and other fields, as the client wrote
  them); without a ``messages`` array, the raw text of the top-level ``prompt``
  value; at most ``block * max_blocks`` bytes of it;
* its *chain*: the stream cut into ``block``-byte blocks (the last one may be
  short), block ``i`` hashed over the hash of block ``i - 1``, so the hash of block
  ``i`` stands for the whole prefix up to its end (see :func:`_block`);
* its *anchor*: the hash, chained the same way, of the stream up to the end of
  the first message whose role is not ``system`` or ``developer`` (the
  conversation's first user turn, which every later turn repeats: what identifies
  a conversation whose system prompt others share), and how many whole blocks lie
  before that end, with bit 63 set when more messages follow it (a later turn);
  0 and 0 without one (a ``prompt``, or no such message within the bytes hashed);
* the *key* returned: ``[anchor, anchor blocks, link 0, link 1, ...]`` packed as
  native-order unsigned 64-bit integers, 8 bytes each (``b""``: nothing to hash),
  which ``score.Picker.pick_prefix`` reads;
* the *session*: the hash (:func:`key_hash`) of the first string among the
  top-level ``prompt_cache_key``, ``safety_identifier`` and ``user`` members, or 0.

Raw text, not decoded values: a client sends the same conversation the same way
from one turn to the next, and the scan copies bytes rather than decoding them.
Where a key repeats, its last value counts, as for ``model``.

**The answer side: events and usage.** An engine's answer is relayed as it comes
and never parsed: :func:`sse_cut` finds where the last whole server-sent event of
a read ends (the relay sends whole events only), and :func:`usage_counts` reads
the token counts of the last ``"usage"`` object of an answer, or of a stream's
last events, for accounting. Both trust nothing in the bytes and return "none"
rather than raise on text that is not what they look for.
"""

from __future__ import annotations

import re
import struct

import orjson

__all__ = [
    "MAX_DEPTH",
    "ROUTE_MAX_BYTES",
    "JSONScanError",
    "Needle",
    "header_hash",
    "json_model",
    "json_route",
    "key_hash",
    "model_span",
    "sse_cut",
    "usage_counts",
]

MAX_DEPTH = 1024


class JSONScanError(ValueError):
    """The body is not valid JSON; ``pos`` is the byte offset of the problem."""

    def __init__(self, message: str, pos: int) -> None:
        super().__init__(f"{message} at byte {pos}")
        self.pos = pos


_CHAR_POS = re.compile(r"\(char (\d+)\)")


def _load(body: bytes) -> object:
    if type(body) is not bytes:
        raise TypeError(f"body must be bytes, not {type(body).__name__}")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        m = _CHAR_POS.search(str(exc))
        raise JSONScanError(exc.msg, int(m.group(1)) if m else exc.pos) from None


def json_model(body: bytes) -> tuple[bool, str | None]:
    """``(is_object, model)`` of a JSON request body.

    Returns:
        ``is_object``: whether the top-level value is an object; ``model``: its
        ``"model"`` member if that is a string (the last one if repeated), else ``None``.

    Raises:
        JSONScanError: the body is not valid JSON (see the module docstring).
    """
    data = _load(body)
    if not isinstance(data, dict):
        return (False, None)
    model = data.get("model")
    return (True, model if isinstance(model, str) else None)


# Tokens of a valid JSON text: strings, structural characters, and the rest
# (numbers, literals) as runs of other non-space bytes.
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[{}\[\]:,]|[^\s{}\[\]:,"]+')


def model_span(body: bytes) -> tuple[int, int]:
    """``(start, end)`` byte offsets of the top-level ``model`` member's value.

    The last one if repeated; ``(-1, -1)`` if there is none (or the body is not an
    object). ``body[start:end]`` is the value's JSON text (a string keeps its quotes).

    Raises:
        JSONScanError: the body is not valid JSON.
    """
    _load(body)  # valid from here on: the tokens below are well formed
    start = end = -1
    stack: list[int] = []  # open containers, innermost last
    expect_key = False
    model_next = False  # the next value is a top-level "model"
    open_at = -1  # where that value began, while it is being read
    for m in _TOKEN.finditer(body):
        tok = m.group()
        c = tok[0]
        if c == 0x3A:  # :
            continue
        if c == 0x2C:  # ,
            expect_key = stack[-1] == 0x7B
            continue
        if c == 0x7D or c == 0x5D:  # } ]
            stack.pop()
            if open_at >= 0 and len(stack) == 1:
                start, end, open_at = open_at, m.end(), -1
            continue
        if expect_key:  # a member's key
            expect_key = False
            model_next = len(stack) == 1 and orjson.loads(tok) == "model"
            continue
        # a value begins
        if model_next:
            model_next = False
            open_at = m.start()
        if c == 0x7B or c == 0x5B:  # { [
            stack.append(c)
            expect_key = c == 0x7B
        elif open_at >= 0 and len(stack) == 1:
            start, end, open_at = open_at, m.end(), -1
    return (start, end)


# -- the prompt's blocks and the session key --------------------------------------

ROUTE_MAX_BYTES = 65536
_M64 = (1 << 64) - 1
_CHAIN_SEED = 0x243F6A8885A308D3
_KEY_SEED = 0x13198A2E03707344
_SESSION_KEYS = ("prompt_cache_key", "safety_identifier", "user")


_K1 = 0xA0761D6478BD642F
_K2 = 0xE7037ED1A0B428DB


def _mum(a: int, b: int) -> int:
    r = a * b
    return (r ^ (r >> 64)) & _M64


def _block(h: int, data: bytes) -> int:
    """One link of the chain: ``data`` (a block) hashed over ``h`` (the previous link).

    After ``h ^= len * 0x9E3779B97F4A7C15``, each 16 bytes (the last zero-padded) as two
    little-endian words ``a, b`` go ``h = mum(a ^ h ^ K1, b ^ K2)``, where ``mum`` folds
    the 128-bit product into 64 bits (low ^ high, as wyhash); then SplitMix64's
    finalizer; 0 becomes 1 (0 marks an empty table slot). Fast, not
    collision-resistant against an adversary: it only steers where a request goes.
    """
    n = len(data)
    h = (h ^ (n * 0x9E3779B97F4A7C15)) & _M64
    for i in range(0, n, 16):
        a = int.from_bytes(data[i : i + 8], "little")
        b = int.from_bytes(data[i + 8 : i + 16], "little")
        h = _mum(a ^ h ^ _K1, b ^ _K2)
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _M64
    h ^= h >> 31
    return h or 1


def chain_hashes(stream: bytes, block: int) -> list[int]:
    """The chain of ``stream`` cut in ``block``-byte blocks (the spec of the packed chain)."""
    out = []
    h = _CHAIN_SEED
    for k in range(0, len(stream), block):
        h = _block(h, stream[k : k + block])
        out.append(h)
    return out


def key_hash(data: bytes) -> int:
    """The session hash of ``data`` (a session header's value, or a body key's raw text); never 0."""
    if type(data) is not bytes:
        raise TypeError(f"data must be bytes, not {type(data).__name__}")
    return _block(_KEY_SEED, data)


def json_route(body: bytes, block: int, max_blocks: int) -> tuple[bool, str | None, bytes, int]:
    """``(is_object, model, chain, session)`` of a JSON request body (see the module docstring).

    Raises:
        JSONScanError: the body is not valid JSON.
        ValueError: ``block`` is not a positive multiple of 8, or ``block * max_blocks``
            exceeds :data:`ROUTE_MAX_BYTES`.
    """
    if block < 8 or block % 8 or max_blocks < 1 or block * max_blocks > ROUTE_MAX_BYTES:
        raise ValueError("block must be a positive multiple of 8 and block * max_blocks at most 65536")
    data = _load(body)
    if not isinstance(data, dict):
        return (False, None, b"", 0)
    model = data.get("model")
    spans, ends = _top_spans(body)
    cap = block * max_blocks
    stream = b""
    anchor = -1
    later = False
    if isinstance(data.get("messages"), list):
        a, b = spans["messages"]
        stream = body[a:b][:cap]
        for j, (m, end) in enumerate(zip(data["messages"], ends, strict=True)):
            if not (isinstance(m, dict) and m.get("role") in ("system", "developer")):
                anchor = end - a if end - a <= cap else -1
                later = j < len(ends) - 1
                break
    elif "prompt" in data:
        a, b = spans["prompt"]
        stream = body[a:b][:cap]
    chain = chain_hashes(stream, block)
    key: list[int] = []
    if chain:
        ah = 0
        if anchor >= 0:
            whole = anchor // block
            prev = chain[whole - 1] if whole else _CHAIN_SEED
            ah = _block(prev, stream[whole * block : anchor]) if anchor % block else prev
        key = [ah, (anchor // block | (1 << 63 if later else 0)) if ah else 0, *chain]
    session = 0
    for name in _SESSION_KEYS:
        if isinstance(data.get(name), str):
            a, b = spans[name]
            session = _block(_KEY_SEED, body[a + 1 : b - 1])
            break
    return (True, model if isinstance(model, str) else None, struct.pack(f"={len(key)}Q", *key), session)


def _top_spans(body: bytes) -> tuple[dict[str, tuple[int, int]], list[int]]:
    """Spans of the last value of each top-level key, and where each element of the
    last top-level ``messages`` array ends (a valid body that is an object)."""
    spans: dict[str, tuple[int, int]] = {}
    ends: list[int] = []
    stack: list[int] = []
    expect_key = False
    key: str | None = None  # the top-level key whose value is next
    open_key: str | None = None  # ... whose value is being read
    open_at = -1

    def ended(end: int) -> None:
        nonlocal open_key
        if len(stack) == 1 and open_key is not None:
            spans[open_key] = (open_at, end)
            open_key = None
        elif len(stack) == 2 and open_key == "messages" and stack[1] == 0x5B:
            ends.append(end)

    for m in _TOKEN.finditer(body):
        tok = m.group()
        c = tok[0]
        if c == 0x3A:  # :
            continue
        if c == 0x2C:  # ,
            expect_key = stack[-1] == 0x7B
            continue
        if c == 0x7D or c == 0x5D:  # } ]
            stack.pop()
            ended(m.end())
            continue
        if expect_key:
            expect_key = False
            key = orjson.loads(tok) if len(stack) == 1 else None
            continue
        if len(stack) == 1 and key is not None:  # a top-level value begins
            open_key, open_at, key = key, m.start(), None
            if open_key == "messages":
                ends = []
        if c == 0x7B or c == 0x5B:  # { [
            stack.append(c)
            expect_key = c == 0x7B
        else:
            ended(m.end())
    return spans, ends


def header_hash(lines: bytes, name: bytes) -> int:
    """The session hash (:func:`key_hash`) of header ``name``'s value in ``lines``, the
    ``Name: value\r\n`` lines a request forwards (``Request.forward``); ``name`` is
    lower-case; the first such line counts; 0: absent or empty."""
    for line in lines.split(b"\n"):
        head, sep, value = line.partition(b":")
        if sep and head.lower() == name:
            value = value.strip(b" \t\r")
            return key_hash(value) if value else 0
    return 0


# -- the answer side ------------------------------------------------------------


def sse_cut(data: bytes) -> int:
    """Where the last complete server-sent event in ``data`` ends (0: none yet).

    An event ends at a blank line: ``\n\n``, or ``\n\r\n`` when the engine uses CRLF
    line endings. ``data[:cut]`` is whole events; ``data[cut:]`` the start of the next.
    """
    lf = data.rfind(b"\n\n")
    crlf = data.rfind(b"\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)


class Needle:
    """One fixed byte string (a replica's key) looked for in many texts: the data path asks whether
    the key an engine holds is in what it streams (a chunk, an event), chunk after chunk.

    Args:
        needle: the bytes looked for (not empty).

    Raises:
        ValueError: an empty needle.
    """

    __slots__ = ("needle",)

    def __init__(self, needle: bytes) -> None:
        if not needle:
            raise ValueError("an empty needle")
        self.needle = needle

    def within(self, data: bytes, start: int, end: int) -> bool:
        """Whether the needle is in ``data[start:end]`` (bounds clamped as slicing does)."""
        return data.find(self.needle, max(0, start), max(0, end)) >= 0


_USAGE_KEY = b'"usage"'
_USAGE_WINDOW = 1024


def _int_value(data: bytes, key: bytes, start: int, end: int) -> int | None:
    i = data.find(key, start, end)
    if i < 0:
        return None
    i += len(key)
    while i < end and data[i] in b" \t\r\n":
        i += 1
    if i >= end or data[i] != 58:  # ':'
        return None
    i += 1
    while i < end and data[i] in b" \t\r\n":
        i += 1
    j = i
    while j < end and j - i < 18 and 48 <= data[j] <= 57:
        j += 1
    if j == i:
        return None
    return int(data[i:j])


def usage_counts(data: bytes) -> tuple[int, int] | None:
    """``(prompt_tokens, completion_tokens)`` of the last ``"usage"`` object in ``data``.

    A JSON answer (or SSE event) reports its token usage in a small object near
    its end. This finds the last ``"usage"`` key and reads the two integers
    within the next 1024 bytes, without parsing the JSON; ``None`` when there are
    none (``"usage": null`` included). Keys inside ``*_details`` objects do not
    match (the closing quote is part of the key).

    The shapes read: chat and completions (``prompt_tokens``, ``completion_tokens``);
    ``/v1/responses`` (``input_tokens``, ``output_tokens``; its stream's usage is in
    the ``response.completed`` event's ``response``); embeddings (``prompt_tokens``
    and ``total_tokens``, no completion: ``total_tokens - prompt_tokens``, 0).
    """
    at = data.rfind(_USAGE_KEY)
    if at < 0:
        return None
    end = min(len(data), at + _USAGE_WINDOW)
    prompt = _int_value(data, b'"prompt_tokens"', at, end)
    if prompt is None:
        prompt = _int_value(data, b'"input_tokens"', at, end)
        if prompt is None:
            return None
    completion = _int_value(data, b'"completion_tokens"', at, end)
    if completion is None:
        completion = _int_value(data, b'"output_tokens"', at, end)
        if completion is None:
            total = _int_value(data, b'"total_tokens"', at, end)
            if total is None or total < prompt:
                return None
            completion = total - prompt
    return prompt, completion
