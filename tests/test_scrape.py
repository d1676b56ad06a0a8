"""llmgw.scrape: per-engine mappings and read_stats, over both promscan twins."""

from __future__ import annotations

import doctest
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from llmgw import engines, scrape
from llmgw.engines.base import MetricSpec
from llmgw.errors import PromParseError
from llmgw.scrape import Stats, mapping_for, read_stats, scan_stats

DATA = Path(__file__).parent / "data"
VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def page(name: str) -> bytes:
    return (DATA / name).read_bytes()


def stats(
    promscan: ModuleType,
    body: bytes,
    engine: str,
    model: str | None = None,
    select: dict[str, str] | None = None,
) -> Stats:
    """read_stats with the given twin (read_stats itself uses the selected one)."""
    return scan_stats(body, mapping_for(engine, select=select, impl=promscan), model)[0]


# -- each engine's page ------------------------------------------------------------------


def test_vllm(promscan: ModuleType) -> None:
    assert stats(promscan, page("vllm_metrics.txt"), "vllm") == Stats(3.0, 12.0, 0.4213)
    assert stats(promscan, page("vllm_metrics.txt"), "vllm", VLLM_MODEL) == Stats(3.0, 12.0, 0.4213)
    assert stats(promscan, page("vllm_metrics.txt"), "vllm", "other-model") == Stats(None, None, None)
    assert stats(promscan, page("vllm_metrics_openmetrics.txt"), "vllm", VLLM_MODEL) == Stats(
        3.0, 12.0, 0.4213
    )


def test_vllm_data_parallel_engines_are_summed(promscan: ModuleType) -> None:
    body = (
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        b'vllm:num_requests_waiting{engine="1",model_name="m"} 5.0\n'
        b'vllm:num_requests_running{engine="0",model_name="m"} 8.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 7.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2\n'
        b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.9\n'
    )
    assert stats(promscan, body, "vllm", "m") == Stats(7.0, 15.0, 0.9)


def test_vllm_before_0_9_2(promscan: ModuleType) -> None:
    body = (
        b'vllm:num_requests_waiting{model_name="m"} 1.0\n'
        b'vllm:num_requests_running{model_name="m"} 2.0\n'
        b'vllm:gpu_cache_usage_perc{model_name="m"} 0.55\n'
    )
    _, result = scan_stats(body, mapping_for("vllm", impl=promscan), "m")
    assert result.values == (1.0, 2.0, 0.55)
    assert result.found[2] == "vllm:gpu_cache_usage_perc"


def test_vllm_new_name_wins_over_old(promscan: ModuleType) -> None:
    body = b'vllm:gpu_cache_usage_perc{model_name="m"} 0.9\nvllm:kv_cache_usage_perc{model_name="m"} 0.3\n'
    assert stats(promscan, body, "vllm").kv_cache_usage == 0.3  # not 1.2, not 0.9


def test_llamacpp_kv_is_absent_not_zero(promscan: ModuleType) -> None:
    got = stats(promscan, page("llamacpp_metrics.txt"), "llamacpp")
    assert got == Stats(2.0, 4.0, None)
    assert got.kv_cache_usage is None
    m = mapping_for("llamacpp", impl=promscan)
    _, result = scan_stats(page("llamacpp_metrics.txt"), m)
    assert scrape.missing_signals(m, result) == {}  # llama.cpp has no KV gauge: nothing to warn about


def test_sglang_sums_ranks_and_maxes_token_usage(promscan: ModuleType) -> None:
    got = stats(promscan, page("sglang_metrics.txt"), "sglang", "Qwen/Qwen2.5-7B-Instruct")
    assert got == Stats(10.0, 15.0, 0.58)


def test_sglang_old_prefix(promscan: ModuleType) -> None:
    assert stats(promscan, page("sglang_old_metrics.txt"), "sglang") == Stats(1.0, 5.0, 0.22)


