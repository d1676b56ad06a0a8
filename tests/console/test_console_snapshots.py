"""SVG snapshots of every view at 80×24 (pytest-textual-snapshot), over HTTP from a recorded admin API.

The data is fixed (:func:`llmgw.console.replay.fleet`) and ages are hidden, so a snapshot
changes only when what the console draws changes. After a deliberate change to the
layout: ``pytest tests/console --snapshot-update``, then look at the SVGs it wrote.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmgw.console.app import ConsoleApp
from llmgw.console.client import AdminClient
from llmgw.console.replay import ReplayAPI, fleet, serve_in_thread

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def recorded() -> Iterator[str]:
    with serve_in_thread(ReplayAPI(fleet(endpoints=9, nodes=4, gpus_per_node=2))) as port:
        yield f"http://127.0.0.1:{port}"


def _app(url: str, view: str, **kw: object) -> ConsoleApp:
    # (a fixed name in the header: the recorded API's port differs run to run)
    return ConsoleApp(AdminClient(url), refresh=3600, name="recorded-fleet", show_ages=False, start=view, **kw)


async def _loaded(pilot: object) -> None:
    app = pilot.app  # type: ignore[attr-defined]
    assert isinstance(app, ConsoleApp)
    if app.polls == 0:
        await app.wait_for_update()
    await pilot.pause()  # type: ignore[attr-defined]


@pytest.mark.parametrize("view", ["endpoints", "models", "nodes", "gpus", "deployments", "mirror"])
def test_view_snapshot(snap_compare: object, recorded: str, view: str) -> None:
    assert snap_compare(_app(recorded, view), terminal_size=(80, 24), run_before=_loaded)  # type: ignore[operator]


def test_help_and_read_only_snapshot(snap_compare: object, recorded: str) -> None:
    assert snap_compare(_app(recorded, "endpoints", read_only=True), press=["question_mark"],  # type: ignore[operator]
                        terminal_size=(80, 24), run_before=_loaded)


def test_no_deployments_api_snapshot(snap_compare: object) -> None:
    routes = fleet(endpoints=9, nodes=4, gpus_per_node=2)
    del routes["/admin/v1/deployments"]
    with serve_in_thread(ReplayAPI(routes)) as port:
        assert snap_compare(_app(f"http://127.0.0.1:{port}", "deployments"),  # type: ignore[operator]
                            terminal_size=(80, 24), run_before=_loaded)
