#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer test files and chat templates (its models/ folder: the
# vocabulary-only ggml-vocab-*.gguf files with their .inp/.out vectors, and templates/) from
# the llama-cpp-python sdist that vendors llama.cpp's source, as scripts/build_llamacpp.sh
# fetches it, unpacking only that folder; prints the folder. The tokenizer and chat-template
# tests read it (tests/llamacpp_files.py); nothing of it is kept in the repository.
#
#   bash scripts/fetch_llamacpp_models.sh      # LCPP_DIR (default ~/.lcpp), LCPP_PY_VERSION (0.3.36)
set -euo pipefail
dir=${LCPP_DIR:-$HOME/.lcpp}
ver=${LCPP_PY_VERSION:-0.3.36}
root="llama_cpp_python-$ver/vendor/llama.cpp"
models="$dir/$root/models"
if [ -f "$models/ggml-vocab-llama-spm.gguf.out" ] && [ -d "$models/templates" ]; then echo "$models"; exit 0; fi
mkdir -p "$dir" && cd "$dir"
[ -f "llama_cpp_python-$ver.tar.gz" ] || pip download -q --no-deps --no-binary :all: "llama-cpp-python==$ver" -d . >&2
tar xzf "llama_cpp_python-$ver.tar.gz" --wildcards "$root/models/ggml-vocab-*" "$root/models/templates/*"
echo "$models"