def test_trtllm_both_prefixes(promscan: ModuleType) -> None:
    assert stats(promscan, page("trtllm_metrics.txt"), "trtllm") == Stats(2.0, 9.0, 0.73)
    assert stats(promscan, page("trtllm_old_metrics.txt"), "trtllm") == Stats(0.0, 3.0, 0.125)
    # Its model label is hard-coded "undefined": a model filter must not drop everything.
    assert stats(promscan, page("trtllm_metrics.txt"), "trtllm", "my-model") == Stats(2.0, 9.0, 0.73)
    assert scrape.metrics_path_for("trtllm") == "/prometheus/metrics"


def test_every_engine_reads_its_own_names(promscan: ModuleType) -> None:
    # Built from llmgw.engines, not from literals here: one page per engine, first names.
    for name, info in engines.ENGINES.items():
        lines = []
        for i, spec in enumerate((info.waiting, info.running, info.kv_cache_usage)):
            if spec.names:
                lines.append(f"{spec.names[0]} {i + 1}.5\n")
        got = stats(promscan, "".join(lines).encode(), name)
        expected = [float(i) + 1.5 if spec.names else None for i, spec in
                    enumerate((info.waiting, info.running, info.kv_cache_usage))]  # fmt: skip
        assert list(got) == expected, name


def test_external_reads_nothing(promscan: ModuleType) -> None:
    assert stats(promscan, page("vllm_metrics.txt"), "external") == Stats(None, None, None)


def test_wrong_engine_page_is_all_absent(promscan: ModuleType) -> None:
    assert stats(promscan, page("vllm_metrics.txt"), "sglang") == Stats(None, None, None)
    m = mapping_for("sglang", impl=promscan)
    _, result = scan_stats(page("vllm_metrics.txt"), m)
    assert scrape.missing_signals(m, result) == {
        "waiting": ("sglang:num_queue_reqs", "sglang_num_queue_reqs"),
        "running": ("sglang:num_running_reqs", "sglang_num_running_reqs"),
        "kv_cache_usage": ("sglang:token_usage", "sglang_token_usage"),
    }


# -- overrides, generic, errors ----------------------------------------------------------------


def test_overrides(promscan: ModuleType) -> None:
    body = b'vllm:kv_cache_usage_perc_v2{model_name="m"} 0.4\nvllm:num_requests_waiting{model_name="m"} 3\n'
    m = mapping_for("vllm", {"kv_cache_usage": ["vllm:kv_cache_usage_perc_v2", "vllm:kv_cache_usage_perc"]},
                    impl=promscan)  # fmt: skip
    # not overridden: the engine's (and its OpenMetrics-escaped spelling)
    assert m.names[0] == ("vllm:num_requests_waiting", "vllm_num_requests_waiting")
    assert m.model_label == "model_name"
    assert scan_stats(body, m, "m")[0] == Stats(3.0, None, 0.4)
    # An empty list switches a signal off; a MetricSpec also sets the aggregate.
    m = mapping_for("vllm", {"waiting": [], "running": MetricSpec(("vllm:num_requests_waiting",), "max")},
                    impl=promscan)  # fmt: skip
    assert scan_stats(body, m)[0] == Stats(None, 3.0, None)


def test_openmetrics_escaped_names_are_read(promscan: ModuleType) -> None:
    # prometheus_client's OpenMetrics output escapes ':' to '_'
    body = (
        b'# TYPE vllm_num_requests_waiting gauge\nvllm_num_requests_waiting{model_name="m"} 2.0\n'
        b'# TYPE vllm_num_requests_running gauge\nvllm_num_requests_running{model_name="m"} 5.0\n# EOF\n'
    )
    assert scan_stats(body, mapping_for("vllm", impl=promscan), "m")[0] == Stats(2.0, 5.0, None)


def test_generic(promscan: ModuleType) -> None:
    body = b'q{shard="a"} 2\nq{shard="b"} 3\nbusy 1\nkv{shard="a"} 0.5\nkv{shard="b"} 0.7\n'
    m = mapping_for(
        "generic", {"waiting": ["q"], "running": ["busy"], "kv_cache_usage": ["kv"]}, impl=promscan
    )
    assert m.aggregates == ("sum", "sum", "max")
    assert m.model_label is None
    assert scan_stats(body, m)[0] == Stats(5.0, 1.0, 0.7)
    m = mapping_for("generic", {"waiting": ["q"]}, model_label="shard", impl=promscan)
    assert scan_stats(body, m, "b")[0] == Stats(3.0, None, None)
    assert mapping_for("generic", impl=promscan).names == ((), (), ())
    assert scrape.metrics_path_for("generic") == "/metrics"


