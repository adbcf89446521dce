# Sourced by scripts/test.sh and scripts/check.sh: run_jobs, the one way they run jobs side by
# side. The caller sets LOGS (a scratch folder), LABEL (the prefix of every line printed, e.g.
# "make test") and FAILED (an array).
#
# run_jobs SLOTS NAME COMMAND [NAME COMMAND ...]: runs the commands (bash command lines) in
# order, at most SLOTS at once (the next starts as soon as one ends), each into $LOGS/NAME.log;
# prints each log whole as its command ends (two jobs' lines never interleave); appends the
# NAMEs of the commands that failed to FAILED.
run_jobs() {
    local slots=$1
    shift
    local -A names=()
    local pid rc t0=$SECONDS
    while [ $# -gt 1 ] || [ ${#names[@]} -gt 0 ]; do
        if [ $# -gt 1 ] && [ ${#names[@]} -lt "$slots" ]; then
            bash -c "$2" >"$LOGS/$1.log" 2>&1 &
            names[$!]=$1
            echo "$LABEL: $1 (at $((SECONDS - t0)) s): $2"
            shift 2
            continue
        fi
        wait -n -p pid "${!names[@]}"
        rc=$?
        echo "===== $LABEL: ${names[$pid]} ended with exit status $rc after $((SECONDS - t0)) s ====="
        cat "$LOGS/${names[$pid]}.log"
        [ "$rc" -eq 0 ] || FAILED+=("${names[$pid]}")
        unset "names[$pid]"
    done
}
