#!/usr/bin/env bash
# tests, the full decode-bench and PyTorch's decoding, then a sweep of split counts
set -o pipefail
X=$(cd "$(dirname "$0")" && pwd); R=$(dirname "$X")
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv > $OUT/gpu.txt
{
el tests
cd $R/steps/08-inference
$X/tests/decode_gpu --include-ignored; echo "decode_gpu rc=$?"
$X/tests/generate_gpu --include-ignored; echo "generate_gpu rc=$?"
cd $R
el bench
$X/bin/decode-bench --out $OUT/decode.json 2>&1 | tail -n 320; echo "decode-bench rc=$?"
el peers
python3 charts/peers/pytorch_peers.py --decode --out $OUT/decode-pytorch.json 2>&1 | tail -n 150; echo "peers rc=$?"
el sweep
for s in 4 8 16 24 33 48 66 132; do
  left=$(( 560 - ($(date +%s) - t0) ))
  [ $left -lt 30 ] && { el "sweep stopped before $s"; break; }
  timeout $left $X/bin/decode-bench --batch 1 --head-dims 64,128 --kv-heads 8,32 --contexts 8192,32768,131072 --splits $s --runs 20 --out /tmp/sweep-$s.json > /tmp/sweep-$s.log 2>&1; echo "splits $s rc=$?"
done
python3 - <<'PY'
import json, glob, os
rows = []
for f in sorted(glob.glob('/tmp/sweep-*.json'), key=lambda f: int(f.split('-')[-1][:-5])):
    rows += json.load(open(f))
open(os.environ['OUT'] + '/sweep.json', 'w').write('[\n' + ',\n'.join(json.dumps(r) for r in rows) + '\n]\n')
print(len(rows), 'sweep rows')
PY
el done
} > $OUT/runA.log 2>&1