def test_select_and_model_label_override(promscan: ModuleType) -> None:
    body = (
        b'sglang:num_queue_reqs{dp_rank="0",tp_rank="0"} 4\n'
        b'sglang:num_queue_reqs{dp_rank="0",tp_rank="1"} 4\n'  # --enable-metrics-for-all-schedulers
        b'sglang:num_queue_reqs{dp_rank="1",tp_rank="0"} 6\n'
    )
    assert stats(promscan, body, "sglang").waiting == 14.0
    assert stats(promscan, body, "sglang", select={"tp_rank": "0"}).waiting == 10.0
    assert mapping_for("vllm", model_label=None, impl=promscan).model_label is None


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("nope",), {}, "unknown engine 'nope'; choose one of: vllm, "),
        (("vllm", {"queue": ["x"]}), {}, "unknown signal 'queue'"),
        (("vllm", {"waiting": "vllm:x"}), {}, "expected a list of metric names"),
        (("vllm", {"waiting": ["not a name"]}), {}, "not a valid metric name"),
        (("vllm",), {"model_label": "model-name"}, "not a valid label name"),
    ],
)
def test_mapping_for_rejects(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        mapping_for(*args, **kwargs)


def test_engine_choices() -> None:
    assert scrape.engine_choices() == engines.ENGINE_NAMES
    assert "generic" in scrape.engine_choices()
    with pytest.raises(ValueError, match="unknown engine"):
        scrape.metrics_path_for("nope")
    assert scrape.metrics_path_for("vllm") == "/metrics"


def test_scan_stats_wants_a_full_mapping(promscan: ModuleType) -> None:
    with pytest.raises(ValueError, match="mapping_for"):
        scan_stats(b"", promscan.Mapping({"waiting": (("w",), "sum")}))


# -- read_stats: the public call -------------------------------------------------------------


def test_read_stats() -> None:
    assert read_stats(page("vllm_metrics.txt"), "vllm", VLLM_MODEL) == Stats(3.0, 12.0, 0.4213)
    assert read_stats(page("llamacpp_metrics.txt"), "llamacpp") == Stats(2.0, 4.0, None)
    assert read_stats(b"", "sglang") == Stats(None, None, None)
    assert isinstance(read_stats(b"", "vllm"), tuple)
    with pytest.raises(ValueError, match="unknown engine"):
        read_stats(b"", "vLLM")


def test_read_stats_nan_is_absent() -> None:
    body = b"vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc nan\n"
    assert read_stats(body, "vllm") == Stats(None, 1.0, None)
    inf = read_stats(b"vllm:num_requests_waiting +Inf\n", "vllm").waiting
    assert inf is not None and math.isinf(inf)


def test_read_stats_malformed_lines() -> None:
    body = b"vllm:num_requests_waiting 2\nvllm:num_requests_running{x} 4\nvllm:num_requests_running 3\n"
    assert read_stats(body, "vllm") == Stats(2.0, 3.0, None)  # the bad line is skipped
    with pytest.raises(PromParseError) as info:
        read_stats(body, "vllm", strict=True)
    assert info.value.lineno == 2
    stats, result = scan_stats(body, mapping_for("vllm"))
    assert stats == Stats(2.0, 3.0, None)
    assert result.bad_lines == 1 and result.error is not None and result.error.lineno == 2
    with pytest.raises(TypeError):
        read_stats(body.decode(), "vllm")  # type: ignore[arg-type]


def test_docstring_example() -> None:
    failures, tried = doctest.testmod(scrape, raise_on_error=False, report=True)
    assert tried >= 2 and failures == 0


def test_fixture_is_up_to_date() -> None:
    script = DATA / "make_vllm_metrics.py"
    done = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
