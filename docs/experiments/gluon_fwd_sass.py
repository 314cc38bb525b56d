"""Where the compiled Gluon forward waits for a step's ``P V``, without a GPU: each configuration of the
persistent kernel (head dim, consumer warpgroups, causal) compiled for sm_90a (Triton's ptxas), disassembled
with Triton's nvdisasm, and, for every ``WARPGROUP.DEPBAR.LE gsb0, 0x0`` (a wait for all products in flight),
the count of ``MUFU.EX2`` (exponentials) between the last ``HGMMA`` before it and the wait, and between the wait
and the next ``HGMMA``. In the KV loop's wait for ``P_j V_j`` the first count is what ran in the product's
shadow: 0 of 64 in the shipped kernel (Triton 3.6), 64 with ``EXP_MODULE`` = gluon_fwd_patches.py's
``wait_after_softmax`` copy (docs/benchmarks.md, "Tried, not adopted: ... the wait for P V kept after the
softmax").

    PYTHONPATH=. python docs/experiments/gluon_fwd_sass.py            # kernels/gluon_forward.py

with the Triton of the environment (the figures in docs/benchmarks.md: ``triton==3.6.0``, the GPU machine's,
whose ptxas is 12.8; Triton 3.9's ptxas 13.4 orders the loop the same way, with other spill counts).
    EXP_MODULE=/tmp/gf.py PYTHONPATH=. python docs/experiments/gluon_fwd_sass.py

Prints one line a configuration: ptxas's spill report, the (before, after) counts of each such wait in code
order (one per consumer partition and place: the first block's, the loop's, the last block's), and the
instructions of one step of the KV loop with its causal mask and of the mask alone (:func:`step`; the fifteenth
session's figures in docs/benchmarks.md). A record of an experiment, not tested code.
"""
import importlib.util
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

spec = importlib.util.spec_from_file_location("gf", os.environ.get("EXP_MODULE", "kernels/gluon_forward.py"))
gf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gf)
PTXAS = get_ptxas(90).path
SIGNATURE = inspect.signature(gf._attn_fwd_persistent.fn).parameters  # older modules: no dynamic walk
NVDISASM = os.path.join(os.path.dirname(PTXAS), "nvdisasm")


def desc(rows, d):
    block = [1, 1, rows, d]
    return f"tensordesc<fp16[{','.join(map(str, block))}],{gl.NVMMASharedLayout.get_default_for(block, gl.float16)!r}>"


def sass(d, groups, causal):
    signature = {"q_desc": desc(gf.BLOCK_M, d), "k_desc": desc(gf.BLOCK_N, d), "v_desc": desc(gf.BLOCK_N, d),
                 "o_desc": desc(gf.BLOCK_M, d), "Lse": "*fp32",
                 **{n: "i32" for n in ("stride_lb", "stride_lh", "stride_ln")}, "c": "fp32",
                 **{n: "i32" for n in ("heads_q", "group", "len_q", "len_k", "tiles_m", "n_tiles")},
                 **({"Counter": "*i32", "tail_heads": "i32"} if "Counter" in SIGNATURE else {}),
                 "Timeline": "constexpr",
                 **{n: "constexpr" for n in ("CAUSAL", "BLOCK_M", "BLOCK_N", "D", "WARPGROUPS", "CONSUMER_REGS")
                    + (("DYNAMIC", ) if "DYNAMIC" in SIGNATURE else ()) + ("TIMELINE", )}}
    constexprs = {"CAUSAL": causal, "BLOCK_M": gf.BLOCK_M, "BLOCK_N": gf.BLOCK_N, "D": d, "WARPGROUPS": groups,
                  "CONSUMER_REGS": gf.CONSUMER_REGS, "TIMELINE": False, "Timeline": None,
                  **({"DYNAMIC": causal} if "DYNAMIC" in SIGNATURE else {})}  # modules before 08d3342
    kernel = triton.compile(GluonASTSource(fn=gf._attn_fwd_persistent, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as fh:
            fh.write(kernel.asm["ptx"])
        run = subprocess.run([PTXAS, "-v", "-arch=sm_90a", ptx, "-o", ptx + ".o"], capture_output=True, text=True)
        spills = re.findall(r"\d+ bytes spill stores", run.stderr)
        dis = subprocess.run([NVDISASM, "-c", ptx + ".o"], capture_output=True, text=True, check=True).stdout
    return spills, dis


def waits(dis):
    pattern = re.compile(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*);")
    ops = [m.group(2) + m.group(3) for m in map(pattern.search, dis.splitlines()) if m]
    found = []
    for i, op in enumerate(ops):
        if op.startswith("WARPGROUP.DEPBAR.LE") and op.rstrip().endswith("0x0"):
            before, j = 0, i - 1
            while j >= 0 and not ops[j].startswith("HGMMA"):
                before += ops[j].startswith("MUFU.EX2")
                j -= 1
            after, j = 0, i + 1
            while j < len(ops) and not ops[j].startswith(("HGMMA", "WARPGROUP.DEPBAR")):
                after += ops[j].startswith("MUFU.EX2")
                j += 1
            found.append((before, after))
    return found


def step(dis):
    """The instructions of a consumer's KV loop (the first loop whose body holds a ``P V`` product and exponentials)
    and of the causal mask's block in it (skipped by a branch where the block needs no mask; 0 where there is
    none): (a masked step's instructions, the mask's)."""
    lines = dis.splitlines()
    label_at = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"(\.L_x_\d+):", line))}
    is_op = [bool(re.search(r"/\*[0-9a-f]{4}\*/", line)) for line in lines]
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if not m or label_at.get(m.group(1), i) >= i:
            continue
        body = range(label_at[m.group(1)], i + 1)
        if any("tnspB" in lines[k] for k in body) and any("MUFU.EX2" in lines[k] for k in body):
            mask = 0
            for k in body:
                f = re.search(r"BRA `\((\.L_x_\d+)\)", lines[k])
                if f and k < label_at.get(f.group(1), -1) <= i:
                    skipped = range(k + 1, label_at[f.group(1)])
                    if any("FSEL" in lines[x] and "-INF" in lines[x] for x in skipped):
                        mask = sum(is_op[x] for x in skipped)
            return sum(is_op[k] for k in body), mask
    return None


if __name__ == "__main__":
    print(triton.__version__, os.environ.get("EXP_MODULE", "kernels/gluon_forward.py"), flush=True)
    for d, groups in ((128, 2), (64, 2), (64, 3)):
        for causal in (False, True):
            spills, dis = sass(d, groups, causal)
            print(f"D={d} warpgroups={groups} causal={causal}: {spills}; waits for all products "
                  f"(EX2 before, after): {waits(dis)}; a KV step's instructions, masked and the mask's: "
                  f"{step(dis)}", flush=True)
