"""A tiny random-weight llama model in GGUF, written in well under a second.

``llama-server`` loads it like any other llama model, so tests and benchmarks can
run a real engine without a model hub. The weights are random, but generation is
steered so that output is printable ASCII and never stops early: one residual
dimension is held at a constant (the embeddings set it, and no layer writes to
it), so that column of ``output.weight`` acts as a per-token logit bias. Giving
``</s>``, the control tokens and the byte-fallback tokens a large negative bias
means every generation runs to ``max_tokens`` and every generated token is one
visible character.

The file is an ordinary GGUF (header, metadata, F32 tensors), so it is also a
valid input for ``llmgw mirror import``.

The ``gguf`` and ``numpy`` packages are test extras (``pip install llmgw[test]``);
they are imported only when a model is written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["CHATML_TEMPLATE", "TinyLlamaSpec", "write_tiny_llama"]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# gguf's TokenType values (llama.cpp's llama_token_type), spelled out so this
# module imports without the gguf package.
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6


class TinyLlamaSpec:
    """The shape of the model :func:`write_tiny_llama` writes (all small)."""

    n_embd = 64
    n_layer = 2
    n_ff = 128
    n_head = 4
    n_head_kv = 4
    rope_freq_base = 10000.0
    rms_eps = 1e-5
    # ids of the special tokens
    unk_id, bos_id, eos_id = 0, 1, 2


def _vocab() -> tuple[list[str], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [_UNKNOWN, _CONTROL, _CONTROL]
    # The 256 byte tokens: the loader looks up <0x0A>, and characters outside the
    # vocabulary are tokenised through them.
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [_BYTE] * 256
    # The word-boundary marker (the space), then every visible ASCII character.
    tokens.append("\u2581")
    types.append(_NORMAL)
    tokens += [chr(c) for c in range(0x21, 0x7F)]
    types += [_NORMAL] * (0x7F - 0x21)
    return tokens, types


def write_tiny_llama(
    path: str | os.PathLike[str],
    *,
    ctx: int = 2048,
    seed: int = 0,
    n_embd: int | None = None,
    n_layer: int | None = None,
    n_ff: int | None = None,
) -> Path:
    """Write a tiny random-weight llama GGUF that ``llama-server`` loads.

    Two layers, 64 wide, a ~350-token character vocabulary with byte fallback and
    a ChatML chat template; about 0.5 MB. Generations never end before
    ``max_tokens`` and produce one visible ASCII character (or a space) per token,
    so a prompt of N such characters is about N tokens.

    Args:
        path: where to write the file (replaced if it exists).
        ctx: the model's training context (``llama.context_length``).
        seed: the random seed; the same seed writes the same bytes.
        n_embd, n_layer, n_ff: a wider or deeper model than :class:`TinyLlamaSpec`'s
            (a multiple of its 4 heads wide), so that prefill takes measurable time
            on a CPU (``bench/prefix_real.py``: 512 wide, 8 layers, about 50 MB).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        RuntimeError: the ``gguf`` or ``numpy`` package is not installed.
        OSError: the file cannot be written.
    """
    try:
        import gguf
        import numpy as np
    except ImportError as exc:
        raise RuntimeError(
            "writing a test model needs the gguf and numpy packages: pip install 'llmgw[test]'"
            " (or pip install gguf numpy)"
        ) from exc

    s: Any = type("Spec", (TinyLlamaSpec,), {})
    if n_embd is not None:
        s.n_embd = n_embd
    if n_layer is not None:
        s.n_layer = n_layer
    if n_ff is not None:
        s.n_ff = n_ff
    out = Path(path)
    rng = np.random.default_rng(seed)
    tokens, types = _vocab()
    n_vocab = len(tokens)
    head_dim = s.n_embd // s.n_head
    n_embd_kv = head_dim * s.n_head_kv

    def rand(*shape: int, scale: float) -> Any:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # numpy shape (rows, cols) is ggml {cols, rows}; a weight W maps x to W @ x.
    emb = rand(n_vocab, s.n_embd, scale=0.5)
    emb[:, 0] = 8.0  # the constant dimension: the logit-bias carrier
    tensors: dict[str, Any] = {"token_embd.weight": emb}
    for i in range(s.n_layer):
        p = f"blk.{i}."
        attn_out = rand(s.n_embd, s.n_embd, scale=0.05)
        ffn_down = rand(s.n_embd, s.n_ff, scale=0.05)
        # No layer writes to the constant dimension, so it survives to the output.
        attn_out[0, :] = 0.0
        ffn_down[0, :] = 0.0
        tensors.update(
            {
                p + "attn_norm.weight": np.ones(s.n_embd, dtype=np.float32),
                p + "attn_q.weight": rand(s.n_embd, s.n_embd, scale=0.1),
                p + "attn_k.weight": rand(n_embd_kv, s.n_embd, scale=0.1),
                p + "attn_v.weight": rand(n_embd_kv, s.n_embd, scale=0.1),
                p + "attn_output.weight": attn_out,
                p + "ffn_norm.weight": np.ones(s.n_embd, dtype=np.float32),
                p + "ffn_gate.weight": rand(s.n_ff, s.n_embd, scale=0.1),
                p + "ffn_up.weight": rand(s.n_ff, s.n_embd, scale=0.1),
                p + "ffn_down.weight": ffn_down,
            }
        )
    output = rand(n_vocab, s.n_embd, scale=0.3)
    bias = rand(n_vocab, scale=0.3)
    for tid, ttype in enumerate(types):
        if ttype != _NORMAL:
            bias[tid] = -10.0  # never </s>, <s>, <unk> or a raw byte
    output[:, 0] = bias
    tensors["output_norm.weight"] = np.ones(s.n_embd, dtype=np.float32)
    tensors["output.weight"] = output

    w = gguf.GGUFWriter(out, "llama")
    w.add_name("llmgw-tiny-llama")
    w.add_file_type(0)  # ALL_F32
    w.add_context_length(ctx)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layer)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(s.rope_freq_base)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types)
    w.add_unk_token_id(s.unk_id)
    w.add_bos_token_id(s.bos_id)
    w.add_eos_token_id(s.eos_id)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    return out
