"""Stand-in for ``trtllm-serve [serve] MODEL ...``; see :mod:`llmgw.testing.standins`.

No API key (trtllm-serve has none: ``--api-key`` is refused). ``/prometheus/metrics``
is served only when the ``--config`` YAML says ``return_perf_metrics: true``; the
model id is the model directory's name.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import VERSION
from ._run import Parser, serve


def _parser() -> Parser:
    p = Parser(prog="trtllm-serve serve")
    p.add_argument("model")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--config", "--extra_llm_api_options", dest="config", default=None)
    p.add_argument("--backend", default="pytorch")
    p.add_argument("--tp_size", "--tensor_parallel_size", type=int, default=1)
    p.add_argument("--pp_size", type=int, default=1)
    p.add_argument("--ep_size", type=int, default=None)
    p.add_argument("--max_batch_size", type=int, default=None)
    p.add_argument("--max_num_tokens", type=int, default=None)
    p.add_argument("--max_seq_len", type=int, default=None)
    p.add_argument("--kv_cache_free_gpu_memory_fraction", type=float, default=0.9)
    return p


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--version":
        print(f"trtllm-serve, version {VERSION}")
        return 0
    if args and args[0] == "serve":
        args = args[1:]
    p = _parser()
    ns = p.parse_args(args)
    metrics = False
    if ns.config:
        import yaml

        try:
            doc = yaml.safe_load(Path(ns.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            p.error(f"--config {ns.config}: {exc}")
        metrics = bool(doc.get("return_perf_metrics"))
    name = Path(ns.model).name or ns.model
    host = "127.0.0.1" if ns.host == "localhost" else ns.host
    return serve("trtllm", name, host, ns.port, api_key=None, metrics=metrics,
                 slots=ns.max_batch_size or 8, max_model_len=ns.max_seq_len or 4096)
