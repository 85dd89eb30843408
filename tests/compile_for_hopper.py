"""Compiles the batch kernels for Hopper (sm_90: the H100 and H200) without a GPU, through Triton's
own compiler (Triton's interpreter, which the CPU's tests run them in, takes what the compiler
refuses), and prints, per kernel, how its global loads came out: JSON lines {kernel, wide, narrow},
wide the 16-byte loads (vector loads into registers, or asynchronous copies into shared memory
for a tl.dot's operand: cp.async.cg moves 16 bytes), narrow the single 2-byte ones. Run by
tests/test_kernels_compile.py in a process of its own, TRITON_INTERPRET unset (tests/conftest.py
sets it)."""

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import operators.block_scores_kernel as scores
import operators.block_topk_kernel as topk
import operators.decode_append_kernel as append
import operators.selected_blocks_kernel as selected
import operators.window_attention_kernel as window

# the batch's tables and buffers start on 16-byte boundaries (the caching allocator's 512, pages)
# and the strides the launchers pass are whole multiples of 16: Triton's launch specialises them
# so, as here
ALIGNED = 16


def compile_for_hopper(name, fn, types, constexprs):
    names = fn.arg_names
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", ALIGNED]] for i, n in enumerate(names)
             if n not in constexprs and (types[n].startswith("*") or n.startswith("stride") or n.startswith("w_"))}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32))
    ptx = kernel.asm["ptx"]
    print(json.dumps({"kernel": name, "wide": ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4")
                      + ptx.count("cp.async.cg.shared.global"),
                      "narrow": ptx.count("ld.global.b16") + ptx.count("ld.global.nc.b16")}), flush=True)


def main():
    window_types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "members_ptr": "*i64", "lo_ptr": "*i64",
                    "hi_ptr": "*i64", "logits_ptr": "*fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32",
                    "share_ptr": "*fp32", "lse_ptr": "*fp32", "n": "i32", "group": "i32", "last": "i32",
                    "scale": "fp32", "stride_head": "i32", "stride_key": "i32", "parts": "i32"}
    shapes = {"ROWS": 16, "DIM": 128, "KEYS": window.KEYS, "TILES": window.TILES}
    compile_for_hopper("window logits", window._logits, window_types, shapes)
    compile_for_hopper("window values", window._values, window_types, {**shapes, "PARTS": 16})
    compile_for_hopper("window shares", window._sum_shares, {"share_ptr": "*fp32", "out_ptr": "*fp32", "group": "i32",
                                                             "parts": "i32"}, {"ROWS": 16, "DIM": 128, "PARTS": 32})
    compile_for_hopper("append", append._append_token, {
        "k_ptr": "*bf16", "v_ptr": "*bf16", "stride_k": "i32", "stride_v": "i32", "slot_ptr": "*i64",
        "wk_ptr": "*bf16", "wv_ptr": "*bf16", "w_head": "i32",
        "w_token": "i32", "members_ptr": "*i64", "kd_ptr": "*i8", "vd_ptr": "*i8", "ks_ptr": "*i16", "vs_ptr": "*i16",
        "stored_ptr": "*i64", "position_ptr": "*i64", "d_head": "i32", "s_head": "i32"},
        {"DIM": 128, "QUANT": True, "STORE": True})
    for shared in (True, False):
        compile_for_hopper(f"scores, {'shared' if shared else 'per head'}", scores._masked_scores, {
            "q_ptr": "*bf16", "anchors_ptr": "*bf16", "bias_ptr": "*fp32", "params_ptr": "*i64",
            "members_ptr": "*i64", "out_ptr": "*fp32", "width_out": "i32", "selected": "i32", "group": "i32"},
            {"NUM_KV": 8, "HEADS": 8, "W": 128, "DIM": 128, "QUEST": False, "SHARED": shared,
             "BLOCKS": scores.blocks_per_program(8, 128),
             "UNIT": 16})
    for first in (True, False):
        compile_for_hopper(f"top-k chunks{', of scores' if first else ''}", topk._chunk_best, {
            "in_ptr": "*fp32" if first else "*i64", "keys_ptr": "*i64", "n": "i32", "stride_row": "i32"},
            {"SCORES": first, "CHUNK": topk.CHUNK, "WIDTH": 32})
    compile_for_hopper("top-k rows", topk._row_best, {"keys_ptr": "*i64", "top_ptr": "*fp32", "picked_ptr": "*i64",
                                                      "count": "i32", "k": "i32"}, {"CHUNK": topk.CHUNK})
    compile_for_hopper("rows", scores._selection_rows, {
        "top_ptr": "*fp32", "picked_ptr": "*i64", "params_ptr": "*i64", "index_ptr": "*i64", "valid_ptr": "*i64",
        "members_ptr": "*i64", "places_out": "i32", "block_size": "i32"}, {"ROWS": 1, "WIDTH": 32})
    plans = {"index_ptr": "*i64", "valid_ptr": "*i64", "count_ptr": "*i64", "rows_ptr": "*i64", "plan_ptr": "*i32",
             "offsets_ptr": "*i64", "num_blocks": "i32", "batch": "i32"}
    steps = {"BLOCK": 128, "SLOTS": 32, "NEAR": True, "WIDTH": selected.WIDTH}
    compile_for_hopper("kept plan", selected._plan_kept, plans, steps)
    compile_for_hopper("shared plan", selected._plan_shared, plans, steps)
    pages = {n: "*i8" for n in ("k_ptr", "v_ptr", "near_k_ptr", "near_v_ptr", "kept_k_ptr", "kept_v_ptr")}
    pages.update({n: "*i16" for n in ("ks_ptr", "vs_ptr", "near_ks_ptr", "near_vs_ptr", "kept_ks_ptr", "kept_vs_ptr")})
    pages.update({"q_ptr": "*fp32", "count_ptr": "*i64", "index_ptr": "*i64", "valid_ptr": "*i64", "plan_ptr": "*i32",
                  "offsets_ptr": "*i64", "out_ptr": "*fp32", "lse_ptr": "*fp32", "num_heads": "i32", "group": "i32",
                  "num_blocks": "i32", "scale": "fp32", "first_share": "i32", "all_shares": "i32",
                  "stride_row": "i32", "stride_token": "i32", "stride_srow": "i32", "stride_stoken": "i32"})
    for sharing, borrowed in ((False, False), (True, False), (True, True)):
        compile_for_hopper(f"selected blocks{', sharing' if sharing else ''}{', borrowed' if borrowed else ''}",
                           selected._selected_blocks_attention, pages,
                           {"BLOCK": 128, "DIM": 128, "ROWS": 16, "KEYS": 32, "PER_SHARE": 32 if borrowed else 2,
                            "QUANT": True, "NEAR": True, "KEPT": True, "WIDTH": selected.WIDTH,
                            "PRECISION": selected.precision(128), "SHARING": sharing, "BORROWED": borrowed})
    compile_for_hopper("merged shares", selected._merge_shares, {
        "out_ptr": "*fp32", "lse_ptr": "*fp32", "base_o_ptr": "*fp32", "base_lse_ptr": "*fp32", "o_ptr": "*fp32",
        "o_lse_ptr": "*fp32", "num_heads": "i32", "group": "i32"}, {"SHARES": 17, "SLOTS": 32, "ROWS": 16, "DIM": 128,
                                                              "BASE": True})


if __name__ == "__main__":
    main()
