#!/usr/bin/env bash
# Split counts at many (sequence, kv head) pairs, head dim 64: batch 64 and 8, 8 and 32 kv
# heads, where the plan's rule counts waves of resident blocks rather than streaming ones;
# the plan's choice and fixed counts, beside PyTorch's SDPA (cuDNN) in the same call.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{
el unpack
tar -xJf $C/gpu.tar.xz
S="--batch 64,8 --kv-heads 8,32 --head-dims 64 --contexts 1024,4096,16384 --runs 30"
el plan; timeout 60 $X/bin/decode-bench $S --out $OUT/sweep-plan.json 2>&1 | tail -n 14
for n in 1 2 3 4 6; do el "splits $n"; timeout 60 $X/bin/decode-bench $S --splits $n --out $OUT/sweep-$n.json 2>&1 | tail -n 13; done
el pytorch
timeout 120 python3 charts/peers/pytorch_peers.py --decode --batches 64,8 --kv-heads 8,32 --head-dims 64 \
  --lengths 1024,4096,16384 --out $OUT/sweep-pytorch.json 2>&1 | tail -n 16
el done
} > $OUT/run.log 2>&1
cat $OUT/run.log
