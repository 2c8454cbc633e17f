#!/usr/bin/env bash
# The chapter's generation measurements again, with the step as one graph: GPT-2 small's
# shape trained for minutes as ../generate-gpu/run.sh trains it, then generate (graphs, by
# launches, without the cache) and PyTorch's static cache, eager and compiled, in one call.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
export BENCH_COMMIT=${BENCH_COMMIT:?the commit the packed binaries were built from}
t0=$(date +%s); left() { echo $(( ${LIMIT:-570} - ($(date +%s) - t0) )); }; el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{
el unpack
tar -xJf $C/gpu.tar.xz; xz -dc $C/corpus.tokens.xz > /tmp/corpus.tokens
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
el train
$X/bin/step05-train train --device cuda --model gpt2 --batch 12 --steps 4000 --warmup 100 --lr 6e-4 \
  --attention hopper --max-seconds 200 --eval-every 600 --eval-batches 8 --print-every 400 \
  --data /tmp/corpus.tokens --out $OUT/generate-gpu-train.json --save /tmp/gpt2.safetensors 2>&1 | tail -n 20; echo "train rc=$?"
el generate
G="--device cuda --checkpoint /tmp/gpt2.safetensors --runs 5"
P="python3 steps/08-inference/peers/generate_pytorch.py --checkpoint /tmp/gpt2.safetensors --runs 5"
$X/bin/generate $G --temperature 0 --prompt "fn main() {" --count 500 --out $OUT/generate-gpu.json | tail -n 8; echo "gen1 rc=$?"
$X/bin/generate $G --temperature 0 --prompt "fn main() {" --prompt-len 1024 --count 1000 --out $OUT/generate-gpu.json | tail -n 8; echo "gen2 rc=$?"
for pr in "impl fmt::Display for " "pub fn new("; do $X/bin/generate --device cuda --checkpoint /tmp/gpt2.safetensors --temperature 0 --prompt "$pr" --count 300 | head -n 12; echo "gen rc=$?"; done
el peers
timeout $(left) $P --compile --prompt "fn main() {" --count 500 --against $OUT/generate-gpu.json --out $OUT/generate-gpu-pytorch.json | tail -n 3; echo "pt1 rc=$?"
timeout $(left) $P --compile --prompt "fn main() {" --prompt-len 1024 --count 1000 --against $OUT/generate-gpu.json --out $OUT/generate-gpu-pytorch.json | tail -n 3; echo "pt2 rc=$?"
timeout $(left) $P --prompt "fn main() {" --count 500 --against $OUT/generate-gpu.json --out $OUT/generate-gpu-pytorch.json | tail -n 3; echo "pt3 rc=$?"
timeout $(left) $P --prompt "fn main() {" --prompt-len 1024 --count 1000 --against $OUT/generate-gpu.json --out $OUT/generate-gpu-pytorch.json | tail -n 3; echo "pt4 rc=$?"
el done
} > $OUT/run-trained.log 2>&1
tail -n 120 $OUT/run-trained.log | cut -c1-400
