"""The supervisor without an engine to run: what it says, what it keeps, what it cleans."""

from __future__ import annotations

import dataclasses
import os
import socket
import struct
import subprocess
import threading
from pathlib import Path

import orjson

from canary import secret
from launch.helpers import Watched
from llmgw.config.agent import AgentEngineConfig
from llmgw.launch.spec import FAILED, STARTING, STOPPED, ModelBlob, ReplicaSpec
from llmgw.launch.supervisor import fingerprint, http_status, process_start_time

KEY = secret("replica")


def spec_for(model: Path, **kw: object) -> ReplicaSpec:
    fields: dict[str, object] = dict(id="chat-1", deployment="chat", engine="llamacpp", model=str(model),
                                     served_name="tiny", api_key=KEY)
    fields.update(kw)
    return ReplicaSpec(**fields)  # type: ignore[arg-type]


async def test_a_spec_the_supervisor_cannot_run_fails_saying_why(tmp_path: Path) -> None:
    w = Watched(tmp_path / "state", engines={"llamacpp": AgentEngineConfig(binary=str(tmp_path / "nope"))})
    try:
        await w.sup.apply([spec_for(tmp_path / "m.gguf"),
                           spec_for(tmp_path / "m.gguf", id="mirror-1", blobs=(ModelBlob("sha256:" + "0" * 64, 1),))])
        st = await w.wait_state("chat-1", FAILED)
        assert "engines.llamacpp.binary" in st.message
        st = await w.wait_state("mirror-1", FAILED)
        assert "mirror" in st.message
        assert STARTING not in (s.state for s in w.sup.statuses())
    finally:
        await w.sup.close()


async def test_bad_specs_fail_alone(tmp_path: Path) -> None:
    w = Watched(tmp_path / "state")
    try:
        await w.sup.apply([spec_for(tmp_path / "m", id="../evil"), spec_for(tmp_path / "m", id="k", api_key=""),
                           spec_for(tmp_path / "m", id="e", engine="ollama")])
        assert "not a name" in (await w.wait_state("../evil", FAILED)).message
        assert "no API key" in (await w.wait_state("k", FAILED)).message
        assert "no launcher for engine 'ollama'" in (await w.wait_state("e", FAILED)).message
        assert not list((tmp_path / "state").glob("*evil*"))
        await w.sup.apply([])
        assert {s.state for s in w.sup.statuses()} == {STOPPED}
        try:
            w.sup.log_tail("nobody")
        except KeyError:
            pass
        else:
            raise AssertionError("log_tail of an unknown replica must raise KeyError")
    finally:
        await w.sup.close()


def test_the_fingerprint_covers_the_whole_spec(tmp_path: Path) -> None:
    s = spec_for(tmp_path / "m", env={"A": "1"})
    assert fingerprint(s) == fingerprint(dataclasses.replace(s))
    for change in ({"api_key": "other"}, {"env": {"A": "2"}}, {"gpus": ("GPU-1",)}, {"args": ("-x",)},
                   {"slots": 2}, {"served_name": "n"}):
        assert fingerprint(dataclasses.replace(s, **change)) != fingerprint(s), change  # type: ignore[arg-type]


async def test_records_of_other_processes_are_not_adopted(tmp_path: Path) -> None:
    """A record whose pid now belongs to another process (start time differs) is dropped; that process lives."""
    state = tmp_path / "state"
    (state / "replicas").mkdir(parents=True)
    other = subprocess.Popen(["sleep", "30"])
    try:
        start = process_start_time(other.pid)
        assert start is not None
        (state / "replicas" / "r-1.json").write_text(orjson.dumps(
            {"version": 1, "id": "r-1", "pid": other.pid, "start_time": start - 1, "port": 1,
             "fingerprint": "x"}).decode())
        (state / "replicas" / "r-2.json").write_text("{not json")
        w = Watched(state)
        await w.sup.adopt()
        assert w.sup.statuses() == []
        assert list((state / "replicas").iterdir()) == []
        assert other.poll() is None
        await w.sup.close()
    finally:
        other.kill()
        other.wait()
    assert os.path.isdir(state / "logs")


async def test_a_probe_of_a_port_that_resets_every_connection_answers_none() -> None:
    """A health probe of an engine that is dying (it accepts, then resets) is "no answer", never an error.

    On uvloop a write to a connection the peer has reset already raises RuntimeError, not OSError; once
    that escaped the probe and failed the replica's supervision (leaving the engine unreaped).
    """
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(512)
    srv.settimeout(0.2)
    port = srv.getsockname()[1]
    done = threading.Event()

    def reset_all() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    t = threading.Thread(target=reset_all)
    t.start()
    try:
        answers = [await http_status("127.0.0.1", port, "/health", timeout=2.0) for _ in range(400)]
    finally:
        done.set()
        t.join(5)
        srv.close()
    assert answers == [None] * 400


async def test_a_log_tail_never_shows_a_key_an_engine_printed(tmp_path: Path) -> None:
    """SGLang prints its settings, key included: the tail of a replica no longer known (or adopted
    from before a restart, with no spec to say its key) shows none of it either."""
    w = Watched(tmp_path / "state")
    try:
        log = w.sup._log_path("gone-1")
        log.write_text(f"server_args=ServerArgs(model_path='m', api_key='{KEY}', port=30000)\n"
                       f"--- llmgw: starting gone-1: python -m sglang.launch_server --api-key {KEY} --port 1\n"
                       '{"api_key": "' + KEY + '", "x": 1}\n')
        tail = w.sup.log_tail("gone-1", 10)
        assert KEY not in tail and tail.count("***") == 3, tail
        assert "api_key='***'" in tail and "--port 1" in tail
    finally:
        await w.sup.close()
