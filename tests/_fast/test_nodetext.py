"""nodetext: a node's cluster readings as Prometheus text from the heartbeat's wire bytes, both twins.

The reference is a renderer over the message as the protobuf runtime (upb) parses it, walking
``ListFields`` (what the collector did before nodetext): every output of both twins must equal it,
on hand-made readings of every kind, on random ones, on messages whose fields came out of order or
twice, and on corrupted bytes (where upb refuses a message, both twins raise the same plain ValueError).
"""

from __future__ import annotations

import math
import random
import struct
from types import ModuleType

import pytest
from google.protobuf.message import DecodeError

from llmgw._fast.nodetext_py import FABRIC_STATES, HEALTH_STATES, SLOTS
from llmgw._proto.agent.v1 import agent_pb2 as pb

COUNTERS = {"llmgw_node_ib_port_receive_bytes", "llmgw_node_ib_port_transmit_bytes", "llmgw_gpu_energy_joules",
            "llmgw_gpu_ecc_errors", "llmgw_gpu_xid_errors"}
OPENS = tuple(f"{n}_total{{".encode() if n in COUNTERS else f"{n}{{".encode() for n in SLOTS)
S = {n: i for i, n in enumerate(SLOTS)}


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if v - v == 0:
        return repr(v)
    return "NaN" if v != v else ("+Inf" if v > 0 else "-Inf")


_INTS = {"memory_total_bytes": "llmgw_gpu_memory_total_bytes", "memory_used_bytes": "llmgw_gpu_memory_used_bytes",
         "memory_free_bytes": "llmgw_gpu_memory_free_bytes", "nvlink_links_active": "llmgw_gpu_nvlink_active_links"}
_FLOATS = {"utilization_gpu_ratio": "llmgw_gpu_utilization_ratio",
           "utilization_memory_ratio": "llmgw_gpu_memory_bandwidth_utilization_ratio",
           "temperature_celsius": "llmgw_gpu_temperature_celsius", "power_watts": "llmgw_gpu_power_watts",
           "power_limit_watts": "llmgw_gpu_power_limit_watts", "energy_joules": "llmgw_gpu_energy_joules",
           "sm_clock_mhz": "llmgw_gpu_sm_clock_hertz"}
_LABELLED = {"ecc_corrected_volatile": ("llmgw_gpu_ecc_errors", ',error_type="corrected"} '),
             "ecc_uncorrected_volatile": ("llmgw_gpu_ecc_errors", ',error_type="uncorrected"} '),
             "remapped_rows_correctable": ("llmgw_gpu_remapped_rows", ',kind="correctable"} '),
             "remapped_rows_uncorrectable": ("llmgw_gpu_remapped_rows", ',kind="uncorrectable"} ')}
_FLAGS = {"remapped_rows_pending": "llmgw_gpu_row_remap_pending", "remapped_rows_failure": "llmgw_gpu_row_remap_failure",
          "mig_mode": "llmgw_gpu_mig_mode"}


