#!/usr/bin/env bash
# The chapter's decoding rows on an H200 with the fewest seconds: decode_gpu's tests, the
# whole decode-bench (charts/data/decode.json) and PyTorch's decoding (decode-pytorch.json).
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
export BENCH_COMMIT=${BENCH_COMMIT:?the commit the packed binaries were built from}
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{
el unpack
tar -xJf $C/gpu.tar.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
exe=$(awk -F'\t' 'index($1, "decode_gpu-")==1 {print $1; exit}' $X/tests/INDEX)
(cd steps/08-inference && timeout 60 $X/tests/$exe --include-ignored --test-threads 1 2>&1 | tail -n 3); echo "decode_gpu rc=$?"
el decode-bench
timeout 120 $X/bin/decode-bench --out $OUT/decode.json 2>&1 | tail -n 3; echo "bench rc=$?"
el pytorch
timeout 80 python3 charts/peers/pytorch_peers.py --decode --out $OUT/decode-pytorch.json 2>&1 | tail -n 2; echo "pytorch rc=$?"
el done
} > $OUT/run.log 2>&1
cat $OUT/run.log
