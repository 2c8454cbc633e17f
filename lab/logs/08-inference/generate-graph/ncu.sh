#!/usr/bin/env bash
# Where a generation step's time goes: every kernel's duration under Nsight Compute, for a
# generation of 1 new byte and of 11 (each an untimed and a timed run), by launches; the
# difference is 20 steps' kernels. Random weights (a step's work does not depend on them).
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{
el unpack
tar -xJf $C/gpu.tar.xz; xz -dc $C/corpus.tokens.xz > /tmp/corpus.tokens
$X/bin/step05-train train --device cuda --model gpt2 --steps 0 --eval-batches 1 --data /tmp/corpus.tokens \
  --save-init /tmp/gpt2.safetensors 2>&1 | tail -n 2
for n in 1 11; do
  el "count $n"
  timeout 200 /usr/local/cuda/bin/ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    $X/bin/generate --device cuda --checkpoint /tmp/gpt2.safetensors --no-graph --runs 1 --temperature 0 \
    --prompt "fn main() {" --count $n > $OUT/ncu-count$n.csv 2> $OUT/ncu-count$n.err; echo "ncu $n rc=$?"
  tail -n 3 $OUT/ncu-count$n.err
  grep -c gpu__time_duration $OUT/ncu-count$n.csv
done
el done
} > $OUT/ncu.log 2>&1
cat $OUT/ncu.log