def reference(msg: pb.Discovery, node: str) -> tuple[bytes, ...]:
    """The lines of the parsed message, walking ``ListFields`` (the collector's renderer before nodetext)."""
    op = [o.decode() for o in OPENS]
    parts: list[list[str]] = [[] for _ in SLOTS]
    n = _esc(node)
    nl = f'node="{n}"}} '
    f = msg.facts
    for fd, v in f.ListFields():
        name = {"cpu_cores": "llmgw_node_cpu_cores", "memory_total_bytes": "llmgw_node_memory_total_bytes",
                "memory_available_bytes": "llmgw_node_memory_available_bytes"}.get(fd.name)
        if name:
            parts[S[name]].append(f"{op[S[name]]}{nl}{v}\n")
    i = S["llmgw_node_discovery_errors"]
    parts[i].append(f"{op[i]}{nl}{len(msg.errors)}\n")
    rcv, xmit = S["llmgw_node_ib_port_receive_bytes"], S["llmgw_node_ib_port_transmit_bytes"]
    for p in f.infiniband:
        pl = f'node="{n}",device="{_esc(p.device)}",port="{p.port}"}} '
        if p.HasField("rcv_bytes"):
            parts[rcv].append(f"{op[rcv]}{pl}{p.rcv_bytes}\n")
        if p.HasField("xmit_bytes"):
            parts[xmit].append(f"{op[xmit]}{pl}{p.xmit_bytes}\n")
    for g in msg.gpus:
        gp = f'node="{n}",gpu_uuid="{_esc(g.uuid)}",gpu_index="{g.index if g.HasField("index") else ""}"'
        gl = gp + "} "
        i = S["llmgw_gpu_info"]
        parts[i].append(f'{op[i]}{gp},gpu_model="{_esc(g.name)}",pci_bus_id="{_esc(g.pci_bus_id)}",'
                        f'parent_gpu_uuid="{_esc(g.parent_uuid)}"}} 1.0\n')
        for fd, v in g.ListFields():
            k = fd.name
            if k in _INTS:
                i = S[_INTS[k]]
                parts[i].append(f"{op[i]}{gl}{v}\n")
            elif k in _FLOATS:
                i = S[_FLOATS[k]]
                parts[i].append(f"{op[i]}{gl}{_num(v * (1e6 if k == 'sm_clock_mhz' else 1.0))}\n")
            elif k in _LABELLED:
                fam, extra = _LABELLED[k]
                parts[S[fam]].append(f"{op[S[fam]]}{gp}{extra}{v}\n")
            elif k in _FLAGS:
                i = S[_FLAGS[k]]
                parts[i].append(f"{op[i]}{gl}{'1.0' if v else '0.0'}\n")
            elif k == "xid_errors":
                i = S["llmgw_gpu_xid_errors"]
                for x in v:
                    parts[i].append(f'{op[i]}{gp},xid="{x.xid}"}} {x.count}\n')
            elif k == "fabric_state":
                i = S["llmgw_gpu_fabric_state"]
                for s in dict.fromkeys([*FABRIC_STATES, v]):
                    parts[i].append(f'{op[i]}{gp},state="{_esc(s)}"}} {"1.0" if s == v else "0.0"}\n')
        h = g.health or "unknown"
        state = HEALTH_STATES.get(h, h)
        i = S["llmgw_gpu_health_state"]
        for s in dict.fromkeys([*HEALTH_STATES.values(), state]):
            parts[i].append(f'{op[i]}{gp},state="{_esc(s)}"}} {"1.0" if s == state else "0.0"}\n')
    return tuple("".join(v).encode() for v in parts)


ODD = 'odd "name" \\ with\nnewline é'


def every_kind() -> pb.Discovery:
    m = pb.Discovery(source="nvml", errors=["partial", "second"])
    m.facts.hostname = "h"
    m.facts.cpu_cores = 64
    m.facts.memory_total_bytes = 2**64 - 1
    m.facts.driver_version = "550.1"
    m.facts.infiniband.add(device="mlx5_0", port=1, rcv_bytes=4)
    m.facts.infiniband.add(device=ODD, port=2**32 - 1, rcv_bytes=0, xmit_bytes=7, rate_gbps=400.0, state="ACTIVE")
    a = m.gpus.add(uuid="GPU-a", index=0, name="NVIDIA A100", mig_mode=True, memory_total_bytes=80, health="degraded",
                   remapped_rows_correctable=3, remapped_rows_pending=False, fabric_state="in_progress",
                   ecc_uncorrected_volatile=0, ecc_corrected_volatile=5, errors=["nvmlDeviceGetX: Unknown"])
    a.xid_errors.add(xid=79, count=2)
    a.xid_errors.add(xid=48, count=1)
    m.gpus.add(uuid="MIG-b", index=1, parent_uuid="GPU-a", memory_used_bytes=5, sm_clock_mhz=1410.0,
               health="some-new-word", fabric_state="a-new-state", remapped_rows_failure=True,
               remapped_rows_uncorrectable=2)
    m.gpus.add(uuid="GPU-c", health="error", utilization_gpu_ratio=math.nan, temperature_celsius=math.inf,
               power_watts=-math.inf, power_limit_watts=-0.0, energy_joules=1e300, utilization_memory_ratio=5e-324,
               nvlink_links_active=0, name=ODD, pci_bus_id='"q"')
    m.gpus.add()  # nothing set at all: its info and health (unknown) only
    m.gpus.add(uuid=ODD, health=ODD, fabric_state=ODD)
    return m


