#!/usr/bin/env bash
# The generation step as one CUDA graph, in one device call: step 08's GPU tests; generation
# with GPT-2 small's shape (random weights: a step's work does not depend on them) with the
# cache, each step by launches and as one graph, and without it, against PyTorch's static
# cache eager and compiled; compute-sanitizer over the new paths; and a subset of
# decode-bench, to see that the kernel's per-sequence lengths cost nothing.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
export BENCH_COMMIT=${BENCH_COMMIT:?the commit the packed binaries were built from}
t0=$(date +%s); left() { echo $(( ${LIMIT:-570} - ($(date +%s) - t0) )); }; el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
test_bin() { awk -F'\t' -v n="$1" 'index($1, n"-")==1 {print $1"\t"$2; exit}' $X/tests/INDEX; }
run_test() { # name, then what goes before the binary (a sanitizer), then after it (a filter)
  local line exe pkg; line=$(test_bin "$1"); exe=${line%%$'\t'*}; pkg=${line#*$'\t'}
  (cd "$R/$pkg" && timeout ${TT:-$(left)} $2 "$X/tests/$exe" --include-ignored --test-threads 1 $3 2>&1 | tail -n 40)
}
{
el unpack
tar -xJf $C/gpu.tar.xz; xz -dc $C/corpus.tokens.xz > /tmp/corpus.tokens
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in decode_gpu generate_gpu grouped_gpu; do el "$t"; TT=120 run_test $t "" ""; echo "$t rc=$?"; done
el init
$X/bin/step05-train train --device cuda --model gpt2 --steps 0 --eval-batches 1 --data /tmp/corpus.tokens \
  --save-init /tmp/gpt2.safetensors 2>&1 | tail -n 4; echo "init rc=$?"
el generate
G="--device cuda --checkpoint /tmp/gpt2.safetensors --runs 3"
P="python3 steps/08-inference/peers/generate_pytorch.py --checkpoint /tmp/gpt2.safetensors --runs 3"
$X/bin/generate $G --temperature 0 --prompt "fn main() {" --count 500 --out $OUT/generate-gpu-graph.json 2>&1 | tail -n 9; echo "gen1 rc=$?"
el peers
timeout $(left) $P --compile --prompt "fn main() {" --count 500 --against $OUT/generate-gpu-graph.json --out $OUT/generate-gpu-graph-pytorch.json; echo "pt2 rc=$?"
timeout $(left) $P --prompt "fn main() {" --count 500 --against $OUT/generate-gpu-graph.json --out $OUT/generate-gpu-graph-pytorch.json; echo "pt1 rc=$?"
el "long prompt"
$X/bin/generate $G --temperature 0 --prompt "fn main() {" --prompt-len 1024 --count 1000 --out $OUT/generate-gpu-graph.json 2>&1 | tail -n 9; echo "gen2 rc=$?"
timeout $(left) $P --compile --prompt "fn main() {" --prompt-len 1024 --count 1000 --against $OUT/generate-gpu-graph.json --out $OUT/generate-gpu-graph-pytorch.json; echo "pt3 rc=$?"
timeout $(left) $P --prompt "fn main() {" --prompt-len 1024 --count 1000 --against $OUT/generate-gpu-graph.json --out $OUT/generate-gpu-graph-pytorch.json; echo "pt4 rc=$?"
el memcheck lens
run_test decode_gpu "/usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20" sequences_of_different; echo "memcheck lens rc=$?"
el decode-bench
timeout $(left) $X/bin/decode-bench --batch 1,64 --contexts 8192,131072 --head-dims 64,128 --kv-heads 32,8 --runs 20 --out $OUT/decode-lens.json 2>&1 | tail -n 20; echo "bench rc=$?"
el memcheck draws
run_test generate_gpu "/usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20" draws; echo "memcheck draws rc=$?"
el done
} > $OUT/run.log 2>&1
tail -n 170 $OUT/run.log
