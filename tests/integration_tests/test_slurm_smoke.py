"""The local Slurm cluster (``tests/slurm/cluster.sh``) has two nodes that are separate hosts
to srun, to torchrun's c10d rendezvous and to gloo."""

import json
import re

import pytest
from launch import clean_env
from slurm_cluster import submit, wait

pytestmark = pytest.mark.integration

# Each rank's address is the one its kernel routes to the rendezvous host from: no hostname.
ALL_REDUCE = """\
import json, os, socket, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
probe.connect((os.environ["MASTER_ADDR"], 1))
addresses = [None] * dist.get_world_size()
dist.all_gather_object(addresses, probe.getsockname()[0])
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"sum": total.item(), "addresses": addresses}, f)
dist.destroy_process_group()
"""

# As multinode_trainer.slurm: rendezvous at the first node's `hostname --ip-address`, nodes
# held exclusively (another job on them could hold port 29500 in their network namespace).
JOB = """\
#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --exclusive
set -euo pipefail
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_ip=$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address)
srun bash -c 'echo "node $SLURMD_NODENAME $(ip -4 -o addr show dev eth0 | awk "{print \\$4}")"'
srun "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc_per_node 1 \\
  --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$head_ip:29500" \\
  "$ALL_REDUCE" "$RESULT"
"""


@pytest.mark.usefixtures("slurm_cluster")
def test_two_nodes_all_reduce_across_namespaces(tmp_path):
    (tmp_path / "all_reduce.py").write_text(ALL_REDUCE)
    (tmp_path / "job.sh").write_text(JOB)
    result, log = tmp_path / "result.json", tmp_path / "job.out"
    env = clean_env(ALL_REDUCE=str(tmp_path / "all_reduce.py"), RESULT=str(result))
    job_id = submit(tmp_path / "job.sh", f"--output={log}", env=env, cwd=tmp_path)

    final = wait(job_id, timeout=180)

    output = log.read_text() if log.exists() else "(no job output)"
    assert (final["state"], final["exit_code"]) == ("COMPLETED", 0), output
    nodes = dict(re.findall(r"^node (\S+) ([\d.]+)/\d+$", output, re.MULTILINE))
    assert sorted(nodes) == ["titan-n1", "titan-n2"], output
    assert len(set(nodes.values())) == 2, output  # each node in its own network namespace
    ranks = json.loads(result.read_text())
    assert ranks["sum"] == 3.0  # 1 + 2
    assert sorted(ranks["addresses"]) == sorted(nodes.values()), output
