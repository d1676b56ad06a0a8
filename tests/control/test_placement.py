"""Placement on plain data: the filter, the score, and the explanation when nothing fits."""

from __future__ import annotations

import pytest

from llmgw.control.placement import GIB, Choice, Claim, GpuInfo, Need, NodeInfo, Unplaceable, place
from llmgw.control.resolve import MirrorModel, compute_margin, kv_cache_bytes, memory_need


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
    # (down and cordoned without the label: they could not take it either, counted, not named)
    assert r.endswith("; and 2 more (1 down, 1 cordoned)"), r
    assert "n-eu has label zone=eu, not ap (no node has it)" in r and "n-us has label zone=us, not ap" in r
    r = why(place(Need("d", gpus=2, labels={"zone": "us"}), [*nodes, node("n-us-down", 1, up=False,
                                                                          labels={"zone": "us"})], []))
    assert "the largest free set is 1 on n-us; n-us-down is down; n-eu has label zone=eu, not us" in r, r
    r = why(place(Need("d", gpus=1, labels={"rack": "7"}), [node("n", 1)], []))
    assert "n lacks label rack=7" in r


def test_an_agent_too_old_to_launch_is_never_placed_on() -> None:
    # (an agent of protocol 1.1 registers and reports its GPUs, but desired sets are 1.2's)
    nodes = [node("n-old", 8, launch_protocol=(1, 1)), node("n-cpu", 0, cpu_cores=8, memory_total=64 * GIB,
                                                               memory_available=60 * GIB)]
    r = why(place(Need("d", gpus=1), nodes, []))
    assert "n-old's agent speaks protocol 1.1, which cannot launch replicas (upgrade its llmgw)" in r, r
    assert chosen(place(Need("d", gpus=0, memory=GIB), nodes, [])).node == "n-cpu"
    assert "n-old's agent speaks protocol 1.1" in why(place(Need("d", gpus=0, memory=GIB), nodes[:1], []))


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
    assert memory_need(m, ctx) == 1000 + expect + 256 * 2**20  # (a small model: the margin's floor)
    assert kv_cache_bytes(MirrorModel("t:1", (), 1000), ctx) is None
    assert memory_need(MirrorModel("t:1", (), 1000), ctx) == 1000 + 256 * 2**20
    assert compute_margin(40 * GIB) == 4 * GIB  # a large one: a tenth of its files


# -- the explanation names the closest node and stays short at a thousand nodes -------------------------

A100 = "NVIDIA A100-SXM4-80GB"


def _fleet(down: int = 40) -> list[NodeInfo]:
    """The tester's cluster: a GPU-less node first, H100 nodes, one A100 node with 52 GiB free on its
    best GPU, and many nodes down."""
    return [
        node("cpu-node", 0, cpu_cores=16, memory_total=64 * GIB, memory_available=60 * GIB),
        node("h100-node-1", gpus=(gpu("h1", 0), gpu("h2", 1))),
        node("mig-node-3", gpus=(gpu("a1", 0, name=A100, used=28 * GIB), gpu("a2", 1, name=A100, used=60 * GIB))),
        node("mig-node-4", gpus=(gpu("a3", 0, name=A100, used=40 * GIB),)),
        *(node(f"rack-2-node-{i:02d}", 2, up=False) for i in range(down)),
    ]


def test_the_closest_node_of_the_model_is_named_not_a_gpu_less_one() -> None:
    r = why(place(Need("d", gpus=1, gpu_model="A100", gpu_memory=70 * GIB), _fleet(), []))
    assert r.startswith("needs 1 GPU (A100) with 70.0 GiB free; the largest free set is 0 on mig-node-3 "
                        "(others: 2 too little free memory (at most 52.0 GiB))"), r
    assert "cpu-node" not in r and "h100-node-1" not in r
    # the down nodes (H100 nodes: no help) counted, not named
    assert " is down" not in r and r.endswith("; 40 nodes down"), r
    # without a model: the node whose GPU comes closest, GPU-less nodes never
    r = why(place(Need("d", gpus=1, gpu_memory=79 * GIB), _fleet(), [Claim("x", "o", "h100-node-1", ("h1", "h2"))]))
    assert "the largest free set is 0 on mig-node-3 (others: 2 too little free memory (at most 52.0 GiB))" in r, r
    # on a tie, the first by name
    twins = [node("b", gpus=(gpu("b0", 0, used=50 * GIB),)), node("a", gpus=(gpu("a0", 0, used=50 * GIB),))]
    assert "the largest free set is 0 on a " in why(place(Need("d", gpus=1, gpu_memory=79 * GIB), twins, []))


