"""How much a quantised DRAM cache changes the model: q8_0 / q4_0 against bf16 K/V on the same
prompts, through the long-context path with every block attended (so only the storage differs).

python -m ktlong.bench kv-fidelity --model qwen2.5-coder-0.5b --lengths 16k,32k --prompts 50

Each prompt (needle and passkey haystacks, depths spread over the document) is prefilled but for
its last token, which decode then runs over the cache: its logits are the first that read the
stored K/V. Rows: agreement of the top-1 token with bf16's, and the KL divergence from bf16's
distribution (nats; mean and largest over the prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from ktlong.bench.common import median
from ktlong.cli import in_range, parse_lengths, print_table
from ktlong.chat.conversation import Conversation
from ktlong.config import load_config, parse_set, refuse_unread
from ktlong.device import resolve_device, resolve_dtype
from ktlong.errors import KtlongError
from ktlong.eval.runner import make_session
from ktlong.eval.tasks import make_sample
from ktlong.models.loader import load_model
from ktlong.gguf.model_config import RopeOptions

# what this bench reads of the config: the model, its RoPE and the KV layout (attention is dense)
READS = frozenset({"model", "device", "dtype", "rope_scaling", "rope_scale", "yarn_orig_ctx", "block_size",
                   "chunk_size", "attention_backend", "gpu_memory_budget_gb", "threads_num",
                   "use_chat_template"})


def prompts_of_length(lm, config, length: int, count: int) -> list[list[int]]:
    conversation = Conversation(lm.tokenizer, lm.chat_template if config.use_chat_template else None)
    tokens = lambda text: len(conversation.render_ids([], text))
    out = []
    for i in range(count):
        task, depth = ("needle", "passkey")[i % 2], (i * 0.37) % 1.0
        sample = make_sample(task, length, depth, 7919 * i + length, tokens)
        out.append(conversation.render_ids([], sample.prompt))
    return out


@torch.inference_mode()
def last_token_log_probs(session, ids: list[int]) -> torch.Tensor:
    session.reset()
    session.prefill(ids[:-1])
    return torch.log_softmax(session.step(ids[-1]).float(), -1).cpu()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m ktlong.bench kv-fidelity", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", help="packaged model name or GGUF path")
    p.add_argument("--lengths", default="16k,32k")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--kv_types", default="q8_0,q4_0", help="compared with bf16")
    p.add_argument("--device", default="auto")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config option")
    args = p.parse_args(argv)
    overrides = parse_set(args.set)
    refuse_unread(overrides, READS, "python -m ktlong.bench kv-fidelity", "compares the --kv_types with bf16 "
                  "through dense attention on the --model's last-token logits")
    overrides.update(model=(args.model, "--model"), device=(args.device, "--device"))
    config = load_config(overrides=overrides, write_user_file=False)
    kv_types = [t.strip() for t in args.kv_types.split(",")]
    if not set(kv_types) <= {"q8_0", "q4_0", "fp16"}:
        raise KtlongError(f"--kv_types {args.kv_types!r}: compare q8_0, q4_0 or fp16 with bf16.")
    in_range("--prompts", args.prompts, 1, 10_000, "the prompts per length")
    lengths = parse_lengths(args.lengths)
    device = resolve_device(config.device)
    lm = load_model(config.model, device, resolve_dtype(config.dtype, device), RopeOptions.of(config))
    print(f"{lm.path.name} on {device}: last-token logits over {args.prompts} prompts per length, every block "
          f"attended, against bf16 K/V")
    rows = []
    for length in lengths:
        prompts = prompts_of_length(lm, config, length, args.prompts)
        max_len = max(map(len, prompts)) + 1
        results = {}
        for kv_type in ["bf16", *kv_types]:
            session = make_session(lm, dataclasses.replace(config, kv_type=kv_type), "dense", max_len)
            start = time.perf_counter()
            results[kv_type] = [last_token_log_probs(session, ids) for ids in prompts]
            print(f"  {length // 1024}K {kv_type}: {time.perf_counter() - start:.0f} s", flush=True)
            del session
        reference = results["bf16"]
        for kv_type in kv_types:
            agree = sum(int(a.argmax() == b.argmax()) for a, b in zip(reference, results[kv_type]))
            kl = [float((a.exp() * (a - b)).sum()) for a, b in zip(reference, results[kv_type])]
            rows.append([f"{length // 1024}K", kv_type, f"{agree}/{len(prompts)}", f"{sum(kl) / len(kl):.2e}",
                         f"{median(kl):.2e}", f"{max(kl):.2e}"])
    print_table(["length", "kv_type", "top-1 as bf16", "KL mean", "KL median", "KL max"], rows)
    return 0
