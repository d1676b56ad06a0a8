"""Stand-in engine executables: ``vllm``, ``trtllm-serve`` and SGLang's ``python -m sglang.launch_server``.

They are written against each engine's documented command line, server and
metrics (``../shared/reference/cluster.md`` §4, ``engines.md``) and serve that
engine's dialect through the simulated engine (:mod:`llmgw.engines.sim`): the
OpenAI API, the engine's ``/health``, its metrics page and its auth rules
(vLLM and SGLang: 401 without the key; trtllm-serve: no key at all, so llmgw's
launcher guards it). **They have not been run against the real engines on a
datacenter GPU**; they exist so that the launchers, the supervisor and
``llmgw ctl engine-check`` can be tested on any machine.

Each accepts the flags llmgw passes and a few more the real one has, and refuses
any other flag as the real one would (an argparse error, exit status 2).
Test switches, in the environment:

* ``LLMGW_STANDIN_LACKS=--flag,...``: behave like a build without those flags
  (absent from ``--help``, refused when passed).
* ``LLMGW_STANDIN_NO_METRICS=1``: serve no metrics page (404).
* ``LLMGW_STANDIN_STARTUP_DELAY=S``: load for S seconds (``/health`` 503) first.
* ``LLMGW_STANDIN_TOKENS_PER_SECOND=N``: generate N tokens a second per request (500).

:func:`install` writes the two executables into a directory (to put first on
``PATH``) and returns it with :data:`PYTHONPATH`, the directory that holds the
``sglang`` and ``tensorrt_llm`` stand-in packages (to put first on ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["PYTHONPATH", "VERSION", "install"]

PYTHONPATH = Path(__file__).resolve().parent / "pypath"
VERSION = "0.0.0+llmgw.standin"

_SCRIPTS = {"vllm": "vllm", "trtllm-serve": "trtllm_serve"}


def install(bin_dir: str | os.PathLike[str]) -> Path:
    """Write the ``vllm`` and ``trtllm-serve`` stand-ins into ``bin_dir``; returns it."""
    path = Path(bin_dir)
    path.mkdir(parents=True, exist_ok=True)
    for name, module in _SCRIPTS.items():
        exe = path / name
        exe.write_text(
            f"#!{sys.executable}\n"
            f"# llmgw's stand-in for {name}: the simulated engine, not the real one.\n"
            "import sys\n"
            f"from llmgw.testing.standins.{module} import main\n"
            "sys.exit(main())\n"
        )
        exe.chmod(0o755)
    return path
