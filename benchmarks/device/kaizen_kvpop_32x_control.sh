#!/usr/bin/env bash
# Issue #11, 32x: does training under 4-bit keys cost a KVpop student recall, or do fewer steps? (docs/DESIGN.md
# section 8, "Composition with KVpop, measured"). One device call, about 9-10 minutes on one H200 (planned; session
# 23 ran PARTS="shipped b4" on nvidia-h200-x2 in 346 s, results/raw/README.md; STEPS=1000 leaves margin under the
# 10-minute limit):
# three benchmarks/device/retrofit.sh runs side by side, each evaluated as it serves, kaizen+kvpop at TARGET (default
# 32: b4 x keep 1/8) on both splits, and under each part alone on the eval split (DECOMPOSE=1: dense, kvpop at 512,
# kaizen_static at TARGET x 512 / 4096):
#   - two retrofits on the same STEPS (default 1300), budget 512, peak target, lr 1e-4: one in full precision (TAG fp)
#     and one under --kv-bits 4 (TAG b4), files under $OUT/fp and $OUT/b4;
#   - the shipped student (checkpoints/testbed-kvpop: Table 1's MLP student, trained at budget 512 in full precision),
#     not retrained (STUDENT=), files under $OUT/shipped.
# PARTS (default "fp b4 shipped") runs some of them; with several GPUs the parts go round robin over them.
# Device files: at most 8 come back, so each folder is tarred ($OUT/fp.tgz, $OUT/b4.tgz, $OUT/shipped.tgz).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kaizen_kvpop_32x_control.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
TARGET=${TARGET:-32}; STEPS=${STEPS:-1300}; N=${N:-100}
echo "commit=${KVLEARN_COMMIT:-?} target=$TARGET steps=$STEPS"
EXTRA_COMMON='--lr 1e-4 --decay-init 0.99999 --target-reduction peak'
PARTS=${PARTS:-fp b4 shipped}
gpus=$(python3 -c 'import torch; print(max(torch.cuda.device_count(), 1))')
i=0
for part in $PARTS; do  # each part on the next GPU (round robin): on two GPUs fp and shipped share cuda:0, b4 has cuda:1
    gpu=$((i % gpus)); i=$((i + 1))
    case $part in
        fp) env=(STEPS="$STEPS" EXTRA="$EXTRA_COMMON") ;;
        b4) env=(STEPS="$STEPS" EXTRA="$EXTRA_COMMON --kv-bits 4") ;;
        # no training: the shipped student (the GPU has room beside a retrofit: the runs are launch-bound)
        shipped) env=(STUDENT=checkpoints/testbed-kvpop) ;;
        *) echo "unknown part $part: expected fp, b4 or shipped"; exit 1 ;;
    esac
    env "${env[@]}" CUDA_VISIBLE_DEVICES=$gpu OUT="$OUT/$part" BUDGET=512 COMPOSE_TARGET=$TARGET DECOMPOSE=1 TAG=$part \
        N=$N bash benchmarks/device/retrofit.sh > "$OUT/$part.log" 2>&1 &
done
wait
for d in $PARTS; do tail -n 20 "$OUT/$d.log"; done
for d in $PARTS; do  # thin the retrofit logs' progress lines, then one archive per folder
    for f in "$OUT/$d"/*.log; do [ -f "$f" ] && tr '\r' '\n' < "$f" | awk '!/step\/s|it\/s/ || NR % 100 == 0' > "$f.t" && mv "$f.t" "$f"; done
    rm -f "$OUT/$d"/*.tar
    tar czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -r "${OUT:?}/$d"
done
ls -la "$OUT"
