"""Every Triton kernel as the model launches it (Qwen3.6-35B-A3B shapes, bf16), compiled
for Hopper (sm_90) down to a cubin without a GPU. Run as a script in a process without
TRITON_INTERPRET (the interpreter replaces the JIT functions the compiler needs); prints one
JSON line per kernel. `tests/kernels/test_compile_sm90.py` drives it.
"""

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from sparrow.core.scheduler import SAVES_INSIDE
from sparrow.kernels.activations import SILU, Glu
from sparrow.kernels.attention import paged
from sparrow.kernels.causal_conv1d import conv
from sparrow.kernels.dequant import dequant
from sparrow.kernels.gated_delta_rule import chunk, fused_recurrent
from sparrow.kernels.moe import combine, expert_gemv, grouped_gemm, routing
from sparrow.kernels.msa import decode as msa_decode
from sparrow.kernels.msa import decode_select as msa_decode_select
from sparrow.kernels.msa import prefill as msa_prefill
from sparrow.kernels.msa import select as msa_select
from sparrow.kernels.quant_gemv import gdn, gemv, mma
from sparrow.kernels.rms_norm import norm

FLOATS = {"eps", "scale"}  # fp32 scalars; every other scalar is i32

# kernel, pointer dtypes (default first), constexprs, launch options: shapes of
# Qwen3.6-35B-A3B in bf16 as the layers launch them.
GEMV_PTRS = {
    "*": "bf16",
    "w_ptr": "i32",
    "rw_ptr": "fp32",
    "ids_ptr": "i32",
    "sw_ptr": "i32",
    "slot_ptr": "i32",
}
ROW = {
    "BITS": 4,
    "GROUP": 64,
    "BLOCK_K": 1024,
    "PACKED": False,
    "PREFETCH": False,
    "F16_DOT": False,
    "X_IN_PLACE": False,
    "ONE_STEP": False,
}  # every row GEMV's
GEMV = ROW | {"GATED": False}
EXPERT = (
    ROW
    | {"TOP_K": 9, "SHARED": True, "GATED": False, "APPLY_WEIGHT": False, "LATE_TRIGGER": False}
    | SILU.meta()
)
OAI = Glu.swiglu_oai(1.702, 7.0).meta()  # MiniMax M3's experts
BF16_QKV = {"RATIO": 2, "DK": 128, "DV": 128}
SAVES = {"save_row_ptr": "i32", "save_at_ptr": "i32"}  # prefix-cache snapshots inside a prompt
CONV_PTRS = {"*": "bf16", "cu_ptr": "i32", "slot_ptr": "i32"} | SAVES
GDN_STATE_PTRS = {
    "*": "bf16",
    "gc_ptr": "fp32",
    "kinv_ptr": "fp32",
    "slot_ptr": "i32",
    "cu_ptr": "i32",
} | SAVES
MOE_GEMM_PTRS = {
    "*": "bf16",
    "w_ptr": "i32",
    "rw_ptr": "fp32",
    "sw_ptr": "i32",
    "sorted_ptr": "i32",
    "block_expert_ptr": "i32",
    "block_start_ptr": "i32",
}
MOE_GEMM = {
    "TOP_K": 9,
    "GATED": True,
    "APPLY_WEIGHT": False,
    "SHARED": True,
    "BITS": 4,
    "GROUP": 64,
    "PRECISION": "tf32",
    "BLOCK_M": 64,
    "BLOCK_N": 64,
    "PACKED": True,
} | SILU.meta()
TF32 = {"PRECISION": "tf32"}
CASES = {
    "add_rms_norm": (
        norm._add_norm_kernel,
        {"*": "bf16"},
        {"HAS_RESIDUAL": True, "D": 2048, "BLOCK": 2048},
        {"num_warps": 4},
    ),
    "rms_norm_rope": (
        norm._norm_rope_kernel,
        {"*": "bf16", "rows_ptr": "i64"},
        {"H": 2, "D": 256, "R": 64, "TO_CACHE": True},
        {"num_warps": 1},
    ),
    "gated_rms_norm": (
        fused_recurrent._gated_norm_kernel,
        {"*": "bf16", "o_ptr": "fp32"},
        {"D": 128, "ROWS": 8},
        {"num_warps": 4},
    ),
    "gdn_decode_step": (
        fused_recurrent._recurrent_step_kernel,
        {
            "*": "bf16",
            "alog_ptr": "fp32",
            "dtb_ptr": "fp32",
            "state_ptr": "fp32",
            "slot_ptr": "i32",
        },
        {"RATIO": 2, "DK": 128, "DV": 128, "COLS": 128, "BV": 32, "NORM": True},
        {"num_warps": 4},
    ),
    "gdn_decode_step_cols": (
        fused_recurrent._recurrent_step_kernel,
        {
            "*": "bf16",
            "alog_ptr": "fp32",
            "dtb_ptr": "fp32",
            "state_ptr": "fp32",
            "slot_ptr": "i32",
            "y_ptr": "fp32",
            "sq_ptr": "fp32",
        },
        {"RATIO": 2, "DK": 128, "DV": 128, "COLS": 16, "BV": 16, "NORM": False},
        {"num_warps": 1},
    ),  # batch 1, fused GEMVs
    "gdn_decode_step_bf16_state": (
        fused_recurrent._recurrent_step_kernel,
        {"*": "bf16", "alog_ptr": "fp32", "dtb_ptr": "fp32", "slot_ptr": "i32"},
        {"RATIO": 2, "DK": 128, "DV": 128, "COLS": 128, "BV": 32, "NORM": True},
        {"num_warps": 4},
    ),  # recurrent_state_dtype="bfloat16"
    "gdn_gates": (
        fused_recurrent._gates_kernel,
        {"*": "bf16", "alog_ptr": "fp32", "g_ptr": "fp32", "beta_ptr": "fp32"},
        {"BLOCK": 1024},
        {"num_warps": 4},
    ),
    "causal_conv1d": (
        conv._conv_kernel,
        CONV_PTRS,
        {"KW": 4, "BLOCK_T": 16, "BLOCK_C": 128, "stride_sc": 1, "SAVES": 0},
        {"num_warps": 4},
    ),
    "causal_conv1d_saves": (
        conv._conv_kernel,
        CONV_PTRS,
        {"KW": 4, "BLOCK_T": 16, "BLOCK_C": 128, "stride_sc": 1, "SAVES": SAVES_INSIDE},
        {"num_warps": 4},
    ),  # a prompt that files prefix-cache snapshots inside it
    "causal_conv1d_step": (
        conv._conv_step_kernel,
        {"*": "bf16", "slot_ptr": "i32"},
        {"KW": 4, "BLOCK_C": 128, "stride_sc": 1},
        {"num_warps": 4},
    ),
    "gdn_wy": (
        chunk._wy_kernel,
        {
            "*": "bf16",
            "g_ptr": "fp32",
            "b_ptr": "fp32",
            "gc_ptr": "fp32",
            "kinv_ptr": "fp32",
            "cu_ptr": "i32",
        },
        BF16_QKV | TF32 | {"BC": 64, "INV_PRECISION": "tf32"},
        {"num_warps": 4},
    ),
    "gdn_state": (
        chunk._state_kernel,
        GDN_STATE_PTRS | {"state_ptr": "fp32"},
        BF16_QKV | {"BV": 32, "STAGES": 4, "SAVES": 0},
        {"num_warps": 4},
    ),
    "gdn_state_saves": (
        chunk._state_kernel,
        GDN_STATE_PTRS | {"state_ptr": "fp32"},
        BF16_QKV | {"BV": 32, "STAGES": 4, "SAVES": SAVES_INSIDE},
        {"num_warps": 4},
    ),  # a prompt that files prefix-cache snapshots inside it
    "gdn_state_bf16_state": (
        chunk._state_kernel,
        GDN_STATE_PTRS,
        BF16_QKV | {"BV": 32, "STAGES": 4, "SAVES": 0},
        {"num_warps": 4},
    ),  # recurrent_state_dtype="bfloat16"
    "gdn_output": (
        chunk._output_kernel,
        {"*": "bf16", "gc_ptr": "fp32", "kinv_ptr": "fp32", "cu_ptr": "i32"},
        BF16_QKV | {"BV": 64},
        {"num_warps": 4},
    ),
    "paged_prefill": (
        paged._paged_attn_kernel,
        {"*": "bf16", "tables_ptr": "i32", "cu_q_ptr": "i32", "ctx_ptr": "i32"},
        {
            "G": 8,
            "D": 256,
            "ROWS": 64,
            "BLOCK_M": 8,
            "BLOCK_N": 16,
            "CACHE_BLOCK": 128,
            "HAS_GATE": True,
            "PRECISION": "tf32",
        },
        {"num_warps": 8},
    ),
    "paged_decode_split": (
        paged._decode_split_kernel,
        {"*": "bf16", "acc_ptr": "fp32", "ml_ptr": "fp32", "tables_ptr": "i32", "ctx_ptr": "i32"},
        {
            "S": 64,
            "G": 8,
            "D": 256,
            "ROWS": 16,
            "BLOCK_N": 32,
            "CACHE_BLOCK": 128,
            "PRECISION": "tf32",
        },
        {"num_warps": 4},
    ),
    "paged_decode_merge": (
        paged._decode_merge_kernel,
        {"*": "bf16", "acc_ptr": "fp32", "ml_ptr": "fp32"},
        {"S": 64, "SP": 64, "D": 256, "HAS_GATE": True},
        {"num_warps": 4},
    ),
    "quant_gemv": (
        gemv._gemv_kernel,
        GEMV_PTRS,
        GEMV | {"BLOCK_N": 16, "PACKED": True},
        {"num_warps": 4, "num_stages": 2},
    ),
    "quant_gemv_prefetch": (
        gemv._gemv_kernel,
        GEMV_PTRS,
        GEMV | {"BLOCK_N": 32, "PACKED": True, "PREFETCH": True, "F16_DOT": True},
        {"num_warps": 4},
    ),  # the GDN in-projection at batch 1
    "quant_gemv_x_in_place": (
        gemv._gemv_kernel,
        GEMV_PTRS,
        GEMV
        | {
            "BLOCK_N": 16,
            "BLOCK_K": 2048,
            "PACKED": True,
            "PREFETCH": True,
            "F16_DOT": True,
            "X_IN_PLACE": True,
            "ONE_STEP": True,
        },
        {"num_warps": 2},
    ),  # 2048 -> 8192 / 9216 / 1024 at batch 1
    "quant_gemv_conv": (
        gdn._gemv_conv_kernel,
        GEMV_PTRS,
        ROW | {"BLOCK_N": 32, "PACKED": True, "PREFETCH": True, "F16_DOT": True, "CONV_KW": 4},
        {"num_warps": 4},
    ),  # ... with the conv step (`quant_gemv_conv`)
    "quant_gemv_rms_scaled": (
        gdn._gemv_rms_kernel,
        GEMV_PTRS | {"x_ptr": "fp32", "sq_ptr": "fp32"},
        ROW
        | {
            "BLOCK_N": 8,
            "BLOCK_K": 4096,
            "PACKED": True,
            "PREFETCH": True,
            "HEAD": 128,
            "PARTS": 8,
            "ONE_STEP": True,
        },
        {"num_warps": 2},
    ),  # the GDN out-projection at batch 1
    "quant_gemv_gated": (
        gemv._gemv_kernel,
        GEMV_PTRS,
        GEMV | {"GATED": True, "BLOCK_N": 4, "PACKED": True},
        {"num_warps": 2, "num_stages": 2},
    ),
    "quant_gemv_8bit": (
        gemv._gemv_kernel,
        GEMV_PTRS,
        GEMV | {"BITS": 8, "BLOCK_N": 4},
        {"num_warps": 2, "num_stages": 2},
    ),
    "quant_mma": (
        mma._mma_kernel,
        {"*": "bf16", "w_ptr": "i32"},
        {
            "BITS": 4,
            "GROUP": 64,
            "BLOCK_N": 32,
            "BLOCK_K": 256,
            "PACKED": True,
            "PRECISION": "tf32",
            "ROWS": 16,
        },
        {"num_warps": 4, "num_stages": 3},
    ),
    "quant_mma_64_rows": (
        mma._mma_kernel,
        {"*": "bf16", "w_ptr": "i32"},
        {
            "BITS": 4,
            "GROUP": 64,
            "BLOCK_N": 32,
            "BLOCK_K": 256,
            "PACKED": True,
            "PRECISION": "tf32",
            "ROWS": 64,
        },
        {"num_warps": 4, "num_stages": 3},
    ),
    "quant_mma_split": (
        mma._mma_split_kernel,
        {"*": "bf16", "w_ptr": "i32"},
        {
            "BITS": 4,
            "GROUP": 64,
            "BLOCK_N": 16,
            "BLOCK_K": 256,
            "SPLIT": 4,
            "PACKED": True,
            "PRECISION": "tf32",
            "ROWS": 16,
        },
        {"num_warps": 4, "num_stages": 3},
    ),
    "quant_mma_8bit": (
        mma._mma_kernel,
        {"*": "bf16", "w_ptr": "i32"},
        {
            "BITS": 8,
            "GROUP": 64,
            "BLOCK_N": 32,
            "BLOCK_K": 256,
            "PACKED": False,
            "PRECISION": "tf32",
            "ROWS": 16,
        },
        {"num_warps": 4, "num_stages": 3},
    ),
    "dequant_8bit": (
        dequant._dequant_kernel,
        {"*": "bf16", "w_ptr": "i32"},
        {"BITS": 8, "GROUP": 64, "BLOCK_N": 16, "BLOCK_K": 256, "PACKED": False},
        {"num_warps": 4},
    ),
    "dequant": (
        dequant._dequant_kernel,
        {"*": "bf16", "w_ptr": "i32"},
        {"BITS": 4, "GROUP": 64, "BLOCK_N": 16, "BLOCK_K": 256, "PACKED": True},
        {"num_warps": 4},
    ),
    "moe_gemv": (
        expert_gemv._expert_gemv_kernel,
        GEMV_PTRS | {"y_ptr": "fp32"},
        EXPERT
        | {
            "APPLY_WEIGHT": True,
            "BLOCK_N": 32,
            "BLOCK_K": 512,
            "PACKED": True,
            "F16_DOT": True,
            "PREFETCH": True,
            "ONE_STEP": True,
        },
        {"num_warps": 2},
    ),  # the down projection's launch
    "moe_gemv_batch": (
        expert_gemv._expert_gemv_kernel,
        GEMV_PTRS | {"y_ptr": "fp32"},
        EXPERT
        | {
            "APPLY_WEIGHT": True,
            "BLOCK_N": 32,
            "BLOCK_K": 512,
            "PACKED": True,
            "F16_DOT": True,
            "ONE_STEP": True,
            "USE_PDL": False,
        },
        {"num_warps": 2},
    ),  # ... at 8-48 tokens (no PDL: one step, no loop)
    "moe_gemv_gated": (
        expert_gemv._expert_gemv_kernel,
        GEMV_PTRS,
        EXPERT
        | {
            "GATED": True,
            "BLOCK_N": 16,
            "PACKED": True,
            "F16_DOT": True,
            "PREFETCH": True,
            "LATE_TRIGGER": True,
        },
        {"num_warps": 4},
    ),  # gate_up's
    "moe_gemm": (
        grouped_gemm._moe_gemm_kernel,
        MOE_GEMM_PTRS,
        MOE_GEMM,
        {"num_warps": 4, "num_stages": 3},
    ),
    "moe_gemm_m3": (
        grouped_gemm._moe_gemm_kernel,
        MOE_GEMM_PTRS,
        MOE_GEMM | {"TOP_K": 4, "SHARED": False} | OAI,
        {"num_warps": 4, "num_stages": 3},
    ),
    "moe_gemv_gated_m3": (
        expert_gemv._expert_gemv_kernel,
        GEMV_PTRS,
        EXPERT
        | {
            "TOP_K": 4,
            "SHARED": False,
            "GATED": True,
            "BLOCK_N": 16,
            "PACKED": True,
            "F16_DOT": True,
        }
        | OAI,
        {"num_warps": 4},
    ),
    "moe_combine": (
        combine._combine_kernel,
        {"*": "bf16"},
        {"TOP_K": 8, "HAS_SHARED": True, "BLOCK": 1024},
        {"num_warps": 4},
    ),
    "topk_route": (
        routing._topk_kernel,
        {"*": "bf16", "w_ptr": "fp32", "ids_ptr": "i32"},
        {"K": 8, "SHARED": True, "BLOCK_E": 256, "BLOCK_K": 8},
        {"num_warps": 1},
    ),
    "align_count": (
        routing._count_kernel,
        {"*": "i32"},
        {"BLOCK": 1024, "BLOCK_E": 512},
        {"num_warps": 4},
    ),
    "align_scan": (
        routing._scan_kernel,
        {"*": "i32"},
        {"BLOCK_M": 128, "SMALL_M": 64, "BLOCK_E": 256, "BLOCK_B": 64},
        {"num_warps": 4},
    ),
    "align_scatter": (routing._scatter_kernel, {"*": "i32"}, {"BLOCK": 1024}, {"num_warps": 4}),
    # MiniMax M3 MSA at its real shapes: 4 index heads x 128, 128-token blocks, top-16,
    # 64 query heads over 4 KV heads of 128
    "msa_block_scores": (
        msa_select._block_scores_kernel,
        {"*": "bf16", "tables_ptr": "i32", "pos_ptr": "i64", "out_ptr": "fp32"},
        {
            "HI": 4,
            "DI": 128,
            "ROWS": 64,
            "BLOCK_M": 16,
            "BS": 128,
            "BLOCK_N": 64,
            "NB": 16,
            "LOCAL": 1,
            "PRECISION": "tf32",
        },
        {"num_warps": 4},
    ),
    "msa_decode_scores_fp8": (
        msa_select._decode_scores_kernel,
        {
            "*": "fp8e4nv",
            "iq_ptr": "bf16",
            "scale_ptr": "fp32",
            "tables_ptr": "i32",
            "pos_ptr": "i64",
            "out_ptr": "fp32",
        },
        {
            "HI": 4,
            "ROWS": 16,
            "DI": 128,
            "BS": 128,
            "BLOCK_N": 128,
            "NB": 8,
            "NB_P2": 8,
            "LOCAL": 1,
            "SCALED": True,
            "QUANT": 2,
            "PRELOAD": True,
            "PRECISION": "tf32",
            "STAGES": 3,
        },
        {"num_warps": 4, "num_stages": 3},
    ),  # the engine's decode selection on fp8 index keys (select.DECODE_TILES_FP8)
    "msa_chunk_top": (
        msa_select._chunk_top_kernel,
        {"*": "fp32", "out_ptr": "i64"},
        {"TOPK": 16, "CHUNK": 8192, "FINAL": True, "NEG_INF_KEY": msa_select.NEG_INF_KEY},
        {"num_warps": 8},
    ),
    "msa_merge_top": (
        msa_select._merge_top_kernel,
        {"*": "i64"},
        {"TOPK": 16, "BLOCK_C": 256, "NEG_INF_KEY": msa_select.NEG_INF_KEY},
        {"num_warps": 8},
    ),
    "msa_decode_select_topk": (
        msa_decode_select._select_topk_kernel,
        {
            "*": "bf16",
            "tables_ptr": "i32",
            "pos_ptr": "i64",
            "cand_s_ptr": "fp32",
            "cand_i_ptr": "i32",
            "count_ptr": "i32",
            "out_ptr": "i64",
        },
        {
            "HI": 4,
            "ROWS": 16,
            "DI": 128,
            "BS": 128,
            "BLOCK_N": 64,
            "NB": 64,
            "TOPK": 16,
            "CW": 2048,
            "LOCAL": 1,
            "PRECISION": "tf32",
        },
        {"num_warps": 4},
    ),  # 1M context: 128 splits of 64 blocks
    "msa_block_major": (
        msa_prefill._block_major_kernel,
        {
            "*": "i64",
            "q_ptr": "bf16",
            "k_ptr": "bf16",
            "v_ptr": "bf16",
            "o_ptr": "bf16",
            "lse_ptr": "fp32",
        },
        {
            "HKV": 4,
            "K": 16,
            "G": 16,
            "D": 128,
            "BS": 128,
            "ROWS": 64,
            "BLOCK_M": 4,
            "TILE": 64,
            "BLOCK_N": 128,
            "PRECISION": "tf32",
        },
        {"num_warps": 4, "num_stages": 1},
    ),
    "msa_head_tables": (
        msa_decode._head_tables_kernel,
        {"*": "i64", "tables_ptr": "i32", "virtual_ptr": "i32", "ctx_ptr": "i32"},
        {"HKV": 4, "K": 16, "K_PAD": 16, "BS": 128, "ROWS": 16},
        {"num_warps": 4},
    ),
    "msa_merge": (
        msa_prefill._merge_kernel,
        {"*": "fp32", "o_ptr": "bf16", "out_ptr": "bf16"},
        {"HKV": 4, "K": 16, "G": 16, "ROWS": 64, "BLOCK_T": 4, "D": 128},
        {"num_warps": 4},
    ),
    "msa_paged_decode_split": (
        paged._decode_split_kernel,
        {"*": "bf16", "acc_ptr": "fp32", "ml_ptr": "fp32", "tables_ptr": "i32", "ctx_ptr": "i32"},
        {
            "S": 16,
            "G": 16,
            "D": 128,
            "ROWS": 16,
            "BLOCK_N": 64,
            "CACHE_BLOCK": 128,
            "PRECISION": "tf32",
        },
        {"num_warps": 4},
    ),  # per (query, KV group) with one head
}


