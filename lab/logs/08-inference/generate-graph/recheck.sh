#!/usr/bin/env bash
# After the review's fixes: step 08's decoding and generation tests (the logits test now
# replays a graph captured on another text), memcheck over the draws, and generate's
# --compare with and without --no-graph.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
test_bin() { awk -F'\t' -v n="$1" 'index($1, n"-")==1 {print $1"\t"$2; exit}' $X/tests/INDEX; }
run_test() {
  local line exe pkg; line=$(test_bin "$1"); exe=${line%%$'\t'*}; pkg=${line#*$'\t'}
  (cd "$R/$pkg" && timeout 100 $2 "$X/tests/$exe" --include-ignored --test-threads 1 $3 2>&1 | grep -v "^\s*$" | tail -n 25)
}
{
tar -xJf $C/gpu.tar.xz
nvidia-smi --query-gpu=name --format=csv,noheader
for t in generate_gpu decode_gpu; do el $t; run_test $t "" "--nocapture"; echo "$t rc=$?"; done
el "memcheck draws"; run_test generate_gpu "/usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20" draws; echo "rc=$?"
el compare
$X/bin/generate --device cuda --model gpt2 --temperature 0 --count 200 --compare | tail -n 6; echo "rc=$?"
$X/bin/generate --device cuda --model gpt2 --temperature 0 --count 200 --compare --no-graph | tail -n 5; echo "rc=$?"
el done
} > $OUT/recheck.log 2>&1
cat $OUT/recheck.log | cut -c1-220
