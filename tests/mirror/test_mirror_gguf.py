"""The bounded GGUF header reader: real files, hand-made edge cases, hostile input."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mirror_helpers import (
    T_ARR,
    T_BOOL,
    T_F32,
    T_STR,
    T_U8,
    T_U32,
    T_U64,
    expected_parameters,
    gguf_bytes,
    gkv,
    gstr,
    gtensor,
    minimal_gguf,
    write_gguf,
    write_projector,
)

from llmgw.mirror.errors import GGUFFormatError, NotGGUFError
from llmgw.mirror.gguf import (
    FILE_TYPES,
    GGML_TYPES,
    MAX_STRING_LENGTH,
    ArrayInfo,
    format_parameter_count,
    is_gguf,
    read_gguf,
)


def _write(tmp_path: Path, data: bytes, name: str = "f.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_reads_a_file_written_by_the_gguf_package(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", name="Tiny Llama", context_length=4096, file_type=15, vocab=300)
    info = read_gguf(path)
    assert info.version == 3
    assert info.architecture == "llama"
    assert info.name == "Tiny Llama"
    assert info.context_length == 4096
    assert info.file_type == 15
    assert info.quantization == "Q4_K_M"
    assert info.block_count == 2
    assert info.tensors.count == 3
    assert info.tensors.parameter_count == expected_parameters()
    assert info.tensors.types == {"F32": 300 * 32, "F16": 2 * 32 * 32}
    assert not info.is_projector
    # The 300-token vocabulary is summarised, not materialised.
    assert info.metadata["tokenizer.ggml.tokens"] == ArrayInfo("string", 300)
    assert info.metadata["tokenizer.ggml.scores"] == ArrayInfo("f32", 300)
    assert info.get("tokenizer.chat_template").startswith("{% for m in messages %}")
    summary = info.summary()
    assert summary["parameter_count"] == expected_parameters()
    assert summary["quantization"] == "Q4_K_M"
    assert summary["chat_template"] is not None
    assert info.data_offset % 32 == 0
    assert info.tensors.data_bytes == 300 * 32 * 4 + 2 * 32 * 32 * 2
    assert is_gguf(path)


def test_parameter_count_matches_the_gguf_packages_own_reader(tmp_path: Path) -> None:
    import gguf

    path = write_gguf(tmp_path / "m.gguf", block_count=3, width=48, vocab=500, big_tensor_elements=1000)
    reader = gguf.GGUFReader(str(path))
    assert read_gguf(path).tensors.parameter_count == sum(int(t.n_elements) for t in reader.tensors)


def test_small_arrays_are_kept(tmp_path: Path) -> None:
    data = minimal_gguf(extra_kvs=[gkv("llama.rope.dimension_sections", T_ARR, (T_U32, [8, 8, 16, 0]))])
    info = read_gguf(_write(tmp_path, data))
    assert info.metadata["llama.rope.dimension_sections"] == [8, 8, 16, 0]


def test_missing_file_type_falls_back_to_the_dominant_tensor_type(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", file_type=None)
    info = read_gguf(path)
    assert info.file_type is None
    assert info.quantization == "F32"  # 9600 F32 elements against 2048 F16


def test_version_2_is_accepted(tmp_path: Path) -> None:
    data = bytearray(minimal_gguf())
    data[4:8] = struct.pack("<I", 2)
    assert read_gguf(_write(tmp_path, bytes(data))).version == 2


@pytest.mark.parametrize("style", ["clip", "mmproj"])
def test_projectors_are_detected(tmp_path: Path, style: str) -> None:
    info = read_gguf(write_projector(tmp_path / "p.gguf", style=style))
    assert info.architecture == "clip"
    assert info.is_projector


def test_projector_rule_block_count_zero_with_vision_blocks(tmp_path: Path) -> None:
    data = minimal_gguf(
        arch="qwen2vl",
        extra_kvs=[gkv("qwen2vl.block_count", T_U32, 0), gkv("qwen2vl.vision.block_count", T_U32, 24)],
    )
    assert read_gguf(_write(tmp_path, data)).is_projector
    plain = minimal_gguf(arch="qwen2", extra_kvs=[gkv("qwen2.block_count", T_U32, 24)])
    assert not read_gguf(_write(tmp_path, plain, "q.gguf")).is_projector


def test_a_200k_token_vocabulary_is_skipped_quickly(tmp_path: Path) -> None:
    tokens = gkv("tokenizer.ggml.tokens", T_ARR, (T_STR, [f"token-{i}" for i in range(200_000)]))
    path = _write(tmp_path, minimal_gguf(extra_kvs=[tokens]))
    t0 = time.perf_counter()
    info = read_gguf(path)
    assert time.perf_counter() - t0 < 2.0
    assert info.metadata["tokenizer.ggml.tokens"] == ArrayInfo("string", 200_000)


def test_tables_agree_with_the_reference_implementation() -> None:
    import gguf

    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        if qtype.value in GGML_TYPES and GGML_TYPES[qtype.value][2]:
            name, my_block, my_size = GGML_TYPES[qtype.value]
            assert (name, my_block, my_size) == (qtype.name, block, size)
    for ftype in gguf.LlamaFileType:
        expected = ftype.name.removeprefix("MOSTLY_").removeprefix("ALL_")
        assert FILE_TYPES[ftype.value] == expected


def test_format_parameter_count() -> None:
    assert format_parameter_count(8_030_261_248) == "8.0B"
    assert format_parameter_count(494_032_768) == "494.0M"
    assert format_parameter_count(5120) == "5.1K"
    assert format_parameter_count(12) == "12"
    assert format_parameter_count(None) == "-"


# --- refusals ------------------------------------------------------------------------


def test_not_gguf(tmp_path: Path) -> None:
    path = _write(tmp_path, b"PK\x03\x04" + b"\0" * 100, "x.zip")
    with pytest.raises(NotGGUFError, match="not a GGUF file"):
        read_gguf(path)
    assert not is_gguf(path)


def test_version_1_is_obsolete(tmp_path: Path) -> None:
    data = bytearray(minimal_gguf())
    data[4:8] = struct.pack("<I", 1)
    with pytest.raises(GGUFFormatError, match="version 1 is obsolete"):
        read_gguf(_write(tmp_path, bytes(data)))


def test_unknown_version(tmp_path: Path) -> None:
    data = bytearray(minimal_gguf())
    data[4:8] = struct.pack("<I", 7)
    with pytest.raises(GGUFFormatError, match="version 7 is not supported"):
        read_gguf(_write(tmp_path, bytes(data)))


@pytest.mark.parametrize("magic", [b"GGUF", b"FUGG"])
def test_big_endian_is_refused(tmp_path: Path, magic: bytes) -> None:
    data = magic + struct.pack(">IQQ", 3, 0, 0)
    with pytest.raises(GGUFFormatError, match="big-endian"):
        read_gguf(_write(tmp_path, data))


def test_every_truncation_of_the_header_is_refused(tmp_path: Path) -> None:
    data = minimal_gguf(
        extra_kvs=[gkv("general.name", T_STR, "n"), gkv("a.list", T_ARR, (T_STR, ["x"] * 70))]
    )
    header_end = len(data) - 32
    for cut in range(header_end):
        path = _write(tmp_path, data[:cut], "cut.gguf")
        with pytest.raises((GGUFFormatError, NotGGUFError)):
            read_gguf(path)


def test_truncated_tensor_data_is_refused(tmp_path: Path) -> None:
    data = minimal_gguf(elements=64)
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf(_write(tmp_path, data[:-1]))
    read_gguf(_write(tmp_path, data, "whole.gguf"))


def test_truncated_real_file_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(GGUFFormatError, match="truncated"):
        read_gguf(path)


@pytest.mark.parametrize(
    ("kvs", "tensors", "message"),
    [
        # A string that claims 2**60 bytes: refused before any allocation.
        ([gstr("general.architecture") + struct.pack("<IQ", T_STR, 1 << 60)], [], "over the limit"),
        ([gstr("general.architecture") + struct.pack("<IQ", T_STR, MAX_STRING_LENGTH + 1)], [], "over the limit"),
        # An array that claims 2**40 u64 elements.
        ([gkv("general.architecture", T_STR, "llama"), gstr("a") + struct.pack("<IIQ", T_ARR, T_U64, 1 << 40)], [],
         "more than the file can hold"),
        ([gkv("general.architecture", T_STR, "llama"), gstr("a") + struct.pack("<II", 99, 0)], [], "unknown value type"),
        ([gkv("general.architecture", T_STR, "llama"), gstr("a") + struct.pack("<IIQ", T_ARR, 77, 1)], [],
         "unknown element type"),
        ([gkv("general.architecture", T_STR, "llama"), gkv("general.architecture", T_STR, "x")], [], "duplicate"),
        ([gkv("general.name", T_STR, "no arch")], [], "no general.architecture"),
        ([gkv("general.architecture", T_U32, 5)], [], "no general.architecture"),
        ([gkv("general.architecture", T_STR, "llama"), gkv("general.alignment", T_U32, 24)], [], "power of two"),
        ([gkv("general.architecture", T_STR, "llama")], [gtensor("t", [1, 1, 1, 1, 1])], "at most 4"),
        ([gkv("general.architecture", T_STR, "llama")], [gtensor("t", [4]), gtensor("t", [4], offset=32)],
         "duplicate tensor"),
        ([gkv("general.architecture", T_STR, "llama")], [gtensor("t", [4], ggml_type=5000)], "unknown ggml type"),
        ([gkv("general.architecture", T_STR, "llama")], [gtensor("t", [33], ggml_type=2)], "not a multiple"),
        ([gkv("general.architecture", T_STR, "llama")], [gtensor("t", [1 << 32, 1 << 32])], "too many elements"),
        ([gstr(b"\xff\xfe") + struct.pack("<I", T_U8) + b"\0"], [], "not valid UTF-8"),
        ([gstr("") + struct.pack("<I", T_U8) + b"\0"], [], "empty metadata key"),
    ],
)  # fmt: skip
def test_hostile_headers_are_refused(
    tmp_path: Path, kvs: list[bytes], tensors: list[bytes], message: str
) -> None:
    data = gguf_bytes(kvs, tensors, data=b"\0" * 4096)
    with pytest.raises(GGUFFormatError, match=message):
        read_gguf(_write(tmp_path, data))


def test_lying_counts_are_refused(tmp_path: Path) -> None:
    base = [gkv("general.architecture", T_STR, "llama")]
    with pytest.raises(GGUFFormatError, match="over the limit"):
        read_gguf(_write(tmp_path, gguf_bytes(base, n_tensors=1 << 40)))
    with pytest.raises(GGUFFormatError, match="over the limit"):
        read_gguf(_write(tmp_path, gguf_bytes(base, n_kv=1 << 40)))
    with pytest.raises(GGUFFormatError, match="cannot fit"):
        read_gguf(_write(tmp_path, gguf_bytes(base, n_kv=60_000)))


def test_deeply_nested_arrays_are_refused(tmp_path: Path) -> None:
    value: tuple[int, list[object]] = (T_U8, [1])
    for _ in range(6):
        value = (T_ARR, [value])  # arrays of arrays are walked, never kept
    payload = gkv("nested", T_ARR, value)
    data = gguf_bytes([gkv("general.architecture", T_STR, "llama"), payload])
    with pytest.raises(GGUFFormatError, match="nests deeper"):
        read_gguf(_write(tmp_path, data))


def test_bools_and_floats(tmp_path: Path) -> None:
    data = minimal_gguf(extra_kvs=[gkv("x.flag", T_BOOL, True), gkv("x.eps", T_F32, 0.5)])
    info = read_gguf(_write(tmp_path, data))
    assert info.metadata["x.flag"] is True
    assert info.metadata["x.eps"] == 0.5


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_mutated_headers_never_crash(tmp_path: Path, data: st.DataObject) -> None:
    """Random byte flips and cuts give a clean result or a GGUF error, never anything else."""
    base = bytearray(
        minimal_gguf(
            extra_kvs=[gkv("general.name", T_STR, "fuzz"), gkv("t.list", T_ARR, (T_STR, ["ab", "c"] * 40))]
        )
    )
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(0, len(base) - 1))
        base[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(base)))
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(base[:cut]) if data.draw(st.booleans()) else bytes(base))
    try:
        read_gguf(path)
    except (GGUFFormatError, NotGGUFError):
        pass


def test_reader_does_not_move_the_fd_offset(tmp_path: Path) -> None:
    from llmgw.mirror.gguf import read_gguf_fd

    path = write_gguf(tmp_path / "m.gguf")
    fd = os.open(path, os.O_RDONLY)
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        read_gguf_fd(fd)
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0
    finally:
        os.close(fd)
