#!/usr/bin/env bash
# One device call: the recheck of main's last commits (step 08's decoding and generation
# tests, memcheck over the logits test and the draws, generate --compare with and without
# --no-graph), then the decoding kernel's shape swept: warps a block (DECODE_WARPS), keys a
# warp's step (DECODE_KEYS) and steps in flight (DECODE_STAGES), read from the environment
# by a build of `variants.patch`, each variant's decode-bench rows beside PyTorch's SDPA
# (cuDNN) on the same shapes in the same call.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
t0=$(date +%s); left() { echo $(( ${LIMIT:-580} - ($(date +%s) - t0) )); }; el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
test_bin() { awk -F'\t' -v n="$1" 'index($1, n"-")==1 {print $1"\t"$2; exit}' $X/tests/INDEX; }
run_test() {
  local line exe pkg; line=$(test_bin "$1"); exe=${line%%$'\t'*}; pkg=${line#*$'\t'}
  (cd "$R/$pkg" && timeout ${TT:-$(left)} $2 "$X/tests/$exe" --include-ignored --test-threads 1 $3 2>&1 | grep -v "^\s*$" | tail -n 25)
}
sweep() { # name, then the environment
  local name=$1; shift
  for b in "1 8192,32768,131072" "8 1024,8192,32768" "64 1024,4096,16384"; do
    set -- $b "$@"; local batch=$1 ctx=$2; shift 2
    env "$@" timeout 60 $C/decode-bench --batch $batch --contexts $ctx --head-dims $D --kv-heads 8,32 \
      --runs 30 --out $OUT/$name-d$D-b$batch.json > $OUT/$name-d$D-b$batch.log 2>&1 || echo "$name d$D b$batch rc=$?"
  done
  el "$name d$D done"
}
{
el unpack
tar -xJf $C/gpu.tar.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ -z "$SWEEP_ONLY" ]; then
for t in decode_gpu generate_gpu; do el $t; TT=120 run_test $t "" ""; echo "$t rc=$?"; done
el "memcheck logits and draws"
TT=150 run_test generate_gpu "/usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20" ""; echo "memcheck rc=$?"
el compare
timeout 60 $X/bin/generate --device cuda --model gpt2 --temperature 0 --count 200 --compare 2>&1 | tail -n 6; echo "rc=$?"
timeout 60 $X/bin/generate --device cuda --model gpt2 --temperature 0 --count 200 --compare --no-graph 2>&1 | tail -n 6; echo "rc=$?"
fi
D=64
sweep base
sweep k32s2 DECODE_KEYS=32 DECODE_STAGES=2
sweep w2k32s4 DECODE_WARPS=2 DECODE_KEYS=32 DECODE_STAGES=4
sweep w2k64s2 DECODE_WARPS=2 DECODE_KEYS=64 DECODE_STAGES=2
sweep s3 DECODE_STAGES=3
sweep w8s2 DECODE_WARPS=8 DECODE_STAGES=2
sweep k32s3 DECODE_KEYS=32 DECODE_STAGES=3
sweep w2k32s2 DECODE_WARPS=2 DECODE_KEYS=32 DECODE_STAGES=2
el pytorch
for b in "1 8192,32768,131072" "8 1024,8192,32768" "64 1024,4096,16384"; do
  set -- $b
  timeout 60 python3 charts/peers/pytorch_peers.py --decode --batches $1 --lengths $2 --kv-heads 8,32 \
    --head-dims 64,128 --out $OUT/pytorch-b$1.json > $OUT/pytorch-b$1.log 2>&1 || echo "pytorch b$1 rc=$?"
done
D=128
el "d128"
sweep base
sweep s2 DECODE_STAGES=2
sweep w2k32s2 DECODE_WARPS=2 DECODE_KEYS=32 DECODE_STAGES=2
sweep w2k32s3 DECODE_WARPS=2 DECODE_KEYS=32 DECODE_STAGES=3
el done
} > $OUT/run.log 2>&1
# the device brings back a few files only: the rows travel as one archive
(cd $OUT && tar -cJf sweep.tar.xz *.json *-b*.log && rm -f *.json *-b*.log)
cut -c1-200 $OUT/run.log
