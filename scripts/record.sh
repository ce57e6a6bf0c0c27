#!/usr/bin/env bash
# Regenerates the benchmark record under docs/bench (the figures BENCHMARKS.md quotes): the
# cost curve, faithfulness per format beside llama.cpp's answers, Spec-Bench three times per
# model, the draft heads at small trees, the peers (llama.cpp's own C++ tools, transformers) per
# model, serving (continuous batching beside llama-server), the drafter families once per model,
# then the tables. About 2.5 hours on a 2-core CPU;
# run alone (nothing else on the machine: llama.cpp's threads spin), from the repository root.
# llama.cpp's tools are built on first use (scripts/build_llamacpp.sh, about 10 minutes).
set -euo pipefail
Q=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
RUNS=${RUNS:-3}
OUT=${OUT:-docs/bench}
WORK=${WORK:-runs/record}
mkdir -p "$OUT" "$WORK"
bash scripts/build_llamacpp.sh >/dev/null
python scripts/cost_curve.py --repeats 7 --out "$OUT/cost_curve.json"
python scripts/faithfulness.py --questions "$Q" --llama-cpp --out "$OUT/faithfulness.json"
for run in $(seq 1 "$RUNS"); do
  for model in smollm2 gemma3; do
    vocabspec bench --model "$model" --questions "$Q" --per-category 1 --max-new-tokens 128 \
      --methods vanilla,pld,eagle,eagle+pld,eagle@2x2 --out "$WORK/specbench-$model-run$run"
  done
done
# Draft heads at the small trees a CPU verifies: each head at one node and at two.
HEADS=vanilla,eagle2+fr:2k@1x1,eagle2+fr:4k@1x1,eagle2+fr:8k@1x1,eagle2+trim:4k@1x1,eagle2+full@1x1,eagle2+spec:1024@1x1,eagle2+fr:4k@2x2
for model in smollm2 gemma3; do
  vocabspec bench --model "$model" --questions "$Q" --per-category 1 --max-new-tokens 128 \
    --methods "$HEADS" --out "$OUT/heads-$model"
  python scripts/bench_peers.py --model "$model" --runs "$RUNS" --questions "$Q" --weights gguf-a8,gguf,f32 \
    --methods pld,eagle,eagle+pld --transformers float32 --decode-only --out "$OUT/peers-$model.json"
done
# Serving: continuous batching against llama-server, greedy per model, then seeded sampling.
for model in smollm2 gemma3; do
  python scripts/bench_serving.py --model "$model" --methods vanilla,pld,eagle@1x1 --concurrency 1,2,4,8,16 \
    --requests-per-client 2 --out "$OUT/serving-$model"
done
python scripts/bench_serving.py --model smollm2 --methods vanilla,pld,eagle@1x1 --temperature 0.7 --concurrency 1,8 \
  --requests-per-client 2 --no-llama-server --out "$OUT/serving-smollm2-sampled"
# Drafter families (Medusa, an independent draft model) beside EAGLE-2, float32 targets.
vocabspec bench --model smollm2 --weights f32 --questions "$Q" --per-category 1 --max-new-tokens 128 \
  --methods vanilla,pld,eagle2+fr:32k,medusa,medusa+fr:32k,medusa@3x8,medusa+fr:32k@3x8,model:smollm2,model:smollm2+trim:32k \
  --out "$OUT/families-smollm2-f32"
vocabspec bench --model gemma3 --weights f32 --questions "$Q" --per-category 1 --max-new-tokens 128 \
  --methods vanilla,pld,eagle2+fr:8k,medusa,medusa+fr:32k,medusa@3x8,medusa+fr:32k@3x8,model:gemma3,model:gemma3+trim:32k,model:gemma3+trim:64k \
  --out "$OUT/families-gemma3-f32"
python scripts/record_tables.py --work "$WORK" --out "$OUT"
