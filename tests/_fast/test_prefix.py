"""The ``prefix`` strategy's kernels: block hashing in the body scan
(``jsonscan.json_route``) and the picker's index, sessions and bounded load
(``score.Picker.pick_prefix``). Both twins, through the ``jsonscan`` and ``score``
fixtures; the hashing is checked against a reference built from a real JSON parse.
"""

from __future__ import annotations

import math
import struct
from types import ModuleType
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw._fast import jsonscan_py

STALE = 3.0


def unpack(key: bytes) -> list[int]:
    """The links of a routing key (less its anchor words)."""
    return list(struct.unpack(f"={len(key) // 8}Q", key))[2:]


def pack(hashes: list[int], anchor: int = 0, shallow: int = 0, later: bool = True) -> bytes:
    """A routing key as json_route makes it: [anchor, its whole blocks (bit 63: a later
    turn), links...]."""
    return struct.pack(f"={len(hashes) + 2}Q", anchor, shallow | (1 << 63 if later and anchor else 0), *hashes)


def reference(data: dict[str, Any], block: int, max_blocks: int) -> tuple[list[int], int, tuple[int, int]]:
    """The chain, session hash and anchor from the parsed body (bodies made by
    orjson.dumps, so a value's raw text is its orjson.dumps)."""
    msgs = data.get("messages")
    anchor = -1
    later = False
    if isinstance(msgs, list):
        stream = orjson.dumps(msgs)
        for k, m in enumerate(msgs):
            if not (isinstance(m, dict) and m.get("role") in ("system", "developer")):
                anchor = len(orjson.dumps(msgs[: k + 1])) - 1  # (less the closing bracket)
                later = k < len(msgs) - 1
                break
    elif "prompt" in data:
        stream = orjson.dumps(data["prompt"])
    else:
        stream = b""
    cap = block * max_blocks
    stream = stream[:cap]
    links = jsonscan_py.chain_hashes(stream, block)
    anchored = (0, 0)
    if 0 <= anchor <= cap and links:
        # the anchor: the prefix up to that message's end, chained like the links
        whole = jsonscan_py.chain_hashes(stream[:anchor], block)
        anchored = (whole[-1], anchor // block | (1 << 63 if later else 0))
    session = 0
    for k in ("prompt_cache_key", "safety_identifier", "user"):
        if isinstance(data.get(k), str):
            session = jsonscan_py.key_hash(orjson.dumps(data[k])[1:-1])
            break
    return links, session, anchored


_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300)
_part = st.fixed_dictionaries({"type": st.just("text"), "text": _text})
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant"]), "content": st.one_of(_text, st.lists(_part, max_size=3))}
)
_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "llama"])},
    optional={
        "messages": st.one_of(st.lists(_message, max_size=8), st.just("not a list")),
        "prompt": st.one_of(_text, st.lists(st.integers(0, 50000), max_size=40)),
        "prompt_cache_key": st.one_of(_text, st.integers(-(2**62), 2**62)),
        "safety_identifier": _text,
        "user": st.one_of(_text, st.none()),
        "temperature": st.floats(0, 2),
        "tools": st.lists(st.fixed_dictionaries({"type": st.just("function")}), max_size=2),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_body, block=st.sampled_from([8, 64, 256]), max_blocks=st.integers(1, 12))
