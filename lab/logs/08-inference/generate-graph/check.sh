#!/usr/bin/env bash
# The least that shows the generation step as one graph works: step 08's decoding tests
# (sequences of different lengths among them), the logits test by launches and by graphs,
# and generate --compare with GPT-2 small's shape (random weights), by launches and graphs.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
t0=$(date +%s); left() { echo $(( ${LIMIT:-150} - ($(date +%s) - t0) )); }; el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
test_bin() { awk -F'\t' -v n="$1" 'index($1, n"-")==1 {print $1"\t"$2; exit}' $X/tests/INDEX; }
run_test() { local line exe pkg; line=$(test_bin "$1"); exe=${line%%$'\t'*}; pkg=${line#*$'\t'}
  (cd "$R/$pkg" && timeout $(left) "$X/tests/$exe" --include-ignored --test-threads 1 $2 2>&1 | grep -v "^test .* ok$" | tail -n 30); }
{
el unpack; tar -xJf $C/gpu.tar.xz; nvidia-smi --query-gpu=name --format=csv,noheader
el generate; timeout $(left) $X/bin/generate --device cuda --model gpt2 --temperature 0 --prompt "fn main() {" --count 500 --compare --runs 3 2>&1 | tail -n 8; echo "gen rc=$?"

el generate_gpu; run_test generate_gpu ""; echo "generate_gpu rc=$?"
el done
} > $OUT/check.log 2>&1
cat $OUT/check.log
