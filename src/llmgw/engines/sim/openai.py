"""OpenAI wire format for the simulated engine: request parsing, tokens, responses.

Tokens are words from a small fixed vocabulary. Each engine draws one long
sequence of them from its seed; a request reads it from an offset derived from a
hash of its prompt (and its ``seed`` field), so the same prompt gets the same
text, streamed or not, on every run. Token JSON is built once, so a streamed
token costs three byte-string joins.
"""

from __future__ import annotations

import base64
import hashlib
import math
import random
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import orjson

__all__ = [
    "DONE_EVENT",
    "ChunkMaker",
    "Job",
    "RequestError",
    "Vocab",
    "completion_body",
    "embed",
    "estimate_tokens",
    "parse_embeddings",
    "parse_generation",
]

DONE_EVENT = b"data: [DONE]\n\n"

WORDS: tuple[str, ...] = (
    "the", "model", "answers", "with", "simulated", "tokens", "from", "a", "small", "fixed",
    "vocabulary", "and", "each", "word", "is", "one", "token", "so", "counts", "match",
    "exactly", "gateway", "routes", "requests", "to", "replicas", "that", "have", "free",
    "slots", "queue", "cache", "prefix", "latency", "stream", "chunk", "metrics", "scrape",
    "engine", "load", "fast", "slow", "ready", "output", "input", "prompt", "context",
    "length", "limit", "test", "bench", "fleet", "node", "it", "works.", "done.", "yes,",
    "then", "next", "more", "data", "time", "first", "last",
)

_SEQ_LEN = 8192  # per-engine token sequence; requests read it from an offset


