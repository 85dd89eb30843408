"""Every option, declared once: its default, type, allowed values, help and command-line flag.

configs/default.yaml is rendered from these declarations (`python -m ktlong.config defaults`
writes it; a test checks the file equals the rendering), the config's checks read them, and the
commands' flags are made from them (ktlong/session/startup.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml

KINDS = ("str", "int", "float", "bool", "auto_bool")  # auto_bool: true, false or "auto"


@dataclass(frozen=True)
class Option:
    name: str
    default: object
    help: str  # one line; names every choice of an option that has choices
    choices: tuple[str, ...] = ()
    low: float | None = None  # lowest allowed value
    high: float | None = None  # highest allowed value
    low_exclusive: bool = False  # the lowest value itself is not allowed
    kind: str = ""  # one of KINDS; empty: the default's type
    flag: str = ""  # the command-line flag that sets it (--flag), besides --set

    @property
    def type(self) -> str:
        return self.kind or type(self.default).__name__

    def range_text(self) -> str:
        """The allowed range as default.yaml's comments write it: (>= 1), (> 0), [0, 1], (0, 1]."""
        if self.low is None:
            return ""
        if self.high is None:
            return f"({'>' if self.low_exclusive else '>='} {self.low})"
        high = "2^63 - 1" if self.high == (1 << 63) - 1 else self.high
        return f"{'(' if self.low_exclusive else '['}{self.low}, {high}]"

    def comment(self) -> str:
        return " ".join(part for part in (self.help, self.range_text()) if part)