def test_every_kind_of_reading_renders_as_the_reference(nodetext: ModuleType) -> None:
    m = every_kind()
    got = nodetext.render(m.SerializeToString(), ODD, OPENS)
    assert got == reference(m, ODD)
    text = b"".join(got).decode()
    assert 'llmgw_gpu_xid_errors_total{node="odd \\"name\\" \\\\ with\\nnewline é",gpu_uuid="GPU-a"' in text
    assert 'gpu_uuid="MIG-b",gpu_index="1",state="some-new-word"} 1.0' in text
    assert 'gpu_uuid="GPU-c",gpu_index=""} NaN\n' in text and "} +Inf\n" in text and "} -Inf\n" in text
    assert 'llmgw_gpu_sm_clock_hertz{node="odd \\"name\\" \\\\ with\\nnewline é",gpu_uuid="MIG-b",gpu_index="1"} ' \
           '1410000000.0\n' in text
    assert 'gpu_uuid="",gpu_index="",state="unknown"} 1.0' in text
    # absent is not zero: what was not set has no line
    assert got[S["llmgw_node_memory_available_bytes"]] == b""
    assert text.count("llmgw_gpu_utilization_ratio{") == 1
    assert text.count("llmgw_node_ib_port_transmit_bytes_total{") == 1


def test_an_empty_message_has_its_error_count_only(nodetext: ModuleType) -> None:
    got = nodetext.render(b"", "n", OPENS)
    assert got == reference(pb.Discovery(), "n")
    assert [i for i, v in enumerate(got) if v] == [S["llmgw_node_discovery_errors"]]
    assert got[S["llmgw_node_discovery_errors"]] == b'llmgw_node_discovery_errors{node="n"} 0\n'


def random_discovery(rng: random.Random) -> pb.Discovery:
    def maybe(p: float = 0.5) -> bool:
        return rng.random() < p

    def word() -> str:
        return rng.choice(["", "ok", "degraded", "error", "x", ODD, "completed", "not_started", "ß\\\"", "GPU-1"])

    def dbl() -> float:
        return rng.choice([rng.random(), rng.uniform(-1e6, 1e6), 0.0, -0.0, 1e-310, math.inf, -math.inf, math.nan,
                           float(rng.randint(0, 1000)), 1.0 / 3.0])

    m = pb.Discovery()
    if maybe():
        m.source = word()
    m.errors.extend(word() for _ in range(rng.randint(0, 3)))
    f = m.facts
    if maybe(0.9):
        f.hostname = word()
    for name, top in (("cpu_cores", 2**32 - 1), ("memory_total_bytes", 2**64 - 1), ("memory_available_bytes", 2**40)):
        if maybe():
            setattr(f, name, rng.choice([0, 1, top, rng.randint(0, top)]))
    for name in ("os", "kernel", "cpu_model", "agent_version", "driver_version", "cuda_driver_version"):
        if maybe(0.3):
            setattr(f, name, word())
    for _ in range(rng.randint(0, 3)):
        p = f.infiniband.add(device=word(), port=rng.randint(0, 2**32 - 1))
        for name in ("rcv_bytes", "xmit_bytes", "link_downed", "symbol_errors"):
            if maybe():
                setattr(p, name, rng.randint(0, 2**64 - 1))
        if maybe(0.3):
            p.rate_gbps = dbl()
    for _ in range(rng.randint(0, 9)):
        g = m.gpus.add()
        for name in ("uuid", "name", "pci_bus_id", "parent_uuid", "fabric_state", "health"):
            if maybe():
                setattr(g, name, word())
        if maybe(0.8):
            g.index = rng.randint(0, 2**32 - 1)
        for name in ("memory_total_bytes", "memory_used_bytes", "memory_free_bytes", "ecc_corrected_volatile",
                     "ecc_uncorrected_volatile", "remapped_rows_correctable", "remapped_rows_uncorrectable"):
            if maybe():
                setattr(g, name, rng.randint(0, 2**64 - 1))
        for name in ("utilization_gpu_ratio", "utilization_memory_ratio", "temperature_celsius", "power_watts",
                     "power_limit_watts", "energy_joules", "sm_clock_mhz"):
            if maybe():
                setattr(g, name, dbl())
        for name in ("remapped_rows_pending", "remapped_rows_failure", "mig_mode", "fabric_healthy"):
            if maybe():
                setattr(g, name, maybe())
        for name in ("nvlink_links_active", "nvlink_links_total"):
            if maybe():
                setattr(g, name, rng.randint(0, 2**32 - 1))
        for _ in range(rng.randint(0, 3)):
            g.xid_errors.add(xid=rng.randint(0, 2**32 - 1), count=rng.randint(0, 2**64 - 1))
        g.errors.extend(word() for _ in range(rng.randint(0, 2)))
    return m


