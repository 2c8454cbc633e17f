#!/usr/bin/env bash
# flash_decode under Nsight Compute at batch 64, head dim 64, 4k tokens: 8 kv heads (a group
# of 4 query rows a tile) against 32 (one row), each at the plan's split.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
{
tar -xJf $C/gpu.tar.xz
for kv in 8 32; do
  echo "== kv heads $kv"
  timeout 100 /usr/local/cuda/bin/ncu --clock-control none -k regex:flash_decode --launch-skip 10 --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section LaunchStats --section SchedulerStats \
    $X/bin/decode-bench --batch 64 --kv-heads $kv --head-dims 64 --contexts 4096 --runs 5 2>&1 | grep -v "^==PROF==" | tail -n 120
done
} > $OUT/ncu.log 2>&1
cat $OUT/ncu.log | cut -c1-160
