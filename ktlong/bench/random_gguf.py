"""A GGUF file of random weights in one of the random model's shapes, for the benches that need
a file, which the server loads (`bench serve`): speed does not depend on the values.

python -m ktlong.bench random-gguf --out FILE [--shape llama-3.1-8b] [--context 1048576]

Weights are float16, each kind of matrix one random slab that every layer reuses (so the file is
written at disk speed); the norms are ones. The tokenizer is byte-level: one token a byte (a
ChatML template and its two special tokens, the rest of the shape's vocabulary placeholders),
so a document of N ASCII characters is N tokens. The file is written next to its final name and
renamed into place; an existing file is not overwritten.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from ktlong.cli import in_range
from ktlong.errors import KtlongError
from ktlong.models.random_model import SHAPES, random_config
from ktlong.regular_file import user_path

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes, in byte order."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    symbol = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [symbol[b] for b in range(256)]


def write_random_gguf(path: Path, shape: str, context: int, seed: int = 0):
    from gguf import GGUFWriter

    c = random_config(shape)
    rng = np.random.default_rng(seed)
    slabs: dict[tuple[int, int], np.ndarray] = {}

    def matrix(rows: int, cols: int) -> np.ndarray:
        if (rows, cols) not in slabs:  # as random_model scales them: rows of unit norm on average
            slabs[rows, cols] = (rng.standard_normal((rows, cols), dtype=np.float32) * cols ** -0.5).astype(np.float16)
        return slabs[rows, cols]

    ones = np.ones(c.hidden_size, dtype=np.float32)
    tokens = byte_symbols() + [f"<t{i}>" for i in range(c.vocab_size - 258)] + ["<|im_start|>", "<|im_end|>"]
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = GGUFWriter(str(partial), "llama")
    w.add_block_count(c.num_layers)
    w.add_context_length(context)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope.base)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (c.vocab_size - 2) + [3, 3])
    w.add_token_merges([])
    w.add_bos_token_id(c.vocab_size - 2)
    w.add_eos_token_id(c.vocab_size - 1)
    w.add_chat_template(CHATML)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w.add_tensor("token_embd.weight", matrix(c.vocab_size, c.hidden_size))
    for i in range(c.num_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", matrix(q, c.hidden_size))
        w.add_tensor(p + "attn_k.weight", matrix(kv, c.hidden_size))
        w.add_tensor(p + "attn_v.weight", matrix(kv, c.hidden_size))
        w.add_tensor(p + "attn_output.weight", matrix(c.hidden_size, q))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", matrix(c.intermediate_size, c.hidden_size))
        w.add_tensor(p + "ffn_up.weight", matrix(c.intermediate_size, c.hidden_size))
        w.add_tensor(p + "ffn_down.weight", matrix(c.hidden_size, c.intermediate_size))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", matrix(c.vocab_size, c.hidden_size))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench random-gguf",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the file to write (refused if it exists)")
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--context", type=int, default=1 << 20, help="the context length the file declares "
                   "(default 1,048,576)")
    args = p.parse_args(argv)
    out = user_path(args.out)
    if out.exists():
        raise KtlongError(f"{out} exists; name a new file for --out.")
    if not out.parent.is_dir():
        raise KtlongError(f"{out.parent} is not a folder; name a file in an existing folder for --out.")
    in_range("--context", args.context, 1024, 1 << 24, "the tokens the file declares")
    c = random_config(args.shape)
    size = 2 * (2 * c.vocab_size * c.hidden_size + c.num_layers * c.layer_matrix_elements)
    print(f"writing {args.shape} random float16 weights, {size / 2**30:.1f} GiB, to {out}", flush=True)
    try:
        write_random_gguf(out, args.shape, args.context)
    except OSError as e:
        raise KtlongError(f"Could not write {out} ({e.strerror or e}); free {size / 2**30:.0f} GiB there or name "
                          f"another folder for --out.") from None
    print(f"written: {out.stat().st_size / 2**30:.1f} GiB")
    return 0
