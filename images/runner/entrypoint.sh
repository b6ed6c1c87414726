#!/bin/sh
# The runner image's entrypoint: raise RLIMIT_NOFILE's soft limit to the hard limit
# (engines often start containers at a soft limit of 1024; the runner holds pipes,
# cgroup and workspace descriptors per job), make the container's own cgroups
# writable when it may, then become sandcell-runner on 0.0.0.0:8080.
# Everything else is configured by SANDCELL_* variables (the runner's config.py);
# SANDCELL_RUNNER_TOKEN is required and never printed.
set -eu

ulimit -n "$(ulimit -Hn)" 2>/dev/null || echo "entrypoint: could not raise RLIMIT_NOFILE" >&2

# Engines mount the container's own cgroup (cgroup v1: one directory per controller)
# read-only. Holding CAP_SYS_ADMIN, which nsjail needs anyway, we remount memory,
# pids and cpu read-write so the runner can nest one cgroup per job under the
# container's, tell an OOM kill from a timeout and bound a session's CPU. Only this container's subtree is mounted
# there, so nothing of the host's hierarchy becomes writable. Without the
# capability the remount fails quietly and the runner falls back to rlimits
# (its /health says so).
for controller in memory pids cpu; do
    # cpu is usually a link to the joint cpu,cpuacct mount.
    dir=$(readlink -f "/sys/fs/cgroup/$controller" 2>/dev/null) || continue
    options=$(awk -v dir="$dir" '$5 == dir { print $6 }' /proc/self/mountinfo)
    case ",$options," in
        *,ro,*) mount -o remount,rw,bind "$dir" 2>/dev/null || true ;;
    esac
done

export SANDCELL_RUNNER_HOST="${SANDCELL_RUNNER_HOST:-0.0.0.0}"
export SANDCELL_RUNNER_PORT="${SANDCELL_RUNNER_PORT:-8080}"

# MicroVM images get the runner's token from the run hook, never from the image:
# they start the hook listener, which starts the runner once the token arrives.
if [ "${SANDCELL_RUNNER_VIA_HOOK:-0}" = 1 ]; then
    exec /opt/sandcell/bin/python -m sandcell_runner.microvm_hook "$@"
fi

exec /opt/sandcell/bin/sandcell-runner "$@"
