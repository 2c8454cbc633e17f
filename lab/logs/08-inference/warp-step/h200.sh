#!/usr/bin/env bash
# The new build (4 KB of keys a warp step, three stages) in one call: step 08's decoding and
# generation tests, memcheck and racecheck over the decoding tests, the whole decode-bench
# (charts/data/decode.json) and PyTorch's decoding (decode-pytorch.json), and the previous
# build's decode-bench at head dim 64 beside them (decode-before-d64.json).
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
export BENCH_COMMIT=${BENCH_COMMIT:?the commit the packed binaries were built from}
t0=$(date +%s); left() { echo $(( ${LIMIT:-585} - ($(date +%s) - t0) )); }; el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
test_bin() { awk -F'\t' -v n="$1" 'index($1, n"-")==1 {print $1"\t"$2; exit}' $X/tests/INDEX; }
run_test() {
  local line exe pkg; line=$(test_bin "$1"); exe=${line%%$'\t'*}; pkg=${line#*$'\t'}
  (cd "$R/$pkg" && timeout ${TT:-$(left)} $2 "$X/tests/$exe" --include-ignored --test-threads 1 $3 2>&1 | grep -v "^\s*$" | tail -n 25)
}
{
el unpack
tar -xJf $C/gpu.tar.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in decode_gpu generate_gpu; do el $t; TT=120 run_test $t "" ""; echo "$t rc=$?"; done
el memcheck; TT=120 run_test decode_gpu "/usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20" "paged_decoding"; echo "rc=$?"
TT=60 run_test decode_gpu "/usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20" "sequences_of_different"; echo "rc=$?"
el racecheck; TT=100 run_test decode_gpu "/usr/local/cuda/bin/compute-sanitizer --tool racecheck --print-limit 20" "sequences_of_different"; echo "rc=$?"
el decode-bench
timeout 200 $X/bin/decode-bench --out $OUT/decode.json 2>&1 | tail -n 70; echo "bench rc=$?"
el pytorch
timeout 200 python3 charts/peers/pytorch_peers.py --decode --out $OUT/decode-pytorch.json 2>&1 | tail -n 6; echo "pytorch rc=$?"
el before
timeout $(left) $C/decode-bench-before --head-dims 64 --out $OUT/decode-before-d64.json 2>&1 | tail -n 4; echo "before rc=$?"
el generate
timeout $(left) $X/bin/generate --device cuda --model gpt2 --temperature 0 --count 200 --compare 2>&1 | tail -n 6
el done
} > $OUT/run.log 2>&1
cut -c1-200 $OUT/run.log | tail -n 150
