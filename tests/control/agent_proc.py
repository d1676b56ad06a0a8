"""Run the real agent client (``llmgw.cli.agent.run_agent``) in its own process with a scenario source.

    python tests/control/agent_proc.py --control 127.0.0.1:PORT[,127.0.0.1:PORT2…] --name NODE --scenario FILE
        [--tls-ca FILE] [--tls-cert FILE --tls-key FILE] [--protocol-major N] [--refused-give-up S]

The join token is read from $LLMGW_JOIN_TOKEN. Exits like ``llmgw agent``: 0 after
SIGTERM (having deregistered), 1 when refused (the reason on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenario import ScenarioSource

from llmgw.cli._common import Fail, run_loop
from llmgw.cli.agent import run_agent
from llmgw.log import setup


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--control", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--tls-ca")
    ap.add_argument("--tls-cert")
    ap.add_argument("--tls-key")
    ap.add_argument("--protocol-major", type=int)
    ap.add_argument("--refused-give-up", type=float, help="seconds (the agent's REFUSED_GIVE_UP_S, 60)")
    a = ap.parse_args()
    import os

    if a.refused_give_up is not None:
        import llmgw.agent.client as client

        client.REFUSED_GIVE_UP_S = a.refused_give_up

    setup("info")
    controls = tuple((h, int(p)) for h, _, p in (c.rpartition(":") for c in a.control.split(",")))
    creds = None
    if a.tls_ca or a.tls_cert:
        from llmgw.agent.client import TLSFiles, channel_credentials

        creds = channel_credentials(TLSFiles(ca=a.tls_ca, cert=a.tls_cert, key=a.tls_key))
    protocol = (a.protocol_major, 0) if a.protocol_major is not None else None
    try:
        return int(run_loop(run_agent(
            controls if len(controls) > 1 else controls[0], a.name, os.environ["LLMGW_JOIN_TOKEN"], ScenarioSource(a.scenario),
            credentials=creds, protocol=protocol,
        )))
    except Fail as exc:
        exc.show()
        return 1


if __name__ == "__main__":
    sys.exit(main())