def test_chain_matches_a_parse(jsonscan: ModuleType, data: dict[str, Any], block: int, max_blocks: int) -> None:
    body = orjson.dumps(data)
    is_object, model, chain, session = jsonscan.json_route(body, block, max_blocks)
    assert is_object and model == data["model"]
    want_chain, want_session, want_anchor = reference(data, block, max_blocks)
    assert unpack(chain) == want_chain
    if chain:
        assert struct.unpack("=2Q", chain[:16]) == want_anchor
    assert session == want_session
    assert jsonscan.json_model(body) == (True, data["model"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=_body, indent=st.booleans())
def test_twins_agree_on_any_spacing(jsonscan: ModuleType, data: dict[str, Any], indent: bool) -> None:
    import json

    body = json.dumps(data, indent=2 if indent else None, ensure_ascii=indent).encode()
    assert jsonscan.json_route(body, 64, 8) == jsonscan_py.json_route(body, 64, 8)


def test_chain_links_cover_the_prefix(jsonscan: ModuleType) -> None:
    """Block i's hash stands for blocks 0..i: a conversation's next turn shares the
    links of its earlier turn's full blocks, and a change early changes every link."""
    sys_msg = {"role": "system", "content": "You are terse. " * 20}
    turn1 = [sys_msg, {"role": "user", "content": "What is a prefix cache? " * 10}]
    turn2 = [*turn1, {"role": "assistant", "content": "A cache of prompt KV."}, {"role": "user", "content": "And?"}]
    c1 = unpack(jsonscan.json_route(orjson.dumps({"model": "m", "messages": turn1}), 64, 64)[2])
    c2 = unpack(jsonscan.json_route(orjson.dumps({"model": "m", "messages": turn2}), 64, 64)[2])
    full1 = (len(orjson.dumps(turn1)) - 1) // 64  # (turn 1's text less its closing bracket)
    assert full1 >= 8 and c2[:full1] == c1[:full1] and c2[full1] != c1[full1]
    other = [{"role": "system", "content": "You are wordy" + sys_msg["content"][13:]}, *turn2[1:]]
    c3 = unpack(jsonscan.json_route(orjson.dumps({"model": "m", "messages": other}), 64, 64)[2])
    assert len(c3) == len(c2) and not set(c3) & set(c2)
    # the role is part of the text hashed
    c4 = unpack(jsonscan.json_route(orjson.dumps({"model": "m", "messages": [{**turn1[0], "role": "user"}]}), 64, 4)[2])
    c5 = unpack(jsonscan.json_route(orjson.dumps({"model": "m", "messages": [turn1[0]]}), 64, 4)[2])
    assert c4[0] != c5[0]


def test_route_scan_refuses_what_json_model_refuses(jsonscan: ModuleType) -> None:
    for bad in (b'{"model":"m","messages":[{"role":"user"}', b'{"messages":[1,]}', b"\xef\xbb\xbf{}"):
        with pytest.raises(jsonscan.JSONScanError):
            jsonscan.json_route(bad, 64, 4)
    assert jsonscan.json_route(b"[1,2]", 64, 4) == (False, None, b"", 0)
    for block, blocks in ((0, 1), (60, 1), (64, 0), (4096, 17)):
        with pytest.raises(ValueError):
            jsonscan.json_route(b"{}", block, blocks)
    assert jsonscan.key_hash(b"abc") == jsonscan_py.key_hash(b"abc") != 0


def test_header_hash(jsonscan: ModuleType) -> None:
    lines = b"Accept: */*\r\nX-Session-ID:  conv-42 \r\nx-session-id: later\r\n"
    assert jsonscan.header_hash(lines, b"x-session-id") == jsonscan.key_hash(b"conv-42")
    assert jsonscan.header_hash(lines, b"x-session") == 0
    assert jsonscan.header_hash(b"x-session-id:\r\n", b"x-session-id") == 0
    assert jsonscan.header_hash(b"", b"x-session-id") == 0
    for blob in (lines, b"a:b", b"x-session-idx: 1\r\n", b"\n\n:x\r\n"):
        assert jsonscan.header_hash(blob, b"x-session-id") == jsonscan_py.header_hash(blob, b"x-session-id")


# -- the picker -------------------------------------------------------------------


def fleet(score: ModuleType, n: int, slots: float = 4.0, running: float = 0.0) -> list[Any]:
    states = []
    for i in range(n):
        s = score.EndpointState(i)
        s.slots = slots
        s.on_scrape(0.0, 0, running, 0.1)
        states.append(s)
    return states


def load(st: Any, n: int, now: float = 0.0) -> None:
    for _ in range(n):
        st.on_dispatch(now)


def test_longest_cached_prefix_wins(score: ModuleType) -> None:
    states = fleet(score, 4)
    p = score.Picker("prefix", seed=1)
    a = pack([11, 12, 13])
    first = p.pick_prefix(states, 0.0, STALE, a, 0)
    assert p.decisions() == (0, 0, 0, 1)  # never seen: blind (consistent hash)
    # the same prefix, longer: the replica that served it
    assert p.pick_prefix(states, 0.1, STALE, pack([11, 12, 13, 14, 15]), 0) == first
    assert p.decisions() == (1, 0, 0, 1)
    # a longer match elsewhere beats a shorter one: [11, 12, 99] recorded on another replica
    other = (first + 1) % 4
    for i, s in enumerate(states):
        s.draining = i != other
    assert p.pick_prefix(states, 0.2, STALE, pack([11, 12, 99, 100]), 0) == other
    for s in states:
        s.draining = False
    assert p.pick_prefix(states, 0.3, STALE, pack([11, 12, 99, 100, 101]), 0) == other
    assert p.pick_prefix(states, 0.4, STALE, pack([11, 12, 13, 14, 15, 16]), 0) == first


def test_bounded_load_falls_back_to_score(score: ModuleType) -> None:
    """With every replica full, a cached one may queue up to load_bound more than the best."""
    states = fleet(score, 3, slots=4.0)
    p = score.Picker("prefix", seed=2, load_bound=0.5)
    chain = pack([7, 8, 9])
    home = p.pick_prefix(states, 0.0, STALE, chain, 0)
    # all full; home 5/4 with this request against 4/4 + 0.5: stays
    load(states[home], 4)
    load(states[(home + 1) % 3], 4)
    load(states[(home + 2) % 3], 4)
    assert p.pick_prefix(states, 0.1, STALE, chain, 0) == home
    assert p.decisions()[0] == 1
    # 7/4 against 4/4 + 0.5: too loaded, spilled elsewhere, counted load_fallback
    load(states[home], 3)
    i = p.pick_prefix(states, 0.2, STALE, chain, 0)
    assert i != home and p.decisions()[2] == 1


def test_no_queue_for_a_short_prefix_while_a_slot_is_free(score: ModuleType) -> None:
    """While score's pick has a free slot, a cached replica that would queue the request is
    taken only if the wait is shorter than the prefill its cache saves: a long prefix (many
    blocks against the pool's mean) is worth a short queue, a short one is not."""
    states = fleet(score, 3, slots=4.0)
    for x in states:
        x.latency = 1.0
    p = score.Picker("prefix", seed=12, load_bound=0.5)
    short = pack([21, 22])
    home = p.pick_prefix(states, 0.0, STALE, short, 0)
    load(states[home], 4)  # full: this request would wait 1/4 of a latency there
    load(states[(home + 1) % 3], 2)  # (2/4: home's 4/4 is within load_bound of it)
    load(states[(home + 2) % 3], 2)
    # saved: PREFILL_WEIGHT x 2 blocks / 2 blocks on average = 0.2 < 0.25: not worth it
    assert p.pick_prefix(states, 0.1, STALE, short, 0) != home
    assert p.decisions()[2] == 1
    # a prefix longer than the pool's mean (32 blocks against ~21) saves ~0.3 latencies: worth it
    q = score.Picker("prefix", seed=12, load_bound=0.5)
    long = pack(list(range(100, 132)))
    for x in states:
        x.draining = x is not states[home]
    assert q.pick_prefix(states, 0.0, STALE, long, 0) == home
    for x in states:
        x.draining = False
    for k in range(30):  # the pool's mean chain: mostly 2-block requests (~21 blocks on average)
        q.pick_prefix(states, 0.0, STALE, pack([5000 + k, 6000 + k]), 0)
    assert q.pick_prefix(states, 0.1, STALE, long, 0) == home
    assert q.decisions()[0] == 1


def test_spill_follows_the_prefix_rendezvous(score: ModuleType) -> None:
    """A prefix whose replica is too loaded spills to the same replica at every router (the
    rendezvous order of its deepest cached block), so its copies stay few."""
    tags = [score.default_tag(200 + i) for i in range(6)]
    spills = set()
    for seed, order in ((13, tags), (14, list(reversed(tags)))):
        states = fleet(score, 6, slots=4.0)
        for x, t in zip(states, order, strict=True):
            x.tag = t
        p = score.Picker("prefix", seed=seed, load_bound=0.25)
        chain = pack([31, 32, 33])
        home = next(i for i, x in enumerate(states) if x.tag == tags[0])
        for i, x in enumerate(states):
            x.draining = i != home
        assert p.pick_prefix(states, 0.0, STALE, chain, 0) == home
        for x in states:
            x.draining = False
        load(states[home], 8)
        i = p.pick_prefix(states, 0.1, STALE, chain, 0)
        assert i != home and p.decisions()[2] == 1
        spills.add(states[i].tag)
        # and the next request for that prefix follows it there
        assert p.pick_prefix(states, 0.2, STALE, chain, 0) == i
    assert len(spills) == 1


def test_free_slot_always_allowed(score: ModuleType) -> None:
    states = fleet(score, 2, slots=8.0)
    p = score.Picker("prefix", seed=3, load_bound=0.0)
    chain = pack([1, 2])
    home = p.pick_prefix(states, 0.0, STALE, chain, 0)
    load(states[home], 6)  # 6 of 8 busy, the other idle: a free slot, so it stays
    assert p.pick_prefix(states, 0.1, STALE, chain, 0) == home


def test_session_moves_and_stays_moved(score: ModuleType) -> None:
    states = fleet(score, 3, slots=2.0)
    p = score.Picker("prefix", seed=4, load_bound=0.25)
    sess = 0xABCDEF
    home = p.pick_prefix(states, 0.0, STALE, pack([1]), sess)
    # another turn, a new prompt entirely (a client that resends less): the session decides
    assert p.pick_prefix(states, 0.1, STALE, pack([555]), sess) == home
    assert p.decisions()[1] == 1
    load(states[home], 4)  # 5 of 2 with this request: too loaded
    moved = p.pick_prefix(states, 0.2, STALE, pack([1, 2]), sess)
    assert moved != home and p.decisions()[2] == 1
    for _ in range(4):  # home empties again: the session stays where it moved
        states[home].on_complete(0.3)
    for k in range(3):
        assert p.pick_prefix(states, 0.4 + k, STALE, pack([1, 2, 3 + k]), sess) == moved
    assert p.decisions()[1] == 4


def test_session_replica_gone_moves(score: ModuleType) -> None:
    states = fleet(score, 3)
    p = score.Picker("prefix", seed=5)
    home = p.pick_prefix(states, 0.0, STALE, b"", 42)
    states[home].draining = True
    moved = p.pick_prefix(states, 0.1, STALE, b"", 42)
    assert moved != home
    states[home].draining = False
    assert p.pick_prefix(states, 0.2, STALE, b"", 42) == moved


def test_independent_routers_agree_on_unseen_prefixes(score: ModuleType) -> None:
    """Rendezvous hashing on the first block (or the session) over replica tags: routers
    that share nothing, with their replicas listed in different orders, agree (while
    prompts are used again: each one here is sent a second time)."""
    tags = [score.default_tag(100 + i) for i in range(6)]
    a, b = fleet(score, 6), fleet(score, 6)
    for x, t in zip(a, tags, strict=True):
        x.tag = t
    for x, t in zip(b, reversed(tags), strict=True):
        x.tag = t
    pa, pb = score.Picker("prefix", seed=6), score.Picker("prefix", seed=7)
    spread = set()
    for k in range(200):
        chain = pack([1000 + k, 5, 6])
        ia = pa.pick_prefix(a, 0.0, STALE, chain, 0)
        ib = pb.pick_prefix(b, 0.0, STALE, chain, 0)
        assert a[ia].tag == b[ib].tag
        spread.add(a[ia].tag)
        assert pa.pick_prefix(a, 0.0, STALE, chain, 0) == ia  # (used again: a hit)
        assert pb.pick_prefix(b, 0.0, STALE, chain, 0) == ib
        sa = pa.pick_prefix(a, 0.0, STALE, b"", 77 + k)
        sb = pb.pick_prefix(b, 0.0, STALE, b"", 77 + k)
        assert a[sa].tag == b[sb].tag
    assert len(spread) == 6  # and they spread over the fleet
    assert pa.decisions() == pb.decisions() == (200, 0, 0, 400)
    assert pa.reuse > score.REUSE_MIN


def test_a_pool_that_reuses_nothing_places_first_turns_as_score(score: ModuleType) -> None:
    """Placing an unseen prompt by its hash pays only when prompts come back. Where none
    does, first turns without a session go where ``score`` sends them (the same picks, drawn
    from the same seed) once under REUSE_MIN of the requests continued anything; later turns
    and sessions are still placed by their hash, and reuse turns the hashing back on."""
    states = fleet(score, 4, slots=8.0)
    for x, n in zip(states, (0, 2, 3, 3), strict=True):
        load(x, n)  # (score's pick: replica 0, alone within its near-tie band)
    p = score.Picker("prefix", seed=21)
    q = score.Picker("score", seed=21)
    assert math.isnan(p.reuse)  # (nothing measured yet: the gate presumes reuse)
    p.pick_prefix(states, 0.0, STALE, b"", 0)
    assert math.isnan(p.reuse)  # (a request with no key measures nothing)
    q.pick(states, 0.0, STALE)
    early = []
    for k in range(400):
        i = p.pick_prefix(states, 0.0, STALE, pack([70_000 + k, 9, 9]), 0)
        assert q.pick(states, 0.0, STALE) == 0
        if k < 20:
            early.append(i)
        elif k >= 300:
            assert i == 0, k
    assert set(early) != {0}  # (while reuse was presumed: placed by the hash, over the pool)
    assert p.reuse < score.REUSE_MIN
    assert p.decisions() == (0, 0, 0, 401)
    # a later turn no router has seen goes to its conversation's home, as at every router
    anchor = 0xC0FFEE
    home = max(range(4), key=lambda i: _rendezvous(score, anchor, states[i].tag))
    assert home != 0
    assert p.pick_prefix(states, 0.0, STALE, pack([80_001, 80_002], anchor=anchor, shallow=1), 0) == home
    # a new session too
    sess = next(s for s in range(1, 100) if max(range(4), key=lambda i: _rendezvous(score, s, states[i].tag)) != 0)
    assert p.pick_prefix(states, 0.0, STALE, b"", sess) != 0
    # prompts coming back (hits): first turns are hashed again
    for _ in range(8):
        p.pick_prefix(states, 0.0, STALE, pack([70_399, 9, 9]), 0)
    assert p.reuse >= score.REUSE_MIN
    placed = {p.pick_prefix(states, 0.0, STALE, pack([90_000 + k, 9, 9]), 0) for k in range(20)}
    assert placed != {0}


def test_a_shared_system_prompt_does_not_decide(score: ModuleType) -> None:
    """A match that covers only the blocks before the anchor (a system prompt other
    conversations share) is not a hit: the conversation's anchor decides, as it did
    at the router that saw its first turn."""
    a, b = fleet(score, 6), fleet(score, 6)
    pa, pb = score.Picker("prefix", seed=10), score.Picker("prefix", seed=11)
    system = [901, 902, 903]  # 3 whole blocks of system prompt
    # router B has seen many conversations with that system prompt
    for k in range(30):
        pb.pick_prefix(b, 0.0, STALE, pack([*system, 5000 + k], 7000 + k, 3), 0)
    # router A sees conversation X's first turn; router B its second
    x1 = pack([*system, 42], 4242, 3)
    x2 = pack([*system, 43, 44, 45], 4242, 3)
    ia = pa.pick_prefix(a, 0.0, STALE, x1, 0)
    ib = pb.pick_prefix(b, 0.1, STALE, x2, 0)
    assert a[ia].tag == b[ib].tag
    assert pb.decisions()[0] == 0  # never a prefix hit on the system prompt alone
    # a match past the anchor is a hit
    assert pb.pick_prefix(b, 0.2, STALE, pack([*system, 43, 44, 45, 46], 4242, 3), 0) == ib
    assert pb.decisions()[0] == 1
    # a first turn (nothing after its anchor) whose only match is a short system prompt
    # goes where its anchor hashes, as a router that never saw that prompt sends it
    c = fleet(score, 6)
    pc = score.Picker("prefix", seed=15)
    first = pb.pick_prefix(b, 0.3, STALE, pack([*system, 8000], 8888, 3, later=False), 0)
    assert pb.decisions()[0] == 1
    assert b[first].tag == c[pc.pick_prefix(c, 0.3, STALE, pack([*system, 8000], 8888, 3, later=False), 0)].tag
    # ... but a long one (more than SHORT_SHARED blocks) takes the system prompt's replica
    long_system = list(range(900, 900 + score.SHORT_SHARED + 1))
    home = pb.pick_prefix(b, 0.4, STALE, pack([*long_system, 7999], 7777, len(long_system)), 0)
    again = pb.pick_prefix(b, 0.5, STALE, pack([*long_system, 8001], 8889, len(long_system), later=False), 0)
    assert again == home and pb.decisions()[0] == 2


def test_a_later_turn_follows_its_anchor(score: ModuleType) -> None:
    """A second turn shares with the first only what ends inside its anchor (the first
    user message): the router that placed the first turn sends it where that went,
    by the anchor it keeps in the index, not where the anchor hashes."""
    states = fleet(score, 6)
    p = score.Picker("prefix", seed=16)
    system = [911, 912]
    t1 = pack([*system, 50], 5150, 2, later=False)
    home = p.pick_prefix(states, 0.0, STALE, t1, 0)
    assert p.decisions() == (0, 0, 0, 1)
    # the same first turn at a router whose anchor's home is draining goes elsewhere
    q = score.Picker("prefix", seed=17)
    for i, x in enumerate(states):
        x.draining = i == home
    moved = q.pick_prefix(states, 0.0, STALE, t1, 0)
    assert moved != home
    for x in states:
        x.draining = False
    # turn 2 (its match ends at the anchor's whole blocks): where each router sent turn 1
    t2 = pack([*system, 51, 52, 53], 5150, 2)
    assert p.pick_prefix(states, 0.1, STALE, t2, 0) == home
    assert q.pick_prefix(states, 0.1, STALE, t2, 0) == moved
    assert p.decisions() == q.decisions() == (1, 0, 0, 1)
    # a router that never saw the conversation: where its anchor hashes
    r = score.Picker("prefix", seed=18)
    assert r.pick_prefix(states, 0.1, STALE, t2, 0) == home
    assert r.decisions() == (0, 0, 0, 1)


def test_a_shared_pool_sends_unseen_turns_home(score: ModuleType) -> None:
    """With other routers' requests on the pool (its own in flight under SHARED_FLEET of
    the load it sees), a later turn this router knows only from an older turn (its
    match ends more than KNOWN_TURN blocks before the chain's end) goes to its
    conversation's home, where the routers that did not see it send it; a router that is
    alone on the pool follows its index."""
    tags = [score.default_tag(300 + i) for i in range(4)]
    anchor = 6060
    home_tag = max(tags, key=lambda t: _rendezvous(score, anchor, t))
    old = pack([1, 2, 3], anchor, 1)  # turn 2, seen here, placed away from home
    new = pack([1, 2, 3, *range(4, 4 + score.KNOWN_TURN + 2)], anchor, 1)  # turn 4
    for alone in (True, False):
        states = fleet(score, 4, slots=8.0)
        for x, t in zip(states, tags, strict=True):
            x.tag = t
        home = next(i for i, x in enumerate(states) if x.tag == home_tag)
        p = score.Picker("prefix", seed=19)
        for i, x in enumerate(states):
            x.draining = i == home
        away = p.pick_prefix(states, 0.0, STALE, old, 0)
        for x in states:
            x.draining = False
        assert away != home
        load(states[away], 1)  # this router's own request in flight
        if not alone:  # the scrape shows the others' requests: 8 on the pool
            for i, x in enumerate(states):
                x.on_scrape(0.05, 0, 2 + (1 if i == away else 0), 0.1)
        pick = p.pick_prefix(states, 0.1, STALE, new, 0)
        assert pick == (away if alone else home), alone
        assert p.decisions()[0] == 1
    # ... and a turn it saw the previous turn of stays where that went
    states = fleet(score, 4, slots=8.0)
    for x, t in zip(states, tags, strict=True):
        x.tag = t
    home = next(i for i, x in enumerate(states) if x.tag == home_tag)
    p = score.Picker("prefix", seed=20)
    for i, x in enumerate(states):
        x.draining = i == home
        x.on_scrape(0.0, 0, 2, 0.1)
    prev = pack([1, 2, 3, 4, 5, 6], anchor, 1)
    away = p.pick_prefix(states, 0.0, STALE, prev, 0)
    for x in states:
        x.draining = False
    assert p.pick_prefix(states, 0.1, STALE, pack([1, 2, 3, 4, 5, 6, 7, 8], anchor, 1), 0) == away


def _rendezvous(score: ModuleType, key: int, tag: int) -> int:
    """The rendezvous weight the picker gives a replica for a key (SplitMix64's finalizer)."""
    m = (1 << 64) - 1
    z = (key ^ tag) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_index_is_bounded_and_ages_out(score: ModuleType) -> None:
    states = fleet(score, 4)
    p = score.Picker("prefix", seed=8, index_entries=64, session_entries=16, entry_ttl=10.0)
    assert p.index_capacity() == (64, 16)
    for k in range(500):
        p.pick_prefix(states, 0.0, STALE, pack([k * 7919 + 1, k * 104729 + 3]), k + 1)
    assert p.index_size(0.0) == (64, 16)  # full, never more
    assert p.index_size(9.9) == (64, 16)
    assert p.index_size(10.5) == (0, 0)  # aged out
    # an aged-out prefix is not a hit
    chain = pack([424242])
    p.pick_prefix(states, 11.0, STALE, chain, 0)
    before = p.decisions()
    p.pick_prefix(states, 12.0, STALE, chain, 0)
    assert p.decisions()[0] == before[0] + 1
    p.pick_prefix(states, 30.0, STALE, chain, 0)
    assert p.decisions()[0] == before[0] + 1 and p.decisions()[3] == before[3] + 1
    # a bucket keeps its most recently used keys
    q = score.Picker("prefix", seed=9, index_entries=4)
    for k, key in enumerate((4, 8, 12, 16, 20)):  # (one bucket: every key maps to it)
        q.pick_prefix(states, float(k), STALE, pack([key]), 0)
    assert q.index_size(5.0) == (4, 0)
    q.pick_prefix(states, 6.0, STALE, pack([4]), 0)  # 4 was evicted, the oldest
    assert q.decisions()[0] == 0
    q.pick_prefix(states, 7.0, STALE, pack([20]), 0)
    assert q.decisions()[0] == 1


def test_other_strategies_keep_no_tables(score: ModuleType) -> None:
    states = fleet(score, 3)
    p = score.Picker("score", seed=1)
    q = score.Picker("score", seed=1)
    for k in range(20):
        assert p.pick_prefix(states, 0.0, STALE, pack([k]), k) == q.pick(states, 0.0, STALE)
    assert p.index_capacity() == (0, 0) and p.decisions() == (0, 0, 0, 0)
    # prefix without a key: score's pick, counted blind
    r = score.Picker("prefix", seed=1)
    s = score.Picker("score", seed=1)
    assert r.pick(states, 0.0, STALE) == s.pick(states, 0.0, STALE)
    assert r.decisions() == (0, 0, 0, 1)
    with pytest.raises(ValueError):
        score.Picker("prefix", index_entries=2)
    with pytest.raises(ValueError):
        score.Picker("prefix", load_bound=-1.0)


# -- routes learnt from other routers (llmgw.fleet.share) --------------------------


def test_a_learnt_route_is_followed(score: ModuleType) -> None:
    """``learn`` records another router's pick as this router's own would be: the chain's blocks,
    the conversation's anchor and its session; a later turn then goes where it went."""
    states = fleet(score, 4)
    p = score.Picker("prefix", seed=31)
    elsewhere = 2
    chain = pack([41, 42, 43, 44, 45, 46], 4040, 1)
    p.learn(chain, 777, states[elsewhere].tag, 0.0)
    assert p.index_size(0.0) == (7, 1)  # 6 blocks and the anchor; the session
    assert p.pick_prefix(states, 0.1, STALE, pack([41, 42, 43, 44, 45, 46, 47], 4040, 1), 0) == elsewhere
    assert p.decisions() == (1, 0, 0, 0)
    assert p.pick_prefix(states, 0.2, STALE, b"", 777) == elsewhere  # the session too
    assert p.decisions() == (1, 1, 0, 0)
    # no key: nothing but the session; a tag of 0 or another strategy: nothing
    q = score.Picker("prefix", seed=32)
    q.learn(b"\x01" * 16, 5, states[1].tag, 0.0)
    assert q.index_size(0.0) == (0, 1)
    q.learn(chain, 6, 0, 0.0)
    assert q.index_size(0.0) == (0, 1)
    r = score.Picker("score", seed=33)
    r.learn(chain, 7, states[1].tag, 0.0)
    assert r.index_size(0.0) == (0, 0)
    # a zero word in a received chain is no key (0 marks an empty slot)
    z = score.Picker("prefix", seed=34)
    z.learn(pack([0, 0, 9]), 0, states[3].tag, 0.0)
    assert z.index_size(0.0) == (1, 0)
    with pytest.raises(TypeError):
        z.learn(None, 0, 1, 0.0)


def test_a_sharing_router_keeps_a_known_conversation_off_its_home(score: ModuleType) -> None:
    """On a shared pool a later turn this router knows only from an older turn goes home; while it
    shares routes (``shared``) and knows where the conversation went (its anchor, learnt), it goes there."""
    tags = [score.default_tag(500 + i) for i in range(4)]
    anchor = 7070
    home_tag = max(tags, key=lambda t: _rendezvous(score, anchor, t))
    new = pack([1, 2, 3, *range(4, 4 + score.KNOWN_TURN + 2)], anchor, 1)
    for shared in (False, True):
        states = fleet(score, 4, slots=8.0)
        for x, t in zip(states, tags, strict=True):
            x.tag = t
        home = next(i for i, x in enumerate(states) if x.tag == home_tag)
        away = (home + 1) % 4
        p = score.Picker("prefix", seed=35)
        assert p.shared is False
        p.shared = shared
        p.learn(pack([1, 2, 3], anchor, 1), 0, tags[away], 0.0)  # turn 2 went there, at another router
        for x in states:  # the others' requests on the pool
            x.on_scrape(0.05, 0, 2, 0.1)
        assert p.pick_prefix(states, 0.1, STALE, new, 0) == (away if shared else home), shared


async def test_a_pool_outbox_keeps_conversation_turns() -> None:
    """``ModelPool.outbox`` (while routes are shared) gets each keyed pick of a request with a session
    or of a later turn, not first turns or single requests; without an outbox nothing is kept."""
    from llmgw.config import load as load_config
    from llmgw.fleet.registry import Registry

    cfg = load_config({"routing": {"strategy": "prefix"},
                       "endpoints": [{"id": f"r{i}", "url": f"http://127.0.0.1:{9000 + i}", "model": "m",
                                      "engine": "vllm"} for i in range(2)]})
    reg = Registry(cfg)
    pool = reg.pools["m"]
    assert pool.keyed and pool.outbox is None
    for ep in pool.endpoints:
        ep.state.slots = 4.0
        ep.state.on_scrape(0.0, 0, 0, 0.1)
    first, later = pack([1, 2], 99, 1, later=False), pack([1, 2, 3], 99, 1)
    pool.pick_keyed(0.0, STALE, (), later, 0)  # no outbox: nothing kept
    pool.outbox = []
    a = pool.pick_keyed(0.0, STALE, (), first, 0)
    assert a is not None and pool.outbox == []
    b = pool.pick_keyed(0.0, STALE, (), later, 0)
    c = pool.pick_keyed(0.0, STALE, (), b"", 55)
    assert b is not None and c is not None
    d = pool.pick_keyed(0.0, STALE, (b,), later, 0)  # a retry elsewhere counts too
    assert d is not None and d is not b
    assert pool.outbox == [(later, 0, b.state.tag), (b"", 55, c.state.tag), (later, 0, d.state.tag)]
    reg.close()
