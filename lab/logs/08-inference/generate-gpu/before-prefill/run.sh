#!/usr/bin/env bash
# GPT-2 small's shape trained for minutes, then generation with and without the cache, ours and PyTorch's
set -o pipefail
X=$(cd "$(dirname "$0")" && pwd); R=$(dirname "$X")
t0=$(date +%s); left() { echo $(( 585 - ($(date +%s) - t0) )); }; el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
cd $R
{
el unpack
xz -dc $X/corpus.tokens.xz > /tmp/corpus.tokens
el train
$X/bin/step05-train train --device cuda --model gpt2 --batch 12 --steps ${STEPS:-3600} --warmup 100 --lr 6e-4 \
  --attention hopper --max-seconds ${SECS:-210} --eval-every 600 --eval-batches 8 --print-every 200 \
  --data /tmp/corpus.tokens --out $OUT/train-gpt2.json --save /tmp/gpt2.safetensors 2>&1 | tail -n 60; echo "train rc=$?"
el generate
G="--device cuda --checkpoint /tmp/gpt2.safetensors --runs 3"
P="python3 steps/08-inference/peers/generate_pytorch.py --checkpoint /tmp/gpt2.safetensors --runs 3"
$X/bin/generate $G --temperature 0 --prompt "fn main() {" --count 500 --out $OUT/generate-gpu.json; echo "gen1 rc=$?"
$X/bin/generate $G --temperature 0 --prompt "fn main() {" --prompt-len 1024 --count 1000 --out $OUT/generate-gpu.json; echo "gen2 rc=$?"
$X/bin/generate $G --temperature 0.8 --prompt "impl " --count 500 --out $OUT/generate-gpu.json; echo "gen3 rc=$?"
el peers
timeout $(left) $P --prompt "fn main() {" --count 500 --against $OUT/generate-gpu.json --out $OUT/generate-gpu-pytorch.json; echo "pt1 rc=$?"
timeout $(left) $P --prompt "fn main() {" --prompt-len 1024 --count 1000 --against $OUT/generate-gpu.json --out $OUT/generate-gpu-pytorch.json; echo "pt2 rc=$?"
timeout $(left) $P --compile --prompt "fn main() {" --count 500 --against $OUT/generate-gpu.json --out $OUT/generate-gpu-pytorch.json; echo "pt3 rc=$?"
timeout $(left) $P --compile --prompt "fn main() {" --prompt-len 1024 --count 1000 --against $OUT/generate-gpu.json --out $OUT/generate-gpu-pytorch.json; echo "pt4 rc=$?"
el done
} > $OUT/runB.log 2>&1
