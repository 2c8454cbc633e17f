#!/usr/bin/env bash
# experiment: decode variants at batch 1
cd "$(dirname "$0")"
B=./decode-bench
common="--batch 1 --contexts 8192,32768,131072 --head-dims 64,128 --kv-heads 8,32 --runs 50"
v() { name=$1; shift; echo "=== $name: $*"; env "$@" $B $common --out $OUT/$name.json 2>&1 | grep -v '^$' | tail -n 40; }
v base DECODE_PLAN=0
v fused DECODE_FUSED=1
v fill DECODE_PLAN=1 DECODE_ALIGN=1
v fillfused DECODE_PLAN=1 DECODE_ALIGN=1 DECODE_FUSED=1
v fillfused_s2 DECODE_PLAN=1 DECODE_ALIGN=1 DECODE_FUSED=1 DECODE_STAGES=2
v fillfused_w2 DECODE_PLAN=1 DECODE_ALIGN=1 DECODE_FUSED=1 DECODE_WARPS=2
v fillfused_k32s2 DECODE_PLAN=1 DECODE_ALIGN=1 DECODE_FUSED=1 DECODE_KEYS=32 DECODE_STAGES=2
for s in 16 24 33 48 66 99 132 198 264; do
  echo "=== splits $s"
  DECODE_SPLITS=$s DECODE_ALIGN=1 DECODE_FUSED=1 $B --batch 1 --contexts 8192,32768,131072 --head-dims 128 --kv-heads 8 --runs 50 --out $OUT/splits$s.json 2>&1 | tail -n 8
done
echo "=== batch 8/64 check, fillfused"
DECODE_PLAN=1 DECODE_ALIGN=1 DECODE_FUSED=1 $B --batch 8,64 --contexts 1024,8192,32768 --head-dims 64,128 --kv-heads 8,32 --runs 30 --out $OUT/big_fillfused.json 2>&1 | tail -n 30
echo "=== batch 8/64 base"
$B --batch 8,64 --contexts 1024,8192,32768 --head-dims 64,128 --kv-heads 8,32 --runs 30 --out $OUT/big_base.json 2>&1 | tail -n 30
echo "=== pytorch"; python3 ../charts/peers/pytorch_peers.py --decode --batches 1 --lengths 8192,32768,131072 --kv-heads 8,32 --head-dims 64,128 --runs 50 --out $OUT/pt.json 2>&1 | tail -n 20
