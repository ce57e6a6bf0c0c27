#!/usr/bin/env bash
# Builds llama.cpp's own C++ tools (llama-bench, llama-completion, llama-lookup, llama-server),
# the peers of the benchmark record, from the source the llama-cpp-python sdist vendors, with
# this CPU's flags: the AVX-512 set (VNNI, BF16, VBMI; AMX off, its tiles fault on some VMs)
# where the CPU has AVX-512, else -DGGML_NATIVE=ON with every AVX-512 option off (a build
# configured for one set and reused on the other dies on its first illegal instruction).
# About 10 minutes on 2 cores; run it alone. Prints the directory holding the tools.
#
#   bash scripts/build_llamacpp.sh            # LCPP_DIR (default ~/.lcpp), LCPP_PY_VERSION (0.3.36)
set -euo pipefail
dir=${LCPP_DIR:-$HOME/.lcpp}
ver=${LCPP_PY_VERSION:-0.3.36}
if grep -qw avx512f /proc/cpuinfo; then
  flavour=avx512
  flags=(-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON
         -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON)
else
  flavour=native
  flags=(-DGGML_NATIVE=ON -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
         -DGGML_AVX512_VBMI=OFF -DGGML_AVX_VNNI=OFF)
fi
build="$dir/build-$flavour"
tools=(llama-bench llama-completion llama-lookup llama-server)
if [ -x "$build/bin/llama-completion" ] && [ -x "$build/bin/llama-server" ]; then echo "$build/bin"; exit 0; fi
mkdir -p "$dir" && cd "$dir"
[ -f "llama_cpp_python-$ver.tar.gz" ] || pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d .
[ -d "llama_cpp_python-$ver" ] || tar xzf "llama_cpp_python-$ver.tar.gz"
src="$dir/llama_cpp_python-$ver/vendor/llama.cpp"
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${flags[@]}" -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build "$build" -j2 --target "${tools[@]}" >/dev/null
echo "$build/bin"
