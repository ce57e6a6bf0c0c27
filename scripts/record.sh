#!/usr/bin/env bash
# Regenerates the benchmark record under docs/bench (the figures BENCHMARKS.md quotes): the
# cost curve, the peers comparison and faithfulness per format, and Spec-Bench three times per
# model, then the tables. About 2 hours on a 2-core CPU; run alone (nothing else on the
# machine), from the repository root, with llama-cpp-python installed (see BENCHMARKS.md).
set -euo pipefail
Q=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
RUNS=${RUNS:-3}
OUT=${OUT:-docs/bench}
WORK=${WORK:-runs/record}
mkdir -p "$OUT" "$WORK"
python scripts/cost_curve.py --repeats 7 --out "$OUT/cost_curve.json"
python scripts/faithfulness.py --questions "$Q" --out "$OUT/faithfulness.json"
for model in smollm2 gemma3; do
  python scripts/bench_peers.py --model "$model" --runs "$RUNS" --questions "$Q" --out "$OUT/peers-$model.json"
done
for run in $(seq 1 "$RUNS"); do
  for model in smollm2 gemma3; do
    vocabspec bench --model "$model" --questions "$Q" --per-category 1 --max-new-tokens 128 \
      --methods vanilla,pld,eagle2,eagle2+fr:32k,eagle2+spec:1024,eagle2+fr:32k+pld \
      --out "$WORK/specbench-$model-run$run"
  done
done
python scripts/record_tables.py --work "$WORK" --out "$OUT"
