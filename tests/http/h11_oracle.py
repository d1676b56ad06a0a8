"""llmgw's request reader and h11 (as a server) side by side: what each makes of some bytes.

Used by ``test_h11_differential.py`` and by ``bench/fuzz/fuzz_h11.py`` (the same
comparison at volume). h11 is an independent HTTP/1.1 implementation written
from the RFCs (pure Python, no llhttp), strict by default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import h11

from llmgw.errors import HTTPError


@dataclass
class Outcome:
    """Requests read, then how reading ended: ``None`` (waiting for more, or all
    read), ``"reject"`` (an error), or ``"upgrade"`` (h11: a protocol switch asked for)."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    end: str | None = None
    detail: str = ""

    @property
    def accepted(self) -> bool:
        return self.end is None


def llmgw_read(mod: ModuleType, data: bytes) -> Outcome:
    out = Outcome()

    def on_request(r: Any) -> None:
        out.requests.append({"method": r.method, "target": r.target, "headers": list(r.headers), "body": r.body,
                             "keep_alive": r.keep_alive, "version": r.version})

    reader = mod.RequestReader(on_request)
    try:
        reader.feed(data)
    except HTTPError as exc:
        out.end, out.detail = "reject", f"{exc.status} {exc.message}"
    return out


def h11_read(data: bytes) -> Outcome:
    """h11 as a server: each request answered (200, empty) before the next is read."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(data)
    out = Outcome()
    cur: dict[str, Any] | None = None
    try:
        for _ in range(10_000):  # (bounded: every event consumes input)
            ev = conn.next_event()
            if ev is h11.NEED_DATA or ev is h11.PAUSED:
                if conn.their_state is h11.MIGHT_SWITCH_PROTOCOL:
                    out.end = "upgrade"
                break
            if isinstance(ev, h11.Request):
                cur = {"method": ev.method, "target": ev.target, "headers": list(ev.headers.raw_items()),
                       "body": b"", "version": ev.http_version}
            elif isinstance(ev, h11.Data):
                assert cur is not None
                cur["body"] += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                assert cur is not None
                if conn.their_state is h11.MIGHT_SWITCH_PROTOCOL:
                    out.end = "upgrade"
                    break
                cur["keep_alive"] = conn.their_state is h11.DONE
                out.requests.append(cur)
                cur = None
                if conn.their_state is not h11.DONE:
                    break  # MUST_CLOSE: nothing more is read
                conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
                conn.send(h11.EndOfMessage())
                conn.start_next_cycle()
            else:
                break
    except h11.RemoteProtocolError as exc:
        out.end, out.detail = "reject", str(exc)
    return out


def fields(r: dict[str, Any]) -> tuple[Any, ...]:
    """What both readers must agree on for one request. (h11 reports a Transfer-Encoding
    value in lower case, as it reads it; that is its API, not a difference.)"""
    headers = [(n.lower(), v.lower() if n.lower() == b"transfer-encoding" else v) for n, v in r["headers"]]
    return (r["method"], r["target"], headers, r["body"], r["keep_alive"], r["version"])


# -- the disagreements, explained ---------------------------------------------------------
#
# Each class: a name, a test on the input (and what each side made of it), and the reason.
# The test file holds one asserted example of each; a disagreement the classifier cannot
# name is a failure there and in bench/fuzz/fuzz_h11.py.

_TCHAR = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
_LLHTTP_METHODS = {
    b"DELETE", b"GET", b"HEAD", b"POST", b"PUT", b"CONNECT", b"OPTIONS", b"TRACE", b"COPY", b"LOCK", b"MKCOL",
    b"MOVE", b"PROPFIND", b"PROPPATCH", b"SEARCH", b"UNLOCK", b"BIND", b"REBIND", b"UNBIND", b"ACL", b"REPORT",
    b"MKACTIVITY", b"CHECKOUT", b"MERGE", b"M-SEARCH", b"NOTIFY", b"SUBSCRIBE", b"UNSUBSCRIBE", b"PATCH",
    b"PURGE", b"MKCALENDAR", b"LINK", b"UNLINK", b"SOURCE", b"QUERY",
}


# origin-form, absolute-form, authority-form (CONNECT) and asterisk-form (RFC 9112 §3.2), loosely
_TARGET_FORM = re.compile(rb"/.*|\*|[A-Za-z][A-Za-z0-9+.-]*://.*|[^/\s]+:[0-9]+", re.S)


_LINE = re.compile(rb"\S+ +\S+ +HTTP/\S*")


def _segments(data: bytes) -> list[list[bytes]]:
    """Every head-like part of ``data`` (split at blank lines) as its lines; pipelined
    requests have one each (and body bytes may make more: this only names classes)."""
    return [seg.lstrip(b"\r\n").split(b"\r\n") for seg in data.split(b"\r\n\r\n") if seg.strip(b"\r\n")]


def _values(lines: list[bytes], name: bytes) -> list[bytes]:
    out = []
    for line in lines:
        n, sep, v = line.partition(b":")
        if sep and n.lower() == name:
            out.append(v.strip(b" \t"))
    return out


def classify(data: bytes, ours: Outcome, theirs: Outcome) -> str | None:
    """The name of the explained class this disagreement belongs to, or ``None``."""
    for a, b in zip(ours.requests, theirs.requests, strict=False):
        if fields(a)[:4] != fields(b)[:4]:
            break
        if a["keep_alive"] != b["keep_alive"]:
            # one side keeps the connection and reads on, the other stops: what follows
            # is read by one side only, whatever it holds
            own = [(n.lower(), v.lower()) for n, v in a["headers"]]
            if a["version"] == b"1.0" and any(n == b"connection" and b"keep-alive" in v for n, v in own):
                return "http/1.0-keep-alive"
            if any(n == b"proxy-connection" for n, _ in own):
                return "proxy-connection"
            break
    segs = _segments(data)
    # request lines: the first part's, and later parts' that look like one (not body bytes)
    starts = [segs[0][0].split(b" ")] if segs else []
    starts += [ln.split(b" ") for ln in data.split(b"\r\n")[1:] if _LINE.fullmatch(ln)]
    lines = [ln for seg in segs for ln in seg[1:]]
    if ours.end == "reject" and (theirs.accepted or theirs.end == "upgrade"):
        # llmgw is stricter
        if theirs.end == "upgrade" or _values(lines, b"upgrade") or any(p[0] == b"CONNECT" for p in starts):
            return "upgrade"
        same = [fields(r)[:4] for r in ours.requests] == [fields(r)[:4] for r in theirs.requests]
        if same and theirs.requests and not theirs.requests[-1]["keep_alive"]:
            return "data-after-close"
        if re.search(rb"(?<!\r)\n", data):
            return "bare-lf"
        if any(ln[:1] in (b" ", b"\t") for ln in lines):
            return "obs-fold"
        for seg in segs:
            lengths = _values(seg[1:], b"content-length")
            if len(lengths) > 1 or any(b"," in v for v in lengths):
                return "duplicate-content-length"
            if lengths and _values(seg[1:], b"transfer-encoding"):
                return "content-length-and-transfer-encoding"
        if any(v.lower() != b"100-continue" for v in _values(lines, b"expect")):
            return "expect"
        nxt = theirs.requests[len(ours.requests)] if len(theirs.requests) > len(ours.requests) else None
        if any(p[0] not in _LLHTTP_METHODS for p in starts) or (nxt and nxt["method"] not in _LLHTTP_METHODS):
            return "unknown-method"
        if nxt and not _TARGET_FORM.fullmatch(nxt["target"]):
            return "request-target-form"
        if any(len(p) == 3 and p[2] not in (b"HTTP/1.1", b"HTTP/1.0") for p in starts):
            return "http-version"
        if any(len(p) == 3 and not _TARGET_FORM.fullmatch(p[1]) for p in starts):
            return "request-target-form"
        if any(re.search(rb"[\x01-\x08\x0b-\x1f\x7f]", ln.partition(b":")[2]) for ln in lines):
            return "control-character-in-field-value"
        if any(re.search(rb"[^A-Za-z0-9\-._~%!$&'()*+,;=:\[\]]", v) for v in _values(lines, b"host")):
            return "host-value"
        body = data.partition(b"\r\n\r\n")[2]
        if _values(lines, b"transfer-encoding") and re.search(rb"(?:^|\r\n)[0-9a-fA-F]+[ \t;]", body):
            return "chunk-size-line"
        if any(re.search(rb"(?i)^transfer-encoding:.*chunked *\t", ln) for ln in lines):
            return "tab-after-chunked"
        if _values(lines, b"transfer-encoding") and re.search(
            rb"(?i)\r\n0+(;[^\r]*)?\r\n(.*\r\n)?(transfer-encoding|content-length):", data, re.S
        ):
            return "framing-field-in-trailer"
        if ours.detail.startswith("501"):
            return "transfer-coding"
        if theirs.accepted and h11_read(data + b"\r\n\r\n").end == "reject":
            return "refused-before-the-line-ends"
        return None
    if ours.accepted and theirs.end == "upgrade":
        if not any(b"upgrade" in v.lower() for v in _values(lines, b"connection")):
            return "upgrade-header-alone"
        if ours.requests and not ours.requests[-1]["keep_alive"]:
            return "upgrade"  # (answered on HTTP/1.1, the offer ignored, the connection closed after it)
        return None
    if ours.accepted and theirs.end == "reject":
        # llmgw is looser
        if any(b"HTTP/1.1" in seg[0] and not _values(seg[1:], b"host") for seg in segs):
            return "missing-host"
        if data[:1] in (b"\r", b"\n") or re.search(rb"\r\n\r\n[\r\n]", data):
            return "leading-empty-line"
        between = theirs.detail == "no request line received" or theirs.detail.startswith("illegal request line")
        if between and len(ours.requests) == len(theirs.requests) and data.rstrip(b"\r\n") != data:
            return "leading-empty-line"  # (between two requests: after a body)
        if between and len(ours.requests) == len(theirs.requests):
            # the same between two requests, the next one begun and not whole yet: without that one empty
            # line (CRLF or a bare LF) h11 reads the same requests and waits for the rest
            theirs_fields = [fields(r)[:4] for r in theirs.requests]
            for m in re.finditer(rb"\r?\n", data):
                for start in {m.start(), m.end() - 1}:
                    again = h11_read(data[:start] + data[m.end():])
                    if again.end is None and [fields(r)[:4] for r in again.requests] == theirs_fields:
                        return "leading-empty-line"
        if any(b"  " in seg[0] for seg in segs):
            return "request-line-spaces"
        return None
    if ours.accepted and theirs.accepted and len(ours.requests) == len(theirs.requests):
        for a, b in zip(ours.requests, theirs.requests, strict=True):
            fa, fb = fields(a), fields(b)
            if fa[:4] != fb[:4]:
                return None
            if fa[4] != fb[4]:
                own = [(n.lower(), v.lower()) for n, v in a["headers"]]  # (this request's, not the first's)
                if a["version"] == b"1.0" and any(n == b"connection" and b"keep-alive" in v for n, v in own):
                    return "http/1.0-keep-alive"
                if any(n == b"proxy-connection" for n, _ in own):
                    return "proxy-connection"
                return None
        return None
    return None


EXPLAINED: dict[str, tuple[bytes, str]] = {
    # name: (an input of the class, why llmgw does what it does)
    "upgrade-header-alone": (
        b"POST / HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\nContent-Length: 0\r\n\r\n",
        "RFC 9110 §7.8: a sender of Upgrade must also send the 'upgrade' connection option (Upgrade is "
        "hop-by-hop). Without it llhttp does not take the request for an upgrade, and llmgw answers it as a "
        "plain request (dropping the header, which it never forwards); h11 reports a switch proposal.",
    ),
    "data-after-close": (
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\nGET /more HTTP/1.1\r\n",
        "After a request that closes the connection (RFC 9112 §9.6: the server closes after its answer), "
        "llhttp refuses further bytes (400, after the request is delivered); h11 stops reading them. Either "
        "way the answer is the last thing on the connection.",
    ),
    "refused-before-the-line-ends": (
        b"GET / HTTP/1.1\r\nHost: a\r\nBad Name: x",
        "llhttp refuses a malformed head at the first bad byte (here the space in a field name, RFC 9112 §5.1); "
        "h11 reads a whole line before it judges it, and so is still waiting. Given the line's end, h11 "
        "refuses it too.",
    ),
    "request-target-form": (
        b"GET ?a HTTP/1.1\r\nHost: a\r\n\r\n",
        "RFC 9112 §3.2: a request-target is in origin-form (starting with '/'), absolute-form, "
        "authority-form (CONNECT) or asterisk-form (OPTIONS). llhttp refuses other shapes; h11 takes any run "
        "of visible characters.",
    ),
    "tab-after-chunked": (
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\t\r\n\r\n0\r\n\r\n",
        "A tab is OWS and not part of the value (RFC 9110 §5.6.3), but llhttp takes spaces after 'chunked' and "
        "not a tab, and refuses the request (400); llmgw frames bodies as llhttp does. h11 strips it.",
    ),
    "framing-field-in-trailer": (
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nTransfer-Encoding: chunked\r\n\r\n",
        "RFC 9110 §6.5.1: framing fields (Transfer-Encoding, Content-Length) must not be sent as trailers. "
        "llhttp refuses a message with one (400); h11 reports it among the trailers. (llmgw never reads "
        "trailers.)",
    ),
    "upgrade": (
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
        "RFC 9110 §7.8: a server MAY ignore Upgrade. llmgw speaks HTTP/1.1 only: it reads the request (its "
        "body off its Content-Length) and answers it on HTTP/1.1, closing the connection after it (what "
        "follows would be the other protocol); CONNECT, and an offer with a chunked body, it refuses. h11 "
        "reports the switch asked for and leaves the choice to the server.",
    ),
    "bare-lf": (
        b"GET / HTTP/1.1\nHost: a\n\n",
        "RFC 9112 §2.2: a recipient MAY take a bare LF as a line terminator. llhttp (strict) does not, and so "
        "llmgw does not; h11 does. Stricter by choice: a bare LF is a request-smuggling ingredient when a "
        "proxy in front reads lines differently.",
    ),
    "obs-fold": (
        b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n",
        "RFC 9112 §5.2: a server receiving obs-fold MUST either reject the message (400) or replace each fold "
        "with SP. llmgw rejects; h11 replaces. Both are conformant.",
    ),
    "duplicate-content-length": (
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
        "RFC 9110 §8.6: a recipient MAY accept repeated identical Content-Length values, or reject them "
        "(RFC 9112 §6.3 item 5: an invalid Content-Length is unrecoverable). llhttp rejects any repetition "
        "and so llmgw does; h11 accepts identical ones.",
    ),
    "content-length-and-transfer-encoding": (
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "RFC 9112 §6.3 item 3: such a message is a smuggling attempt that 'ought to be handled as an error'; "
        "a server MAY reject it, or read the chunked body and close. llmgw rejects (400); h11 reads it.",
    ),
    "expect": (
        b"POST / HTTP/1.1\r\nHost: a\r\nExpect: other\r\nContent-Length: 0\r\n\r\n",
        "RFC 9110 §10.1.1: a server that receives an Expect value it does not support MAY answer 417. llmgw "
        "does; h11 leaves Expect to the application.",
    ),
    "unknown-method": (
        b"get / HTTP/1.1\r\nHost: a\r\n\r\n",
        "llhttp knows a fixed list of methods (case-sensitive) and refuses others (400); h11 takes any token. "
        "RFC 9110 §9.1 suggests 501 for an unknown method; llmgw answers every refused head 400.",
    ),
    "http-version": (
        b"GET / HTTP/1.2\r\nHost: a\r\n\r\n",
        "llmgw reads HTTP/1.0 and HTTP/1.1 only (505 otherwise, as llhttp refuses other minors); h11 takes "
        "any HTTP/1.x as 1.1 (RFC 9112 §2.3 lets a server treat a higher minor as the highest it supports).",
    ),
    "host-value": (
        b"GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
        "RFC 9112 §3.2: a server MUST answer 400 to a request whose Host has an invalid value (RFC 3986 "
        "§3.2.2: reg-name, IP-literal, an optional :port). llmgw does; h11 takes any field value.",
    ),
    "control-character-in-field-value": (
        b"GET / HTTP/1.1\r\nHost: a\r\nX: a\x01b\r\n\r\n",
        "RFC 9110 §5.5: a field value is VCHAR, obs-text, SP and HTAB; other controls are invalid. llhttp "
        "(strict) refuses them, and so llmgw does; h11 refuses only CR, LF and NUL.",
    ),
    "chunk-size-line": (
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1 \r\nx\r\n0\r\n\r\n",
        "RFC 9112 §7.1: chunk-size is 1*HEXDIG, chunk extensions follow with BWS only before ';' "
        "(§7.1.1). llhttp (strict) refuses whitespace after the size; h11 tolerates it.",
    ),
    "transfer-coding": (
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        "Both refuse; listed because llmgw answers 501 (RFC 9112 §6.1) where h11's error says the same: only "
        "chunked is supported. (Found by this test: llmgw used to read such a body, de-chunk it, and send it "
        "on still gzip-coded.)",
    ),
    "missing-host": (
        b"GET / HTTP/1.1\r\n\r\n",
        "RFC 9112 §3.2: a server MUST answer 400 to an HTTP/1.1 request without Host. The request reader "
        "(compared here) reads it; the server answers it 400 missing_host and closes "
        "(tests/http/test_server.py), as h11 refuses it.",
    ),
    "leading-empty-line": (
        b"\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
        "RFC 9112 §2.2: a server SHOULD ignore at least one empty line before the request-line (a client's "
        "stray CRLF after a POST body). llmgw (llhttp) does; h11 refuses.",
    ),
    "request-line-spaces": (
        b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n",
        "RFC 9112 §3: the request-line's parts are separated by single SP, but recipients MAY split on "
        "whitespace. llhttp does, so llmgw does; h11 refuses.",
    ),
    "http/1.0-keep-alive": (
        b"GET / HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
        "RFC 9112 §9.3: an HTTP/1.0 connection persists when the client sent the keep-alive option and the "
        "server wishes to honour it. llmgw (llhttp) honours it; h11 never keeps HTTP/1.0 alive.",
    ),
    "proxy-connection": (
        b"GET / HTTP/1.1\r\nHost: a\r\nProxy-Connection: close\r\n\r\n",
        "Proxy-Connection is not standard (RFC 9112 §9.6 mentions only Connection). llhttp reads it like "
        "Connection, so llmgw closes after the answer; h11 ignores it. Closing is the safe side.",
    ),
}
