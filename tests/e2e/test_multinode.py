"""Two "machines" on 127.0.0.1 (two torchrun calls, 2 processes each) train like one process."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torchrun_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
NODES, PER_NODE = 2, 2
STEPS, MICRO_BATCH, LR = 6, 3, 1e-2
# float64 on both sides: the sharded run and torch.optim agree to round-off (~1e-15);
# a wrong reduction (sum for mean, a missed shard, a stale gather) is off by > 1e-3.
ATOL = 1e-10
LAUNCH_TIMEOUT = 90.0  # seconds for the whole job; collectives fail after 30


def _load_example():
    spec = importlib.util.spec_from_file_location("torchrun_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(stage: int, out: Path, logs: Path, forked: bool) -> list[str]:
    """Runs the two torchrun invocations concurrently; returns their outputs.

    `forked`: workers are forked from torchrun's agent (`--run-path --start-method fork`)
    instead of started as fresh interpreters, so they need not import torch again: about
    7 s a launch instead of 16 on two cores. Same script, rendezvous and process group.
    """
    port = _free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs, files = [], []
    try:
        for node in range(NODES):
            cmd = [
                str(TORCHRUN),
                f"--nnodes={NODES}",
                f"--nproc-per-node={PER_NODE}",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                "--max-restarts=0",
                *(["--run-path", "--start-method=fork"] if forked else []),
                str(SCRIPT),
                f"--stage={stage}",
                f"--steps={STEPS}",
                f"--micro-batch={MICRO_BATCH}",
                f"--lr={LR}",
                "--dtype=float64",
                "--timeout=30",
                *([f"--out={out}"] if node == 0 else []),
            ]
            log = (logs / f"node{node}.log").open("w+")
            files.append(log)
            # Own session: on failure the agent and its workers die together (killpg).
            procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        outputs = [f.seek(0) or f.read() for f in files]
        for node, (proc, text) in enumerate(zip(procs, outputs)):
            assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{text[-3000:]}"
        return outputs
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for f in files:
            f.close()


def _reference(example) -> dict[str, torch.Tensor]:
    """Plain torch.optim.AdamW on one process, each step on the whole global batch."""
    model = example.make_model(torch.float64)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=0.01, foreach=False)
    for x, y in example.make_data(STEPS, NODES * PER_NODE * MICRO_BATCH, torch.float64):
        opt.zero_grad()
        out = torch.func.functional_call(model, params, (x,))
        F.mse_loss(out, y).backward()
        opt.step()
    return {k: v.detach() for k, v in params.items()}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_machines_train_like_one_process(stage: int, tmp_path: Path) -> None:
    out = tmp_path / "params.pt"
    # Stage 3 runs the exact command of the README; the others start their workers faster.
    node0, _ = _launch(stage, out, tmp_path, forked=stage != 3)
    assert f"stage {stage}, {NODES * PER_NODE} ranks (gloo)" in node0
    got = torch.load(out, weights_only=True)
    want = _reference(_load_example())
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=ATOL, msg=name)
    # Training moved the parameters well beyond the tolerance: the check has teeth.
    init = dict(_load_example().make_model(torch.float64).named_parameters())
    assert max((got[k] - init[k]).abs().max().item() for k in want) > 1e-3
