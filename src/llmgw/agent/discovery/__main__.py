"""Print what discovery reads on this node, as JSON: ``python -m llmgw.agent.discovery``.

A diagnostic for operators and for the check on a real GPU node (not the agent's
CLI, which is ``llmgw agent``)::

    python -m llmgw.agent.discovery --source auto --reads 3 --interval 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from llmgw import __version__

from . import KINDS, open_source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmgw.agent.discovery", description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=KINDS, default="auto")
    parser.add_argument("--reads", type=int, default=1, help="how many reads (XIDs and retries show on later ones)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reads")
    parser.add_argument("--smi-path", default="nvidia-smi")
    args = parser.parse_args(argv)
    source = open_source(args.source, agent_version=__version__, smi_path=args.smi_path)
    try:
        for i in range(max(1, args.reads)):
            if i:
                time.sleep(args.interval)
            started = time.perf_counter()
            d = source.read()
            out = {"read": i, "took_s": round(time.perf_counter() - started, 4), **dataclasses.asdict(d)}
            json.dump(out, sys.stdout, indent=2)
            sys.stdout.write("\n")
    finally:
        source.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
