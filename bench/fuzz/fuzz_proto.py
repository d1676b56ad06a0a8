"""Fuzz target: the protobuf-facing code of the control plane (``llmgw.agent.wire``,
``llmgw.control``).

The first byte picks the input's shape:

* arbitrary bytes parsed as a ``RegisterRequest`` (0) or a ``HeartbeatRequest`` (1);
  bytes protobuf refuses (``DecodeError``) end there;
* a structured ``RegisterRequest`` (2, 3): the rest of the input drives a walk of
  the message's descriptor that sets or leaves out every field (nested messages,
  repeated fields), with edge values for numbers (NaN, infinities, -0.0, the
  ends of each integer range) and arbitrary text.

The message then goes through what the control plane does with one: the
``AgentService`` RPC itself (token check, protocol and node-name checks,
``discovery_from_proto``, the node map; a heartbeat follows a registration), the
management API's views (``node_view``, ``gpu_rows``, serialised with orjson as
``send_json`` does) and the cluster's Prometheus samples. Checks:

* the RPC ends with a response or a gRPC abort, nothing else;
* the wire round trip keeps the model: ``discovery_from_proto(discovery_to_proto(d)) == d``;
* the two renderings of a node's samples agree: ``node_text`` (the fast path, text)
  read by a strict parser of the text format's sample-line grammar holds the same samples as
  ``node_samples``.
"""

from __future__ import annotations

import logging
import math
import re
import struct
from typing import Any

from _harness import Disagreement, main

NAME = "proto"
INSTRUMENT = ["llmgw.agent.wire", "llmgw.control.nodes", "llmgw.control.views", "llmgw.control.collector",
              "llmgw.control.service"]
MAX_LEN = 2048

TOKEN = "fuzz-token"

_m: dict[str, Any] = {}


class _Abort(Exception):
    pass


class _Context:
    """A gRPC servicer context (grpc's, not llmgw's): metadata, peer, abort."""

    def __init__(self) -> None:
        self.md = (("authorization", f"Bearer {TOKEN}"),)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.md

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def abort(self, code: Any, message: str) -> None:
        raise _Abort(code, message)


def setup() -> None:
    logging.disable(logging.CRITICAL)  # the service logs each registration
    import orjson
    from google.protobuf.message import DecodeError
    from prometheus_client.parser import text_string_to_metric_families

    from llmgw.agent import wire
    from llmgw.config import ControlConfig
    from llmgw.control import collector, nodes, service, views

    _m.update(wire=wire, nodes=nodes, views=views, collector=collector, service=service, orjson=orjson,
              DecodeError=DecodeError, parse_text=text_string_to_metric_families,
              control=ControlConfig(listen=("127.0.0.1", 0), join_tokens=(TOKEN,)))