def test_a_model_no_node_has_is_said_and_down_nodes_are_not_listed() -> None:
    r = why(place(Need("d", gpus=1, gpu_model="B200", gpu_memory=70 * GIB), _fleet(), []))
    assert r == ("needs 1 GPU (B200) with 70.0 GiB free; no node has a GPU matching B200 "
                 f"(the GPUs there: {A100}, NVIDIA H100 80GB HBM3)"), r
    r = why(place(Need("d", gpus=1), [node("cpu-1"), node("cpu-2", up=False)], []))
    assert r == "needs 1 GPU nobody else holds; no node has a GPU", r


def test_a_model_only_on_nodes_left_out_names_those_first() -> None:
    nodes = [node("cpu-node"), *(node(f"n-{i:03d}", 1, up=False) for i in range(900)),
             node("a100-node", gpus=(gpu("a", 0, name=A100),), cordoned=True)]
    r = why(place(Need("d", gpus=1, gpu_model="A100"), nodes, []))
    assert r == ("needs 1 GPU (A100) nobody else holds; no eligible node has a GPU matching A100; "
                 "a100-node is cordoned; and 900 more down"), r


def test_a_thousand_nodes_left_out_give_a_short_line() -> None:
    nodes = [*(node(f"n-{i:04d}", 8, up=False) for i in range(990)),
             *(node(f"c-{i}", 8, cordoned=True) for i in range(8)), node("old", 8, launch_protocol=(1, 1))]
    r = why(place(Need("d", gpus=8, gpu_memory=40 * GIB), nodes, []))
    assert r.startswith("needs 8 GPUs with 40.0 GiB free each; no node is eligible; n-0000 is down"), r
    assert r.endswith("; and 994 more (985 down, 8 cordoned, 1 with an agent too old to launch replicas)"), r
    assert len(r) < 400, len(r)
    # CPU replicas too
    cpu = [NodeInfo(f"cpu-{i}", cpu_cores=4, memory_total=8 * GIB, memory_available=GIB) for i in range(1000)]
    r = why(place(Need("c", memory=4 * GIB), cpu, []))
    assert r.startswith("needs 4.0 GiB of node memory; no node is eligible; cpu-0 has 1.0 GiB of memory free"), r
    assert r.endswith("; and 995 more with too little memory free") and len(r) < 400, r


def test_a_label_no_node_has_is_said() -> None:
    nodes = [node(f"n-{i}", 1, labels={"zone": "eu"}) for i in range(20)]
    r = why(place(Need("d", gpus=1, labels={"pool": "cpu"}), nodes, []))
    assert r.startswith("needs 1 GPU nobody else holds; no node is eligible; n-0 lacks label pool=cpu "
                        "(no node has it); n-1 lacks label pool=cpu;"), r
    assert r.endswith("; and 15 more without label pool=cpu"), r
    # one node has it (down): not said
    r = why(place(Need("d", gpus=1, labels={"zone": "us"}), [*nodes, node("us-1", 1, up=False, labels={"zone": "us"})],
                  []))
    assert "(no node has it)" not in r and "; no node is eligible; us-1 is down; n-0 has label zone=eu, not us" in r, r


def test_a_gpu_whose_memory_in_use_is_absent_has_no_free_memory_known() -> None:
    # (a GPU kept by its identity while its source fails: total known, every reading absent)
    kept = node("n", gpus=(gpu("g", 0, used=None, healthy=True),))
    assert "1 memory not reported" in why(place(Need("d", gpus=1, gpu_memory=GIB), [kept], []))
    assert chosen(place(Need("d", gpus=1), [kept], [])).gpus == ("g",)  # no stated need: as an unknown total


