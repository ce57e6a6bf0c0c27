#!/usr/bin/env bash
# Regenerates the benchmark record under docs/bench (the figures BENCHMARKS.md quotes): the
# cost curve, the peers comparison and faithfulness per format, Spec-Bench three times per
# model, the drafter families once per model, then the tables. About 2.5 hours on a 2-core
# CPU; run alone (nothing else on the machine), from the repository root, with
# llama-cpp-python installed (see BENCHMARKS.md).
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
# Drafter families (Medusa, an independent draft model) beside EAGLE-2, float32 targets.
vocabspec bench --model smollm2 --weights f32 --questions "$Q" --per-category 1 --max-new-tokens 128 \
  --methods vanilla,pld,eagle2+fr:32k,medusa,medusa+fr:32k,medusa@3x8,medusa+fr:32k@3x8,model:smollm2,model:smollm2+trim:32k \
  --out "$OUT/families-smollm2-f32"
vocabspec bench --model gemma3 --weights f32 --questions "$Q" --per-category 1 --max-new-tokens 128 \
  --methods vanilla,pld,eagle2+fr:8k,medusa,medusa+fr:32k,medusa@3x8,medusa+fr:32k@3x8,model:gemma3,model:gemma3+trim:32k,model:gemma3+trim:64k \
  --out "$OUT/families-gemma3-f32"
python scripts/record_tables.py --work "$WORK" --out "$OUT"
