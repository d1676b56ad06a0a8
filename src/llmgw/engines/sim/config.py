"""The simulated engine's configuration: one immutable, validated object."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from .. import SIMULATED_ENGINES
from .faults import SimFaults

__all__ = ["SimConfig"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How one simulated engine behaves.

    Attributes:
        model: the served model name (vLLM's ``--served-model-name``, llama.cpp's ``--alias``).
        engine: the dialect: ``vllm``, ``llamacpp``, ``trtllm`` or ``sglang``.
        api_key: require this key, checked the way the engine checks it (``None``: open).
            llama.cpp accepts a comma-separated list. TensorRT-LLM has no key support:
            the key is ignored with a warning, as ``trtllm-serve`` would have no flag for it.
        slots: requests generating at once (vLLM's ``max_num_seqs``, llama.cpp's ``--parallel``).
        max_queue: requests that may wait for a slot; past it new requests are answered
            ``queue_full_status``. ``-1``: no limit (what vLLM, llama.cpp and TensorRT-LLM do).
        queue_full_status: 429 or 503.
        ttft_ms: time from admission to the first token.
        tokens_per_second: decode speed of one stream.
        seed: makes token choice and fault draws reproducible.
        max_model_len: context length; longer requests are answered 400.
        kv_tokens: KV-cache capacity in tokens (0: ``slots * max_model_len``). A request is
            admitted only when its prompt plus its ``max_tokens`` fit beside those running.
        startup_delay: seconds of simulated model loading after ``start()``: ``/health``
            and inference answer 503 until then (llama.cpp: ``/metrics`` too, as
            llama-server does).
        metrics: serve the Prometheus page (``False`` simulates llama-server without
            ``--metrics``, SGLang without ``--enable-metrics``, ...: 404).
        chat_max_tokens: output length of a chat completion without ``max_tokens``.
        completion_max_tokens: the same for ``/v1/completions`` (OpenAI's default is 16).
        embedding_dim: length of ``/v1/embeddings`` vectors.
        keepalive_timeout: seconds an idle keep-alive connection is kept open
            (uvicorn's ``timeout_keep_alive``: 5 for vLLM, SGLang and trtllm-serve;
            cpp-httplib's 5 for llama-server); the default keeps them long.
        count_arrivals: count inference requests per ``X-Request-Id``
            (:attr:`SimEngine.arrivals`: a request that arrives twice is counted twice).
        faults: the fault switches in force at start (changed later at run time).
    """

    model: str = "sim-model"
    engine: str = "vllm"
    api_key: str | None = None
    slots: int = 8
    max_queue: int = 1024
    queue_full_status: int = 503
    ttft_ms: float = 50.0
    tokens_per_second: float = 50.0
    seed: int = 0
    max_model_len: int = 4096
    kv_tokens: int = 0
    startup_delay: float = 0.0
    metrics: bool = True
    chat_max_tokens: int = 64
    completion_max_tokens: int = 16
    embedding_dim: int = 384
    keepalive_timeout: float = 300.0
    count_arrivals: bool = False
    faults: SimFaults = field(default_factory=SimFaults)

    def __post_init__(self) -> None:
        if self.engine not in SIMULATED_ENGINES:
            raise ConfigError("engine", f"must be one of {', '.join(SIMULATED_ENGINES)}, not {self.engine!r}")
        if not self.model or any(c in self.model for c in "\r\n\"\\"):
            raise ConfigError("model", "must be a non-empty name without quotes, backslashes or newlines")
        if self.api_key is not None and (not self.api_key or any(c in self.api_key for c in "\r\n")):
            raise ConfigError("api_key", "must be a non-empty single-line string")
        _check_int("slots", self.slots, 1, 1_000_000)
        _check_int("max_queue", self.max_queue, -1, 100_000_000)
        if self.queue_full_status not in (429, 503):
            raise ConfigError("queue_full_status", "must be 429 or 503")
        if not 0 <= self.ttft_ms <= 3_600_000:
            raise ConfigError("ttft_ms", "must be between 0 and 3600000")
        if not self.tokens_per_second > 0:
            raise ConfigError("tokens_per_second", "must be greater than 0")
        _check_int("seed", self.seed, -(2**63), 2**63 - 1)
        _check_int("max_model_len", self.max_model_len, 2, 100_000_000)
        _check_int("kv_tokens", self.kv_tokens, 0, 10**12)
        if self.kv_tokens == 0:
            object.__setattr__(self, "kv_tokens", self.slots * self.max_model_len)
        elif self.kv_tokens < self.max_model_len:
            raise ConfigError(
                "kv_tokens", f"must hold at least one full-length request (max_model_len={self.max_model_len})"
            )
        if not 0 <= self.startup_delay <= 86_400:
            raise ConfigError("startup_delay", "must be between 0 and 86400 seconds")
        # Defaults longer than the context shrink to fit each request (as vLLM's do).
        _check_int("chat_max_tokens", self.chat_max_tokens, 1, 100_000_000)
        _check_int("completion_max_tokens", self.completion_max_tokens, 1, 100_000_000)
        _check_int("embedding_dim", self.embedding_dim, 1, 65_536)
        if isinstance(self.keepalive_timeout, bool) or not 0.01 <= self.keepalive_timeout <= 86_400:
            raise ConfigError("keepalive_timeout", "must be between 0.01 and 86400 seconds")
        if not isinstance(self.faults, SimFaults):
            raise ConfigError("faults", "must be a SimFaults")

    def summary(self) -> dict[str, Any]:
        """The settings as plain JSON values (the key is not shown)."""
        return {
            "model": self.model,
            "engine": self.engine,
            "api_key": self.api_key is not None,
            "slots": self.slots,
            "max_queue": self.max_queue,
            "queue_full_status": self.queue_full_status,
            "seed": self.seed,
            "max_model_len": self.max_model_len,
            "kv_tokens": self.kv_tokens,
            "startup_delay": self.startup_delay,
            "metrics": self.metrics,
            "chat_max_tokens": self.chat_max_tokens,
            "completion_max_tokens": self.completion_max_tokens,
            "embedding_dim": self.embedding_dim,
            "keepalive_timeout": self.keepalive_timeout,
        }


def _check_int(key: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(key, f"must be an integer between {lo} and {hi}, not {value!r}")
