#!/usr/bin/env bash
# Runs an MPI job across two (or more) "nodes" built from network namespaces on this machine, so
# that multi-node behaviour (a slow link between nodes, shared memory inside a node) can be measured
# without a second machine. Needs root (ip netns, tc). See docs/comm.md, "Two nodes on one machine".
#
# usage: bench/two_nodes.sh [options] [--] PROGRAM [ARGS...]
#   -n, --nodes N        number of namespaces ("nodes"), default 2 (NODES)
#   -p, --per-node P     ranks per node, default 1 (PER_NODE)
#   -r, --rate RATE      shape each node's link with tc tbf, e.g. 1gbit, 100mbit (RATE; default none)
#   -k, --keep           leave the namespaces up after the job (for debugging; remove them with
#                        bench/two_nodes.sh --cleanup)
#   --cleanup            remove namespaces left by a --keep run and exit
#   -x, --mpirun-arg A   extra mpirun argument (repeatable), e.g. -x "--mca btl_tcp_links 2"
# Environment: MPIRUN (default mpirun); every MESHTRAIN_* variable is passed to the ranks.
#
# Layout: node i is namespace mtnode<i> with address 10.99.0.<i+1>/24. Two nodes are joined by one
# veth pair; more nodes each get a veth into a bridge that lives in its own namespace (mtnodebr).
# Only these addresses are used, only inside these namespaces; everything is deleted on exit.
# mpirun runs in mtnode0; ranks on other nodes are started through a launch agent (instead of ssh)
# that runs the command under `ip netns exec mtnode<i>`. Each node also gets its own UTS namespace
# with hostname mtnode<i> (OpenMPI names shared-memory segments after the host). Ranks are placed by slot: ranks
# 0..P-1 on node 0, P..2P-1 on node 1, ...; ranks in one node talk over shared memory (vader),
# across nodes over TCP on the veth link.
#
# example:
#   sudo RATE=1gbit bench/two_nodes.sh -p 2 -- build/meshtrain bench comm --max-bytes 16M
set -euo pipefail

NODES=${NODES:-2}
PER_NODE=${PER_NODE:-1}
RATE=${RATE:-}
BURST=${BURST:-256kb}
MPIRUN=${MPIRUN:-mpirun}
KEEP=0
PREFIX=mtnode
SUBNET=10.99.0
EXTRA=()

cleanup_all() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    case "$ns" in "${PREFIX}"[0-9]* | "${PREFIX}br") ip netns del "$ns" 2>/dev/null || true ;; esac
  done
}

while [[ $# -gt 0 ]]; do
  case "$1" in
    -n | --nodes) NODES=$2; shift 2 ;;
    -p | --per-node) PER_NODE=$2; shift 2 ;;
    -r | --rate) RATE=$2; shift 2 ;;
    -k | --keep) KEEP=1; shift ;;
    -x | --mpirun-arg) read -r -a _a <<<"$2"; EXTRA+=("${_a[@]}"); shift 2 ;;
    --cleanup) cleanup_all; exit 0 ;;
    -h | --help) sed -n '2,30p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) echo "two_nodes.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "two_nodes.sh: no program given (see --help)" >&2; exit 2; }
[[ $EUID -eq 0 ]] || { echo "two_nodes.sh: needs root (network namespaces)" >&2; exit 1; }
[[ $NODES -ge 2 && $NODES -le 250 ]] || { echo "two_nodes.sh: --nodes must be 2..250" >&2; exit 2; }
command -v "$MPIRUN" >/dev/null || { echo "two_nodes.sh: $MPIRUN not found" >&2; exit 1; }

for ((i = 0; i < NODES; i++)); do
  if ip netns list | awk '{print $1}' | grep -qx "${PREFIX}$i"; then
    echo "two_nodes.sh: namespace ${PREFIX}$i already exists (a --keep run? use --cleanup)" >&2
    exit 1
  fi
done

WORK=$(mktemp -d /tmp/two_nodes.XXXXXX)
cleanup() {
  local rc=$?
  if [[ $KEEP -eq 0 ]]; then
    cleanup_all
    rm -rf "$WORK"
  else
    echo "two_nodes.sh: kept namespaces and $WORK (remove with --cleanup)" >&2
  fi
  exit $rc
}
trap cleanup EXIT INT TERM