def _signature(fn, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + pointers.get(name, pointers["*"])
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    return sig


def _aligned(fn, constexprs: dict) -> dict:
    """Pointers and strides marked divisible by 16, as the JIT specialises them at launch
    (tensors are 16-byte aligned and the model's strides are multiples of 16): without this
    the compiler cannot vectorise loads and the cubin is not the one the GPU runs."""
    return {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if name not in constexprs and (name.endswith("_ptr") or name.startswith("stride"))
    }


def compile_kernel(name: str):
    """(the compiled kernel of case `name`, its runtime parameters in order)."""
    fn, pointers, constexprs, options = CASES[name]
    if "USE_PDL" in fn.arg_names:  # compiled as launched with PDL on, unless the case says
        constexprs = {"USE_PDL": True} | constexprs
    src = ASTSource(
        fn=fn,
        signature=_signature(fn, pointers, constexprs),
        constexprs=constexprs,
        attrs=_aligned(fn, constexprs),
    )
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    return kernel, [n for n in fn.arg_names if n not in constexprs]


def compile_case(name: str) -> dict:
    try:
        kernel, _ = compile_kernel(name)
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        return {"case": name, "error": f"{type(e).__name__}: {e}"[-2000:]}
    return {
        "case": name,
        "cubin": "cubin" in kernel.asm,
        "shared_bytes": kernel.metadata.shared,
        **_resources(kernel.asm["ptx"]),
    }


def _resources(ptx: str) -> dict:
    """Registers and spill bytes from ptxas -v (the CompiledKernel reads them from a device)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the one Triton itself used for the cubin
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        out = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(src), "-o", f"{tmp}/k.o"],
            capture_output=True,
            text=True,
        )
    info = out.stderr + out.stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spills": int(spills.group(1)) if spills else None,
    }


if __name__ == "__main__":
    for case in sys.argv[1:] or sorted(CASES):
        print(json.dumps(compile_case(case)), flush=True)
