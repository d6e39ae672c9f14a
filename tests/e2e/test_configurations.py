"""Random configurations of the whole API against one process with torch.optim (float64).

Each example draws a world size (a 2-D mesh at 4), a stage, how units enter (module hooks,
`fzero.gathered`, before the forward), units (per block, grouped, none), a layout,
accumulation, token-weighted losses with a rank missing a step, clipping, param groups,
frozen and tied weights, BatchNorm's buffers, offload to host or disk, prefetch,
resharding and hpZ, donation, bucket sizes, and a checkpoint reloaded after the first
step; three steps must end where one process does. Combinations the tests of each
feature do not cross found four bugs this way (tied weights inside units, a 2-D mesh
with layout="tensor", a rank without data after a reload compiled, and local
accumulation in bf16), each with a focused test of its own beside its feature.
"""

import os
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero

D, STEPS = 5, 3


class Block(nn.Module):
    def __init__(self, norm: bool) -> None:
        super().__init__()
        # Before a BatchNorm a bias has no gradient but rounding noise, which Adam would
        # scale up to its step size: none then.
        self.a = nn.Linear(D, D, bias=not norm)
        self.b = nn.Linear(D, D, bias=False)
        self.n = nn.BatchNorm1d(D) if norm else nn.Identity()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.b(torch.tanh(self.n(self.a(h)))))


