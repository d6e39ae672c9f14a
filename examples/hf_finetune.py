"""Fine-tune a pretrained Hugging Face model with ZeRO-3 shards: load, train, evaluate,
generate, export, reload.

    python examples/hf_finetune.py --make-pretrained /tmp/tiny    # a stand-in download
    torchrun --nproc-per-node 2 examples/hf_finetune.py --pretrained /tmp/tiny --out /tmp/tuned

Every rank reads only its shards of the pretrained files (`from_file`: sharded safetensors
and their index); RoPE's `inv_freq`, which no checkpoint holds, comes from the model's own
construction, recorded on fake tensors (`deferred`). Training is AdamW with Hugging Face's
cosine warmup, gradient clipping and two micro-batches per step; evaluation and generation
run the model's own methods on the shards (`bind`; `synced_gpus` keeps ranks that finish
early in step); the export is `save_pretrained`'s layout, written unit by unit, and plain
`from_pretrained` reloads it. The data is a synthetic pattern, so the loss must fall.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.func import functional_call
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    get_cosine_schedule_with_warmup,
)

import fzero


def batches(
    rank: int, steps: int, micro: int, size: int, vocab: int, seq: int = 16
) -> torch.Tensor:
    """Token rows of arithmetic progressions mod `vocab`: (steps, micro, size, seq)."""
    g = torch.Generator().manual_seed(1000 + rank)
    start = torch.randint(vocab, (steps, micro, size, 1), generator=g)
    stride = torch.randint(1, 4, (steps, micro, size, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pretrained", help="a save_pretrained directory")
    ap.add_argument("--out", help="where the fine-tuned model is exported")
    ap.add_argument("--make-pretrained", help="write a tiny random Llama there, and stop")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    if args.make_pretrained:
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        AutoModelForCausalLM.from_config(cfg).save_pretrained(
            args.make_pretrained, max_shard_size="100KB"
        )
        return

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    mesh = fzero.ProcessGroupMesh()
    config = AutoConfig.from_pretrained(args.pretrained)
    model = fzero.init.deferred(AutoModelForCausalLM.from_config, config)  # no memory
    lr, warmup = 3e-3, args.steps // 10
    schedule = fzero.optim.from_torch_scheduler(
        lambda opt: get_cosine_schedule_with_warmup(opt, warmup, args.steps), lr
    )
    opt = fzero.optim.chain(
        fzero.optim.clip_by_global_norm(1.0), fzero.optim.adamw(schedule, weight_decay=0.01)
    )
    state = fzero.shard_state(
        dict(model.named_parameters()), opt, mesh, stage=3, units=fzero.units.auto(model),
        buffers=dict(model.named_buffers()),
        init=fzero.init.from_file(args.pretrained, missing=fzero.init.from_module(model)),
    )  # fmt: skip

    def loss_fn(params, buffers, batch):
        out = functional_call(model, (params, buffers), (), {"input_ids": batch, "labels": batch})
        return out.loss, buffers

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=3, module=model, accumulate="local")
    data = batches(mesh.rank, args.steps, 2, 4, config.vocab_size)
    held = batches(10_000 + mesh.rank, 1, 1, 8, config.vocab_size)[0, 0]

    def evaluate() -> float:
        with fzero.bind(model, state, mesh):
            loss = model(input_ids=held, labels=held).loss
        dist.all_reduce(loss)
        return loss.item() / mesh.size

    before = evaluate()
    for k in range(args.steps):
        state, loss = step(state, list(data[k]))
        if mesh.rank == 0 and k % 10 == 0:
            print(f"step {k}: loss {loss.item():.4f}, lr {schedule(k):.2e}", flush=True)
    after = evaluate()
    with fzero.bind(model, state, mesh):
        prompt = held[mesh.rank : mesh.rank + 1, :4]
        tokens = model.generate(prompt, max_new_tokens=8, do_sample=False, synced_gpus=True)
        logits = model(input_ids=held).logits
    fzero.checkpoint.export_pretrained(state, args.out, mesh, module=model, config=config)
    if mesh.rank == 0:
        print(f"held-out loss {before:.4f} -> {after:.4f}")
        print(f"rank 0 generates {tokens[0].tolist()}")
        reloaded = AutoModelForCausalLM.from_pretrained(args.out)
        with torch.no_grad():
            same = torch.equal(reloaded(input_ids=held).logits, logits)
        print(f"from_pretrained({args.out}): logits {'identical' if same else 'DIFFER'}")
    # Torn down together: a rank that tears down while its peer still uses the group can
    # abort at exit on gloo ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