class RequestError(Exception):
    """A request the engine refuses; the dialect turns it into its own error body.

    Attributes:
        status: HTTP status.
        message: the error message.
        kind: ``invalid``, ``context`` (prompt longer than the context), ``not_found``,
            ``unavailable``, ``server`` or ``rate_limit``: lets a dialect pick its type.
        extra: extra top-level error fields (llama.cpp's ``n_prompt_tokens``, ``n_ctx``).
    """

    def __init__(
        self, status: int, message: str, kind: str = "invalid", extra: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.extra = extra


def estimate_tokens(chars: int) -> int:
    """Prompt tokens for ``chars`` characters of text: about 4 per token, at least 1."""
    return max(1, (chars + 3) // 4)


class Vocab:
    """One engine's token sequence and the pre-encoded JSON of every word."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        nw = len(WORDS)
        self.seq = [rng.randrange(nw) for _ in range(_SEQ_LEN)]
        self._salt = struct.pack("<q", seed)
        self.first_text = WORDS
        self.spaced_text = tuple(" " + w for w in WORDS)
        self.first_json = tuple(orjson.dumps(w) for w in WORDS)
        self.spaced_json = tuple(orjson.dumps(" " + w) for w in WORDS)
        # The spaced text of the sequence, twice over, so any run of up to
        # _SEQ_LEN tokens is one slice.
        spaced = [self.spaced_text[i] for i in self.seq]
        self._spaced2 = spaced + spaced

    def offset(self, key: int, choice: int) -> int:
        """Where choice ``choice`` of a request with prompt hash ``key`` starts reading."""
        return (key + choice * 7919) % _SEQ_LEN

    def key(self, *parts: bytes) -> int:
        crc = zlib.crc32(self._salt)
        for p in parts:
            crc = zlib.crc32(p, crc)
        return crc

    def text(self, off: int, n: int) -> str:
        """The text of ``n`` tokens from ``off`` (the first without a leading space)."""
        if n <= 0:
            return ""
        first = self.first_text[self.seq[off]]
        if n <= _SEQ_LEN:
            return first + "".join(self._spaced2[off + 1 : off + n])
        seq, sp = self.seq, self.spaced_text
        return first + "".join(sp[seq[(off + i) % _SEQ_LEN]] for i in range(1, n))

    def token_json(self, off: int, i: int) -> bytes:
        """Token ``i`` from ``off`` as a JSON string."""
        w = self.seq[(off + i) % _SEQ_LEN]
        return self.spaced_json[w] if i else self.first_json[w]

    def token_text(self, off: int, i: int) -> str:
        w = self.seq[(off + i) % _SEQ_LEN]
        return self.spaced_text[w] if i else self.first_text[w]

    def stop_at(self, off: int, n: int, stops: Sequence[str]) -> int:
        """Index of the first of ``n`` tokens whose text contains a stop string, or -1."""
        seq, first, sp = self.seq, self.first_text, self.spaced_text
        for i in range(n):
            w = seq[(off + i) % _SEQ_LEN]
            t = sp[w] if i else first[w]
            for s in stops:
                if s in t:
                    return i
        return -1


class Job:
    """A parsed chat or completions request.

    Attributes:
        chat: chat completions (else legacy completions).
        prompt_tokens: per prompt (a batched completion has several).
        n: choices per prompt.
        max_tokens: output limit per choice.
        n_list / reasons / offsets: per choice: output tokens, finish reason, vocab offset.
        stream, include_usage: streaming options.
        stop: stop strings.
        model: the ``model`` field (``None`` when absent).
    """

    __slots__ = (
        "chat",
        "include_usage",
        "max_tokens",
        "model",
        "n",
        "n_list",
        "offsets",
        "prompt_tokens",
        "reasons",
        "stop",
        "stop_hit",
        "stream",
    )

    def __init__(self) -> None:
        self.chat = True
        self.prompt_tokens: list[int] = []
        self.n = 1
        self.max_tokens = 0
        self.n_list: list[int] = []
        self.reasons: list[str] = []
        self.offsets: list[int] = []
        self.stop_hit: list[str | None] = []
        self.stream = False
        self.include_usage = False
        self.stop: tuple[str, ...] = ()
        self.model: str | None = None

    @property
    def total_prompt(self) -> int:
        return sum(self.prompt_tokens)


def _int_field(body: dict[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(400, f"'{name}' must be an integer")
    return v


def _chat_prompt(messages: Any) -> tuple[int, list[bytes]]:
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list of messages")
    chars = 0
    parts: list[bytes] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(400, "each message must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, str):
            chars += len(content)
            parts.append(content.encode())
        elif isinstance(content, list):
            for p in content:
                if isinstance(p, dict) and isinstance(p.get("text"), str):
                    chars += len(p["text"])
                    parts.append(p["text"].encode())
        elif content is not None:
            raise RequestError(400, "message 'content' must be a string or a list of parts")
    return chars, parts


def _completion_prompts(prompt: Any) -> tuple[list[int], list[bytes]]:
    if isinstance(prompt, str):
        return [estimate_tokens(len(prompt))], [prompt.encode()]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [estimate_tokens(len(p)) for p in prompt], [p.encode() for p in prompt]
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [len(prompt)], [orjson.dumps(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return [len(p) for p in prompt], [orjson.dumps(p) for p in prompt]
    raise RequestError(
        400, "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"
    )


def parse_generation(
    body: Any,
    *,
    chat: bool,
    vocab: Vocab,
    default_max_tokens: int,
    max_model_len: int,
    clamp_to_context: bool,
    usage_default_with_options: bool,
) -> Job:
    """Read a chat or completions request and plan its output.

    Args:
        body: the decoded JSON body.
        chat: ``/v1/chat/completions`` (else ``/v1/completions``).
        vocab: the engine's tokens.
        default_max_tokens: output length when the request sets none.
        max_model_len: the context length.
        clamp_to_context: llama.cpp: only the prompt must fit, output stops at the
            context end; otherwise (vLLM, SGLang, TensorRT-LLM) prompt plus
            ``max_tokens`` must fit.
        usage_default_with_options: TensorRT-LLM: ``include_usage`` defaults to true
            once ``stream_options`` is present.

    Raises:
        RequestError: 400 for a malformed request or one too long for the context.
    """
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    job = Job()
    job.chat = chat
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(400, "'model' must be a string")
    job.model = model
    if chat:
        chars, key_parts = _chat_prompt(body.get("messages"))
        job.prompt_tokens = [estimate_tokens(chars)]
    else:
        if "prompt" not in body:
            raise RequestError(400, "'prompt' is required")
        job.prompt_tokens, key_parts = _completion_prompts(body["prompt"])
    n = _int_field(body, "n")
    if n is None:
        n = 1
    if not 1 <= n <= 128:
        raise RequestError(400, "'n' must be between 1 and 128")
    job.n = n
    max_tokens = _int_field(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    defaulted = max_tokens is None
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(400, "'max_tokens' must be at least 1")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise RequestError(400, "'stream' must be a boolean")
    job.stream = bool(stream)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise RequestError(400, "'stream_options' must be an object")
        iu = opts.get("include_usage", usage_default_with_options)
        job.include_usage = bool(iu) and job.stream
    stop = body.get("stop")
    if isinstance(stop, str):
        job.stop = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        job.stop = tuple(s for s in stop if s)
    elif stop is not None:
        raise RequestError(400, "'stop' must be a string or a list of strings")
    seed = _int_field(body, "seed")

    longest = max(job.prompt_tokens)
    if clamp_to_context:
        if longest >= max_model_len:
            raise RequestError(
                400,
                "the request exceeds the available context size, try increasing it",
                kind="context",
                extra={"n_prompt_tokens": longest, "n_ctx": max_model_len},
            )
        if max_tokens is None:
            max_tokens = default_max_tokens
    elif defaulted:
        if longest >= max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your request "
                f"has {longest} input tokens. Please reduce the length of the input messages.",
                kind="context",
            )
        max_tokens = default_max_tokens
    else:
        assert max_tokens is not None
        if longest + max_tokens > max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{longest + max_tokens} tokens ({longest} in the messages, {max_tokens} in the "
                f"completion). Please reduce the length of the messages or completion.",
                kind="context",
            )
    assert max_tokens is not None

    seed_part = b"" if seed is None else b"%d" % seed
    top = 0
    for pi, part in enumerate(key_parts if not chat else [b"\x00".join(key_parts)]):
        limit = max_tokens
        if clamp_to_context or defaulted:
            # The output ends at the context's end (llama.cpp), or the default
            # shrinks to fit (vLLM sets max_tokens = max_model_len - prompt).
            limit = min(max_tokens, max_model_len - job.prompt_tokens[pi])
        top = max(top, limit)
        key = vocab.key(part, seed_part)
        for c in range(n):
            off = vocab.offset(key, c)
            out, reason, hit = limit, "length", None
            if job.stop:
                at = vocab.stop_at(off, limit, job.stop)
                if at >= 0:
                    out, reason = at, "stop"
                    tok = vocab.token_text(off, at)
                    hit = next(s for s in job.stop if s in tok)
            job.n_list.append(out)
            job.reasons.append(reason)
            job.offsets.append(off)
            job.stop_hit.append(hit)
    job.max_tokens = top
    return job


def completion_body(
    job: Job,
    vocab: Vocab,
    rid: str,
    created: int,
    model: str,
    *,
    choice_extra: dict[str, Any],
    message_extra: dict[str, Any],
    top_extra: dict[str, Any],
    stop_reason_field: bool,
) -> bytes:
    """A whole ``chat.completion`` or ``text_completion`` answer with ``usage``."""
    choices = []
    for j, (n, reason, off) in enumerate(zip(job.n_list, job.reasons, job.offsets, strict=True)):
        text = vocab.text(off, n)
        if job.chat:
            ch: dict[str, Any] = {
                "index": j,
                "message": {"role": "assistant", "content": text, **message_extra},
                "logprobs": None,
                "finish_reason": reason,
            }
        else:
            ch = {"index": j, "text": text, "logprobs": None, "finish_reason": reason}
        if stop_reason_field:
            ch["stop_reason"] = job.stop_hit[j]
        if choice_extra:
            ch.update(choice_extra)
        choices.append(ch)
    prompt = job.total_prompt
    completion = sum(job.n_list)
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
    if top_extra:
        obj.update(top_extra)
    return orjson.dumps(obj)


class ChunkMaker:
    """Builds the SSE events of one streamed request.

    Token events are ``prefix[choice] + token_json + suffix``, the prefix and suffix
    encoded once per request.
    """

    __slots__ = ("_base", "_head", "_pre", "_suf", "job", "vocab")

    def __init__(self, job: Job, vocab: Vocab, rid: str, created: int, model: str) -> None:
        self.job = job
        self.vocab = vocab
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        self._base = {"id": rid, "object": obj, "created": created, "model": model}
        head = b"data: " + orjson.dumps(self._base)[:-1]
        self._head = head
        field = b'"delta":{"content":' if job.chat else b'"text":'
        self._pre = [b'%s,"choices":[{"index":%d,%s' % (head, j, field) for j in range(len(job.n_list))]
        tail = b"}" if job.chat else b""
        extra = b',"stop_reason":null' if not job.chat else b""
        usage = b',"usage":null' if job.include_usage else b""
        self._suf = tail + b',"logprobs":null,"finish_reason":null' + extra + b"}]" + usage + b"}\n\n"

    def token(self, j: int, i: int) -> bytes:
        """Token ``i`` of choice ``j``."""
        return self._pre[j] + self.vocab.token_json(self.job.offsets[j], i) + self._suf

    def _event(self, choices: list[dict[str, Any]], usage: Any = None, extra: dict[str, Any] | None = None) -> bytes:
        obj = {**self._base, "choices": choices}
        if self.job.include_usage:
            obj["usage"] = usage
        if extra:
            obj.update(extra)
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def role(self, j: int, content: Any) -> bytes:
        """The first chat event of choice ``j``: the role, no text."""
        return self._event(
            [{"index": j, "delta": {"role": "assistant", "content": content}, "logprobs": None, "finish_reason": None}]
        )

    def last_token(self, j: int, i: int, reason: str, stop_reason_field: bool) -> bytes:
        """Token ``i`` of choice ``j`` carrying the finish reason (vLLM's style)."""
        text = self.vocab.token_text(self.job.offsets[j], i)
        ch: dict[str, Any] = (
            {"index": j, "delta": {"content": text}, "logprobs": None, "finish_reason": reason}
            if self.job.chat
            else {"index": j, "text": text, "logprobs": None, "finish_reason": reason}
        )
        if stop_reason_field:
            ch["stop_reason"] = self.job.stop_hit[j]
        return self._event([ch])

    def finish(self, j: int, reason: str, stop_reason_field: bool, extra: dict[str, Any] | None = None) -> bytes:
        """A separate event closing choice ``j`` with its finish reason."""
        ch: dict[str, Any] = (
            {"index": j, "delta": {}, "logprobs": None, "finish_reason": reason}
            if self.job.chat
            else {"index": j, "text": "", "logprobs": None, "finish_reason": reason}
        )
        if stop_reason_field:
            ch["stop_reason"] = self.job.stop_hit[j]
        return self._event([ch], extra=extra)

    def usage(self) -> bytes:
        """The ``include_usage`` event: no choices, the whole request's usage."""
        prompt = self.job.total_prompt
        completion = sum(self.job.n_list)
        obj = {
            **self._base,
            "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }
        return b"data: " + orjson.dumps(obj) + b"\n\n"


# -- embeddings --


def parse_embeddings(body: Any, max_model_len: int, max_dim: int) -> tuple[list[bytes], list[int], int, bool]:
    """Read an embeddings request.

    Returns:
        (the inputs as bytes to hash, their token counts, dimensions, base64 wanted).

    Raises:
        RequestError: 400 for a malformed request or an input longer than the context.
    """
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    inp = body.get("input")
    items: list[bytes]
    counts: list[int]
    if isinstance(inp, str):
        items, counts = [inp.encode()], [estimate_tokens(len(inp))]
    elif isinstance(inp, list) and inp and all(isinstance(s, str) for s in inp):
        items, counts = [s.encode() for s in inp], [estimate_tokens(len(s)) for s in inp]
    elif isinstance(inp, list) and inp and all(isinstance(t, int) and not isinstance(t, bool) for t in inp):
        items, counts = [orjson.dumps(inp)], [len(inp)]
    elif (
        isinstance(inp, list)
        and inp
        and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in inp)
    ):
        items, counts = [orjson.dumps(p) for p in inp], [len(p) for p in inp]
    else:
        raise RequestError(
            400, "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists"
        )
    if max(counts) > max_model_len:
        raise RequestError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{max(counts)} tokens in the input for embedding generation. Please reduce the length of the input.",
            kind="context",
            extra={"n_prompt_tokens": max(counts), "n_ctx": max_model_len},
        )
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64", None):
        raise RequestError(400, "'encoding_format' must be 'float' or 'base64'")
    dims = body.get("dimensions")
    if dims is None:
        dims = max_dim
    elif isinstance(dims, bool) or not isinstance(dims, int) or not 1 <= dims <= max_dim:
        raise RequestError(400, f"'dimensions' must be an integer between 1 and {max_dim}")
    return items, counts, dims, fmt == "base64"


def embed(data: bytes, dim: int, salt: bytes) -> tuple[float, ...]:
    """A unit vector of ``dim`` float32 values determined by ``data`` (and ``salt``)."""
    raw = hashlib.shake_256(salt + data).digest(2 * dim)
    ints = struct.unpack(f"<{dim}H", raw)
    vals = [(x - 32767.5) / 32767.5 for x in ints]
    norm = math.sqrt(sum(v * v for v in vals)) or 1.0
    # Round through float32 so the JSON floats equal the base64 encoding exactly.
    return struct.unpack(f"<{dim}f", struct.pack(f"<{dim}f", *(v / norm for v in vals)))


def embedding_item(vec: tuple[float, ...], index: int, b64: bool) -> dict[str, Any]:
    """One ``data[]`` entry; base64 is little-endian float32."""
    if b64:
        value: Any = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    else:
        value = vec
    return {"index": index, "object": "embedding", "embedding": value}
