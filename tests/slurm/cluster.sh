#!/usr/bin/env bash
# A real two-node Slurm cluster on this machine, for tests (Debian's slurm-wlm 22.05 and munge).
#   tests/slurm/cluster.sh install   # apt-get the packages if missing (root)
#   tests/slurm/cluster.sh up        # start it; safe to repeat
#   tests/slurm/cluster.sh status    # sinfo, squeue, daemons; exit 0 when both nodes are usable
#   tests/slurm/cluster.sh down      # stop and remove everything, also from a half-done up
# What up builds: munged; slurmctld on the host; bridge titanbr0 (10.77.0.1/24); two network
# namespaces titan-n1, titan-n2, each with a veth named eth0 (10.77.0.11, 10.77.0.12), its own
# hostname (a UTS namespace, so `hostname --ip-address` gives the node's address as on a real
# cluster) and one slurmd; /etc/hosts entries for both names; /etc/slurm/{slurm,cgroup}.conf.
# Logs and spool: /var/lib/titan-slurm. Exit code 3: this machine cannot run the cluster (not
# root, packages missing, no network namespaces); tests skip on it.
set -euo pipefail

STATE=/var/lib/titan-slurm
CONF=/etc/slurm/slurm.conf
CGROUP_CONF=/etc/slurm/cgroup.conf
MARK="# titan-slurm"  # on every line (/etc/hosts) and file (/etc/slurm) this script writes
BRIDGE=titanbr0
HOST_ADDR=10.77.0.1
NODES=(titan-n1 titan-n2)
declare -A ADDR=([titan-n1]=10.77.0.11 [titan-n2]=10.77.0.12)
PACKAGES=(slurm-wlm munge)
UP_TIMEOUT=60

die() { echo "cluster.sh: $*" >&2; exit 1; }
unsupported() { echo "cluster.sh: $*" >&2; exit 3; }

# Whether pid file $1 names a running $2 (a stale file's pid may be another program's now).
alive() { [ -f "$1" ] && [ "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" = "$2" ]; }

# Sends TERM to the pids, KILL to those alive 5 s later (slurmstepd ignores TERM), and returns
# when all are gone.
stop_pids() {
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for i in $(seq 100); do
    [ "$i" = 50 ] && { kill -KILL "$@" 2>/dev/null || true; }
    local left=0
    for pid in "$@"; do
      # A zombie (state Z) is gone for our purpose; its parent may be one of the others.
      [ -d "/proc/$pid" ] && [ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ] && left=1
    done
    [ "$left" = 0 ] && return 0
    sleep 0.1
  done
  echo "cluster.sh: still running after KILL: $*" >&2
}

