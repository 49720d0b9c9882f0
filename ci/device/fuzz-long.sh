#!/usr/bin/env bash
# Long fuzz runs on the device machine's 16 cores (issue 16): every cargo-fuzz target, its
# binary built here (`cargo fuzz build` in protocol/ and vgpu-backend/, stripped, carried
# in .devbin/fuzz with the seed corpora), run with libFuzzer's fork mode for SECS seconds
# with WORKERS worker processes each, all targets at once. Prints each target's last
# status line (total executions, coverage, corpus) and any crash.
#   WORKERS="virtqueue=3 session=3 ..." SECS=560 ci/device/fuzz-long.sh
set -u
F=$(pwd)/.devbin/fuzz
O=${OUT:-/tmp/out}
SECS=${SECS:-560}
mkdir -p "$O"
pids=()
for tw in $WORKERS; do
  t=${tw%=*}; w=${tw#*=}
  c=/tmp/corpus/$t; mkdir -p $c "$O/crash-$t"
  [ -d $F/corpus/$t ] && cp -r $F/corpus/$t/. $c/ 2>/dev/null
  ( cd "$O/crash-$t" && timeout $((SECS + 30)) $F/$t -fork=$w -max_total_time=$SECS -rss_limit_mb=2048 \
      -ignore_crashes=0 $c > "$O/fuzz-$t.log" 2>&1 ) &
  pids+=($!)
done 2>/dev/null
wait
for tw in $WORKERS; do
  t=${tw%=*}; w=${tw#*=}
  echo "$t workers=$w secs=$SECS: $(grep -E '^#[0-9]+' "$O/fuzz-$t.log" | tail -1)"
  grep -E "ERROR|panicked|deadly|SUMMARY" "$O/fuzz-$t.log" | head -3
  ls "$O/crash-$t" | head -3
done