def test_random_readings_render_as_the_reference(nodetext: ModuleType) -> None:
    rng = random.Random(17)
    for _ in range(300):
        m = random_discovery(rng)
        node = rng.choice(["n", ODD, "node-0001"])
        assert nodetext.render(m.SerializeToString(), node, OPENS) == reference(m, node)


def test_render_message_is_render_of_its_serialization(nodetext: ModuleType) -> None:
    rng = random.Random(29)
    msgs = [every_kind(), pb.Discovery(), *(random_discovery(rng) for _ in range(200))]
    for m in msgs:
        assert nodetext.render_message(m, ODD, OPENS) == nodetext.render(m.SerializeToString(), ODD, OPENS)
    with pytest.raises(ValueError, match="prefixes"):
        nodetext.render_message(pb.Discovery(), "n", OPENS[1:])


def _tag(num: int, wt: int) -> bytes:
    return _varint(num << 3 | wt)


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len(num: int, body: bytes) -> bytes:
    return _tag(num, 2) + _varint(len(body)) + body


def test_fields_out_of_order_twice_or_unknown_read_as_the_runtime_reads_them(nodetext: ModuleType) -> None:
    rng = random.Random(5)
    for _ in range(100):
        a, b = random_discovery(rng), random_discovery(rng)
        data = a.SerializeToString() + b.SerializeToString()  # concatenated messages merge (facts too)
        assert nodetext.render(data, "n", OPENS) == reference(pb.Discovery.FromString(data), "n")
    gpu = pb.Gpu(uuid="GPU-z", index=3, memory_used_bytes=9, health="ok")
    fields = [_tag(7, 0) + _varint(9), _len(28, b"ok"), _tag(2, 0) + _varint(3), _len(1, b"GPU-z")]
    unknown = [
        _tag(99, 0) + _varint(1), _tag(98, 5) + b"\0\0\0\0", _tag(97, 1) + b"\0" * 8, _len(96, b"\xff\xfe"),
        _tag(95, 3) + _tag(1, 0) + _varint(4) + _tag(94, 3) + _tag(94, 4) + _tag(95, 4),  # nested groups
        _len(7, b"x"),  # a known field on another wire type: skipped, as the runtime does (unknown)
        _tag(28, 0) + _varint(1),
    ]
    for _ in range(50):
        parts = fields + unknown
        rng.shuffle(parts)
        body = b"".join(parts)
        parsed = pb.Discovery.FromString(_len(2, body))
        assert [g.ListFields() for g in parsed.gpus] == [gpu.ListFields()]  # (the unknown ones kept aside)
        assert nodetext.render(_len(2, body), "n", OPENS) == reference(parsed, "n")
    # a scalar seen twice: the last one
    body = _tag(7, 0) + _varint(1) + _tag(7, 0) + _varint(2) + _len(1, b"g")
    assert nodetext.render(_len(2, body), "n", OPENS) == reference(pb.Discovery.FromString(_len(2, body)), "n")
    # a uint32 sent wider than 32 bits is read modulo 2**32, as the runtime reads it
    body = _tag(2, 0) + _varint(2**40 + 5) + _tag(24, 0) + _varint(2**33 + 1)
    assert nodetext.render(_len(2, body), "n", OPENS) == reference(pb.Discovery.FromString(_len(2, body)), "n")
    assert b'gpu_index="5"' in nodetext.render(_len(2, body), "n", OPENS)[S["llmgw_gpu_info"]]


BAD = (ValueError, "not a Discovery message")
"""What both twins raise for any malformed message: the same type (not a subclass such as
UnicodeDecodeError) and text, whichever fault each meets first."""


def _outcome(mod: ModuleType, data: bytes) -> object:
    try:
        return mod.render(data, "n", OPENS)
    except ValueError as exc:
        return type(exc), str(exc)


