#!/bin/sh
# Save and restore of one named session holding a SIZE buffer (sim backend),
# against dd writing (with fsync) and reading the same bytes on the same disk.
# Usage: tools/state-bench.sh build/tools/salusd [SIZE]   (root: drops caches)
# BACKEND=cuda runs it on the machine's GPU 0 (process isolation) instead.
set -eu
SALUSD=$1; SIZE=${2:-1G}; T=$(mktemp -d /tmp/salus-saverestore-XXXXXX)
if [ "${BACKEND:-sim}" = cuda ]; then B="--backend cuda"; else B="--backend sim --sim-gpus 1 --sim-memory 4G"; fi
M=$T/mnt; mkdir $M
P=
trap '[ -n "$P" ] && kill $P 2>/dev/null; sleep 0.5; fusermount3 -u -z $M 2>/dev/null || true; rm -rf $T' EXIT
head -c $SIZE /dev/urandom > $T/src
$SALUSD $B --mount $M --state-dir $T/state > $T/log1 2>&1 & P=$!
for i in $(seq 1200); do [ -e $M/version ] && break; sleep 0.05; done
mkdir $M/sessions/big
echo "need persistent=$SIZE ephemeral=1M" > $M/sessions/big/ctl
echo "alloc w $SIZE" > $M/sessions/big/ctl
printf "upload w file:$T/src $SIZE\nsync\n" > $M/sessions/big/ctl
kill -TERM $P; wait $P; P=
grep -E "state: (saving|saved)" $T/log1
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
$SALUSD $B --mount $M --state-dir $T/state > $T/log2 2>&1 & P=$!
for i in $(seq 2000); do [ -e $M/version ] && break; sleep 0.05; done
grep -E "state: restor" $T/log2
cmp $M/sessions/big/mem/w $T/src && echo "restored bytes match"
kill -TERM $P; wait $P; P=
sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
echo "baseline dd write+fsync:"; dd if=$T/src of=$T/copy bs=8M conv=fsync 2>&1 | tail -1
echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
echo "baseline dd read:"; dd if=$T/copy of=/dev/null bs=8M 2>&1 | tail -1
