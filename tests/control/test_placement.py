"""Placement on plain data: the filter, the score, and the explanation when nothing fits."""

from __future__ import annotations

import pytest

from llmgw.control.placement import GIB, Choice, Claim, GpuInfo, Need, NodeInfo, Unplaceable, place
from llmgw.control.resolve import MirrorModel, kv_cache_bytes, memory_need


def gpu(uuid: str, index: int = 0, total: int | None = 80 * GIB, used: int | None = 0,
        name: str = "NVIDIA H100 80GB HBM3", **kw: object) -> GpuInfo:
    return GpuInfo(uuid, index, name, total, used, **kw)  # type: ignore[arg-type]


def node(name: str, n_gpus: int = 0, **kw: object) -> NodeInfo:
    gpus = tuple(gpu(f"GPU-{name}-{i}", i) for i in range(n_gpus))
    return NodeInfo(name, gpus=kw.pop("gpus", gpus), **kw)  # type: ignore[arg-type]


def chosen(got: Choice | Unplaceable) -> Choice:
    assert isinstance(got, Choice), got
    return got


def why(got: Choice | Unplaceable) -> str:
    assert isinstance(got, Unplaceable), got
    return got.reason


def test_no_nodes_says_so() -> None:
    assert "no nodes are registered" in why(place(Need("d", gpus=1), [], []))


def test_down_cordoned_and_labels_are_filtered_and_named() -> None:
    nodes = [node("n-down", 1, up=False), node("n-cord", 1, cordoned=True),
             node("n-eu", 1, labels={"zone": "eu"}), node("n-us", 1, labels={"zone": "us"})]
    c = chosen(place(Need("d", gpus=1, labels={"zone": "us"}), nodes, []))
    assert c.node == "n-us" and c.gpus == ("GPU-n-us-0",)
    r = why(place(Need("d", gpus=1, labels={"zone": "ap"}), nodes, []))
    assert "n-down is down" in r and "n-cord is cordoned" in r
    assert "n-eu has label zone=eu, not ap" in r and "n-us has label zone=us, not ap" in r
    r = why(place(Need("d", gpus=1, labels={"rack": "7"}), [node("n", 1)], []))
    assert "n lacks label rack=7" in r


def test_the_issue_example_explanation() -> None:
    nodes = [node("gpu-node-1", 2, gpus=(gpu("a", 0, used=50 * GIB), gpu("b", 1, used=60 * GIB))),
             node("gpu-node-3", 2, gpus=(gpu("c", 0, used=10 * GIB), gpu("d", 1, used=70 * GIB)))]
    r = why(place(Need("big", gpus=2, gpu_memory=40 * GIB), nodes, []))
    assert r.startswith("needs 2 GPUs with 40.0 GiB free each; the largest free set is 1 on gpu-node-3"), r
    assert "1 too little free memory" in r


def test_one_replica_per_gpu_unless_shared() -> None:
    n = node("n", 2)
    claims = [Claim("r1", "d", "n", ("GPU-n-0",), 10 * GIB, exclusive=True)]
    c = chosen(place(Need("d", gpus=1, gpu_memory=10 * GIB), [n], claims))
    assert c.gpus == ("GPU-n-1",)
    claims.append(Claim("r2", "d", "n", ("GPU-n-1",), 10 * GIB, exclusive=True))
    r = why(place(Need("d", gpus=1, gpu_memory=10 * GIB), [n], claims))
    assert "the largest free set is 0 on n" in r and "2 held by another replica" in r
    # sharing replicas stack on one GPU while its memory lasts; exclusive holders take nobody
    shared = [Claim(f"s{i}", "s", "n", ("GPU-n-0",), 30 * GIB, exclusive=False) for i in range(2)]
    c = chosen(place(Need("s", gpus=1, gpu_memory=15 * GIB, share=True), [node("n", 1)], shared))
    assert c.gpus == ("GPU-n-0",) and c.fractions == (15 / 80,)
    r = why(place(Need("s", gpus=1, gpu_memory=30 * GIB, share=True), [node("n", 1)], shared))
    assert "needs 1 GPU with 30.0 GiB free" in r and "too little free memory" in r
    r = why(place(Need("s", gpus=1, gpu_memory=GIB, share=True), [n], claims))
    assert "held by another replica" in r
    # a non-sharing replica never joins a GPU held by sharing ones
    assert why(place(Need("x", gpus=1, gpu_memory=GIB), [node("n", 1)], shared[:1]))


def test_sharing_needs_a_known_memory_size() -> None:
    assert "set gpu_memory" in why(place(Need("s", gpus=1, share=True), [node("n", 1)], []))


def test_spread_is_a_preference_not_a_filter() -> None:
    nodes = [node("a", 2), node("b", 2)]
    claims = [Claim("r1", "d", "a", ("GPU-a-0",), GIB)]
    assert chosen(place(Need("d", gpus=1, gpu_memory=GIB), nodes, claims)).node == "b"
    # another deployment's replica does not push this one away
    other = [Claim("r1", "o", "a", ("GPU-a-0",), GIB)]
    assert chosen(place(Need("d", gpus=1, gpu_memory=GIB), nodes, other)).node == "b"  # (b has more free memory)
    # b is full: the second replica shares node a with the first
    full = [*claims, Claim("x1", "o", "b", ("GPU-b-0",), GIB), Claim("x2", "o", "b", ("GPU-b-1",), GIB)]
    assert chosen(place(Need("d", gpus=1, gpu_memory=GIB), nodes, full)).node == "a"