def test_degraded_gpus_are_taken_last() -> None:
    """A degraded GPU (an XID, uncorrected ECC errors, its fabric not started) is placed on only where
    nothing fits without it: on a node, the healthy GPUs first; among nodes, one that needs none of them,
    even over spreading the deployment."""
    a = node("a", gpus=tuple(gpu(f"GPU-a-{i}", i, degraded=i in (1, 3)) for i in range(4)))
    c = chosen(place(Need("d", gpus=2, gpu_memory=10 * GIB), [a], []))
    assert c.gpus == ("GPU-a-0", "GPU-a-2")
    # a third needs one of the degraded ones: placed all the same (healthy enough), the healthy one first
    held = [Claim("r1", "d", "a", ("GPU-a-0",), 10 * GIB)]
    c = chosen(place(Need("d", gpus=2, gpu_memory=10 * GIB), [a], held))
    assert c.gpus[0] == "GPU-a-2" and c.gpus[1] in ("GPU-a-1", "GPU-a-3")
    # another node with healthy GPUs wins, though the deployment already has a replica there
    b = node("b", 2)
    c = chosen(place(Need("d", gpus=2, gpu_memory=10 * GIB), [a, b], [Claim("r2", "d", "b"), *held]))
    assert c.node == "b"


def test_a_leaving_node_is_filtered_and_named_as_such() -> None:
    """A node whose agent is stopping takes no replica, and the explanation says it is leaving (it said
    'cordoned', which nobody had done)."""
    assert chosen(place(Need("d", gpus=1), [node("a", 1, leaving=True), node("b", 1)], [])).node == "b"
    r = why(place(Need("d", gpus=1), [node("a", 1, leaving=True)], []))
    assert "a is leaving (its agent is stopping)" in r and "cordoned" not in r, r


def test_a_cpu_replica_takes_a_node_without_idle_gpus_before_a_gpu_node() -> None:
    # A GPU node usually has the most memory free: by memory alone every CPU replica went there, taking the
    # memory and cores its GPU replicas need while a CPU node stood idle.
    gpu_node = node("a-gpu", 2, cpu_cores=64, memory_total=512 * GIB, memory_available=500 * GIB)
    cpu_node = node("b-cpu", 0, cpu_cores=16, memory_total=64 * GIB, memory_available=60 * GIB)
    need = Need("c", memory=4 * GIB)
    assert chosen(place(need, [gpu_node, cpu_node], [])).node == "b-cpu"
    # spreading comes first: the second replica goes to the GPU node
    claims = [Claim("r0", "c", "b-cpu", memory=4 * GIB)]
    assert chosen(place(need, [gpu_node, cpu_node], claims)).node == "a-gpu"
    # a GPU node whose GPUs are all held has none left idle: memory decides again
    held = [Claim(f"g{i}", "v", "a-gpu", gpus=(f"GPU-a-gpu-{i}",)) for i in range(2)]
    assert chosen(place(need, [gpu_node, cpu_node], held)).node == "a-gpu"
    # and a CPU node that cannot take it leaves it to the GPU node
    assert chosen(place(Need("c", memory=100 * GIB), [gpu_node, cpu_node], [])).node == "a-gpu"


def test_a_node_where_the_deployment_failed_lately_is_taken_last() -> None:
    """QA: a replica failing for a reason of its node's own (its ports, a file missing there) was placed
    there again and again, the best-scored node, while other nodes were idle."""
    cpu_nodes = [node("n-cpu"), node("n-gpu", 2)]  # (a CPU replica goes to the node without idle GPUs first)
    assert chosen(place(Need("d"), cpu_nodes, [])).node == "n-cpu"
    assert chosen(place(Need("d"), cpu_nodes, [], avoid=("n-cpu",))).node == "n-gpu"
    gpu_nodes = [node("a", 1), node("b", 1)]
    assert chosen(place(Need("d", gpus=1), gpu_nodes, [])).node == "a"
    assert chosen(place(Need("d", gpus=1), gpu_nodes, [], avoid=("a",))).node == "b"
    # a preference, not a filter: with nowhere else, there again
    assert chosen(place(Need("d"), [node("n-cpu")], [], avoid=("n-cpu",))).node == "n-cpu"
    assert chosen(place(Need("d", gpus=1), [node("a", 1)], [], avoid=("a",))).node == "a"
