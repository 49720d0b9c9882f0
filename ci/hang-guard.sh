#!/usr/bin/env bash
# hang-guard.sh SECONDS COMMAND...: runs COMMAND; if it is still running after SECONDS,
# prints every thread's stack of each process under it (gdb where it can attach, the
# kernel's wait channel otherwise) and kills the lot, so a hung test fails CI in minutes
# with the stacks that say why, instead of using up CI's whole time limit in silence.
set -uo pipefail
limit="$1"
shift
setsid "$@" &
pid=$!
deadline=$((SECONDS + limit))
while kill -0 "$pid" 2>/dev/null; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "hang-guard: '$*' still running after $limit s; the stacks of its processes:"
        for p in $(pgrep -s "$pid"); do
            echo "--- pid $p: $(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | cut -c1-200)"
            if command -v gdb >/dev/null; then
                timeout 60 gdb -p "$p" -batch -nx -ex 'thread apply all bt 30' 2>/dev/null |
                    grep -E '^(Thread|#)' | head -400
            fi
            for t in /proc/"$p"/task/*; do
                echo "    task ${t##*/} $(cat "$t/comm" 2>/dev/null) wchan=$(cat "$t/wchan" 2>/dev/null)"
            done
        done
        kill -KILL -- "-$pid" 2>/dev/null
        wait "$pid" 2>/dev/null
        echo "hang-guard: killed after $limit s"
        exit 124
    fi
    sleep 2
done
wait "$pid"
