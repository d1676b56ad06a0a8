"""The Deployments view against a recorded admin API in the shape of ``/admin/v1/deployments``
(desired and ready replicas, where each runs, why one is not placed): Enter shows the replicas'
log tails, ``s`` scales (asking for the count, then confirming), and a gateway without the API
says so instead of showing an empty table."""

from __future__ import annotations

import pytest
from console_helpers import wait_for

from llmgw.console.app import AskScreen, ConfirmScreen, ConsoleApp, TextScreen
from llmgw.console.client import AdminClient
from llmgw.console.replay import ReplayAPI, fleet, serve_in_thread

pytestmark = pytest.mark.timeout(60)


async def test_deployments_scale_and_log_tails() -> None:
    api = ReplayAPI(fleet(endpoints=2, nodes=2, gpus_per_node=1))
    with serve_in_thread(api) as port:
        app = ConsoleApp(AdminClient(f"http://127.0.0.1:{port}"), refresh=3600, start="deployments")
        async with app.run_test(size=(120, 30)) as pilot:
            await app.wait_for_update()
            assert [r.key for r in app.rendered_rows] == ["chat", "vision"]
            chat = app.rendered_rows[0]
            assert "no node has 12.0 gb" in chat.text and "node-000,node-001" in chat.text
            await pilot.press("enter")
            await wait_for(lambda: isinstance(app.screen, TextScreen), what="the log tails")
            text = str(app.screen.body)  # type: ignore[attr-defined]
            assert "chat-a1 on node-000: ready" in text and "all slots are idle" in text
            assert "chat-b2" in text and "no log:" in text  # (its node has none: said, not hidden)
            await pilot.press("escape")
            await pilot.press("s")
            assert isinstance(app.screen, AskScreen)
            await pilot.press("backspace", "5", "enter")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("y")
            await wait_for(lambda: "/admin/v1/deployments/chat/scale" in api.posts, what="the scale call")
            await pilot.press("s", "backspace", "x", "enter")
            assert any("not a replica count" in t for t in app.told)


async def test_a_gateway_without_the_deployments_api() -> None:
    routes = fleet(endpoints=2, nodes=1, gpus_per_node=1)
    del routes["/admin/v1/deployments"]
    with serve_in_thread(ReplayAPI(routes)) as port:
        app = ConsoleApp(AdminClient(f"http://127.0.0.1:{port}"), refresh=3600, start="deployments")
        async with app.run_test(size=(80, 24)):
            await app.wait_for_update()
            assert app.rendered_rows == []
            assert "the control plane has no deployments API" in app.message_text


def test_the_reason_is_one_line_as_ctl_shows_it() -> None:
    """A crash-looping replica's message carries the end of its log: the view's cell is the reason and the
    log's telling line (what llmgw ctl deployments shows), never the log's lines; a ready replica's own
    message ("ready") is no reason."""
    from llmgw.console.views import ABSENT, DeploymentsView

    log = "--- llmgw 2025-01-01T00:00:00Z: starting c-1: llama-server -m m.gguf\nerror: invalid argument: -x\n" * 3
    doc = {"deployments": [
        {"name": "crash", "desired": 1, "ready": 0, "nodes": ["n1"],
         "message": f"replica c-1 on n1: exited with status 1; restarting in 8s (3 restarts so far); its log ends:\n{log}",
         "replicas": [{"id": "c-1", "node": "n1", "state": "starting", "message": "started: llama-server"}]},
        {"name": "fine", "desired": 1, "ready": 1, "nodes": ["n1"], "message": None,
         "replicas": [{"id": "f-1", "node": "n1", "state": "ready", "message": "ready"}]},
        {"name": "fetch", "desired": 1, "ready": 0, "nodes": ["n1"], "message": None,
         "replicas": [{"id": "g-1", "node": "n1", "state": "fetching", "message": "fetching the model"}]},
    ]}
    rows = {r.key: r for r in DeploymentsView().rows({"/admin/v1/deployments": doc})}
    assert rows["crash"].cells[-1] == ("replica c-1 on n1: exited with status 1; restarting in 8s (3 restarts so far); "
                                       "log: error: invalid argument: -x")
    assert rows["fine"].cells[-1] == ABSENT
    assert rows["fetch"].cells[-1] == "fetching the model"


async def test_a_deployed_model_with_no_replica_ready_is_a_model() -> None:
    """The Models view lists a deployed model before any replica of it is ready (with its deployments'
    ready of desired), and Enter on it goes to its deployments, which say why; a gateway with no
    deployments API shows its models as before, with no error about the API it lacks."""
    api = ReplayAPI(fleet(endpoints=2, nodes=2, gpus_per_node=1))
    with serve_in_thread(api) as port:
        app = ConsoleApp(AdminClient(f"http://127.0.0.1:{port}"), refresh=3600, start="models")
        async with app.run_test(size=(140, 30)) as pilot:
            await app.wait_for_update()
            rows = {r.key: r for r in app.rendered_rows}
            assert "vision" in rows and "llava:7b" not in rows, sorted(rows)  # (served as, not made of)
            vision = rows["vision"]
            assert vision.cells[2] == "0/0" and vision.cells[3].plain == "0/1"  # type: ignore[union-attr]
            served = next(k for k, r in rows.items() if r.record["total"] > 0)
            assert rows[served].cells[3] == "–"  # (no deployment: not deployed, not "0")
            assert not app.message_text
            app.query_one("#table").focus()
            keys = [r.key for r in app.rendered_rows]
            for _ in range(keys.index("vision")):
                await pilot.press("down")
            await pilot.press("enter")
            await wait_for(lambda: app.place.view == "deployments", what="the model's deployments")
            await app.wait_for_update()
            assert [r.key for r in app.rendered_rows] == ["vision"]
    routes = fleet(endpoints=2, nodes=1, gpus_per_node=1)
    del routes["/admin/v1/deployments"]
    with serve_in_thread(ReplayAPI(routes)) as port:
        app = ConsoleApp(AdminClient(f"http://127.0.0.1:{port}"), refresh=3600, start="models")
        async with app.run_test(size=(120, 30)):
            await app.wait_for_update()
            assert app.rendered_rows and all(r.cells[3] == "–" for r in app.rendered_rows)
            assert "vision" not in {r.key for r in app.rendered_rows}
            assert not app.message_text


def test_a_deployment_is_counted_under_the_name_clients_use() -> None:
    """A deployment's row in the Models view is its served name (what its endpoints list and clients ask
    for), never its source (a mirror reference, a path): one row, its endpoints and its ready of desired."""
    from llmgw.console.views import ModelsView

    data = {
        "/admin/v1/endpoints": {"endpoints": [
            {"id": "d1-a", "models": ["chat-model"], "pool": "n1", "state": "ok", "usable": True}]},
        "/admin/v1/deployments": {"deployments": [
            {"name": "d1", "model": "llama3.2:1b", "served_name": "chat-model", "desired": 2, "ready": 1},
            {"name": "old", "model": "/models/x.gguf", "desired": 1, "ready": 0}]},  # (an API without served_name)
    }
    rows = {r.key: r for r in ModelsView().rows(data)}
    assert sorted(rows) == ["chat-model", "old"]
    assert rows["chat-model"].cells[2] == "1/1" and rows["chat-model"].cells[3].plain == "1/2"  # type: ignore[union-attr]
    assert rows["old"].cells[3].plain == "0/1"  # type: ignore[union-attr]