def _run(coro: Any) -> Any:
    """Run an RPC coroutine that never waits (the service's do not, but for abort)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    except _Abort:
        return None
    finally:
        coro.close()
    raise AssertionError("the RPC suspended: it waited on something")


# -- structured messages -------------------------------------------------------------

_DOUBLES = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e308, 5e-324, 0.5, 100.0, 1e19]
_TEXT = ["", "gpu", "a b", "é", "\n", "\r", "\t", "\x00", "a,b", "x=\"y\"}", '"', "\\", "x" * 300, "\u2028", "\U0001f600", "{}", "ok", "unknown"]


class _Source:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out


def _scalar(fd: Any, src: _Source) -> Any:
    t, b = fd.type, src.byte()
    if t == fd.TYPE_STRING:
        if b & 1:
            return _TEXT[(b >> 1) % len(_TEXT)]
        return src.take(b >> 3).decode("utf-8", errors="replace")
    if t == fd.TYPE_BOOL:
        return bool(b & 1)
    if t in (fd.TYPE_DOUBLE, fd.TYPE_FLOAT):
        if b & 1:
            v = _DOUBLES[(b >> 1) % len(_DOUBLES)]
        else:
            v = struct.unpack("<d", src.take(8).ljust(8, b"\0"))[0]
        return v if t == fd.TYPE_DOUBLE or not math.isfinite(v) or abs(v) < 3e38 else math.copysign(3e38, v)
    unsigned = t in (fd.TYPE_UINT32, fd.TYPE_UINT64, fd.TYPE_FIXED32, fd.TYPE_FIXED64)
    bits = 32 if t in (fd.TYPE_UINT32, fd.TYPE_INT32, fd.TYPE_SINT32, fd.TYPE_FIXED32, fd.TYPE_SFIXED32,
                       fd.TYPE_ENUM) else 64
    lo, hi = (0, 2**bits - 1) if unsigned else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    edges = [0, 1, lo, hi, hi - 1, 255, 1000, 2**31, -1]
    v = edges[(b >> 1) % len(edges)] if b & 1 else int.from_bytes(src.take(bits // 8), "little")
    return min(max(v, lo), hi) if lo <= v <= hi or not (b & 1) else 0


def _fill(msg: Any, src: _Source, depth: int) -> None:
    for fd in msg.DESCRIPTOR.fields:
        b = src.byte()
        if b & 3 == 0:
            continue  # left out
        repeated = fd.is_repeated
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            k_fd, v_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            m = getattr(msg, fd.name)
            for _ in range((b >> 2) % 4):  # (a map: entries by key, e.g. RegisterRequest.labels)
                m[_scalar(k_fd, src)] = _scalar(v_fd, src)
        elif fd.message_type is not None:
            if depth >= 3:
                continue
            if repeated:
                for _ in range((b >> 2) % 4):
                    _fill(getattr(msg, fd.name).add(), src, depth + 1)
            else:
                getattr(msg, fd.name).SetInParent()
                _fill(getattr(msg, fd.name), src, depth + 1)
        elif repeated:
            getattr(msg, fd.name).extend(_scalar(fd, src) for _ in range((b >> 2) % 4))
        else:
            v = _scalar(fd, src)
            if fd.type in (fd.TYPE_UINT32, fd.TYPE_UINT64, fd.TYPE_FIXED32, fd.TYPE_FIXED64):
                v = abs(v) % (2**64 if fd.type in (fd.TYPE_UINT64, fd.TYPE_FIXED64) else 2**32)
            setattr(msg, fd.name, v)


# -- the checks ----------------------------------------------------------------------


_LINE = re.compile(r'([a-zA-Z_:][a-zA-Z0-9_:]*)\{((?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*",?)*)\} (\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\[\\"n])*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


def _samples_from_text(text: bytes) -> list[tuple[str, tuple[str, ...], str]]:
    """The sample lines of ``node_text`` read by a strict parser of the text format's grammar written here
    (independent of llmgw's scanner; PERF: prometheus_client's parser took most of this target's time and
    held it at ~600 inputs/s). Anything that is not a whole sample line is a ValueError."""
    out = []
    for line in text.decode().split("\n"):
        if not line:
            continue
        m = _LINE.fullmatch(line)
        if m is None:
            raise ValueError(f"not a sample line: {line[:200]!r}")
        labels = tuple(sorted((k, re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], v))
                              for k, v in _LABEL.findall(m.group(2))))
        out.append((m.group(1), labels, repr(float(m.group(3)))))
    return sorted(out)


def _samples(st: Any, up: bool) -> list[tuple[str, tuple[str, ...], str]]:
    c = _m["collector"]
    out = []
    for idx, labels, value in c.node_samples(st, up):
        fam = c.FAMILIES[idx]
        name = c._SAMPLE_NAMES[idx]
        out.append((name, tuple(sorted(zip(fam.labels, labels, strict=True))), repr(float(value))))
    return sorted(out)


def _check_node(nodes: Any, st: Any) -> None:
    views, collector, orjson = _m["views"], _m["collector"], _m["orjson"]
    orjson.dumps(views.node_view(nodes, st, gpus=True))
    orjson.dumps(views.node_view(nodes, st, gpus=False))
    orjson.dumps(views.gpu_rows(nodes))
    for up in (True, False):
        text = b"".join(collector.node_text(st, up).values())
        try:
            got = _samples_from_text(text)
        except ValueError as exc:
            raise Disagreement(f"node_text is not Prometheus text ({exc}): {text[:400]!r}", "node_text unparsable") from exc
        want = _samples(st, up)
        if got != want:
            missing = sorted(set(want) - set(got))[:3]
            extra = sorted(set(got) - set(want))[:3]
            raise Disagreement(f"node_text != node_samples: missing {missing}, extra {extra}", "node_text samples")


def _round_trip(d: Any) -> None:
    wire = _m["wire"]
    back = wire.discovery_from_proto(wire.discovery_to_proto(d))
    if repr(back) != repr(d):
        raise Disagreement(f"wire round trip changed the model:\n{d!r}\n{back!r}", "wire round trip")


def one_input(data: bytes) -> None:
    wire, svc = _m["wire"], _m["service"]
    pb = wire.pb
    mode = data[0] & 3 if data else 0
    if mode == 0 or mode == 1:
        cls = pb.RegisterRequest if mode == 0 else pb.HeartbeatRequest
        try:
            msg = cls.FromString(data[1:])
        except _m["DecodeError"]:
            return
    else:
        msg = pb.RegisterRequest()
        _fill(msg, _Source(data[1:]), 0)
        if data[0] & 4:
            msg.protocol.major = wire.PROTOCOL[0]  # (half the time, a protocol that is accepted)
        if data[0] & 8:
            msg.node_name = f"node-{len(data)}"  # (and a name that is)
        msg = pb.RegisterRequest.FromString(msg.SerializeToString())  # as received
    nodes = _m["nodes"].NodeMap(lambda: 15.0)
    service = svc.AgentService(nodes, lambda: _m["control"], svc.ControlStats())
    if isinstance(msg, pb.HeartbeatRequest):
        reg = pb.RegisterRequest(node_name=msg.node_name or "n1", protocol=pb.ProtocolVersion(major=wire.PROTOCOL[0]))
        got = _run(service.Register(reg, _Context()))
        if got is not None and data[0] & 4:
            msg.node_id = got.node_id  # (half the time, a node that is registered)
        _run(service.Heartbeat(msg, _Context()))
    else:
        _run(service.Register(msg, _Context()))
    _round_trip(wire.discovery_from_proto(msg.discovery))
    for st in nodes:
        _check_node(nodes, st)
    list(_m["collector"].ClusterCollector(nodes, service.stats).collect())


if __name__ == "__main__":
    import sys

    main(sys.modules[__name__])
