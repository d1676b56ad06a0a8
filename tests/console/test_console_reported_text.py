"""What agents and engines report, as the console shows it (Textual's Pilot against a real gateway, or a
recorded admin API, over real sockets): text that looks like markup is shown as written, never parsed
(``[/link]`` in a GPU's name crashed the GPU details); control characters are escaped; a node past its
heartbeat grace has no current readings in the details either; a node's own errors are shown above its
GPUs; a console pointed at the client port does not say "connected"; a scale takes 0-1024 only; the
details screens show values as the tables do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from console_helpers import gateway, register, wait_for

from llmgw.console.app import AskScreen, ConfirmScreen, ConsoleApp, TextScreen
from llmgw.console.client import AdminClient
from llmgw.console.replay import ReplayAPI, fleet, serve_in_thread

pytestmark = pytest.mark.timeout(90)

MARKUP_GPU = {"uuid": "GPU-11111111-2222-4333-8444-555555555555", "index": 0, "name": "NVIDIA H100 [/link]",
              "pci_bus_id": "00000000:01:00.0", "memory_total_bytes": 85899345920, "memory_used_bytes": 2**30,
              "utilization_gpu_ratio": 0.05, "temperature_celsius": 40.0, "errors": ["fell off [/red] the bus"]}


def keys(app: ConsoleApp) -> list[str]:
    return [r.key for r in app.rendered_rows]


def body(app: ConsoleApp) -> str:
    screen = app.screen
    assert isinstance(screen, TextScreen), screen
    return screen.body.plain if hasattr(screen.body, "plain") else str(screen.body)


async def test_markup_and_control_characters_from_an_agent_are_shown_as_written(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        await register(gw.control_port, "node-m", {
            "hostname": "host [/b]", "facts": {"driver_version": "550.54[/]"},
            "gpus": [MARKUP_GPU, {**MARKUP_GPU, "uuid": "GPU-esc", "index": 1, "name": "H100\x1b[2J\x9b"}],
            "errors": ["nvidia-smi said [bold]no[/] \x1b]0;PWNED\x07 \x1b[2J"]})
        app = ConsoleApp(AdminClient(gw.url), refresh=0.2, start="gpus")
        async with app.run_test(size=(120, 40)) as pilot:
            await app.wait_for_update()
            # the table: the name as written, the cell free of markup and control characters
            await pilot.press("slash", *"link", "enter")
            await app.wait_for_update()
            assert [r.record["name"] for r in app.rendered_rows] == ["NVIDIA H100 [/link]"]
            # enter: the GPU's details (this crashed the console: MarkupError)
            await pilot.press("enter")
            text = body(app)
            assert "name: NVIDIA H100 [/link]" in text and "fell off [/red] the bus" in text
            await pilot.press("escape")
            # a GPU whose name holds control characters: escaped in its cell (never drawn raw)
            await pilot.press("slash", *"GPU-esc", "enter")
            await app.wait_for_update()
            assert [r.cells[9] for r in app.rendered_rows] == ["H100\\x1b[2J\\x9b"]
            # a filter that looks like markup (shown in the breadcrumbs as typed)
            await pilot.press("slash", *"[/x]")
            await app.wait_for_update()
            assert "filter /[/x]" in str(app._shown["#crumbs"])
            await pilot.press("escape", "escape")
            # the node's own errors, above its GPUs: escaped, never sent to the terminal raw
            await pilot.press("colon", *"nodes", "enter")
            await app.wait_for_update()
            app.main.query_one("#table").cursor = keys(app).index("node-m")
            await pilot.press("enter")
            await app.wait_for_update()
            assert app.place.scope == ("node", "node-m")
            assert "node-m: nvidia-smi said [bold]no[/] \\x1b]0;PWNED\\x07 \\x1b[2J" in app.message_text
            assert "\x1b" not in app.message_text and "\x07" not in app.message_text
            assert app.is_running


async def test_a_nodes_own_errors_are_shown_above_its_gpus(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw:
        await register(gw.control_port, "node-h", {"hostname": "host-h", "source": "nvidia-smi", "gpus": [],
                                                   "errors": ["nvidia-smi did not answer within 10 s"]})
        await register(gw.control_port, "node-e", {"hostname": "host-e", "gpus": [MARKUP_GPU],
                                                   "errors": [f"error {i}" for i in range(4)]})
        app = ConsoleApp(AdminClient(gw.url), refresh=0.2, start="nodes")
        async with app.run_test(size=(120, 40)) as pilot:
            await app.wait_for_update()
            app.main.query_one("#table").cursor = keys(app).index("node-h")
            await pilot.press("enter")
            await app.wait_for_update()
            assert app.place.scope == ("node", "node-h")
            assert app.message_text.splitlines() == [
                "node-h: nvidia-smi did not answer within 10 s",
                "node-h reports no GPUs (a CPU node, or its GPUs unseen)",
            ]
            assert app.main.query_one("#message").has_class("warn")
            await pilot.press("escape")
            await app.wait_for_update()
            app.main.query_one("#table").cursor = keys(app).index("node-e")
            await pilot.press("enter")
            await app.wait_for_update()
            assert app.message_text.splitlines() == [
                "node-e: error 0", "node-e: error 1", "… and 2 more error(s): llmgw ctl nodes node-e lists them"]
            # (a node without errors: nothing above its GPUs)
            await pilot.press("escape")
            await app.wait_for_update()
            app.main.query_one("#table").cursor = keys(app).index("node-a")
            await pilot.press("enter")
            await app.wait_for_update()
            assert app.message_text == "" and len(app.rendered_rows) == 2


async def test_the_details_of_a_gpu_of_a_node_past_its_grace_have_no_current_readings(tmp_path: Path) -> None:
    # (the nodes registered by the helper send no heartbeat: past a short grace, they are unhealthy)
    async with gateway(tmp_path, grace="0.5s") as gw:
        app = ConsoleApp(AdminClient(gw.url), refresh=0.2, start="gpus")
        async with app.run_test(size=(120, 60)) as pilot:
            await wait_for(lambda: app.rendered_rows and all(r.record["node_state"] == "unhealthy"
                                                             for r in app.rendered_rows), what="the nodes unhealthy")
            await pilot.press("slash", *"^node-a", "enter")
            await app.wait_for_update()
            row = app.rendered_rows[0]
            assert row.cells[8].plain == "node unhealthy"  # type: ignore[union-attr]  # (the table, as before)
            await pilot.press("enter")
            text = body(app)
            assert text.startswith("node unhealthy: no current readings")
            lines = dict(line.split(": ", 1) for line in text.splitlines()[2:] if ": " in line)
            for k in ("utilization_gpu_ratio", "temperature_celsius", "power_watts", "memory_used_bytes"):
                assert lines[k] == "–", (k, lines[k])
            assert lines["health"] == "unknown"
            assert lines["name"] == "NVIDIA H100 80GB HBM3" and lines["memory_total_bytes"] == "80.0 GiB"
            # the Nodes view: no current error count either (QA: 0, read as none)
            await pilot.press("escape", "colon", *"nodes", "enter")
            await app.wait_for_update()
            nodes = {r.key: r for r in app.rendered_rows}
            assert nodes and all(str(r.cells[7]) == "–" for r in nodes.values()), [r.cells for r in nodes.values()]


async def test_the_client_port_is_not_called_connected(tmp_path: Path) -> None:
    async with gateway(tmp_path, control=False) as gw:
        assert gw.runtime.listen_addr is not None
        app = ConsoleApp(AdminClient(f"http://127.0.0.1:{gw.runtime.listen_addr[1]}"), refresh=0.2)
        async with app.run_test(size=(120, 30)):
            await app.wait_for_update()
            status = str(app._shown["#status"])
            assert "connected" not in status and "not an admin API" in status, status
            assert "is the client port, not the admin port" in app.message_text
        # the admin port: connected
        app = ConsoleApp(AdminClient(gw.url), refresh=0.2)
        async with app.run_test(size=(120, 30)):
            await app.wait_for_update()
            assert "● connected" in str(app._shown["#status"])


@pytest.mark.parametrize("typed", ["99999", "1025", "٣", "-1", "1_0", " "])
async def test_scale_takes_0_to_1024_in_ascii_digits(typed: str) -> None:
    api = ReplayAPI(fleet(endpoints=2, nodes=1, gpus_per_node=1))
    with serve_in_thread(api) as port:
        app = ConsoleApp(AdminClient(f"http://127.0.0.1:{port}"), refresh=3600, start="deployments")
        async with app.run_test(size=(120, 30)) as pilot:
            await app.wait_for_update()
            await pilot.press("s")
            screen = app.screen
            assert isinstance(screen, AskScreen)
            from textual.widgets import Input

            screen.query_one(Input).value = typed
            await pilot.press("enter")
            await pilot.pause()
            assert not isinstance(app.screen, ConfirmScreen)  # (refused before asking to confirm)
            assert app.told[-1] == f"{typed!r} is not a replica count: a whole number from 0 to 1024"
            assert api.posts == []
            await pilot.press("s")
            app.screen.query_one(Input).value = "1024"
            await pilot.press("enter")
            assert isinstance(app.screen, ConfirmScreen)


def _routes(**changes: Any) -> dict[str, Any]:
    routes = fleet(endpoints=2, nodes=2, gpus_per_node=2)
    routes.update(changes)
    return routes


async def test_empty_views_say_what_fills_them() -> None:
    routes = _routes(**{"/admin/v1/deployments": {"deployments": []},
                        "/admin/v1/mirror/models": {"root": "/m", "models": []}})
    with serve_in_thread(ReplayAPI(routes)) as port:
        for read_only in (False, True):
            app = ConsoleApp(AdminClient(f"http://127.0.0.1:{port}"), refresh=3600, start="mirror",
                             read_only=read_only)
            async with app.run_test(size=(160, 30)) as pilot:
                await app.wait_for_update()
                if read_only:  # (I is hidden: not offered)
                    assert "press I" not in app.message_text and "llmgw mirror import-ollama" in app.message_text
                else:
                    assert "press I" in app.message_text
                await pilot.press("colon", *"deployments", "enter")
                await app.wait_for_update()
                assert "llmgw ctl deploy" in app.message_text, app.message_text


async def test_details_show_values_as_the_tables_do() -> None:
    with serve_in_thread(ReplayAPI(_routes())) as port:
        app = ConsoleApp(AdminClient(f"http://127.0.0.1:{port}"), refresh=3600, start="gpus")
        async with app.run_test(size=(120, 60)) as pilot:
            await app.wait_for_update()
            await pilot.press("enter")
            text = body(app)
            lines = dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)
            assert lines["mig_mode"] == "no" and lines["xid_errors"] == "none" and lines["errors"] == "none"
            assert lines["ecc_corrected_volatile"] == "0" and lines["temperature_celsius"].endswith("°C")
            assert lines["utilization_gpu_ratio"].endswith("%") and lines["memory_total_bytes"] == "80.0 GiB"
            for python in ("False", "True", "{}", "[]", "None"):
                assert python not in text, (python, text)
            await pilot.press("escape", "colon", *"endpoints", "enter")
            await app.wait_for_update()
            await pilot.press("enter")
            lines = dict(line.split(": ", 1) for line in body(app).splitlines() if ": " in line)
            # (the first endpoint is a llama.cpp replica: it reports no KV use, absent, not 0%)
            assert lines["id"] == "llamacpp-0001" and lines["kv_cache_usage"] == "–"
            assert lines["draining"] == "no" and lines["stale"] == "no" and lines["last_scrape_age_s"].endswith("s")


def test_nodes_gpu_memory_and_utilisation_are_over_the_gpus_that_report_them() -> None:
    """One GPU without a memory reading (or a MIG GPU without utilisation) does not blank the node's bar:
    both are over the GPUs that report them, – only when none does."""
    from llmgw.console.views import ABSENT, NodesView

    gib = 2**30
    gpus = [{"node": "n", "memory_used_bytes": 20 * gib, "memory_total_bytes": 80 * gib, "utilization_gpu_ratio": 0.5},
            {"node": "n", "memory_used_bytes": None, "memory_total_bytes": 80 * gib, "utilization_gpu_ratio": None},
            {"node": "m", "memory_used_bytes": None, "memory_total_bytes": 80 * gib, "utilization_gpu_ratio": None}]
    data = {"/admin/v1/nodes": {"nodes": [{"name": "n", "state": "up", "gpu_count": 2},
                                          {"name": "m", "state": "up", "gpu_count": 1}]},
            "/admin/v1/gpus": {"gpus": gpus}}
    rows = {r.key: r for r in NodesView().rows(data)}
    util, mem = rows["n"].cells[5], rows["n"].cells[6]
    assert str(getattr(util, "plain", util)).endswith(" 50%") and str(getattr(mem, "plain", mem)).endswith(" 25%")
    assert rows["m"].cells[5] == ABSENT and rows["m"].cells[6] == ABSENT
