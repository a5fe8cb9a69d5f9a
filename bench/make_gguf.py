"""GGUF files of a benchmark checkpoint for bench/decode.py's llama.cpp rows. Not a test.

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_TILE=OFF \\
      -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" .venv/bin/pip install llama-cpp-python==0.3.36
    (a CPU without AVX512 dies of SIGILL in that build: there CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF
     -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF", about 7 minutes on 2 cores)
    .venv/bin/pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/llsd
    tar xzf /tmp/llsd/llama_cpp_python-0.3.36.tar.gz -C /tmp/llsd
    .venv/bin/pip install -e /tmp/llsd/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py
    .venv/bin/python bench/make_gguf.py /tmp/moefit-bench-decode/hf-big-151936 /tmp/big \\
        --llama-cpp /tmp/llsd/llama_cpp_python-0.3.36/vendor/llama.cpp

writes /tmp/big-q8_0.gguf and /tmp/big-q4_0.gguf (the checkpoint needs Qwen's tokenizer,
which bench/decode.py gives it at vocab 151936: llama.cpp's converter refuses unknown ones).
The hybrid shape (bench/decode.py --shape hybrid) has no MTP layers: add --no-mtp.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir")
    ap.add_argument("prefix", help="output files are PREFIX-q8_0.gguf and PREFIX-q4_0.gguf")
    ap.add_argument("--llama-cpp", required=True, help="the llama.cpp source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--types", default="q8_0,q4_0", help="llama.cpp file types: q8_0, q4_0, q4_k_m, q5_k_m, "
                    "q6_k, iq4_xs, ...")
    ap.add_argument("--no-mtp", action="store_true", help="tell the converter the checkpoint has no MTP layers "
                    "(a Qwen3.5 / Next checkpoint without them: bench/decode.py --shape hybrid)")
    args = ap.parse_args()
    import llama_cpp
    full = Path(f"{args.prefix}-bf16.gguf")
    subprocess.run([sys.executable, str(Path(args.llama_cpp) / "convert_hf_to_gguf.py"), args.hf_dir,
                    "--outtype", "bf16", "--outfile", str(full), *(["--no-mtp"] if args.no_mtp else [])], check=True)
    for name in args.types.split(","):
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{name.upper()}")
        out = f"{args.prefix}-{name}.gguf"
        if llama_cpp.llama_model_quantize(str(full).encode(), out.encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"quantising to {name} failed")
        print(f"wrote {out}")
    full.unlink()


if __name__ == "__main__":
    main()
