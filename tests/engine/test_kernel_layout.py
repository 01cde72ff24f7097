"""The Triton kernel modules hold kernels and their launches only: their checks and timings live
in ``bench/kernels_check.py``, their case builders and references in ``fovea.engine.kernels.cases``."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ["triton_decode", "triton_prefill", "triton_ops", "qwen_vision_kernels", "vision_kernels",
           "checksum_kernel", "cases", "fp8_quantize", "fp8_activation", "split_sum", "quant_gemv", "quant_matmul"]


def test_the_kernel_modules_import_nothing_above_them():
    code = ("import sys\n"
            "import fovea.engine.kernels.triton_decode, fovea.engine.kernels.triton_prefill, fovea.engine.kernels.triton_ops\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('fovea'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    # (triton_ops hands FP8 products their inputs quantised: the quantiser's constants and the
    # activation's type, kernel modules both)
    assert out == ["fovea", "fovea.engine", "fovea.engine.kernels", "fovea.engine.kernels.fp8_activation",
                   "fovea.engine.kernels.fp8_quantize", "fovea.engine.kernels.triton_decode",
                   "fovea.engine.kernels.triton_ops", "fovea.engine.kernels.triton_prefill",
                   "fovea.engine.kernels.triton_util"]


def test_every_kernel_module_imports_no_engine_object():
    modules = ", ".join(f"fovea.engine.kernels.{name}" for name in KERNELS)
    code = (f"import sys\nimport {modules}\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('fovea'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == sorted(["fovea", "fovea.engine", "fovea.engine.kernels", "fovea.engine.kernels.triton_util",
                          *(f"fovea.engine.kernels.{name}" for name in KERNELS)])


def test_the_kernel_check_command_line():
    script = str(ROOT / "bench" / "kernels_check.py")
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, check=False)
    assert shown.returncode == 0 and "--kernel" in shown.stdout
    nothing = subprocess.run([sys.executable, script, "--kernel", "ops"], capture_output=True, text=True, check=False)
    assert nothing.returncode == 2  # no action: the usage, and not a pass
    refused = subprocess.run([sys.executable, script, "--kernel", "ops", "--sweep"], capture_output=True, text=True,
                             check=False)
    assert refused.returncode == 2 and "no --sweep" in refused.stderr
