"""What the GPU would execute, counted without a GPU: the quantised matrix-vector kernels
(``quant_gemv``) compiled for sm_90 by this machine's triton and ptxas, and their main loop's
SASS counted per weight.

    python3 bench/kernel_sass.py [--rows 1,2,4] [--kernels fp8,fp8-block,int4] [--group 128] [--arch 90]
                                 [--dump DIR]

For every launch configuration the shape's choice would time (``fp8_gemv_candidates``,
``fp8_block_gemv_candidates`` for 128x128 weight blocks, ``int4_gemv_candidates``): registers a
thread, shared memory, spills (``cuobjdump -res-usage``), the instructions of the longest loop in
the SASS (``nvdisasm``) and their count per weight the loop streams, and the most frequent opcodes. Arguments are specialised as the JIT does on the
Qwen2.5-VL-7B shapes (16-byte aligned pointers, integers divisible by 16, one row a constant).

It is a diagnostic, not a timing. It answers the questions a timing cannot point at: whether a
tile is re-laid out through shared memory every step (STS/LDS/BAR in the loop), whether loads are
16 bytes wide (LDG.E.128), how many integer and float instructions a weight costs against the
issue rate (one warp instruction a clock for each of an SM's four schedulers; on an H200
6.5e9 weights a 7B decode step at 4 instructions a weight is ~0.8 ms, the int4 bandwidth floor),
and whether the registers leave room for enough programs a SM. Exit status 2 where triton's
compiler or its NVIDIA tools are missing.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def nvidia_tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not path.exists():
        raise FileNotFoundError(f"triton's {name} is not at {path}")
    return str(path)


def compile_kernel(fn, signature: dict, constants: dict, warps: int, arch: int):
    """Compile as the JIT would for the 7B shapes: pointers and int arguments (but M) divisible by 16,
    M == 1 a constant where there is one row."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature[name].startswith("*") or (signature[name] == "i32" and name != "M")}
    if constants.get("ROWS") == 1:
        signature = dict(signature, M="constexpr")
        constants = dict(constants, M=1)
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


def resources(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = RES_USAGE.search(out)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output:\n{out}")
    return dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups())))


