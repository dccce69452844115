# Shared by the benchmarks/gpu_*.sh device scripts (sourced, not run): `step NAME TIMEOUT CMD...` runs one step
# under its own timeout, its output in $out/NAME.log, and prints its exit status, its seconds and the log lines
# matching $STEP_SUMMARY (an extended regular expression the script sets) plus errors and test counts.
step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "== $name rc=$rc $((SECONDS - t0)) s"
    grep -E "^(${STEP_SUMMARY:-Traceback})|^(Traceback|RuntimeError|.*Error:|FAILED|ERROR)|passed|failed" \
        "$out/$name.log" | tail -40
}
