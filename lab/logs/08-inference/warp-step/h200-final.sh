#!/usr/bin/env bash
# The final decoding build on an H200 in one call: step 08's GPU tests, memcheck over the
# paged and lengths tests, racecheck over the lengths test, the whole decode-bench
# (charts/data/decode.json) and PyTorch's decoding (decode-pytorch.json). The rest of the
# workspace's tests are ../whole-suite/run.sh. `.gpu-exp/gpu.tar.xz` is the whole of `.gpu/`
# as `../shared/gpu/pack` left it.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
export BENCH_COMMIT=${BENCH_COMMIT:?the commit the packed binaries were built from}
t0=$(date +%s); left() { echo $(( ${LIMIT:-580} - ($(date +%s) - t0) )); }; el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
test_bin() { awk -F'\t' -v n="$1" 'index($1, n"-")==1 {print $1"\t"$2; exit}' $X/tests/INDEX; }
run_test() {
  local line exe pkg; line=$(test_bin "$1"); exe=${line%%$'\t'*}; pkg=${line#*$'\t'}
  (cd "$R/$pkg" && timeout ${TT:-$(left)} $2 "$X/tests/$exe" --include-ignored --test-threads 1 $3 2>&1 | grep -v "^\s*$" | tail -n 25)
}
san=/usr/local/cuda/bin/compute-sanitizer
{
el unpack
tar -xJf $C/gpu.tar.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for t in decode_gpu generate_gpu grouped_gpu; do el $t; TT=120 run_test $t "" ""; echo "$t rc=$?"; done
el memcheck
TT=60 run_test decode_gpu "$san --tool memcheck --print-limit 20" "paged_decoding"; echo "rc=$?"
TT=60 run_test decode_gpu "$san --tool memcheck --print-limit 20" "sequences_of_different"; echo "rc=$?"
el racecheck
TT=100 run_test decode_gpu "$san --tool racecheck --print-limit 20" "sequences_of_different"; echo "rc=$?"
el decode-bench
timeout 200 $X/bin/decode-bench --out $OUT/decode.json 2>&1 | tail -n 90; echo "bench rc=$?"
el pytorch
timeout 150 python3 charts/peers/pytorch_peers.py --decode --out $OUT/decode-pytorch.json 2>&1 | tail -n 6; echo "pytorch rc=$?"
el done
} > $OUT/run.log 2>&1
cut -c1-200 $OUT/run.log | tail -n 160