def disassemble(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvidia_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def longest_loop(sass: str) -> list[str]:
    """The opcodes between a label and the longest backward branch to it (predicates dropped)."""
    lines = sass.splitlines()
    labels: dict[str, int] = {}
    best: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith(".L_"):
            labels[line.rstrip(":").strip()] = i
        if "BRA" in line:
            for label, start in labels.items():
                if f"`({label})" in line and i - start > len(best):
                    best = lines[start:i + 1]
    return opcodes(best)


def opcodes(lines: list[str]) -> list[str]:
    """The opcodes of nvdisasm's instruction lines among ``lines`` (predicates dropped)."""
    ops = []
    for line in lines:
        if "*/" in line and ";" in line:
            ins = line.split("*/", 1)[1].strip().rstrip(";").strip()
            if ins.startswith("@"):
                ins = ins.split(None, 1)[1]
            ops.append(ins.split()[0])
    return ops


def fp8_case(rows: int, config, block_scaled: bool = False) -> tuple[dict, dict, int]:
    signature = {"X": "*fp8e4nv", "XS": "*fp32", "W": "*fp8e4nv", "WS": "*fp32", "C": "*bf16", "BIAS": "*bf16",
                 "M": "i32", "N": "i32", "K": "i32", "k_split": "i32", "stride_xm": "i32", "stride_xs": "i32",
                 "stride_wn": "i32", "stride_ws": "i32", "stride_cs": "i32", "stride_cm": "i32", "group_n": "i32",
                 "GROUP_K": "constexpr", "ROWS": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
                 "EVEN_K": "constexpr", "BLOCK_SCALED": "constexpr", "HAS_BIAS": "constexpr",
                 "PARTIAL": "constexpr", "PREFETCH": "constexpr"}
    constants = {"PREFETCH": config.prefetch, "GROUP_K": 128 if block_scaled else 1, "ROWS": rows,
                 "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "EVEN_K": True,
                 "BLOCK_SCALED": block_scaled, "HAS_BIAS": False, "PARTIAL": config.split_k > 1}
    return signature, constants, config.block_n * config.block_k  # weights a loop step streams


def int4_case(rows: int, config, group: int) -> tuple[dict, dict, int]:
    signature = {"X": "*bf16", "P": "*i32", "S": "*bf16", "Z": "*bf16", "C": "*bf16", "BIAS": "*bf16",
                 "M": "i32", "N": "i32", "K": "i32", "k_split": "i32", "stride_xm": "i32", "stride_pk": "i32",
                 "stride_sk": "i32", "stride_zk": "i32", "stride_cs": "i32", "stride_cm": "i32",
                 "low_mask": "i32", "high_mask": "i32", "GROUP": "constexpr", "HAS_ZEROS": "constexpr",
                 "HAS_BIAS": "constexpr", "PARTIAL": "constexpr", "FOLD": "constexpr", "ROWS": "constexpr",
                 "BLOCK_N": "constexpr", "PREFETCH": "constexpr"}
    constants = {"GROUP": group, "HAS_ZEROS": True, "HAS_BIAS": False, "PARTIAL": config.split_k > 1,
                 "FOLD": True, "ROWS": rows, "BLOCK_N": config.block_n, "PREFETCH": config.prefetch}
    return signature, constants, config.block_n * group


@dataclass
class Analysis:
    regs: int
    shared: int
    spilled: int  # bytes of local memory a thread
    loop: collections.Counter  # opcodes of the longest loop
    per_weight: float  # the loop's instructions per weight it streams, a thread
    ttgir: str
    sass: str


def analyse(kind: str, rows: int, config, group: int = 128, arch: int = 90) -> Analysis:
    """Compile one matrix-vector kernel (``kind`` fp8, fp8-block (128x128 weight blocks) or int4) for
    ``rows`` rows and ``config`` and count its SASS."""
    from fovea.engine.kernels import quant_gemv

    fp8_kernel, int4_kernel = quant_gemv._kernels()
    if kind in ("fp8", "fp8-block"):
        fn, (signature, constants, per_step) = fp8_kernel, fp8_case(rows, config, kind == "fp8-block")
    else:
        fn, (signature, constants, per_step) = int4_kernel, int4_case(rows, config, group)
    kernel = compile_kernel(fn, signature, constants, config.num_warps, arch)
    cubin = kernel.asm["cubin"]
    sass = disassemble(cubin)
    use = resources(cubin)
    ops = longest_loop(sass)
    per_weight = len(ops) / (per_step / (32 * config.num_warps)) if ops else float("nan")
    return Analysis(use["regs"], use["shared"], use["local"], collections.Counter(ops), per_weight,
                    kernel.asm["ttgir"], sass)


def tools_missing() -> str | None:
    """Why this cannot run here, or None."""
    try:
        import triton  # noqa: F401

        nvidia_tool("nvdisasm")
        nvidia_tool("cuobjdump")
    except (ImportError, FileNotFoundError) as e:
        return str(e)
    return None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4", help="rows of x (1-4)")
    p.add_argument("--kernels", default="fp8,fp8-block,int4")
    p.add_argument("--group", type=int, default=128, help="int4 group size")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for H100/H200")
    p.add_argument("--dump", type=Path, help="write each kernel's ttgir and SASS here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = tools_missing()
    if missing:
        print(f"kernel_sass: {missing}", file=sys.stderr)
        return 2
    from fovea.engine.kernels import quant_gemv

    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    print(f"{'kernel':9} {'rows':>4} {'config':37} {'regs':>4} {'smem':>5} {'spill':>5} {'loop':>5} "
          f"{'/weight':>7}  top opcodes in the loop")
    for kind in args.kernels.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            configs = (quant_gemv.fp8_gemv_candidates(rows) if kind == "fp8"
                       else quant_gemv.fp8_block_gemv_candidates(rows, (128, 128)) if kind == "fp8-block"
                       else quant_gemv.int4_gemv_candidates(rows, args.group))
            # the split count changes only whether partials are stored: one compile for 1, one for more
            for config in dict.fromkeys(dataclasses.replace(c, split_k=min(c.split_k, 2)) for c in configs):
                a = analyse(kind, rows, config, args.group, args.arch)
                top = ", ".join(f"{op}:{n}" for op, n in a.loop.most_common(6))
                print(f"{kind:9} {rows:>4} {config.describe():37} {a.regs:>4} {a.shared:>5} {a.spilled:>5} "
                      f"{sum(a.loop.values()):>5} {a.per_weight:>7.2f}  {top}")
                if args.dump:
                    stem = args.dump / (f"{kind}_r{rows}_{config.block_n}x{config.block_k}_s{config.split_k}"
                                        + ("_prefetch" if config.prefetch else ""))
                    stem.with_suffix(".ttgir").write_text(a.ttgir)
                    stem.with_suffix(".sass").write_text(a.sass)
    return 0


if __name__ == "__main__":
    sys.exit(main())
