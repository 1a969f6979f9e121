#!/usr/bin/env bash
# Runs the README's test command PASSES times in a row (default 3) on a fresh clone of one commit
# while two busy processes (`python3 -c "while True: pass"`, one per core of a 2-core machine)
# run beside it: how a shared, noisy CI machine looks to the suite. Stops at the first red pass.
#   bash scripts/suite_under_load.sh [PASSES] [COMMIT] [WORKDIR]
# Each pass's output, with every test's outcome as it ends and its duration (which tests a
# loaded machine stretches), goes to WORKDIR/passK.log, one summary line per pass to
# WORKDIR/summary, the load average and CPU pressure once a minute to WORKDIR/loadlog, and every
# process's session, niceness, state and CPU time so far once a minute to WORKDIR/pslog (which
# process starved, when a test timed out waiting on one). The clone uses this
# checkout's .venv (a link), so the passes measure the tests, not the install.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
passes=${1:-3}
commit=$(git -C "$root" rev-parse "${2:-HEAD}")
work=${3:-/tmp/suite-under-load}
mkdir -p "$work"
busy=()
cleanup() {
    kill "${busy[@]}" "${loadlog_pid:-}" 2>/dev/null
    wait 2>/dev/null
}
trap cleanup EXIT
for _ in 1 2; do
    python3 -c "while True: pass" &
    busy+=($!)
done
(while true; do
    echo "$(date +%T) $(cut -d' ' -f1-3 /proc/loadavg) cpu-pressure $(head -1 /proc/pressure/cpu 2>/dev/null)"
    echo "=== $(date +%T)" >> "$work/pslog"
    ps -eo pid,ppid,sid,ni,stat,time,etime,args --sort=-time | cut -c1-180 >> "$work/pslog"
    sleep 60
done) >> "$work/loadlog" &
loadlog_pid=$!
echo "$(date +%T) commit $commit, $passes passes, busy pids ${busy[*]}" >> "$work/summary"
for pass in $(seq 1 "$passes"); do
    clone="$work/clone"
    rm -rf "$clone"
    git clone -q "$root" "$clone" && git -C "$clone" checkout -q "$commit"
    ln -s "$root/.venv" "$clone/.venv"
    # Older than the environment's install stamp: setup.sh must not re-point the editable install.
    touch -d 2000-01-01 "$clone/pyproject.toml"
    started=$(date +%s)
    # -vv (one -v only cancels the README command's -q): each test's outcome is written as it
    # ends, so a failure is known (and can be chased) while the pass still runs; xdist's quiet
    # output names failures only once the pass is over.
    (cd "$clone" && bash scripts/test.sh -vv --durations=0) > "$work/pass$pass.log" 2>&1
    rc=$?
    result=$(grep -E "(passed|failed|error).* in [0-9.]+s" "$work/pass$pass.log" | tail -1)
    echo "$(date +%T) pass $pass rc=$rc wall=$(( $(date +%s) - started ))s $result" >> "$work/summary"
    [ "$rc" -eq 0 ] || exit "$rc"
done
