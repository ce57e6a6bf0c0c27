#!/usr/bin/env bash
# The GPU check in one command (under 8 minutes on one H100/H200 with its default sections):
# exactness in float32 and bfloat16, read-backs a step, speed of plain decoding and the main
# methods (EAGLE-2 also at the graph-step tuner's tree, with its table), drafting cost on a
# Llama-3-8B-shaped model, a profile of one step, the row-invariant Triton kernels (--backend
# triton: exact without --allow-inexact, in float32 and bfloat16), their captured graph steps
# against torch's in bfloat16, and the linear kernels' microbenchmark and row-invariance
# decision; report.md, run.json and the traces go to OUT.
#   bash scripts/gpu_check.sh OUT SMOLLM2_GGUF [PROMPTS_JSON] [gpu_check.py options...]
# SMOLLM2_GGUF: the GGUF file, or where it is to be joined from its pieces SMOLLM2_GGUF.part*
# (in name order) when it is too large to travel in one piece: e.g. made by
#   split -b 48M -d -a 1 SmolLM2-135M-Instruct.Q4_1.gguf .carry/smollm2.gguf.part
# PROMPTS_JSON: a JSON list of prompts (the Spec-Bench category prompts: see BENCHMARKS.md);
# "" or absent: the first prompt of each category of the project's own.
set -euo pipefail
out=${1:?usage: gpu_check.sh OUT SMOLLM2_GGUF [PROMPTS_JSON] [options]}
gguf=${2:?usage: gpu_check.sh OUT SMOLLM2_GGUF [PROMPTS_JSON] [options]}
prompts=${3:-}
if [[ ! -f "$gguf" ]]; then
  pieces=("$gguf".part*)
  [[ -f "${pieces[0]}" ]] || { echo "no $gguf nor its pieces $gguf.part*" >&2; exit 2; }
  cat "${pieces[@]}" > "$gguf"
  echo "joined ${#pieces[@]} pieces into $gguf ($(stat -c %s "$gguf") bytes)"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 "$(dirname "$0")/gpu_check.py" --gguf "$gguf" ${prompts:+--prompts "$prompts"} --out "$out" "${@:4}"
