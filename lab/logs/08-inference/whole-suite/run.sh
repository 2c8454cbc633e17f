#!/usr/bin/env bash
# Every packed test binary of the workspace on one GPU, ignored (GPU) tests included and the
# tests that need two GPUs skipped (`--skip two_gpus`), each from its package folder; step
# 08's first. `.gpu-exp/gpu.tar.xz` is the whole of `.gpu/` as `../shared/gpu/pack` left it.
set -o pipefail
R=$(pwd); X=$R/.gpu; C=$R/.gpu-exp
t0=$(date +%s); left() { echo $(( ${LIMIT:-580} - ($(date +%s) - t0) )); }; el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
{
el unpack
tar -xJf $C/gpu.tar.xz
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
failed=0
for pass in 08-inference other; do
  while IFS=$'\t' read -r name pkg; do
    case $pkg in *08-inference) [ $pass = 08-inference ] || continue ;; *) [ $pass = other ] || continue ;; esac
    [ "$(left)" -gt 5 ] || { echo "== $pkg :: $name: not run, no time left"; failed=1; continue; }
    el "$pkg :: $name"
    (cd "$R/$pkg" && timeout $(left) "$X/tests/$name" --include-ignored --skip two_gpus 2>&1 \
      | grep -E "^test result|FAILED|panicked|^failures:" | head -n 20)
    rc=$?; [ $rc = 0 ] || { echo "rc=$rc"; failed=1; }
  done < $X/tests/INDEX
done
el "done, failed=$failed"
} > $OUT/run.log 2>&1
cut -c1-220 $OUT/run.log | tail -n 200
