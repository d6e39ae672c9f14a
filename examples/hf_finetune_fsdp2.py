"""The job of `hf_finetune.py` with FSDP2, for comparison (docs/huggingface.md counts both).

    torchrun --nproc-per-node 2 examples/hf_finetune_fsdp2.py --pretrained /tmp/tiny --out /tmp/t2

The memory-sane FSDP2 recipe: rank 0 alone loads the pretrained model, the others build it
on the meta device; `fully_shard` per decoder layer and the root; `to_empty`; rank 0's
weights broadcast into the shards (`set_model_state_dict(broadcast_from_rank0=True)`);
RoPE's buffer, left as garbage by `to_empty` and absent from checkpoints, recomputed by
hand. Accumulation turns gradient sync off but for the last micro-batch; the export
gathers a full state dict to rank 0's CPU and saves it with the rank-0 model.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from hf_finetune import batches
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, get_cosine_schedule_with_warmup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrained", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dmesh = init_device_mesh(device.type, (world,))
    config = AutoConfig.from_pretrained(args.pretrained)
    full, weights = None, {}
    if rank == 0:
        full = AutoModelForCausalLM.from_pretrained(args.pretrained)
        weights = full.state_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dmesh)
    fully_shard(model, mesh=dmesh)
    model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, weights, options=options)
    rotary = model.model.rotary_emb  # not in any checkpoint, garbage after to_empty
    inv_freq, _ = rotary.compute_default_rope_parameters(config, device=device)
    rotary.inv_freq.copy_(inv_freq)
    rotary.original_inv_freq = inv_freq
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = get_cosine_schedule_with_warmup(opt, args.steps // 10, args.steps)
    data = batches(rank, args.steps, 2, 4, config.vocab_size).to(device)
    held = batches(10_000 + rank, 1, 1, 8, config.vocab_size)[0, 0].to(device)

    def evaluate() -> float:
        with torch.no_grad():
            loss = model(input_ids=held, labels=held).loss
        dist.all_reduce(loss)
        return loss.item() / world

    before = evaluate()
    for k in range(args.steps):
        for i, micro in enumerate(data[k]):
            model.set_requires_gradient_sync(i == len(data[k]) - 1)
            loss = model(input_ids=micro, labels=micro).loss / len(data[k])
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        scheduler.step()
        opt.zero_grad()
        if rank == 0 and k % 10 == 0:
            print(f"step {k}: loss {len(data[k]) * loss.item():.4f}", flush=True)
    after = evaluate()
    with torch.no_grad():
        prompt = held[rank : rank + 1, :4]
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False, synced_gpus=True)
        logits = model(input_ids=held).logits
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    trained = get_model_state_dict(model, options=options)
    if rank == 0:
        full.save_pretrained(args.out, state_dict=trained)
        config.save_pretrained(args.out)
        print(f"held-out loss {before:.4f} -> {after:.4f}")
        print(f"rank 0 generates {tokens[0].tolist()}")
        reloaded = AutoModelForCausalLM.from_pretrained(args.out)
        with torch.no_grad():
            same = torch.equal(reloaded(input_ids=held.cpu()).logits, logits.cpu())
        print(f"from_pretrained({args.out}): logits {'identical' if same else 'DIFFER'}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Exit without the interpreter's teardown. On gloo, a worker thread drops the last
    # collective's work just after the barrier returns; FSDP2's DTensor all-gathers leave
    # tensors in it whose Python objects only C++ still holds, and freeing one needs the
    # GIL. If that race is lost to the interpreter's shutdown, the thread exits inside a
    # destructor and the process aborts ("terminate called without an active exception";
    # 2 runs in 19 here, with the process group destroyed first).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
