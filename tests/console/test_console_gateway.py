"""The console (Textual's Pilot) against a real gateway over real sockets: simulated engines,
a control plane with registered nodes, the mirror and a hand-made Ollama store."""

from __future__ import annotations

from pathlib import Path

import pytest
from console_helpers import gateway, ollama_store, wait_for

from llmgw.console.app import ConfirmScreen, ConsoleApp, ImportScreen, TextScreen
from llmgw.console.client import AdminClient

pytestmark = pytest.mark.timeout(90)


def keys(app: ConsoleApp) -> list[str]:
    return [r.key for r in app.rendered_rows]


def state_of(app: ConsoleApp, key: str) -> str:
    row = next(r for r in app.rendered_rows if r.key == key)
    return str(row.record.get("state"))


async def test_every_view_and_action(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ollama_store(tmp_path / "ollama")
    monkeypatch.setenv("OLLAMA_MODELS", str(store.root))
    async with gateway(tmp_path) as gw:
        rt = gw.runtime
        app = ConsoleApp(AdminClient(gw.url), refresh=0.2)
        async with app.run_test(size=(120, 40)) as pilot:
            await app.wait_for_update()
            assert app.place.view == "endpoints" and keys(app) == ["sim-a", "sim-b"]

            # / filter (live as typed), esc clears it
            await pilot.press("slash", *"a$", "enter")
            assert keys(app) == ["sim-a"] and app.place.filter == "a$"
            await pilot.press("slash", "escape")
            await pilot.press("escape")
            assert keys(app) == ["sim-a", "sim-b"] and app.place.filter == ""

            # sorting: > moves to the next column, = reverses
            await pilot.press("equals_sign")
            assert keys(app) == ["sim-b", "sim-a"]
            await pilot.press("equals_sign")

            # d asks first; n changes nothing, y drains; u undrains
            await pilot.press("d")
            assert isinstance(app.screen, ConfirmScreen)
            await pilot.press("n")
            assert not rt.registry.endpoints["sim-a"].draining
            await pilot.press("d", "y")
            await wait_for(lambda: rt.registry.endpoints["sim-a"].draining, what="sim-a draining")
            await wait_for(lambda: state_of(app, "sim-a") == "draining", what="the view shows draining")
            await pilot.press("u")
            await wait_for(lambda: not rt.registry.endpoints["sim-a"].draining, what="sim-a undrained")

            # r reloads the config file (asks first)
            await pilot.press("r", "y")
            await wait_for(lambda: rt.reloads.get("ok") == 1, what="a reload")
            await wait_for(lambda: any("configuration reloaded" in t for t in app.told), what="told of it")

            # enter on an endpoint: its details
            await pilot.press("enter")
            assert isinstance(app.screen, TextScreen)
            await pilot.press("escape")

            # : command mode with completion (tab)
            await pilot.press("colon", "m", "o", "tab", "enter")
            assert app.place.view == "models"
            await app.wait_for_update()
            assert keys(app) == ["sim-model"]
            assert "2/2" in app.rendered_rows[0].text
            await pilot.press("enter")  # a model's endpoints
            await app.wait_for_update()
            assert app.place.view == "endpoints" and app.place.scope == ("models", "sim-model")
            assert keys(app) == ["sim-a", "sim-b"]
            await pilot.press("escape")
            assert app.place.view == "models"

            # nodes: c cordons (asks first), c again uncordons; enter: its GPUs; esc back
            await pilot.press("colon", *"nodes", "enter")
            await app.wait_for_update()
            assert keys(app) == ["node-a", "node-b"]
            await pilot.press("c", "y")
            cp = rt.components[0]
            await wait_for(lambda: cp.nodes.get("node-a").cordoned, what="node-a cordoned")
            await wait_for(lambda: "cordoned" in app.rendered_rows[0].text, what="the view shows cordoned")
            await pilot.press("c")
            await wait_for(lambda: not cp.nodes.get("node-a").cordoned, what="node-a uncordoned")
            await pilot.press("enter")
            assert app.place.view == "gpus" and app.place.scope == ("node", "node-a")
            await app.wait_for_update()
            assert len(app.rendered_rows) == 2 and all(r.record["node"] == "node-a" for r in app.rendered_rows)
            await pilot.press("escape")
            assert app.place.view == "nodes"

            # gpus: the MIG GPU's utilisation is absent (–), never 0
            await pilot.press("colon", *"gpus", "enter")
            await app.wait_for_update()
            assert not app.stack  # (a view named with : starts a new trail: no Nodes › GPUs › ... pile-up)
            mig = next(r for r in app.rendered_rows if r.record["uuid"] == "GPU-mig")
            assert mig.cells[2] == "–"

            # deployments: the control plane has none yet, and the view says how to add one
            # (a gateway without the API says so instead: the replay snapshot test)
            await pilot.press("colon", *"deployments", "enter")
            await app.wait_for_update()
            assert app.message_text.startswith("no deployments (add them") and not app.rendered_rows

            # mirror: empty; I lists the Ollama store and imports with progress; refusals are clear
            await pilot.press("colon", *"mirror", "enter")
            await app.wait_for_update()
            assert keys(app) == [] and "mirror is empty" in app.message_text
            await pilot.press("I")
            screen = app.screen
            assert isinstance(screen, ImportScreen)
            await wait_for(screen.loaded.is_set, what="the Ollama list")
            from llmgw.console.table import FleetTable

            table = screen.query_one(FleetTable)
            names = [r.key for r in table.rows]
            assert {"tiny:latest", "broken:latest", "newengine:latest"} <= set(names)
            problem = {r.key: r.record["problem"] for r in table.rows}
            assert "safetensors" in problem["newengine:latest"] and problem["tiny:latest"] is None
            assert {r.key: r.cells[4] for r in table.rows}["tiny:latest"] == "not yet"  # (IN THE MIRROR AS)

            async def choose(name: str) -> str:
                table.cursor = names.index(name)
                screen.done.clear()
                await pilot.press("enter")
                await wait_for(screen.done.is_set, what=f"the import of {name}")
                return screen.status_text

            assert "refused (corrupt_blob)" in await choose("broken:latest")
            assert "refused (unsupported_model)" in await choose("newengine:latest")
            assert (await choose("tiny:latest")).startswith("imported tiny:latest")
            assert screen.job is not None and screen.job["progress"] == 1.0
            await pilot.press("escape")
            await app.wait_for_update()
            assert keys(app) == ["tiny:latest"]
            assert app.rendered_rows[0].record["architecture"] == "llama"

            # ? help lists every key
            await pilot.press("question_mark")
            assert isinstance(app.screen, TextScreen)
            await pilot.press("escape")


async def test_read_only_hides_every_action(tmp_path: Path) -> None:
    async with gateway(tmp_path, control=False) as gw:
        app = ConsoleApp(AdminClient(gw.url), refresh=0.2, read_only=True)
        async with app.run_test(size=(100, 30)) as pilot:
            await app.wait_for_update()
            for action in ("drain", "undrain", "cordon", "scale", "reload", "import_ollama"):
                assert app.check_action(action, ()) is False, action
            await pilot.press("d", "r")
            assert not isinstance(app.screen, ConfirmScreen)
            assert not gw.runtime.registry.endpoints["sim-a"].draining
            # nodes without a control plane: the API's reason, not an empty table
            await pilot.press("colon", *"nodes", "enter")
            await app.wait_for_update()
            assert "no control plane" in app.message_text


async def test_disconnect_and_recovery(tmp_path: Path) -> None:
    async with gateway(tmp_path / "one", control=False) as gw:
        port = gw.admin_port
        app = ConsoleApp(AdminClient(gw.url, timeout=1.0), refresh=0.1)
        async with app.run_test(size=(80, 24)):
            await app.wait_for_update()
            assert keys(app) == ["sim-a", "sim-b"]
            await gw.runtime.stop()
            await wait_for(lambda: app.disconnected is not None, what="disconnected")
            assert keys(app) == ["sim-a", "sim-b"]  # the last data stays on screen, marked as old
            await app.wait_for_update()
            # said first on the status line, which a narrow terminal cuts at its end; why, under the table
            assert app._shown["#status"].startswith("[bold red]✖ disconnected"), app._shown["#status"]
            assert app.message_text.startswith("cannot reach the admin API: "), app.message_text
            async with gateway(tmp_path / "two", control=False, admin_port=port):
                await wait_for(lambda: app.disconnected is None, what="connected again")
                await app.wait_for_update()
                assert keys(app) == ["sim-a", "sim-b"]
                assert "connected again" in app.told


async def test_https_to_the_plain_admin_listener_says_the_fix_on_an_80_column_terminal(tmp_path: Path) -> None:
    """QA: at 80x24 the header cut "the admin API at https://... speaks" before the fix it named."""
    async with gateway(tmp_path, control=False) as gw:
        app = ConsoleApp(AdminClient(gw.url.replace("http://", "https://"), timeout=1.0), refresh=0.2)
        async with app.run_test(size=(80, 24)):
            await wait_for(lambda: app.disconnected is not None, what="the TLS call refused")
            await app.wait_for_update()
            assert app._shown["#status"].startswith("[bold red]✖ disconnected, retrying"), app._shown["#status"]
            said = app.message_text
            assert "speaks plain HTTP, not TLS" in said and f"pass --admin {gw.url}" in said, said


async def test_a_poll_ending_while_the_screen_closes_draws_nothing(tmp_path: Path) -> None:
    """Closing down, the screen's widgets go one by one: a poll that ends meanwhile found the table but not
    the lines under it (NoMatches in the poll worker failed the app on its way out, a CI flake)."""
    async with gateway(tmp_path, control=False) as gw:
        app = ConsoleApp(AdminClient(gw.url, timeout=1.0), refresh=60)
        async with app.run_test(size=(80, 24)):
            await app.wait_for_update()
            await app.main.query_one("#crumbs").remove()  # (as the teardown does, the table still there)
            app._shown.clear()  # (every line to be drawn again)
            app._render()  # nothing drawn, nothing raised
            await app.poll_once()
            assert app._shown == {}


async def test_a_wrong_token_is_told_once(tmp_path: Path) -> None:
    from canary import secret

    async with gateway(tmp_path, control=False, admin_token=secret("admin-tok-19")) as gw:
        app = ConsoleApp(AdminClient(gw.url, token="wrong"), refresh=0.05)
        async with app.run_test(size=(80, 24)):
            await wait_for(lambda: app.polls >= 4, what="a few polls")
            assert app.auth_error is not None and "refused the token" in app.auth_error
            assert sum("refused the token" in t for t in app.told) == 1
            assert "refused the token" in app.message_text
            # (nothing was ever read: no count, where 'Endpoints (0)' read as a gateway with none)
            assert app._shown["#crumbs"].startswith("Endpoints (–)"), app._shown["#crumbs"]
