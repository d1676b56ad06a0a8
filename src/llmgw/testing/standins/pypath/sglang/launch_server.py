"""Stand-in for ``python -m sglang.launch_server``; see :mod:`llmgw.testing.standins`.

The key (``--api-key``) is demanded on all but ``/health*`` and ``/metrics*``
(newer SGLang); ``/metrics`` needs ``--enable-metrics``.
"""

from __future__ import annotations

import sys

from llmgw.testing.standins._run import Parser, serve


def _parser() -> Parser:
    p = Parser(prog="python -m sglang.launch_server")
    p.add_argument("--model-path", "--model", dest="model_path", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--tp-size", "--tensor-parallel-size", "--tp", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--config", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    # Like SGLang, print every setting at start, the key included (llmgw must not show it on).
    print("server_args=ServerArgs(" + ", ".join(f"{k}={v!r}" for k, v in sorted(vars(ns).items())) + ")",
          flush=True)
    return serve("sglang", ns.served_model_name or ns.model_path, ns.host, ns.port, api_key=ns.api_key,
                 metrics=ns.enable_metrics, slots=ns.max_running_requests or 8,
                 max_model_len=ns.context_length or 4096)


if __name__ == "__main__":
    sys.exit(main())