class Net(nn.Module):
    def __init__(self, blocks: int, tied: bool, norm: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.blocks = nn.ModuleList(Block(norm) for _ in range(blocks))
        self.out = nn.Linear(D, 3)
        if tied:  # one module in two blocks (two units)
            self.blocks[1].b = self.blocks[0].b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


@st.composite
def configurations(draw: Any) -> dict[str, Any]:
    ws = draw(st.sampled_from([1, 2, 3, 4]))
    stage = draw(st.integers(0, 3))
    blocks = draw(st.sampled_from([2, 3]))
    mode = draw(st.sampled_from(["hooks", "gathered", "upfront"]))
    per_block = [f"blocks.{i}" for i in range(blocks)]
    units = draw(st.sampled_from([per_block, [tuple(per_block[:2]), *per_block[2:]], None]))
    if mode == "gathered":
        units = per_block
    accumulate = draw(st.sampled_from([None, "local", "sharded"]))
    norm = draw(st.booleans())
    pairs = draw(st.booleans())
    reshard: bool | int = True
    if stage == 3:
        reshard = draw(st.sampled_from([True, False, 2] if ws == 4 else [True, False]))
    offload = None
    if stage > 0 and draw(st.booleans()):
        offload = (draw(st.sampled_from(["host", "disk"])), draw(st.sampled_from([1.0, 0.5])))
    return dict(
        seed=draw(st.integers(0, 999)), ws=ws, stage=stage, blocks=blocks, mode=mode,
        units=units, layout=draw(st.sampled_from(["flat", "tensor"])), accumulate=accumulate,
        micro=draw(st.sampled_from([2, 3])) if accumulate else 1,
        # An empty micro-batch only where a loss weighs tokens and another rank has some.
        sizes=draw(st.sampled_from([[2, 3], [0, 3]])) if pairs and not norm and ws > 1 else [2, 3],
        pairs=pairs, absent=ws > 1 and draw(st.booleans()), clip=draw(st.sampled_from([None, 0.5])),
        reshard=reshard, prefetch=draw(st.booleans()), overlap=draw(st.booleans()),
        bucket=draw(st.sampled_from([None, 0, 256])), offload=offload,
        donate=(offload is not None and offload[0] == "disk") or draw(st.booleans()),
        frozen=draw(st.sampled_from([(), ("blocks.0.b.weight",), ("inp.bias",)])),
        tied=mode != "gathered" and draw(st.booleans()), norm=norm,
        sync=draw(st.sampled_from(["broadcast", "mean"])), opt=draw(st.sampled_from(list(OPTS))),
        groups=draw(st.booleans()), shard=2 if ws == 4 and draw(st.booleans()) else None,
        reload=draw(st.booleans()),
    )  # fmt: skip


OPTS = {
    "adamw": (torch.optim.AdamW, fzero.optim.adamw, dict(lr=0.05, weight_decay=0.1)),
    "adam": (torch.optim.Adam, fzero.optim.adam, dict(lr=0.05)),
    "sgd": (torch.optim.SGD, fzero.optim.sgd, dict(lr=0.1, momentum=0.9, nesterov=True)),
}


def model_of(c: dict[str, Any]) -> nn.Module:
    torch.manual_seed(c["seed"])
    return Net(c["blocks"], c["tied"], c["norm"]).double()


def batches(c: dict[str, Any]) -> list[list[Any]]:
    """Per step, per rank, its micro-batches (None: the last rank misses step 1)."""
    g = torch.Generator().manual_seed(c["seed"] + 1)
    out = []
    for t in range(STEPS):
        per_rank: list[Any] = []
        for r in range(c["ws"]):
            sizes = [c["sizes"][(t + r + m) % len(c["sizes"])] for m in range(c["micro"])]
            mbs = [
                tuple(torch.randn(n, 3, generator=g, dtype=torch.float64) for _ in "xy")
                for n in sizes
            ]
            per_rank.append(None if c["absent"] and r == c["ws"] - 1 and t == 1 else mbs)
        out.append(per_rank)
    return out


def loss_of(out: torch.Tensor, y: torch.Tensor, pairs: bool) -> Any:
    if pairs:  # a token-weighted loss: the global sum over the global count
        return (out - y).square().sum(), torch.tensor(float(y.shape[0]), dtype=torch.float64)
    return (out - y).square().mean()


def reference(c: dict[str, Any], data: list[list[Any]]) -> dict[str, torch.Tensor]:
    """torch.optim on one process: each rank's micro-batches run through the model in
    order, its buffers threaded through them and then agreed as `buffer_sync` says."""
    model = model_of(c)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    for k, p in params.items():
        p.requires_grad_(not k.startswith(c["frozen"]) if c["frozen"] else True)
    trained = [p for p in params.values() if p.requires_grad]
    cls, _, kw = OPTS[c["opt"]]
    if c["groups"]:
        bias = [p for k, p in params.items() if p.requires_grad and k.endswith("bias")]
        rest = [p for k, p in params.items() if p.requires_grad and not k.endswith("bias")]
        groups = [{"params": bias, "lr": 0.02, "weight_decay": 0.0}, {"params": rest}]
        opt = cls([g for g in groups if g["params"]], **kw, foreach=False)
    else:
        opt = cls(trained, **kw, foreach=False)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    for per_rank in data:
        opt.zero_grad()
        outs, kept = [], {}
        for r, mbs in enumerate(per_rank):
            if mbs is None:
                continue
            kept[r] = {k: v.clone() for k, v in buffers.items()}
            outs += [(functional_call(model, {**params, **kept[r]}, (x,)), y) for x, y in mbs]
        if c["pairs"]:
            loss = sum(loss_of(o, y, True)[0] for o, y in outs) / sum(y.shape[0] for _, y in outs)
        else:
            loss = sum(loss_of(o, y, False) for o, y in outs) / len(outs)
        loss.backward()
        for p in trained:  # fzero steps an unused leaf with a zero gradient
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        if c["clip"]:
            torch.nn.utils.clip_grad_norm_(trained, c["clip"])
        opt.step()
        if buffers:
            first = kept[min(kept)]
            if c["sync"] == "mean":
                mean = {k: sum(b[k] for b in kept.values()) / len(kept) for k in first}
                buffers = {k: mean[k] if v.is_floating_point() else v for k, v in first.items()}
            else:
                buffers = first
    return {**{k: v.detach() for k, v in params.items()}, **buffers}


def train(mesh: fzero.Mesh, c: dict[str, Any], data: list[list[Any]], root: str) -> Any:
    model = model_of(c)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    make, hyper = OPTS[c["opt"]][1:]
    if c["groups"]:
        groups = [
            {"params": lambda p: p.endswith("bias"), "lr": 0.02, "weight_decay": 0.0},
            {"params": lambda p: True},
        ]
        opt = fzero.optim.param_groups(make, groups, **hyper)
    else:
        opt = make(**hyper)
    if c["clip"]:
        opt = fzero.optim.chain(fzero.optim.clip_by_global_norm(c["clip"]), opt)
    offload = None
    if c["offload"]:
        to, fraction = c["offload"]
        where = os.path.join(root, f"offload-{mesh.rank}") if to == "disk" else None
        offload = fzero.Offload(to, fraction=fraction, directory=where)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()} or None
    kw = dict(stage=c["stage"], layout=c["layout"], units=c["units"], offload=offload)
    kw["frozen"] = list(c["frozen"]) or None
    state = fzero.shard_state(params, opt, mesh, buffers=buffers, **kw)

    def loss_fn(p: dict, *rest: Any) -> Any:
        b, (x, y) = rest if buffers is not None else (None, rest[0])
        if c["mode"] == "gathered":
            h = functional_call(
                model.inp, {k[4:]: v for k, v in p.items() if k[:4] == "inp."}, (x,)
            )
            for i, block in enumerate(model.blocks):
                own = {k[9:]: v for k, v in (b or {}).items() if k.startswith(f"blocks.{i}.")}
                h = functional_call(block, {**fzero.gathered(p, f"blocks.{i}"), **own}, (h,))
            out = functional_call(
                model.out, {k[4:]: v for k, v in p.items() if k[:4] == "out."}, (h,)
            )
        else:
            out = functional_call(model, {**p, **(b or {})}, (x,))
        loss = loss_of(out, y, c["pairs"])
        return (loss, b) if buffers is not None else loss

    step = fzero.sharded_step(
        loss_fn, opt, mesh, stage=c["stage"], module=model if c["mode"] == "hooks" else None,
        just_in_time=c["mode"] == "gathered", reshard_after_forward=c["reshard"],
        prefetch=c["prefetch"], donate=c["donate"], accumulate=c["accumulate"],
        overlap_reduce=c["overlap"], reduce_bucket_bytes=c["bucket"], buffer_sync=c["sync"],
    )  # fmt: skip
    for t, per_rank in enumerate(data):
        mine = per_rank[mesh.rank]
        state, _ = step(state, mine if mine is None or c["accumulate"] else mine[0])
        if c["reload"] and t == 0:
            path = os.path.join(root, "checkpoint")
            fzero.checkpoint.save(state, path, mesh)
            state = fzero.checkpoint.load(path, mesh, opt, params, buffers_like=buffers, **kw)
    return {**fzero.gather_params(state.params, mesh), **(state.buffers or {})}


@pytest.mark.slow
@pytest.mark.multiprocess
@given(c=configurations())
def test_any_configuration_trains_as_one_process(c: dict[str, Any], tmp_path_factory: Any) -> None:
    data = batches(c)
    want = reference(c, data)
    root = str(tmp_path_factory.mktemp("run"))
    runs = fzero.Simulation(c["ws"], collective_timeout=30, timeout=120, shard_size=c["shard"])
    for got in runs.run(train, c, data, root):
        fzero.assert_trees_close(got, want, rtol=1e-9, atol=1e-10, what=str(c))
    start = dict(model_of(c).named_parameters())
    assert max((want[k] - start[k]).abs().max().item() for k in start) > 1e-3  # trained
