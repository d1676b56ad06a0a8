"""Enter on a node without GPUs: the empty GPUs table says so of that node (``--gpu-source none``, or a CPU
node), not "no GPUs reported (no nodes, or nodes without GPUs)", which is the fleet's empty GPUs view.
Against a recorded admin API over HTTP on 127.0.0.1."""

from __future__ import annotations

import pytest
from console_helpers import wait_for

from llmgw.console.app import ConsoleApp
from llmgw.console.client import AdminClient
from llmgw.console.replay import ReplayAPI, fleet, serve_in_thread

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("source", "said"), [
    ("none", "zz-cpu-node reports no GPUs (its agent's --gpu-source is none)"),
    ("nvml", "zz-cpu-node reports no GPUs (a CPU node, or its GPUs unseen)"),
])
async def test_a_node_without_gpus_says_so_when_entered(source: str, said: str) -> None:
    routes = fleet(endpoints=2, nodes=2, gpus_per_node=1)
    routes["/admin/v1/nodes"]["nodes"].append({
        "name": "zz-cpu-node", "id": "id-cpu", "state": "up", "cordoned": False, "hostname": "cpu-host",
        "agent_version": "0.9.0", "heartbeat_age_s": 0.5, "gpu_source": source, "gpu_count": 0, "errors": [],
        "facts": {}})
    with serve_in_thread(ReplayAPI(routes)) as port:
        app = ConsoleApp(AdminClient(f"http://127.0.0.1:{port}"), refresh=3600, start="nodes")
        async with app.run_test(size=(120, 30)) as pilot:
            await app.wait_for_update()
            assert [r.key for r in app.rendered_rows][-1] == "zz-cpu-node"
            await pilot.press("end", "enter")
            await wait_for(lambda: app.view.name == "gpus" and app.polls >= 2, what="the node's GPUs")
            await wait_for(lambda: app.message_text != "", what="the empty table's line")
            assert app.rendered_rows == []
            assert app.message_text == said
            # the fleet's GPUs view is not empty: its own line is not said here
            assert "no nodes, or nodes without GPUs" not in app.message_text