addr() { echo "${SUBNET}.$(($1 + 1))"; }

shape() {  # shape NS DEV
  if [[ -n "$RATE" ]]; then
    ip netns exec "$1" tc qdisc add dev "$2" root tbf rate "$RATE" burst "$BURST" latency 50ms
  fi
}

for ((i = 0; i < NODES; i++)); do
  ip netns add "${PREFIX}$i"
  ip netns exec "${PREFIX}$i" ip link set lo up
done
if [[ $NODES -eq 2 ]]; then
  ip link add mt0 netns "${PREFIX}0" type veth peer name mt1 netns "${PREFIX}1"
  for i in 0 1; do
    ip netns exec "${PREFIX}$i" ip addr add "$(addr $i)/24" dev "mt$i"
    ip netns exec "${PREFIX}$i" ip link set "mt$i" up
    shape "${PREFIX}$i" "mt$i"
  done
else
  ip netns add "${PREFIX}br"
  ip netns exec "${PREFIX}br" ip link add br0 type bridge
  ip netns exec "${PREFIX}br" ip link set br0 up
  for ((i = 0; i < NODES; i++)); do
    ip link add "mt$i" netns "${PREFIX}$i" type veth peer name "port$i" netns "${PREFIX}br"
    ip netns exec "${PREFIX}br" ip link set "port$i" master br0
    ip netns exec "${PREFIX}br" ip link set "port$i" up
    ip netns exec "${PREFIX}$i" ip addr add "$(addr $i)/24" dev "mt$i"
    ip netns exec "${PREFIX}$i" ip link set "mt$i" up
    shape "${PREFIX}$i" "mt$i"
  done
fi

# Launch agent: mpirun calls it like ssh ("AGENT [options] HOST COMMAND...").
cat >"$WORK/agent.sh" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do case "\$1" in -*) shift ;; *) break ;; esac; done
host=\$1; shift
case "\$host" in
EOF
for ((i = 0; i < NODES; i++)); do
  echo "  $(addr $i)) ns=${PREFIX}$i ;;" >>"$WORK/agent.sh"
done
cat >>"$WORK/agent.sh" <<'EOF'
  *) echo "two_nodes agent: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns; $*"
EOF
# Node 0 (where mpirun itself runs) gets its own hostname the same way: OpenMPI names its
# shared-memory segments after the host name, so every "node" needs a distinct one.
cat >"$WORK/node0.sh" <<EOF
#!/bin/sh
hostname ${PREFIX}0
exec "\$@"
EOF
chmod +x "$WORK/node0.sh"
chmod +x "$WORK/agent.sh"

: >"$WORK/hosts"
for ((i = 0; i < NODES; i++)); do echo "$(addr $i) slots=$PER_NODE" >>"$WORK/hosts"; done

ENV_ARGS=(-x "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" -x "OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
while IFS= read -r name; do ENV_ARGS+=(-x "$name"); done < <(env | sed -n 's/^\(MESHTRAIN_[A-Za-z0-9_]*\)=.*/\1/p')

NP=$((NODES * PER_NODE))
CMD=("$MPIRUN" -np "$NP" --hostfile "$WORK/hosts" --map-by slot
  --mca plm_rsh_agent "$WORK/agent.sh"
  --mca btl self,vader,tcp --mca btl_tcp_if_include "${SUBNET}.0/24"
  --mca oob_tcp_if_include "${SUBNET}.0/24"
  --bind-to none --oversubscribe --mca mpi_yield_when_idle 1
  "${ENV_ARGS[@]}" "${EXTRA[@]}" "$@")
echo "two_nodes.sh: $NODES nodes x $PER_NODE ranks, link ${RATE:-unshaped}" >&2
echo "two_nodes.sh: ip netns exec ${PREFIX}0 ${CMD[*]}" >&2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
set +e
ip netns exec "${PREFIX}0" unshare --uts "$WORK/node0.sh" "${CMD[@]}"
rc=$?
set -e
if [[ -n "$RATE" ]]; then
  ip netns exec "${PREFIX}0" tc -s qdisc show dev mt0 | sed 's/^/two_nodes.sh: node0 qdisc: /' >&2 || true
fi
exit $rc
