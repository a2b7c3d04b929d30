"""The attention kernel's K/V offsets in the integer widths ``offset_widths`` promises, read from the
kernel compiled for Hopper (sm_90) to Triton's IR on the CPU: no GPU needed, and none of the tests
run under the interpreter can see a width (the interpreter computes in numpy's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

# Run in a process of its own: the test session may have set TRITON_INTERPRET, which Triton reads
# when the kernel is defined. Prints, per WIDE_OFFSETS, the element type of each multiply of a page
# id or a slot by a stride.
_COMPILE = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prefix_cache.kernels.attention import _attention_kernel

pointers = {
    "q_ptr": "*bf16", "q_rows_ptr": "*i64", "k_ptr": "*bf16", "v_ptr": "*bf16", "kv_indices_ptr": "*i32",
    "work_ptr": "*i32", "num_work_ptr": "*i32", "o_rows_ptr": "*i64", "o_ptr": "*fp32", "lse_ptr": "*fp32",
    "final_ptr": "*bf16", "qk_scale": "fp32",
}
constants = dict(
    NUM_KV_HEADS=8, PAGE_SIZE=16, GROUP_SIZE=4, TILE_Q=4, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=64,
    BLOCK_D=128, UPCAST=False, DOT_PRECISION="tf32", LAUNCH_DEPENDENTS=False,
)
names = _attention_kernel.arg_names
found = {}
for wide in (0, 1, 2):
    values = dict(constants, WIDE_OFFSETS=wide)
    signature = {
        name: pointers.get(name, "constexpr" if name in values else "i32") for name in names
    }
    source = ASTSource(_attention_kernel, signature, {(names.index(k),): v for k, v in values.items()})
    ir = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    muls = re.findall(r"arith\.muli %(page|slot)\w*, %\w+ : tensor<\d+x(i\d+)>", ir.asm["ttir"])
    found[wide] = sorted(muls)
print(json.dumps(found))
"""


def test_compiled_offset_terms_have_the_promised_widths() -> None:
    """Kernel 0 multiplies page ids and slots by the strides in 32 bits; kernel 1 the page ids in
    64; kernel 2 both (K and V each). A kernel that widens too little would read the wrong KV past
    2**31 elements, one that widens too much runs measurably slower (benchmarks/NOTES.md)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = {int(wide): [tuple(m) for m in muls] for wide, muls in json.loads(done.stdout).items()}
    assert found == {
        0: [("page", "i32")] * 2 + [("slot", "i32")] * 2,
        1: [("page", "i64")] * 2 + [("slot", "i32")] * 2,
        2: [("page", "i64")] * 2 + [("slot", "i64")] * 2,
    }


# Compiles the decode tile (16 rows) over fp8 and bf16 K/V for sm_90 with the specializations a
# launch gets (16-divisible pointers and strides), and counts byte-wise shared-memory loads and
# ldmatrix instructions in the PTX.
_COMPILE_FP8 = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from prefix_cache.kernels.attention import _attention_kernel

names = _attention_kernel.arg_names
found = {}
for kv in ("*fp8e4nv", "*bf16"):
    types = {
        "q_ptr": "*bf16", "q_rows_ptr": "*i64", "k_ptr": kv, "v_ptr": kv, "kv_indices_ptr": "*i32",
        "work_ptr": "*i32", "num_work_ptr": "*i32", "o_rows_ptr": "*i64", "o_ptr": "*fp32",
        "lse_ptr": "*fp32", "final_ptr": "*bf16", "qk_scale": "fp32", "v_scale": "fp32",
    }
    values = dict(
        NUM_KV_HEADS=8, PAGE_SIZE=16, GROUP_SIZE=4, TILE_Q=4, HEAD_DIM=128, BLOCK_M=16, BLOCK_N=64,
        BLOCK_D=128, UPCAST=False, DOT_PRECISION="tf32", LAUNCH_DEPENDENTS=False, WIDE_OFFSETS=0,
    )
    signature = {name: types.get(name, "constexpr" if name in values else "i32") for name in names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(names)
        if signature[name] not in ("constexpr", "fp32")
    }
    constants = {(names.index(k),): v for k, v in values.items()}
    source = ASTSource(_attention_kernel, signature, constants, attrs=attrs)
    options = dict(num_warps=4, num_stages=2)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    found[kv] = {op: len(re.findall(op, ptx)) for op in ("ld.shared.b8", "ldmatrix", "mma.sync")}
print(json.dumps(found))
"""


def test_fp8_tiles_reach_the_tensor_cores_as_bf16_ones_do() -> None:
    """An fp8 decode tile is converted in registers before shared memory, so it is read from there
    with ldmatrix like a bf16 tile, never a byte at a time (which made fp8 decode slower than bf16
    on the H100: benchmarks/NOTES.md, "fp8 tiles converted before shared memory")."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_FP8], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert found["*fp8e4nv"]["ld.shared.b8"] == 0
    assert found["*fp8e4nv"]["ldmatrix"] == found["*bf16"]["ldmatrix"] > 0
    assert found["*fp8e4nv"]["mma.sync"] == found["*bf16"]["mma.sync"] > 0
