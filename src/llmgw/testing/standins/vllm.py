"""Stand-in for ``vllm`` (``vllm serve MODEL ...``, ``vllm --version``); see :mod:`llmgw.testing.standins`.

The key: ``--api-key`` or ``$VLLM_API_KEY``, checked on ``/v1*`` only, as vLLM does.
``--help`` lists the flags; ``--help=all`` too (real vLLM groups them unless ``=all``).
"""

from __future__ import annotations

import os
import sys

from . import VERSION
from ._run import Parser, serve


def _parser() -> Parser:
    p = Parser(prog="vllm serve", add_help=False)
    p.add_argument("model_tag", nargs="?", default=None)
    p.add_argument("--help", nargs="?", const="", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--host", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--disable-log-stats", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-v", "--version"):
        print(VERSION)
        return 0
    if not args or args[0] != "serve":
        print("usage: vllm {serve} ... (llmgw stand-in: only 'serve' and '--version')", file=sys.stderr)
        return 2
    p = _parser()
    ns = p.parse_args(args[1:])
    if ns.help is not None:
        p.print_help()
        return 0
    model = ns.model_tag or ns.model
    if not model:
        p.error("the following arguments are required: model_tag")
    name = (ns.served_model_name or [model])[0]
    if not 0 < ns.gpu_memory_utilization <= 1:
        p.error("--gpu-memory-utilization must be in (0, 1]")
    key = ns.api_key or os.environ.get("VLLM_API_KEY") or None
    return serve("vllm", name, ns.host or "0.0.0.0", ns.port, api_key=key, metrics=True,
                 slots=ns.max_num_seqs or 8, max_model_len=ns.max_model_len or 4096)