SECTIONS: list[tuple[str, list[Option]]] = [
    ('model and machine', [
        Option('model', 'smollm2-135m', 'a packaged model (smollm2-135m, qwen2.5-coder-0.5b, gemma3-270m) or a .gguf path', flag='model'),
        Option('mode', 'normal', 'normal (dense, short prompts) | long_context (offloaded KV, sparse attention)', choices=('normal', 'long_context'), flag='mode'),
        Option('device', 'auto', 'auto (cuda when present, else cpu) | cpu | cuda | cuda:N', flag='device'),
        Option('dtype', 'auto', 'auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16 | float16', choices=('auto', 'float32', 'bfloat16', 'float16')),
        Option('cpu_stored_weights', True, "on a CPU in one process, keep each matrix of a quantised type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) as the GGUF stores it and multiply it in place with Numba kernels: a decode step reads 0.56-1.06 bytes per weight instead of float32's 4; false = dequantised to dtype, as on a GPU"),
        Option('cpu_engine', 'auto', "normal mode on a CPU in one process: auto = numpy and Numba without torch (about 200 MB less memory) where the model allows: the llama family with every matrix and the embedding of a type above, kept as stored, a bf16 cache, float32 compute; else torch's | torch = torch's always", choices=('auto', 'torch')),
        Option('max_seq_len', 0, "longest prompt plus answer in tokens; 0 = the model's context length (extended by rope_scaling)", low=0, flag='max_seq_len'),
        Option('rope_scaling', 'auto', "RoPE context extension, as llama.cpp's --rope-scaling: auto (what the GGUF says) | none | linear | yarn", choices=('auto', 'none', 'linear', 'yarn'), flag='rope_scaling'),
        Option('rope_scale', 0.0, "context scaling factor, as --rope-scale (Qwen2.5: yarn and 4 reach 131,072); 0 = the GGUF's", low=0, flag='rope_scale'),
        Option('yarn_orig_ctx', 0, "YaRN: the context the model was trained to, as --yarn-orig-ctx; 0 = the GGUF's", low=0, flag='yarn_orig_ctx'),
        Option('gpu_memory_budget_gb', 24, 'GPU memory the plan may use, in GiB', low=0, low_exclusive=True, kind="float"),
        Option('use_cuda_graph', 'auto', "long-context mode: replay the decode step's GPU part, and a short follow-up's projections and MLP, from CUDA graphs: auto (on with CUDA) | true | false", kind="auto_bool", flag='use_cuda_graph'),
        Option('resident_history', True, "long-context follow-ups: GPU memory the plan leaves free keeps some layers' history on the GPU between turns, so only the rest crosses from DRAM"),
        Option('tensor_parallel', 1, 'ranks that split heads and MLP columns; start them with torchrun --nproc_per_node N', low=1, flag='tensor_parallel'),
    ]),
    ('long-context prefill (CompactAttention)', [
        Option('chunk_size', 0, "prompt tokens per prefill chunk; a multiple of block_size; 0 = 8192 on a GPU, 512 on a CPU (where a chunk's activations are host memory: Qwen2.5-Coder-0.5B at 4K peaks at 1.03 GiB with 512, 1.5 with 8192, prefilling as fast)", low=0),
        Option('prefill_attention', 'compact', 'compact (block-sparse CompactAttention, the default: on a RULER grid of ten tasks at 32K-127K, 16 samples a cell, 127 right against 126 for dense and no cell more than 2 below; 1.8x faster prefill at 128K and 4.4x at 512K at 8B shapes; docs/decisions.md) | dense', choices=('dense', 'compact')),
        Option('selector', 'topk', 'compact block selector: topk (the keep_blocks best blocks; docs/decisions.md) | flashprefill (alpha of the best score) | xattention (softmax mass)', choices=('flashprefill', 'xattention', 'topk')),
        Option('alpha', 0.1, 'flashprefill: keep a kv block scoring at least alpha x the best; 0 keeps all', low=0, high=1),
        Option('keep_blocks', 128, "topk: history blocks every query-head group keeps (sinks and window included), ranked as flashprefill scores them; a fixed count makes each chunk's attention cost the same at any length, so prefill grows close to linearly, and lets one attention plan serve every chunk and layer", low=1),
        Option('topk_rank', 'margin', "topk: what orders the history blocks: margin (a block's best score against each pooled query block's best, FlashPrefill's; the default: multikey at 127K 11 of 16, dense 10) | mass (its estimated attention share: each pooled query block's softmax over the history's pooled keys, averaged over the group; keeps more of the exact attention, but multikey at 127K fell to 2 of 16; docs/measurements/2026-12-03-selection-mass.md)", choices=('margin', 'mass')),
        Option('layer_budget', 'fixed', "topk: fixed (every layer keeps keep_blocks; the default, which holds the RULER grid) | attention (each layer's count follows its attention: at the layer's first selected chunk, the blocks in rank order that hold budget_mass of a sample of its queries' exact attention over the history, against the mean of that over the layers so far, times keep_blocks; from keep_blocks to twice that in steps of 16, so flat attention keeps keep_blocks everywhere; with half as the least, multikey at 127K fell to 4 of 16 against fixed's 11, with keep_blocks as the least 9; docs/decisions.md)", choices=('fixed', 'attention')),
        Option('budget_mass', 0.8, "layer_budget attention: the share of a layer's sampled attention over the history whose block count sets its budget", low=0, high=1, low_exclusive=True),
        Option('threshold', 0.9, 'xattention: keep blocks until this softmax mass is covered; 1.0 keeps all', low=0, high=1, low_exclusive=True),
        Option('stride', 8, 'xattention: antidiagonal scoring stride in tokens', low=1),
        Option('sink_blocks', 1, 'compact: first blocks always kept', low=0),
        Option('window_blocks', 2, 'compact: blocks nearest the diagonal always kept', low=0),
        Option('subgroup_size', 4, 'compact: query heads that share one page list when a kv group is larger', low=1),
        Option('tail_queries', 0, "flashprefill: the prompt's last N queries also score every history token, and keep each block whose best token is within alpha of their best (the question at the end keeps the key it asks about); 0 = block means only", low=0),
        Option('dense_tail', 128, "compact: the prompt's last N queries (the question, and the position the first answer token comes from) attend to every history block, as dense prefill; 0 = as selected", low=0),
        Option('prefill_dense_layer_num', 2, 'compact: first layers whose prefill attention stays dense (never selected), as dense_layer_num is for decode; 2 keeps multikey within one sample of dense at 128K', low=0),
        Option('dense_above', 0.6, 'compact: a chunk whose selection keeps more of its history than this runs dense, where selecting and planning cost more than they save (on an H100, Qwen2.5-0.5B shapes gained nothing from compact chunks keeping 2/3 of their history; docs/decisions.md); 1 = never', low=0, high=1, low_exclusive=True),
        Option('attention_backend', 'auto', 'auto (fa3 on compute capability 9.x, else fa2) | fa2 | fa3 | torch (the reference; CPU always uses it)', choices=('auto', 'fa2', 'fa3', 'torch')),
    ]),
    ('KV cache and sparse decode', [
        Option('block_size', 128, 'tokens per KV block; a power of two', low=16, high=4096),
        Option('kv_type', 'auto', 'KV storage: auto (bf16; in long_context mode fp32 when the model computes in float32, as on the CPU) | bf16 | fp16 | fp32 | q8_0 | q4_0 (long_context mode only)', choices=('auto', 'bf16', 'fp16', 'fp32', 'q8_0', 'q4_0')),
        Option('local_windows_len', 4096, 'most recent tokens always attended, kept on the GPU', low=0),
        Option('second_select_num', 32, 'context blocks selected per decode step', low=0),
        Option('anchor_type', 'DYNAMIC', 'block representative tokens: MAX | MEAN | QUEST | DYNAMIC | FIX', choices=('MAX', 'MEAN', 'QUEST', 'DYNAMIC', 'FIX')),
        Option('anchor_num', 1, 'representative tokens per block for DYNAMIC and FIX', low=1),
        Option('head_select_mode', 'SHARED', 'SHARED (one selection summed over kv heads) | SEPARATE (per kv head)', choices=('SHARED', 'SEPARATE')),
        Option('dense_layer_num', 0, 'first layers that read every context block; each costs O(context) per token', low=0),
        Option('preselect_block', True, 'score blocks once after prefill from the last queries and select only among them'),
        Option('preselect_block_count', 32, 'blocks kept by preselection', low=1),
        Option('layer_step', 1, 'reselect blocks every layer_step layers, reuse in between', low=1),
        Option('token_step', 1, 'reselect blocks every token_step tokens, reuse in between', low=1),
        Option('block_scoring', 'auto', 'where blocks are scored: auto (the GPU when there is one, from a device copy of the anchors) | device | cpu', choices=('auto', 'device', 'cpu')),
        Option('context_attention', 'auto', 'who attends to the selected context blocks in DRAM: auto (gpu on a GPU with triton and kv_type bf16/fp16/fp32/q8_0, each tensor-parallel rank reading the blocks of its own kv heads; else cpu) | cpu (the Numba operator) | gpu (the GPU reads them where they lie, over PCIe, zero-copy, and selects them too: one CUDA graph a token; ktlong/decode/dram_blocks.py; 50 vs 29 tok/s at 128K q8_0 on an H100, docs/decisions.md); unused on the CPU', choices=('auto', 'cpu', 'gpu')),
        Option('max_num_seqs', 1, "long-context mode: conversations decoded together, one batch (one pass over the weights a step for all of them, each reading its own blocks; ktlong/decode/batch.py); the plan sizes each one's decode window and anchors on the GPU and refuses what does not fit; a KV cache holds DRAM only for the tokens its conversation reaches, and the server starts a request when its cache fits beside the others", low=1, high=256, flag='max_num_seqs'),
        Option('threads_num', 0, 'CPU threads for the Numba kernels; 0 = every core but one beside a GPU, every core on the CPU alone in normal mode', low=0, flag='cpu_infer'),
    ]),
    ('generation', [
        Option('max_new_tokens', 512, 'most tokens generated per answer', low=1, flag='max_new_tokens'),
        Option('temperature', 0.0, '0 = greedy; above 0 samples', low=0, flag='temperature'),
        Option('top_p', 1.0, 'nucleus sampling mass', low=0, high=1, low_exclusive=True),
        Option('top_k', 0, 'sample among the k likeliest tokens; 0 = no limit', low=0),
        Option('seed', 0, 'random seed for sampling', low=0, high=(1 << 63) - 1),
        Option('presence_penalty', 0.0, "taken off the logit of each token the answer already chose, as OpenAI's presence_penalty (and the server's default for it)", low=-2, high=2),
        Option('frequency_penalty', 0.0, "taken off the logit of each token the answer already chose, once per time, as OpenAI's frequency_penalty (and the server's default)", low=-2, high=2),
        Option('use_chat_template', True, "wrap prompts in the model's chat template: true | false"),
        Option('system_prompt', '', "system message for the chat template; empty = the template's own default"),
        Option('chat_template_file', '', "a Jinja chat template file used instead of the GGUF's (as transformers' chat_template); empty = the GGUF's", flag='chat_template_file'),
    ]),
    ('server (python -m ktlong.server)', [
        Option('host', '127.0.0.1', 'address the OpenAI-compatible server listens on; 0.0.0.0 exposes it to the network', flag='host'),
        Option('port', 8000, 'its TCP port (0: any free one, printed)', low=0, high=65535, flag='port'),
        Option('queue_size', 8, 'requests that may wait beyond those running (max_num_seqs answers decode together, one request prefills at a time); more get 429', low=0, flag='queue_size'),
        Option('prefill_slice_ms', 30.0, "a prefill's work in each decode step of the answers already running, done while the device runs the step (and on until the step is done, if later), so they keep streaming meanwhile (it then stops at its next chunk of a layer); with nothing decoding it runs on", low=0, low_exclusive=True, high=60000),
        Option('decode_sm_share', 0.0, "long-context mode on a GPU: while a prefill runs beside decoding answers, the share of the GPU's SMs kept for their steps, the prefill on the rest (a CUDA green context, a multiple of 8 SMs); 0 = they take turns on every SM (each step after the prefill's chunks queued before it, the next chunks after the step). H200, four streams beside a 1M prefill: taking turns p99 between tokens 65 ms and its first token 1.36x of alone; 0.15: 56 ms and 1.59x", low=0, high=0.9),
        Option('api_key', '', 'when set, every /v1 request must send "Authorization: Bearer KEY"; KTLONG_API_KEY also sets it', flag='api_key'),
        Option('finish_prefill_on_disconnect', True, 'a client that goes away during prefill lets the prefill finish into the KV cache, so that its retry reuses it (generation stops when the prefill ends); false stops the prefill at once'),
        Option('cache_dram_gb', 8.0, 'long-context mode: GiB of DRAM for the KV caches of earlier (idle) conversations, kept whole so that a request going back to one reuses it; the least recently used goes first (to cache_dir); 0 = only the conversations in use', low=0, flag='cache_dram_gb'),
        Option('cache_dir', '', 'long-context mode: folder where conversations evicted from DRAM are written as saved caches, and found again after a restart; empty = no disk tier', flag='cache_dir'),
        Option('cache_disk_gb', 64.0, 'most GiB the files in cache_dir may take; the least recently used go first', low=0, low_exclusive=True, flag='cache_disk_gb'),
        Option('cache_min_tokens', 1024, 'an earlier conversation is brought back for a prompt that shares at least this many leading tokens with it', low=1),
        Option('body_timeout_seconds', 30.0, 'a request whose body sends nothing for this many seconds gets a 408 and its connection is closed', low=0, low_exclusive=True),
        Option('keepalive_seconds', 5.0, 'a streamed answer sends an SSE comment after this many seconds without an event (a long prefill), so that proxies and clients see the connection alive', low=0, low_exclusive=True),
    ]),
]
OPTIONS: dict[str, Option] = {o.name: o for _, options in SECTIONS for o in options}

HEADER = """\
# ktlong configuration. Every option, its default and its allowed values.
# Precedence: these defaults <- ~/.config/ktlong/config.yaml <- --config FILE <- command line.
# `python -m ktlong.config show` prints the value in force and where it came from.
# Rendered from ktlong/options.py by `python -m ktlong.config defaults`; edit the declarations there.
"""


def yaml_value(value) -> str:
    """A default as YAML writes it in a flow scalar ("" for the empty string)."""
    if value == "":
        return '""'
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


def render_defaults() -> str:
    """configs/default.yaml's text."""
    lines = [HEADER]
    for title, options in SECTIONS:
        lines.append(f"# ---- {title} ----")
        for o in options:
            lines.append(f"{f'{o.name}: {yaml_value(o.default)}':<27} # {o.comment()}")
        lines.append("")
    return "\n".join(lines)