preflight() {
  [ "$(id -u)" = 0 ] || unsupported "needs root (network namespaces, daemons as root)"
  local missing=()
  for bin in munged slurmctld slurmd sbatch ip unshare; do
    command -v "$bin" >/dev/null || missing+=("$bin")
  done
  [ ${#missing[@]} = 0 ] ||
    unsupported "missing ${missing[*]}: run 'tests/slurm/cluster.sh install' (apt-get ${PACKAGES[*]})"
  unshare --net --uts true 2>/dev/null || unsupported "cannot create network/UTS namespaces here"
}

cmd_install() {
  [ "$(id -u)" = 0 ] || unsupported "install needs root"
  local installed
  installed=$(dpkg-query -W -f='${Status}\n' "${PACKAGES[@]}" 2>/dev/null | grep -c "ok installed" || true)
  if [ "$installed" != ${#PACKAGES[@]} ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      "${PACKAGES[@]}" >/dev/null
  fi
  echo "installed: $(slurmd -V), munge $(dpkg-query -W -f='${Version}' munge)"
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    return 0  # a munged is already serving (ours from an earlier up, or the system's)
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    install -d -o munge -g munge -m 700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key
  chmod 400 /etc/munge/munge.key
  install -d -o munge -g munge -m 755 /run/munge
  runuser -u munge -- munged || die "munged did not start; see /var/log/munge/munged.log"
  touch "$STATE/munged.ours"  # so down stops this munged and not a system one
}

netns_exists() { [ -e "/run/netns/$1" ]; }

start_network() {
  ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
  ip addr replace "$HOST_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for node in "${NODES[@]}"; do
    netns_exists "$node" || ip netns add "$node"
    ip link show "veth-$node" >/dev/null 2>&1 ||
      ip link add "veth-$node" type veth peer name eth0 netns "$node"
    ip link set "veth-$node" master "$BRIDGE" up
    ip -n "$node" link set lo up
    ip -n "$node" addr replace "${ADDR[$node]}/24" dev eth0
    ip -n "$node" link set eth0 up
    ip -n "$node" route replace default via "$HOST_ADDR"
    # `ip netns exec` mounts this over /etc/resolv.conf: the host's DNS server is unreachable
    # from the namespace, and c10d's reverse lookups would wait 10 s for it on every connect.
    mkdir -p "/etc/netns/$node"
    printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' >"/etc/netns/$node/resolv.conf"
  done
}

# Rewrites a shared file in place (it may be a bind mount, as /etc/hosts is in containers).
remove_marked_lines() {
  [ -f "$1" ] || return 0
  local kept
  kept=$(grep -v -- "$MARK\$" "$1" || true)
  printf '%s\n' "$kept" >"$1"
}

write_hosts() {
  remove_marked_lines /etc/hosts
  for node in "${NODES[@]}"; do
    echo "${ADDR[$node]} $node $MARK" >>/etc/hosts
  done
}

ours() { [ -f "$1" ] && grep -q "^$MARK" "$1"; }

write_conf() {
  for file in "$CONF" "$CGROUP_CONF"; do
    [ ! -f "$file" ] || ours "$file" ||
      die "$file exists and was not written by this script; move it away first"
  done
  mkdir -p "$(dirname "$CONF")"
  # slurmd 22.05 always loads a cgroup plugin; naming v1 skips its autodetection, which fails
  # where no cgroup fs is mounted (under `ip netns exec`). No cgroup is used (proctrack/linuxproc).
  printf '%s\nCgroupPlugin=cgroup/v1\n' "$MARK: written by tests/slurm/cluster.sh" >"$CGROUP_CONF"
  # Boards, sockets, cores, threads as slurmd detects them, so it registers without complaint.
  local hardware
  hardware=$(slurmd -C | grep -o 'CPUs=.*ThreadsPerCore=[0-9]*')
  # No cgroups (containers), no accounting daemon: finished jobs stay in `scontrol show job`
  # for MinJobAge (a day) instead of sacct. config_overrides: both nodes are this machine.
  # A requeued job may start again cred_expire + 1 s later (default 121 s), found by the next
  # scheduling pass (default every 60 s): both short here so requeue tests take seconds.
  local conf
  conf=$(cat <<EOF
$MARK: written by tests/slurm/cluster.sh up, removed by its down
ClusterName=titan
SlurmctldHost=$(hostname -s)($HOST_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdSpoolDir=$STATE/%n
SlurmdPidFile=$STATE/%n/slurmd.pid
SlurmdLogFile=$STATE/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=86400
SchedulerParameters=sched_interval=1,bf_interval=1
KillWait=5
NodeName=titan-n1 NodeAddr=${ADDR[titan-n1]} $hardware State=UNKNOWN
NodeName=titan-n2 NodeAddr=${ADDR[titan-n2]} $hardware State=UNKNOWN
PartitionName=titan Nodes=titan-n1,titan-n2 Default=YES MaxTime=INFINITE State=UP
EOF
)
  if alive "$STATE/slurmctld.pid" slurmctld && [ "$conf" != "$(cat "$CONF" 2>/dev/null)" ]; then
    die "the cluster runs with another $CONF: run 'tests/slurm/cluster.sh down' first"
  fi
  printf '%s\n' "$conf" >"$CONF"
}

start_daemons() {
  alive "$STATE/slurmctld.pid" slurmctld || slurmctld || die "slurmctld did not start; see $STATE/slurmctld.log"
  for node in "${NODES[@]}"; do
    alive "$STATE/$node/slurmd.pid" slurmd && continue
    install -d -m 755 "$STATE/$node"
    # Own UTS namespace: hostname is the node name, which resolves to the node's address.
    ip netns exec "$node" unshare --uts -- \
      sh -c 'hostname "$1" && exec slurmd -N "$1"' sh "$node" ||
      die "slurmd on $node did not start; see $STATE/$node/slurmd.log"
  done
}

wait_idle() {
  local states
  for _ in $(seq $((UP_TIMEOUT * 2))); do
    states=$(sinfo -h -N -o '%N %t' 2>/dev/null || true)
    [ "$(grep -c ' idle$' <<<"$states")" = ${#NODES[@]} ] && return 0
    sleep 0.5
  done
  die "nodes not idle after ${UP_TIMEOUT}s (sinfo: ${states:-no answer}); see" \
    "$STATE/slurmctld.log and $STATE/<node>/slurmd.log"
}

cmd_up() {
  preflight
  local start=$SECONDS
  install -d -m 755 "$STATE" "$STATE/ctld"
  start_munge
  start_network
  write_hosts
  write_conf
  start_daemons
  wait_idle
  echo "up in $((SECONDS - start))s: nodes ${NODES[*]} idle; logs in $STATE"
}

cmd_down() {
  [ "$(id -u)" = 0 ] || unsupported "down needs root"
  local start=$SECONDS pids=()
  alive "$STATE/slurmctld.pid" slurmctld && pids+=("$(cat "$STATE/slurmctld.pid")")
  if [ -f "$STATE/munged.ours" ] && alive /run/munge/munged.pid munged; then
    pids+=("$(cat /run/munge/munged.pid)")
  fi
  for node in "${NODES[@]}"; do
    # Every process in the namespace is ours: its slurmd, slurmstepds and job processes.
    netns_exists "$node" && mapfile -t -O ${#pids[@]} pids < <(ip netns pids "$node")
  done
  stop_pids "${pids[@]}"  # all at once: each daemon takes ~2 s to exit
  for node in "${NODES[@]}"; do
    if netns_exists "$node"; then ip netns del "$node"; fi
  done
  for node in "${NODES[@]}"; do
    ip link del "veth-$node" 2>/dev/null || true
    rm -rf "/etc/netns/$node"
  done
  rmdir /etc/netns 2>/dev/null || true
  ip link del "$BRIDGE" 2>/dev/null || true
  remove_marked_lines /etc/hosts
  for file in "$CONF" "$CGROUP_CONF"; do
    if ours "$file"; then rm -f "$file"; fi
  done
  rm -rf "$STATE"
  echo "down in $((SECONDS - start))s"
}

cmd_status() {
  local ok=0
  echo "slurmctld: $(alive "$STATE/slurmctld.pid" slurmctld && cat "$STATE/slurmctld.pid" || echo stopped)"
  for node in "${NODES[@]}"; do
    echo "$node: netns $(netns_exists "$node" && echo present || echo absent)," \
      "slurmd $(alive "$STATE/$node/slurmd.pid" slurmd && cat "$STATE/$node/slurmd.pid" || echo stopped)"
    netns_exists "$node" && alive "$STATE/$node/slurmd.pid" slurmd || ok=1
  done
  if alive "$STATE/slurmctld.pid" slurmctld && sinfo -N 2>/dev/null; then
    squeue
    [ "$(sinfo -h -N -o '%t' | grep -cE '^(idle|alloc|mix)$')" = ${#NODES[@]} ] || ok=1
  else
    ok=1
  fi
  return $ok
}

case "${1:-}" in
  install) cmd_install ;;
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  *) die "usage: $0 install|up|down|status" ;;
esac
