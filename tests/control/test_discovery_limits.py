"""Bounds on a node's reading over real gRPC (control/limits.py): a registration over a limit is
refused (INVALID_ARGUMENT naming it, counted among the refusals), a heartbeat's reading is trimmed
to the limits and kept, logged once; a reading that would render hundreds of MB on /metrics
renders a bounded amount."""

from __future__ import annotations

import logging

import grpc
import pytest
from cp_helpers import TOKEN, control_plane, control_runtime, free_port, metrics, metrics_text, pick
from scenario import discovery_of, h100s

from llmgw._proto.agent.v1 import agent_pb2_grpc
from llmgw.agent.wire import PROTOCOL, discovery_to_proto, pb
from llmgw.control import limits

pytestmark = pytest.mark.timeout(60)

MD = (("authorization", f"Bearer {TOKEN}"),)


def _request(name: str, discovery: pb.Discovery) -> pb.RegisterRequest:
    return pb.RegisterRequest(node_name=name, agent_version="test",
                              protocol=pb.ProtocolVersion(major=PROTOCOL[0], minor=PROTOCOL[1]), discovery=discovery)


def _real(n: int = 2) -> pb.Discovery:
    return discovery_to_proto(discovery_of({"gpus": h100s(n)}))


def _amplifier() -> pb.Discovery:
    """The reviewer's reading: one GPU with a 4 KiB UUID and 20 000 empty XID entries, and
    100 000 empty GPUs (~0.3 MB on the wire)."""
    d = _real(1)
    g = d.gpus[0]
    g.uuid = "U" * 4096
    for _ in range(20_000):
        g.xid_errors.add()
    for _ in range(100_000):
        d.gpus.add()
    return d


async def test_a_registration_over_a_limit_is_refused_naming_it() -> None:
    port = free_port()
    async with control_runtime(port) as rt:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            many = _real(1)
            for _ in range(limits.MAX_GPUS):
                many.gpus.add(uuid="GPU-x")
            xids = _real(1)
            for i in range(limits.MAX_XIDS + 1):
                xids.gpus[0].xid_errors.add(xid=i, count=1)
            long_name = _real(1)
            long_name.gpus[0].name = "N" * (limits.MAX_TEXT + 1)
            ports = _real(1)
            for i in range(limits.MAX_IB_PORTS + 1):
                ports.facts.infiniband.add(device="mlx5_0", port=i)
            cases = [(many, f"at most {limits.MAX_GPUS}"), (xids, f"at most {limits.MAX_XIDS}"),
                     (long_name, "name of 129 characters"), (ports, f"at most {limits.MAX_IB_PORTS}"),
                     (_amplifier(), "GPUs")]
            for d, says in cases:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await stub.Register(_request("n1", d), metadata=MD, timeout=10)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "limits" in (exc.value.details() or "") and says in (exc.value.details() or "")
            assert control_plane(rt).service.nodes.get("n1") is None
            # a real node's reading (within every limit) is taken
            ok = await stub.Register(_request("n1", _real(8)), metadata=MD, timeout=10)
            assert ok.node_id
        samples = await metrics(rt)
        assert pick(samples, "llmgw_control_joins_refused_total", reason="oversized_discovery") == [len(cases)]


async def test_a_heartbeat_over_the_limits_is_trimmed_and_the_scrape_stays_bounded(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    port = free_port()
    async with control_runtime(port) as rt:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = agent_pb2_grpc.AgentServiceStub(ch)
            reg = await stub.Register(_request("n1", _real(2)), metadata=MD, timeout=10)
            normal = len(await metrics_text(rt))
            d = _amplifier()
            wire = d.ByteSize()
            for seq in (1, 2):  # (the second one is trimmed as well, and not logged again)
                await stub.Heartbeat(pb.HeartbeatRequest(node_id=reg.node_id, node_name="n1", sequence=seq,
                                                         discovery=d), metadata=MD, timeout=30)
        st = control_plane(rt).service.nodes.get("n1")
        assert st is not None and st.heartbeats == 2  # kept, not lost for an odd reading
        kept = st.reading
        assert len(kept.gpus) == limits.MAX_GPUS
        assert len(kept.gpus[0].uuid) == limits.MAX_TEXT and len(kept.gpus[0].xid_errors) == limits.MAX_XIDS
        text = await metrics_text(rt)
        trimmed = [r for r in caplog.records if "over the limits" in r.getMessage()]
        assert len(trimmed) == 1 and "n1" in trimmed[0].getMessage()
    # untrimmed this reading rendered ~0.5 GB (the reviewer's figure for its kind); trimmed, its
    # size is bounded by the limits: a few MB at most, a few hundred KB for this one
    assert wire > 250_000
    assert normal < len(text) < 3_000_000, (normal, len(text))


def test_trim_keeps_the_most_seen_xids_in_their_order() -> None:
    d = _real(30)  # (over limits.SMALL: checked field by field)
    assert d.ByteSize() > limits.SMALL
    g = d.gpus[0]
    del g.xid_errors[:]
    counts = [(i, 1 + (i * 7919) % 101) for i in range(limits.MAX_XIDS + 10)]
    for xid, count in counts:
        g.xid_errors.add(xid=xid, count=count)
    assert limits.problem(d) is not None
    assert limits.trim(d) is not None and limits.problem(d) is None
    want = sorted(sorted(counts, key=lambda c: -c[1])[:limits.MAX_XIDS])
    assert [(x.xid, x.count) for x in g.xid_errors] == want
    # within the limits: untouched
    before = _real(8)
    after = pb.Discovery()
    after.CopyFrom(before)
    assert limits.trim(after) is None and after == before


def test_a_small_heartbeat_reading_is_taken_unchecked_and_renders_bounded() -> None:
    """limits.SMALL: a reading of at most 4 KiB is not checked field by field (a heartbeat's
    fast path); its worst shapes render under 3 MB."""
    from llmgw._fast import nodetext_py as P

    opens = tuple(f"{s}{{".encode() for s in P.SLOTS)
    long_uuid = pb.Discovery()
    g = long_uuid.gpus.add(uuid="U" * (limits.SMALL // 2))
    for _ in range(limits.SMALL):  # (as many as fit)
        g.xid_errors.add()
        if long_uuid.ByteSize() > limits.SMALL:
            del g.xid_errors[-1]
            break
    empty = pb.Discovery()
    for _ in range(limits.SMALL):
        empty.gpus.add()
        if empty.ByteSize() > limits.SMALL:
            del empty.gpus[-1]
            break
    for d in (long_uuid, empty):
        assert limits.problem(d) is not None  # over a limit: a registration would be refused
        assert limits.trim(d) is None  # a heartbeat's is kept as it is
        assert sum(map(len, P.render_message(d, "n", opens))) < 3_000_000