def test_corrupted_bytes_raise_where_the_runtime_refuses_them(nodetext: ModuleType) -> None:
    rng = random.Random(23)
    seeds = [every_kind().SerializeToString()] + [random_discovery(rng).SerializeToString() for _ in range(20)]
    refused = 0
    for i in range(3000):
        data = bytearray(rng.choice(seeds))
        if not data:
            continue
        how = i % 4
        if how == 0:
            del data[rng.randrange(len(data)):]  # truncated
        elif how == 1:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == 2:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        else:
            at = rng.randrange(len(data))
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        raw = bytes(data)
        try:
            want: object = reference(pb.Discovery.FromString(raw), "n")
        except DecodeError:
            want = BAD
            refused += 1
        assert _outcome(nodetext, raw) == want, raw.hex()
    assert refused > 300  # the corruptions did reach the error paths


@pytest.mark.parametrize("data", [
    b"\x08",  # a tag with its varint missing
    b"\x12\x05ab",  # a length past the end
    b"\x00\x01",  # field 0
    b"\x0f",  # wire type 7
    b"\x0c",  # an end-group with no group open
    b"\x1b\x08\x01",  # an unterminated group
    b"\x1a\x02\xc3\x28",  # source: invalid UTF-8
    b"\x12\x04\x0a\x02\xed\xa0",  # a GPU's uuid: a surrogate
    _tag(1, 0) + b"\xff" * 10 + b"\x01",  # a varint of 11 bytes
])
def test_malformed_messages_raise_value_error(nodetext: ModuleType, data: bytes) -> None:
    with pytest.raises(DecodeError):
        pb.Discovery.FromString(data)
    assert _outcome(nodetext, data) == BAD


def test_arguments_are_checked(nodetext: ModuleType) -> None:
    with pytest.raises(ValueError, match="prefixes"):
        nodetext.render(b"", "n", OPENS[:-1])
    with pytest.raises(TypeError):
        nodetext.render(bytearray(b""), "n", OPENS)
    with pytest.raises(TypeError):
        nodetext.render(b"", b"n", OPENS)
    with pytest.raises(TypeError):
        nodetext.render(b"", "n", list(OPENS))


def test_doubles_are_written_as_repr(nodetext: ModuleType) -> None:
    rng = random.Random(3)
    edges = [0.0, -0.0, 1.0, -3.0, 57.0, 700.0, 1980e6, 1e15, 9999999999999998.0, 1e16, -1e16, 2.0**53, 2.0**63,
             2.0**64, 1e300, 0.26, 491.1, 1e-7, 0.0001, 5e-324, 1.7976931348623157e308]
    doubles = [*edges, *(float(rng.randint(-10**17, 10**17)) for _ in range(300)),
               *(rng.randint(0, 10**6) / 10 ** rng.randint(0, 4) for _ in range(300)),
               *(round(rng.uniform(-1e6, 1e6), rng.randint(0, 12)) for _ in range(3000)),
               *(rng.randint(1, 10**15) / 10 ** rng.randint(1, 19) for _ in range(3000)),
               *(math.nextafter(x, math.inf) for x in (0.1, 0.26, 1e-4, 491.1, 123456789.123)),
               *(math.nextafter(x, -math.inf) for x in (0.1, 0.26, 1e-4, 491.1, 123456789.123)),
               *(struct.unpack("<d", rng.randbytes(8))[0] for _ in range(500))]
    for v in doubles:
        g = pb.Gpu(uuid="u", power_watts=v)
        data = pb.Discovery(gpus=[g]).SerializeToString()
        line = nodetext.render(data, "n", OPENS)[S["llmgw_gpu_power_watts"]]
        assert line.rsplit(b" ", 1)[1] == (_num(v) + "\n").encode()


@pytest.mark.parametrize("hex_data", [
    # (found by fuzzing: each twin met another fault first, invalid UTF-8 before a bad length or after it)
    "0a330a016828b6a791c30430e3e8bfd399b4a8ec285a080a066122625c41f24458630a5a140a066d6c78355f301005288de7c5e8e7f7"
    "d8f74b12420a054750552d314939d6c56d544b8a406958610ec3c3e9fcc371f44e05dc9321814079010000000000",
    "0a200a016828c2f4b3db0330bcf2c4e192f0f28b8c015a0a0a066122625c630a10d11a04af766d6c",
])
@pytest.mark.c_extension
def test_a_message_with_two_faults_raises_the_same_error_in_both_twins(hex_data: str) -> None:
    import importlib

    compiled = importlib.import_module("llmgw._fast.nodetext")
    nodetext_py = importlib.import_module("llmgw._fast.nodetext_py")
    data = bytes.fromhex(hex_data)
    assert _outcome(compiled, data) == _outcome(nodetext_py, data) == BAD
