#!/usr/bin/env bash
# Write a containers.conf for podman on machines where its defaults cannot start a
# container, and print its path; use it with
#
#   export CONTAINERS_CONF="$(deploy/container/podman-conf.sh /tmp/kvgate-podman.conf)"
#
# Two defaults fail inside some sandboxes and CI runners (found with Debian's podman 4.3
# as root):
# - crun refuses a hybrid cgroup v1/v2 layout; runc runs there (apt-get install runc);
# - podman raises each container's open-files and process limits to values above the
#   current hard limits, which needs CAP_SYS_RESOURCE; asking for the hard limits
#   themselves (nofile: `ulimit -Hn`, nproc: the kernel's pid_max) needs nothing.
# On an ordinary machine neither is needed, and this file changes nothing that matters.
set -euo pipefail

out="${1:-${TMPDIR:-/tmp}/kvgate-containers.conf}"
nofile="$(ulimit -Hn)"
nproc="$(cat /proc/sys/kernel/pid_max)"
cat >"$out" <<EOF
# Written by kvgate's deploy/container/podman-conf.sh.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
EOF
echo "$out"
