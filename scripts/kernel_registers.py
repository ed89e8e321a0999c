#!/usr/bin/env python3
"""Registers and spills of generated persistent kernels, without a GPU.

Compiles each CUDA source given (as `ramus-cuda`'s ignored `kernel_sources`
test writes them) with NVRTC for sm_90, as the engine does, and prints
ptxas's resource report: registers, stack frame and spill bytes. A kernel
the engine would refuse shows nonzero spill stores. The device's NVRTC
(CUDA 13.0.88) comes from PyPI and needs no GPU or driver:

    pip install --no-deps --target /tmp/cu13 'nvidia-cuda-nvrtc==13.0.88'
    RAMUS_KERNEL_SOURCE_DIR=$PWD/kernels cargo test --release -p ramus-cuda \\
        --lib kernel_sources -- --ignored
    python3 scripts/kernel_registers.py kernels/*.cu

`NVRTC_LIB` names another libnvrtc (default: the one installed as above).
Its ptxas must be the device's exactly: CUDA 12's reported spills in
kernels that CUDA 13 compiled without any, and CUDA 13.5's none in one
that 13.0 spilled.
"""

import ctypes
import glob
import os
import re
import sys

DEFAULT_LIB = "/tmp/cu13/nvidia/cu13/lib/libnvrtc.so.13"
OPTIONS = [b"--gpu-architecture=sm_90", b"-default-device", b"-std=c++17",
           b"--ptxas-options=-v"]


def report(nvrtc, path):
    """ptxas's resource lines for the source at `path`, or the compile log."""
    with open(path, "rb") as f:
        source = f.read()
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), source, b"kernel.cu",
                                0, None, None) != 0:
        return "cannot create an NVRTC program"
    options = (ctypes.c_char_p * len(OPTIONS))(*OPTIONS)
    status = nvrtc.nvrtcCompileProgram(program, len(OPTIONS), options)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
    text = log.value.decode(errors="replace")
    if status != 0:
        return "compile error:\n" + text
    lines = [re.sub(r"^ptxas(\s+info)?[\s:.]*", "", line.strip())
             for line in text.splitlines()
             if "spill" in line or "registers" in line]
    return " | ".join(lines)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    lib = os.environ.get("NVRTC_LIB", DEFAULT_LIB)
    try:
        # its builtins library beside it, found without LD_LIBRARY_PATH
        for builtins in sorted(glob.glob(os.path.join(os.path.dirname(lib),
                                                      "libnvrtc-builtins.so.*"))):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        nvrtc = ctypes.CDLL(lib)
    except OSError as e:
        sys.exit(f"cannot load NVRTC from {lib} ({e}); see --help")
    for path in sys.argv[1:]:
        print(f"{os.path.basename(path)}: {report(nvrtc, path)}")


if __name__ == "__main__":
    main()
