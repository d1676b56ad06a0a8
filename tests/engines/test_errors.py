"""``llmgw.engines.errors.normalize_error``: each engine's error bodies in OpenAI's shape.

The bodies are the engines' own (``shared/reference/engines.md`` §1.4, §2.5, §3.4,
§8.3) and those the simulated engines write. With the engine that wrote a body the
answer is the same as without one (the shapes say what they are), checked by
example and by hypothesis; where the engines' knowledge differs the tests below
say how.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import engines
from llmgw.engines import errors
from llmgw.engines.base import EngineInfo
from llmgw.engines.errors import normalize_error
from llmgw.engines.sim.config import SimConfig
from llmgw.engines.sim.dialects import DIALECTS
from llmgw.engines.sim.openai import RequestError
from llmgw.engines.sim.scheduler import Scheduler, Stats

VLLM, LLAMACPP, TRTLLM, SGLANG = (engines.get(n) for n in ("vllm", "llamacpp", "trtllm", "sglang"))
EXTERNAL, GENERIC = engines.get("external"), engines.get("generic")


def err(status: int, body: bytes, engine: EngineInfo | None = None) -> dict[str, Any]:
    out = orjson.loads(normalize_error(status, body, engine))
    assert set(out) == {"error"}
    e: dict[str, Any] = out["error"]
    assert isinstance(e["code"], str) and e["code"], e
    assert isinstance(e["type"], str) and e["type"], e
    assert isinstance(e["message"], str) and e["message"], e
    assert e["param"] is None or isinstance(e["param"], str), e
    return e


def openai(message: str, type_: str, code: str, param: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"message": message, "type": type_, "param": param, "code": code, **extra}


# (engine, status, body as the engine writes it, what clients get)
CASES: list[tuple[EngineInfo | None, int, bytes, dict[str, Any]]] = [
    # vLLM since v0.10.1: nested, integer code [V15]
    (VLLM, 400, b'{"error":{"message":"bad n","type":"BadRequestError","param":null,"code":400}}',
     openai("bad n", "invalid_request_error", "invalid_request")),
    # vLLM before v0.10.1: flat [V15]
    (VLLM, 404, b'{"object":"error","message":"The model `x` does not exist.","type":"NotFoundError",'
                b'"param":"model","code":404}',
     openai("The model `x` does not exist.", "invalid_request_error", "not_found", "model")),
    # vLLM's key check: not OpenAI's envelope [V9]
    (VLLM, 401, b'{"error": "Unauthorized"}', openai("Unauthorized", "invalid_request_error", "invalid_api_key")),
    # vLLM's exception-class types, by status: OpenAI's for it (§8.3)
    (VLLM, 404, b'{"error":{"message":"The model `zzz` does not exist.","type":"NotFoundError","param":"model",'
                b'"code":404}}',
     openai("The model `zzz` does not exist.", "invalid_request_error", "not_found", "model")),
    (VLLM, 429, b'{"error":{"message":"slow down","type":"RateLimitError","param":null,"code":429}}',
     openai("slow down", "rate_limit_exceeded", "rate_limit_exceeded")),
    (VLLM, 500, b'{"error":{"message":"CUDA out of memory","type":"InternalServerError","param":null,"code":500}}',
     openai("CUDA out of memory", "server_error", "internal_error")),
    (VLLM, 503, b'{"error":{"message":"overloaded","type":"ServiceUnavailableError","param":null,"code":503}}',
     openai("overloaded", "service_unavailable_error", "service_unavailable")),
    # vLLM's context overflow: named only in its message; OpenAI's code for it, as llama.cpp's
    (VLLM, 400, b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, you '
                b'requested 5000 tokens (4000 in the messages, 1000 in the completion).","type":"BadRequestError",'
                b'"param":null,"code":400}}',
     openai("This model's maximum context length is 4096 tokens. However, you requested 5000 tokens (4000 in "
            "the messages, 1000 in the completion).", "invalid_request_error", "context_length_exceeded")),
    (VLLM, 400, b'{"object":"error","message":"This model\'s maximum context length is 2048 tokens. However, '
                b'your request has 3000 input tokens.","type":"BadRequestError","param":null,"code":400}',
     openai("This model's maximum context length is 2048 tokens. However, your request has 3000 input tokens.",
            "invalid_request_error", "context_length_exceeded")),
    # FastAPI's validation answer
    (VLLM, 422, b'{"detail":[{"loc":["body","messages"],"msg":"Field required"}]}',
     openai('[{"loc":["body","messages"],"msg":"Field required"}]', "invalid_request_error", "invalid_request")),
    (VLLM, 404, b'{"detail":"Not Found"}', openai("Not Found", "invalid_request_error", "not_found")),
    # llama.cpp [C8]
    (LLAMACPP, 400, b'{"error":{"code":400,"message":"the request exceeds the available context size",'
                    b'"type":"exceed_context_size_error","n_prompt_tokens":100,"n_ctx":64}}',
     openai("the request exceeds the available context size", "invalid_request_error",
            "context_length_exceeded", n_prompt_tokens=100, n_ctx=64)),
    (LLAMACPP, 503, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}',
     openai("Loading model", "service_unavailable_error", "service_unavailable")),
    (LLAMACPP, 401, b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}',
     openai("Invalid API Key", "invalid_request_error", "invalid_api_key")),
    (LLAMACPP, 403, b'{"error":{"code":403,"message":"no","type":"permission_error"}}',
     openai("no", "permission_error", "permission_denied")),
    (LLAMACPP, 404, b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}',
     openai("File Not Found", "invalid_request_error", "not_found")),
    (LLAMACPP, 400, b'{"error":{"code":400,"message":"bad","type":"invalid_request_error"}}',
     openai("bad", "invalid_request_error", "invalid_request")),
    (LLAMACPP, 500, b'{"error":{"code":500,"message":"boom","type":"server_error"}}',
     openai("boom", "server_error", "internal_error")),
    (LLAMACPP, 501, b'{"error":{"code":501,"message":"not supported","type":"not_supported_error"}}',
     openai("not supported", "server_error", "not_implemented")),
    # TensorRT-LLM [T2]
    (TRTLLM, 400, b'{"error":"1 validation error for ChatCompletionRequest"}',
     openai("1 validation error for ChatCompletionRequest", "invalid_request_error", "invalid_request")),
    (TRTLLM, 501, b'{"object":"error","message":"no","type":"NotImplementedError","param":null,"code":501}',
     openai("no", "server_error", "not_implemented")),
    (TRTLLM, 400, b'{"object":"error","message":"bad","type":"InvalidRequestError","param":null,"code":400}',
     openai("bad", "invalid_request_error", "invalid_request")),
    # SGLang: flat, integer code; its key check as vLLM's [S6]
    (SGLANG, 400, b'{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}',
     openai("bad", "invalid_request_error", "invalid_request")),
    (SGLANG, 503, b'{"object":"error","message":"busy","type":"ServiceUnavailableError","param":null,"code":503}',
     openai("busy", "service_unavailable_error", "service_unavailable")),
    (SGLANG, 401, b'{"error":"Unauthorized"}', openai("Unauthorized", "invalid_request_error", "invalid_api_key")),
    # a string code is the engine's and stays
    (GENERIC, 404, b'{"error":{"message":"no such model","type":"invalid_request_error","code":"model_not_found"}}',
     openai("no such model", "invalid_request_error", "model_not_found")),
    # plain text, nothing, a JSON value that is not an object, an unknown status
    (GENERIC, 502, b"upstream went away\n", openai("upstream went away", "server_error", "bad_gateway")),
    (GENERIC, 503, b"", openai("the engine answered HTTP 503", "service_unavailable_error", "service_unavailable")),
    (GENERIC, 429, b"[1, 2]", openai("[1, 2]", "rate_limit_exceeded", "rate_limit_exceeded")),
    (GENERIC, 418, b'{"error":{"message":""}}', openai("the engine answered HTTP 418", "invalid_request_error",
                                                      "http_418")),
    (GENERIC, 599, b"\xff\xfe oops", openai("\ufffd\ufffd oops", "server_error", "http_599")),
    (None, 400, b'{"error":{"message":{"why":"nested"},"type":"","code":""}}',
     openai('{"why":"nested"}', "invalid_request_error", "invalid_request")),
]


@pytest.mark.parametrize(("engine", "status", "body", "want"), CASES)
def test_engine_bodies(engine: EngineInfo | None, status: int, body: bytes, want: dict[str, Any]) -> None:
    assert err(status, body, engine) == want


@pytest.mark.parametrize(("engine", "status", "body", "want"), CASES)
def test_the_engine_that_wrote_a_body_changes_nothing_today(
    engine: EngineInfo | None, status: int, body: bytes, want: dict[str, Any]
) -> None:
    # given the engine that wrote it, the answer to that engine's own body is the
    # same bytes as without one
    assert normalize_error(status, body, engine) == normalize_error(status, body)
    err(status, body, engine)


@settings(max_examples=300, deadline=None)
@given(
    status=st.sampled_from([400, 401, 403, 404, 418, 422, 429, 500, 501, 502, 503, 504, 599]),
    error=st.one_of(
        st.none(),
        st.text(max_size=10),
        st.dictionaries(
            st.sampled_from(["message", "type", "param", "code", "detail", "n_ctx", "n_prompt_tokens", "x"]),
            st.one_of(st.none(), st.booleans(), st.integers(-5, 600), st.text(max_size=8),
                      st.sampled_from(["exceed_context_size_error", "unavailable_error"])),
            max_size=6,
        ),
    ),
    flat=st.booleans(),
)
def test_without_an_engine_the_answer_is_todays(status: int, error: Any, flat: bool) -> None:
    if flat and isinstance(error, dict):
        body = orjson.dumps({"object": "error", **error})
    else:
        body = orjson.dumps({"error": error}) if error is not None else b""
    err(status, body)


@given(body=st.binary(max_size=60), status=st.integers(400, 599))
def test_any_bytes(body: bytes, status: int) -> None:
    err(status, body)
    for info in engines.ENGINES.values():
        err(status, body, info)


# -- where the engines' knowledge differs ------------------------------------------

_LCPP_CONTEXT = (b'{"error":{"code":400,"message":"too long","type":"exceed_context_size_error",'
                 b'"n_prompt_tokens":100,"n_ctx":64}}')


def test_llamacpp_context_type_is_llamacpps_own() -> None:
    # only llama.cpp's module maps its type to OpenAI's code and passes its fields on
    assert err(400, _LCPP_CONTEXT, LLAMACPP)["code"] == "context_length_exceeded"
    assert err(400, _LCPP_CONTEXT, LLAMACPP)["n_ctx"] == 64
    for info in (VLLM, TRTLLM, SGLANG, GENERIC, EXTERNAL):
        e = err(400, _LCPP_CONTEXT, info)
        assert e == openai("too long", "invalid_request_error", "invalid_request"), info.name
    # not knowing the engine: what llmgw knows of any
    assert err(400, _LCPP_CONTEXT)["code"] == "context_length_exceeded"


def test_an_integer_code_is_the_status_where_the_engine_puts_it_there() -> None:
    body = b'{"error":{"message":"m","type":"invalid_request_error","code":1214}}'
    for info in (VLLM, LLAMACPP, TRTLLM, SGLANG, GENERIC):
        assert info.integer_error_code
        assert err(400, body, info)["code"] == "invalid_request", info.name
    assert err(400, body)["code"] == "invalid_request"


def test_an_external_providers_own_integer_code_is_kept_as_a_string() -> None:
    assert not EXTERNAL.integer_error_code
    assert err(400, b'{"error":{"message":"m","type":"invalid_request_error","code":1214}}', EXTERNAL)["code"] == "1214"
    # one that is the HTTP status says no more than the status does
    assert err(400, b'{"error":{"message":"m","code":400}}', EXTERNAL)["code"] == "invalid_request"
    # true is not an integer code
    assert err(400, b'{"error":{"message":"m","code":true}}', EXTERNAL)["code"] == "invalid_request"
    assert err(429, b'{"error":{"message":"m","code":"rate_limit_exceeded"}}', EXTERNAL)["code"] == "rate_limit_exceeded"


def test_knowledge_comes_from_the_engine_record() -> None:
    # a made-up engine: its type codes and extra fields are what is read
    from dataclasses import replace

    probe = replace(GENERIC, name="probe", error_type_codes=(("quota_error", "insufficient_quota"),),
                    error_extra_fields=("retry_in",), integer_error_code=False)
    body = b'{"error":{"message":"m","type":"quota_error","code":7,"retry_in":3,"n_ctx":1}}'
    assert err(429, body, probe) == openai("m", "rate_limit_exceeded", "insufficient_quota", retry_in=3)
    assert err(429, b'{"error":{"message":"m","type":"x","code":7}}', probe)["code"] == "7"


def test_what_any_engine_knows_is_every_engines() -> None:
    assert errors._ANY_TYPE_CODES == {"exceed_context_size_error": "context_length_exceeded"}
    assert errors._ANY_EXTRA_FIELDS == ("n_prompt_tokens", "n_ctx")
    assert errors._ANY_MESSAGE_CODES == (("maximum context length is", "context_length_exceeded"),)


_VLLM_CONTEXT = (b'{"error":{"message":"This model\'s maximum context length is 64 tokens. However, you requested '
                 b'100 tokens.","type":"BadRequestError","param":null,"code":400}}')


def test_vllm_context_message_is_vllms_own() -> None:
    # only vLLM's module reads its message; a string code the engine sent wins; only a 400 is read so
    assert err(400, _VLLM_CONTEXT, VLLM)["code"] == "context_length_exceeded"
    assert err(400, _VLLM_CONTEXT)["code"] == "context_length_exceeded"
    for info in (LLAMACPP, TRTLLM, SGLANG, GENERIC, EXTERNAL):
        assert err(400, _VLLM_CONTEXT, info)["code"] == "invalid_request", info.name
    assert err(500, _VLLM_CONTEXT.replace(b"400}", b"500}"), VLLM)["code"] == "internal_error"
    coded = b'{"error":{"message":"This model\'s maximum context length is 64 tokens.","code":"too_long"}}'
    assert err(400, coded, VLLM)["code"] == "too_long"


@pytest.mark.parametrize("etype", sorted(errors.OPENAI_TYPES))
def test_an_openai_type_is_kept_whatever_the_status(etype: str) -> None:
    for status in (400, 429, 500, 503):
        body = orjson.dumps({"error": {"message": "m", "type": etype, "code": status}})
        assert err(status, body)["type"] == etype
        for info in engines.ENGINES.values():
            assert err(status, body, info)["type"] == etype, info.name


@settings(max_examples=200, deadline=None)
@given(status=st.integers(400, 599), etype=st.text(min_size=1, max_size=20))
def test_any_other_type_is_openais_for_the_status(status: int, etype: str) -> None:
    body = orjson.dumps({"error": {"message": "m", "type": etype, "code": status}})
    want = etype if etype in errors.OPENAI_TYPES else errors.TYPE_BY_STATUS.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    assert err(status, body)["type"] == want
    assert want in errors.OPENAI_TYPES


# -- the simulated engines' bodies -------------------------------------------------


def _dialect(name: str) -> Any:
    cfg = SimConfig(engine=name)
    cls = DIALECTS[name]
    stats = Stats(cls.buckets_for(cfg))
    return cls(cfg, Scheduler(cfg.slots, cfg.max_queue, cfg.kv_tokens, stats), stats, 0)


_SIM_ERRORS = [
    RequestError(400, "max_tokens must be at least 1", "invalid"),
    RequestError(400, "the prompt is too long", "context", {"n_prompt_tokens": 100, "n_ctx": 64}),
    RequestError(404, "The model `x` does not exist.", "not_found"),
    RequestError(429, "the queue is full", "unavailable"),
    RequestError(503, "The model is still loading; retry shortly.", "unavailable"),
]


@pytest.mark.parametrize("name", engines.SIMULATED_ENGINES)
@pytest.mark.parametrize("exc", _SIM_ERRORS, ids=lambda e: f"{e.status}-{e.kind}")
def test_simulated_engine_errors(name: str, exc: RequestError) -> None:
    info = engines.get(name)
    status, body = _dialect(name).request_error(exc)
    e = err(status, body, info)
    assert e["message"] == exc.message
    assert e == err(status, body)
    if exc.kind == "context" and name == "llamacpp":
        assert e["code"] == "context_length_exceeded" and e["n_ctx"] == 64
    else:
        assert e["code"] == errors.CODE_BY_STATUS[status]


@pytest.mark.parametrize("name", engines.SIMULATED_ENGINES)
def test_simulated_engine_key_refusal(name: str) -> None:
    status, body = _dialect(name).unauthorized()
    assert status == 401
    assert err(status, body, engines.get(name))["code"] == "invalid_api_key"
