#!/usr/bin/env bash
# Make the Docker backend of 02-sandbox testable: install the engine, start it, build the image.
#
#   .ci/docker.sh          run by .ci/run before `make test-all`; idempotent, about 1 s when all is there
#
# It never fails the CI: when Docker cannot be made to work it says why and exits 0, and the
# docker tests then skip with their own reason. The dockerd it starts keeps running after it
# exits (its pid is in $DOCKERD_PIDFILE) so that the tests can reach it.
set -u
cd "$(dirname "$0")/.."

image=${SANDBOX_IMAGE:-tool-rl-lab-sandbox:latest}
pidfile=${DOCKERD_PIDFILE:-/tmp/tool-rl-lab-dockerd.pid}
log=${DOCKERD_LOG:-/tmp/tool-rl-lab-dockerd.log}
t0=$SECONDS

say() { echo "docker.sh: $*"; }
give_up() { say "$* -- the docker tests will be skipped"; exit 0; }
engine_up() { timeout 10 docker info >/dev/null 2>&1; }

if engine_up && docker image inspect "$image" >/dev/null 2>&1; then
    say "engine up and $image present (${SECONDS}s)"
    exit 0
fi

# 1. Install. Debian's docker.io brings dockerd, containerd and runc; debootstrap builds the image.
if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    [[ $(id -u) == 0 ]] || give_up "dockerd or debootstrap missing and not root, cannot install them"
    command -v apt-get >/dev/null || give_up "dockerd or debootstrap missing and no apt-get"
    say "installing docker.io and debootstrap"
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -qq >/tmp/tool-rl-lab-apt.log 2>&1 \
        && timeout 600 apt-get install -y -qq --no-install-recommends docker.io debootstrap >>/tmp/tool-rl-lab-apt.log 2>&1 \
        || give_up "apt-get failed (see /tmp/tool-rl-lab-apt.log)"
fi

# 2. Start the engine unless one answers already.
start_dockerd() {  # args: extra dockerd flags
    nohup dockerd "$@" >"$log" 2>&1 &
    echo $! >"$pidfile"
    for _ in $(seq 60); do
        engine_up && return 0
        kill -0 "$(cat "$pidfile")" 2>/dev/null || return 1
        sleep 0.5
    done
    return 1
}
stop_ours() {
    local pid; pid=$(cat "$pidfile" 2>/dev/null) || return 0
    kill "$pid" 2>/dev/null; for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    rm -f "$pidfile"
}
running=$(cat /var/run/docker.pid 2>/dev/null)
if ! engine_up && [[ -n "$running" ]] && kill -0 "$running" 2>/dev/null; then
    # One engine per machine: never start a second one beside it, give it time instead.
    say "dockerd (pid $running) is running but does not answer yet; waiting up to 30 s"
    for _ in $(seq 30); do engine_up && break; sleep 1; done
    engine_up || give_up "dockerd (pid $running) does not answer on ${DOCKER_HOST:-the default socket}"
fi
if ! engine_up; then
    [[ $(id -u) == 0 ]] || give_up "no engine answers and only root can start dockerd"
    say "starting dockerd (log: $log)"
    if ! start_dockerd; then
        # Kernels without netfilter (many CI sandboxes) make the default bridge network fail.
        # The sandbox only ever runs containers with network_mode=none, so it needs no bridge.
        say "dockerd did not come up with defaults ($(tail -1 "$log")); retrying without iptables and bridge"
        stop_ours
        start_dockerd --iptables=false --ip6tables=false --bridge=none \
            || { stop_ours; give_up "dockerd does not start: $(tail -1 "$log")"; }
    fi
    say "dockerd running, pid $(cat "$pidfile")"
fi

# 3. Build the image from a locally made root file system (no registry is needed).
if ! docker image inspect "$image" >/dev/null 2>&1; then
    say "building $image"
    timeout 900 02-sandbox/build_image.sh "$image" || give_up "image build failed"
fi
say "ready in $((SECONDS - t0))s"
exit 0
