"""Guard: the compiled module is what runs unless the pure build was asked for.

A silent fall back to the twin would be a silent slowdown (aiohttp
``test_c_parser_loaded``, multidict ``test_circular_imports``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if k != "LLMGW_NO_EXTENSIONS"}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.c_extension
@pytest.mark.c_extension  # needs the compiled module to exist; deselected in pure runs
def test_compiled_httpproto_is_loaded() -> None:
    from llmgw import _accel
    from llmgw.http import parser

    assert parser.RequestReader.__module__ == "llmgw._fast.httpproto"
    assert parser.ResponseReader.__module__ == "llmgw._fast.httpproto"
    assert not parser.RequestReader.__module__.endswith("_py")
    assert _accel.loaded()["httpproto"] == "compiled"


def test_no_extensions_selects_the_twin() -> None:
    res = run_python(
        """
        from llmgw import _accel
        from llmgw.http import parser
        print(parser.RequestReader.__module__, _accel.NO_EXTENSIONS, _accel.loaded()["httpproto"])
        """,
        LLMGW_NO_EXTENSIONS="1",
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["llmgw._fast.httpproto_py", "True", "pure"]
    assert res.stderr == ""  # chosen on purpose: no warning


@pytest.mark.parametrize("value", ["0", ""])
def test_no_extensions_off_values(value: str) -> None:
    res = run_python("from llmgw import _accel; print(_accel.NO_EXTENSIONS)", LLMGW_NO_EXTENSIONS=value)
    assert res.stdout.strip() == ("True" if sys.implementation.name != "cpython" else "False")


@pytest.mark.c_extension  # needs the compiled module to exist; deselected in pure runs
def test_missing_compiled_module_warns_and_uses_the_twin() -> None:
    res = run_python(
        """
        import sys
        from importlib.abc import MetaPathFinder

        class Block(MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "llmgw._fast.httpproto":
                    raise ImportError("blocked by the test")
                return None

        sys.meta_path.insert(0, Block())
        from llmgw import _accel
        from llmgw.http import parser
        import llmgw.gateway.proxy  # (more modules that select httpproto)
        print(parser.RequestReader.__module__, _accel.loaded()["httpproto"])
        """
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["llmgw._fast.httpproto_py", "pure"]
    assert res.stderr.count("llmgw._fast.httpproto is not available") == 1, res.stderr  # (said once)
    assert "pure-Python twin" in res.stderr
    assert "blocked by the test" in res.stderr


@pytest.mark.c_extension
def test_compiled_data_path_is_loaded() -> None:
    from llmgw import _accel
    from llmgw.fleet import registry
    from llmgw.gateway import observe, proxy
    from llmgw.http import client, server

    for cls, module in (
        (server.HTTPServer, "server"),
        (server.ResponseWriter, "server"),
        (client.UpstreamPool, "upstream"),
        (registry.Endpoint, "replica"),
        (registry.ModelPool, "replica"),
        (observe.TrafficCounters, "counters"),
        (proxy.Call, "proxy"),
        (proxy.Gateway, "proxy"),
    ):
        assert cls.__module__ == f"llmgw._fast.{module}", cls
        assert _accel.loaded()[module] == "compiled"
    assert _accel.loaded()["jsonscan"] == "compiled"


@pytest.mark.c_extension
@pytest.mark.timeout(480)  # (three suites in a subprocess, on the slower twin: about 2 minutes here, more on a slow box)
def test_the_data_path_suites_pass_on_the_pure_twin() -> None:
    # The compiled data path is its own twin's source (Cython pure-Python mode):
    # the server, client and gateway suites run once more on the pure build.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["LLMGW_NO_EXTENSIONS"] = "1"
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         "tests/http", "tests/gateway", "tests/fleet"],
        cwd=root, env=env, capture_output=True, text=True, timeout=450, check=False,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert " passed" in res.stdout and " failed" not in res.stdout
