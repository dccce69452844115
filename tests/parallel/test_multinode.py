"""Two "nodes" on this machine: two network namespaces joined by a veth pair (10.117.N.1 and .2), one rank
each of a TP=2 engine. The head (node 0: an offline LLM with --nnodes/--node-rank/--master-addr/--master-port
as LLM arguments) and the worker node (`pagedllm serve ... --node-rank 1`, which serves no HTTP) meet through
torch.distributed's rendezvous at the head's address; the tokens equal one rank's. Skips (with the reason)
where network namespaces cannot be made (no CAP_NET_ADMIN, no `ip`)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

HEAD_SCRIPT = """
import json, sys
from pagedllm import LLM, SamplingParams
model_dir, addr, port, out = sys.argv[1:5]
llm = LLM(model_dir, device="cpu", enforce_eager=True, tensor_parallel_size=2, nnodes=2, node_rank=0,
          master_addr=addr, master_port=int(port), num_gpu_blocks_override=64)
prompts = [[5, 9, 17, 33, 100], [44, 55, 66, 77, 88, 99, 111], [7] * 20]
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0),
                    use_tqdm=False)
json.dump([list(o.outputs[0].token_ids) for o in outs], open(out, "w"))
llm.engine.shutdown()
"""


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


@pytest.fixture()
def two_namespaces():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2) to make network namespaces")
    tag = f"{os.getpid() % 10000}"
    a, b, va, vb = f"pl{tag}a", f"pl{tag}b", f"pl{tag}va", f"pl{tag}vb"
    net = f"10.117.{os.getpid() % 250}"
    made: list[str] = []
    try:
        for ns in (a, b):
            r = _sh("ip", "netns", "add", ns)
            if r.returncode:
                pytest.skip(f"cannot make network namespaces here: {r.stderr.strip()}")
            made.append(ns)
        steps = [("ip", "link", "add", va, "type", "veth", "peer", "name", vb),
                 ("ip", "link", "set", va, "netns", a), ("ip", "link", "set", vb, "netns", b),
                 ("ip", "-n", a, "addr", "add", f"{net}.1/24", "dev", va),
                 ("ip", "-n", b, "addr", "add", f"{net}.2/24", "dev", vb),
                 ("ip", "-n", a, "link", "set", va, "up"), ("ip", "-n", b, "link", "set", vb, "up"),
                 ("ip", "-n", a, "link", "set", "lo", "up"), ("ip", "-n", b, "link", "set", "lo", "up")]
        for step in steps:
            r = _sh(*step)
            if r.returncode:
                pytest.skip(f"cannot wire two network namespaces ({' '.join(step)}): {r.stderr.strip()}")
        yield (a, va, f"{net}.1"), (b, vb, f"{net}.2")
    finally:
        for ns in made:
            _sh("ip", "netns", "del", ns)


def test_two_nodes_in_network_namespaces_match_one_rank(two_namespaces, tiny_llama_dir, tmp_path):
    from pagedllm import LLM, SamplingParams

    (head_ns, head_if, head_ip), (node_ns, node_if, _) = two_namespaces
    port = "29611"
    out = tmp_path / "tokens.json"
    script = tmp_path / "head.py"
    script.write_text(HEAD_SCRIPT)
    env = dict(os.environ, PAGEDLLM_DISABLE_PROGRESS_BARS="1", PAGEDLLM_NODE_JOIN_TIMEOUT_S="150")
    node_log = open(tmp_path / "node1.log", "w")
    node = subprocess.Popen(["ip", "netns", "exec", node_ns, sys.executable, "-m", "pagedllm.entrypoints.cli.main",
                             "serve", tiny_llama_dir, "--device", "cpu", "--enforce-eager", "-tp", "2",
                             "--nnodes", "2", "--node-rank", "1", "--master-addr", head_ip, "--master-port", port],
                            stdout=node_log, stderr=subprocess.STDOUT, env=dict(env, GLOO_SOCKET_IFNAME=node_if))
    try:
        head = subprocess.run(["ip", "netns", "exec", head_ns, sys.executable, str(script), tiny_llama_dir, head_ip,
                               port, str(out)], capture_output=True, text=True, timeout=200,
                              env=dict(env, GLOO_SOCKET_IFNAME=head_if))
        assert head.returncode == 0, head.stderr[-3000:]
        assert node.wait(60) == 0, (tmp_path / "node1.log").read_text()[-3000:]  # the head's shutdown ends it
    finally:
        if node.poll() is None:
            node.kill()
    llm = LLM(tiny_llama_dir, device="cpu", enforce_eager=True, num_gpu_blocks_override=64)
    prompts = [[5, 9, 17, 33, 100], [44, 55, 66, 77, 88, 99, 111], [7] * 20]
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)]
    assert json.loads(out.read_text()) == expected
    assert "2 worker ranks ready (tensor_parallel_size=2, pipeline_parallel_size=1, 2 node(s))" in head.stderr