def test_the_gpus_with_most_free_memory_are_taken() -> None:
    n = node("n", gpus=(gpu("g0", 0, used=30 * GIB), gpu("g1", 1, used=5 * GIB), gpu("g2", 2, used=5 * GIB)))
    assert chosen(place(Need("d", gpus=2, gpu_memory=GIB), [n], [])).gpus == ("g1", "g2")


def test_gpu_model_health_mig_and_unknown_memory() -> None:
    n = node("n", gpus=(gpu("a100", 0, name="NVIDIA A100-SXM4-80GB"), gpu("h100", 1),
                        gpu("sick", 2, healthy=False), gpu("mig-parent", 3, mig_parent=True),
                        gpu("MIG-1", 0, total=10 * GIB, name="NVIDIA H100 MIG 1g.10gb")))
    assert chosen(place(Need("d", gpus=1, gpu_model="a100"), [n], [])).gpus == ("a100",)
    assert chosen(place(Need("d", gpus=1, gpu_model="H100", gpu_memory=20 * GIB), [n], [])).gpus == ("h100",)
    assert chosen(place(Need("d", gpus=1, gpu_memory=5 * GIB, gpu_model="MIG"), [n], [])).gpus == ("MIG-1",)
    r = why(place(Need("d", gpus=2, gpu_model="H100", gpu_memory=20 * GIB), [n], []))
    assert "needs 2 GPUs (H100) with 20.0 GiB free each" in r and "unhealthy" in r and "another model" in r
    unknown = node("u", gpus=(gpu("g", 0, total=None, used=None),))
    assert "memory not reported" in why(place(Need("d", gpus=1, gpu_memory=GIB), [unknown], []))
    assert chosen(place(Need("d", gpus=1), [unknown], [])).gpus == ("g",)  # no stated need: a whole free GPU


def test_memory_used_by_others_counts_once() -> None:
    # 60 GiB in use, of which 40 GiB is our own claim: 20 GiB free
    n = node("n", gpus=(gpu("g", 0, used=60 * GIB),))
    claims = [Claim("r", "o", "n", ("g",), 40 * GIB, exclusive=False, loaded=True)]
    assert chosen(place(Need("d", gpus=1, gpu_memory=20 * GIB, share=True), [n], claims))
    assert why(place(Need("d", gpus=1, gpu_memory=21 * GIB, share=True), [n], claims))
    # a replica still loading may not show in the reading yet: its claim counts whole
    loading = [Claim("r", "o", "n", ("g",), 10 * GIB, exclusive=False)]
    assert why(place(Need("d", gpus=1, gpu_memory=11 * GIB, share=True), [n], loading))


def test_cpu_replicas_share_a_node_while_memory_and_cores_allow() -> None:
    n = NodeInfo("cpu-1", cpu_cores=8, memory_total=16 * GIB, memory_available=13 * GIB)
    need = Need("c", memory=3 * GIB, cpu_cores=2)
    claims: list[Claim] = []
    for i in range(4):  # 13 GiB available (3 in use by others): 4 fit, spread is only a preference
        c = chosen(place(need, [n], claims))
        assert c.node == "cpu-1" and c.gpus == ()
        claims.append(Claim(f"r{i}", "c", "cpu-1", memory=3 * GIB, cpu_cores=2))
    r = why(place(need, [n], claims))
    assert "needs 3.0 GiB of node memory and 2 CPU cores" in r and "cpu-1 has 1.0 GiB of memory free" in r
    r = why(place(Need("c", cpu_cores=2), [n], claims))
    assert "cpu-1 has 0 CPU cores unclaimed" in r
    r = why(place(Need("c", cpu_cores=9), [n], []))
    assert "cpu-1 has 8 CPU cores unclaimed" in r
    # with two nodes the second replica goes to the other one
    m = NodeInfo("cpu-2", cpu_cores=8, memory_total=16 * GIB, memory_available=16 * GIB)
    assert chosen(place(need, [n, m], claims[:1])).node == "cpu-2"
    assert "did not report its memory" in why(place(need, [NodeInfo("x")], []))
    assert chosen(place(Need("c"), [NodeInfo("x")], [])).node == "x"  # no stated need: any up node


@pytest.mark.parametrize("ctx, expect", [(None, 2 * 4 * 2048 * 16 * 2 * 2), (512, 2 * 4 * 512 * 16 * 2 * 2)])
def test_kv_cache_estimate(ctx: int | None, expect: int) -> None:
    m = MirrorModel("t:1", (), 1000, context_length=2048, block_count=4, embedding_length=64, head_count=4,
                    head_count_kv=2)
    assert kv_cache_bytes(m, ctx) == expect
    assert memory_need(m, ctx) == 1000 + expect
    assert kv_cache_bytes(MirrorModel("t:1", (), 1000), ctx) is None
    assert memory_need(MirrorModel("t:1", (), 1000), ctx) == 1000
