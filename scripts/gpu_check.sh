#!/usr/bin/env bash
# The GPU check in one command (under 8 minutes on one H100/H200): exactness in float32 and
# bfloat16, read-backs a step, speed of plain decoding and the main methods (EAGLE-2 also at the
# static-step tuner's tree, with its table), drafting cost on a Llama-3-8B-shaped model, a
# profile of one step, and the row-invariant Triton kernels (--backend triton: exact without
# --allow-inexact, in float32 and bfloat16); report.md, run.json and the traces go to OUT.
#   bash scripts/gpu_check.sh OUT SMOLLM2_GGUF PROMPTS_JSON
# PROMPTS_JSON: a JSON list of prompts (the Spec-Bench category prompts: see BENCHMARKS.md).
set -euo pipefail
out=${1:?usage: gpu_check.sh OUT SMOLLM2_GGUF PROMPTS_JSON}
gguf=${2:?usage: gpu_check.sh OUT SMOLLM2_GGUF PROMPTS_JSON}
prompts=${3:?usage: gpu_check.sh OUT SMOLLM2_GGUF PROMPTS_JSON}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 "$(dirname "$0")/gpu_check.py" --gguf "$gguf" --prompts "$prompts" --out "$out" "${@:4}"
