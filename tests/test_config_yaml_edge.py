"""The YAML reader at its edges: merge keys, aliases of aliases, deep nesting; each a line, never a traceback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from llmgw.cli import main
from llmgw.config import load_file
from llmgw.errors import ConfigError


def _write(tmp_path: Path, text: str, name: str = "llmgw.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _lines(p: Path) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        load_file(p)
    return str(ei.value).splitlines()


# -- merge keys --


def test_a_key_written_beside_a_merge_key_is_on_its_own_line(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "endpoints:\n"  # 1
        "  - &e {id: a, url: 'http://127.0.0.1:20001', model: m, engine: tgi}\n"  # 2
        "  - <<: *e\n"  # 3
        "    id: b\n"  # 4
        "    url: bogus\n"  # 5
        "  - <<: *e\n"  # 6
        "    id: a\n",  # 7
    )
    assert [line.split(": ", 3)[:3] for line in _lines(p)] == [
        # engine is merged, not overridden: on the anchor's line
        [f"{p}:2", "endpoints[0].engine", "unknown engine 'tgi'; choose one of vllm, llamacpp, trtllm, sglang, generic, external"],
        [f"{p}:2", "endpoints[1].engine", "unknown engine 'tgi'; choose one of vllm, llamacpp, trtllm, sglang, generic, external"],
        [f"{p}:2", "endpoints[2].engine", "unknown engine 'tgi'; choose one of vllm, llamacpp, trtllm, sglang, generic, external"],
        [f"{p}:5", "endpoints[1].url", "not a URL (expected http://host:port), got 'bogus'"],
        [f"{p}:7", "endpoints[2].id", "duplicate id 'a' (also endpoints[0])"],
    ]


def test_a_merged_mapping_that_overrides_its_own_merge_is_no_duplicate(tmp_path: Path) -> None:
    # The anchor sits deeper than the mapping that merges it, so PyYAML flattens it on the way,
    # before building it: its own url then follows the url it overrides.
    p = _write(
        tmp_path,
        "x-defs:\n"
        "  deeper:\n"
        "    b: &b {<<: {url: 'http://h:1'}, url: 'http://h:2'}\n"
        "endpoints: [{<<: *b, id: a, model: m}]\n",
    )
    with pytest.raises(ConfigError) as ei:
        load_file(p)
    assert [pr.key for pr in ei.value.problems] == ["x-defs"]


# -- aliases --


def _aliases_of_aliases(levels: int, per_level: int = 9) -> str:
    """A list of ``per_level`` items, then ``levels - 1`` lists of ``per_level`` aliases of the one before."""
    out = ["x-a0: &a0 [" + ", ".join(["x"] * per_level) + "]"]
    for i in range(1, levels):
        out.append(f"x-a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * per_level) + "]")
    return "\n".join(out) + "\n"


@pytest.mark.timeout(10)
def test_aliases_of_aliases_are_refused_at_once(tmp_path: Path) -> None:
    p = _write(tmp_path, _aliases_of_aliases(9) + "endpoints: [{id: a, url: 'http://h:1', model: m, metric_names: {waiting: *a8}}]\n")
    start = time.perf_counter()
    assert _lines(p) == [f"{p}:5: aliases expand the document past 100000 values"]
    assert time.perf_counter() - start < 1.0
    # a few levels are only aliases: the keys llmgw does not know are named, each on its line
    p.write_text(_aliases_of_aliases(4))
    assert [line.split(" unknown key")[0] for line in _lines(p)] == [
        f"{p}:{i + 1}: x-a{i}:" for i in range(4)
    ]


def test_a_key_under_an_alias_is_on_its_anchors_line(tmp_path: Path) -> None:
    p = _write(
        tmp_path,
        "endpoints:\n"  # 1
        "  - id: a\n"  # 2
        "    url: 'http://h:1'\n"  # 3
        "    model: m\n"  # 4
        "    metric_names: &names\n"  # 5
        "      running: vllm:num_requests_running\n"  # 6
        "      waiting: bad name\n"  # 7
        "  - {id: b, url: 'http://h:2', model: m, metric_names: *names}\n",  # 8
    )
    assert [line.split(": ", 2)[:2] for line in _lines(p)] == [
        [f"{p}:7", "endpoints[0].metric_names.waiting"],
        [f"{p}:7", "endpoints[1].metric_names.waiting"],
    ]


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path: Path) -> None:
    p = _write(tmp_path, "endpoints: &a [{id: a, url: 'http://h:1', model: m, metric_names: {waiting: *a}}]\n")
    assert _lines(p) == [f"{p}:1: an alias inside its own anchor nests the data without end"]


def test_merges_of_merges_are_refused_past_their_limit(tmp_path: Path) -> None:
    keys = ", ".join(f"k{i}: 0" for i in range(4000))
    p = _write(tmp_path, f"x-a: &a {{{keys}}}\nx-b: {{<<: [*a, *a, *a]}}\n")
    assert _lines(p) == [f"{p}:2: merge keys bring more than 10000 keys into one mapping"]


# -- deep nesting --


def test_nesting_too_deep_is_one_line(tmp_path: Path) -> None:
    p = _write(tmp_path, "x: " + "[" * 500 + "]" * 500 + "\n")
    assert _lines(p) == [f"{p}:1: nested too deeply (more than 128 levels)"]
    for args in (["check-config", str(p)], ["serve", "-c", str(p)]):
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 1, res.output
        assert res.stderr.splitlines() == [f"llmgw: error: {p}:1: nested too deeply (more than 128 levels)"]
    p.write_text("x: " + "[" * 100 + "]" * 100 + "\n")  # deep, but not too deep
    assert [line.split(": ", 2)[1] for line in _lines(p)] == ["x"]


def test_merge_keys_nested_too_deep_are_one_line(tmp_path: Path) -> None:
    # Anchors nested below the mapping that merges the last of them: PyYAML flattens the chain in one go.
    chain = "".join(f"    a{i}: &a{i} {{<<: *a{i - 1}, k{i}: 1}}\n" for i in range(1, 300))
    p = _write(tmp_path, "x:\n  y:\n    a0: &a0 {k: 1}\n" + chain + "z: {<<: *a299}\n")
    (line,) = _lines(p)
    assert line.startswith(f"{p}:") and line.endswith(": merge keys nested too deeply (more than 128 levels)")
