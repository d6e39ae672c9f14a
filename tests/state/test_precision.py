"""Mixed precision and dynamic loss scaling, against one process doing the same casts."""

from typing import Any

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import (
    differences,
    graphs_made,
    least_live,
    map_every_allocation,
    peak_rss_rise,
    run,
)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Net(nn.Module):
    def __init__(self, d: int = 6, h: int = 10) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh())
        self.head = nn.Linear(h, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


UNITS = [("layers.0", "head"), "layers.2"]  # a group of two submodules, and one


def data(n: int, steps: int, seed: int = 0, inf_at: tuple[int, int] | None = None) -> Any:
    """Per step, per rank micro-batches (x, y) in float32; optionally an inf in one."""
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, n, 3, 6, generator=g)
    ys = torch.randn(steps, n, 3, 2, generator=g)
    if inf_at is not None:
        xs[inf_at[0], inf_at[1], 0, 0] = float("inf")
    return xs, ys


def make_loss(model: nn.Module, dtype: torch.dtype) -> Any:
    def loss_fn(params: dict, batch: Any) -> torch.Tensor:
        x, y = batch
        out = functional_call(model, params, (x.to(dtype),))
        return ((out - y.to(dtype)) ** 2).mean()

    return loss_fn


def reference(
    xs: torch.Tensor,
    ys: torch.Tensor,
    pdt: torch.dtype,
    rdt: torch.dtype,
    scale: bool,
    frozen: tuple[str, ...] = (),
) -> dict[str, Any]:
    """torch.optim.Adam on float32 masters, one process, (torch.amp.GradScaler).

    Each step: parameters cast to `pdt` (once: autograd sums the micro-batches' `pdt`
    gradients in `pdt`, like a reduction in `pdt`; or once per micro-batch when reducing
    in float32, each cast's gradient arriving in float32), a loss per micro-batch (what
    each rank computes), their gradients summed, then divided by the number of
    micro-batches: the mean over ranks. `frozen` leaves are cast once and never updated.
    """
    torch.manual_seed(0)
    model = Net()
    loss_fn = make_loss(model, pdt)
    start = {k: v.detach() for k, v in model.named_parameters()}
    masters = {k: v.clone().requires_grad_() for k, v in start.items() if k not in frozen}
    fixed = {k: start[k].to(pdt) for k in frozen}
    opt = torch.optim.Adam(list(masters.values()), lr=0.01, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3) if scale else None
    n, skipped = xs.shape[1], []
    for t in range(xs.shape[0]):
        opt.zero_grad()
        shared = {**{k: m.to(pdt) for k, m in masters.items()}, **fixed}
        total = 0
        for r in range(n):
            p = shared if rdt == pdt else {**{k: m.to(pdt) for k, m in masters.items()}, **fixed}
            loss = loss_fn(p, (xs[t, r], ys[t, r]))
            total = total + (scaler.scale(loss) if scaler else loss)
        total.backward()
        for m in masters.values():
            m.grad /= n
        if scaler:
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
        else:
            opt.step()
    out = {k: m.detach() for k, m in masters.items()}
    return {
        "masters": out,
        "skipped": skipped,
        "scale": scaler.get_scale() if scaler else None,
        "fixed": fixed,
        "start": start,
    }


def train(mesh: fzero.Mesh, xs: torch.Tensor, ys: torch.Tensor, stage: int, **kw: Any) -> Any:
    made = graphs_made()
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=kw["pdt"], reduce_dtype=kw["rdt"])
    scale = fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=3) if kw["scale"] else None
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(
        params, opt, mesh, stage=stage, units=UNITS, precision=prec, loss_scale=scale
    )
    step = fzero.sharded_step(
        make_loss(model, kw["pdt"]),
        opt,
        mesh,
        stage=stage,
        units=UNITS,
        module=model if kw.get("hooks") else None,
        compile=kw.get("compile", False),
        accumulate=kw.get("accumulate"),
    )
    scales = []
    for t in range(xs.shape[0]):
        batch = (xs[t, mesh.rank], ys[t, mesh.rank])
        # Accumulating: the batch twice, whose mean gradient is the batch's, exactly.
        state, _ = step(state, [batch, batch] if kw.get("accumulate") else batch)
        scales.append(None if state.scaler is None else float(state.scaler.scale))
    params = fzero.gather_params(state.params, mesh)
    return {
        "masters": fzero.master_params(state, mesh),
        "params": params,
        "scales": scales,
        "step": state.step,
        "graphs": graphs_made() - made,
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("pdt", [BF16, FP16])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_reference_doing_the_same_casts(pdt: torch.dtype, stage: int) -> None:
    xs, ys = data(2, 4)
    for rdt in (FP32, pdt):
        ref = reference(xs, ys, pdt, rdt, scale=pdt == FP16)
        out = fzero.simulate(
            2, train, xs, ys, stage, pdt=pdt, rdt=rdt, scale=pdt == FP16, hooks=stage == 3
        )[0]
        for k, m in ref["masters"].items():
            assert out["masters"][k].dtype == FP32 and out["params"][k].dtype == pdt
            torch.testing.assert_close(out["masters"][k], m, rtol=0, atol=0, msg=k)
            assert torch.equal(out["params"][k], m.to(pdt))


def close(got: dict, want: dict, rtol: float, atol: float) -> None:
    for k, m in want.items():
        torch.testing.assert_close(got[k], m, rtol=rtol, atol=atol, msg=lambda s, k=k: f"{k}: {s}")


@pytest.mark.slow
@pytest.mark.multiprocess
@settings(max_examples=8)
@given(
    n=st.integers(1, 4),
    stage=st.integers(0, 3),
    pdt=st.sampled_from([BF16, FP16]),
    reduce_in_param_dtype=st.booleans(),
    hooks=st.booleans(),
)
def test_property_any_world_size(
    n: int, stage: int, pdt: torch.dtype, reduce_in_param_dtype: bool, hooks: bool
) -> None:
    """Any world size, stage and dtype: within float32 round-off of the reference.

    Tolerance: 1 and 2 ranks are bitwise (one addition commutes; dividing by 2 is exact).
    Over 3 or 4 ranks the reduction sums in the ring's order, not micro-batch order, and
    dividing by 3 is inexact: reducing in float32, that is float32 round-off, 1e-5 after
    4 Adam steps. Reducing in a 16-bit dtype over 3 or 4 ranks is not compared: one
    16-bit rounding of a near-zero gradient can flip an Adam step (|Δ| up to ~lr), so no
    tolerance would be both honest and able to fail; the reference cannot reproduce the
    ring's summation order.
    """
    xs, ys = data(n, 4, seed=n)
    rdt = pdt if reduce_in_param_dtype and n <= 2 else FP32
    ref = reference(xs, ys, pdt, rdt, scale=pdt == FP16)
    out = run(n, train, xs, ys, stage, pdt=pdt, rdt=rdt, scale=pdt == FP16, hooks=hooks)
    atol = 0.0 if n <= 2 else 1e-5
    for r in out:
        close(r["masters"], ref["masters"], rtol=0, atol=atol)


def probe(mesh: fzero.Mesh, xs: torch.Tensor, ys: torch.Tensor, stage: int) -> Any:
    """Steps with donate=False, keeping every state, so a skipped step can be compared."""
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(
        params,
        opt,
        mesh,
        stage=stage,
        units=UNITS,
        precision=fzero.Precision(param_dtype=FP16, reduce_dtype=FP32),
        loss_scale=fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=3),
    )
    step = fzero.sharded_step(
        make_loss(model, FP16), opt, mesh, stage=stage, units=UNITS, donate=False
    )
    states = [state]
    for t in range(xs.shape[0]):
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
        states.append(state)
    return [
        {
            "params": fzero.gather_params(s.params, mesh),
            "masters": fzero.master_params(s, mesh),
            "opt": s.opt_state,
            "scale": float(s.scaler.scale),
            "step": s.step,
            "tracker": int(s.scaler.growth_tracker),
        }
        for s in states
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [2, 3])
def test_inf_on_one_rank_skips_the_step_everywhere(stage: int, n: int) -> None:
    """An inf in ONE rank's micro-batch at step 1: every rank skips that update, the scale
    halves on every rank, nothing else changes, and training then matches GradScaler."""
    xs, ys = data(n, 5, inf_at=(1, n - 1))
    ranks = run(n, probe, xs, ys, stage)
    ref = reference(xs, ys, FP16, FP32, scale=True)
    assert ref["skipped"] == [False, True, False, False, False]
    for states in ranks:
        assert [s["scale"] for s in states] == [256.0, 256.0, 128.0, 128.0, 128.0, 256.0]
        assert [s["step"] for s in states] == [0, 1, 1, 2, 3, 4]
        before, after = states[1], states[2]
        for key in ("params", "masters"):
            assert all(torch.equal(before[key][k], after[key][k]) for k in before[key])
        flat_before = [x for x in torch.utils._pytree.tree_leaves(before["opt"])]
        flat_after = [x for x in torch.utils._pytree.tree_leaves(after["opt"])]
        assert all(
            torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
            for a, b in zip(flat_before, flat_after)
        )
        close(states[-1]["masters"], ref["masters"], rtol=0, atol=1e-5 if n > 2 else 0)
        assert states[-1]["scale"] == ref["scale"]


def comm_bytes(mesh: fzero.Mesh, stage: int, prec: Any) -> Any:
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS, precision=prec)
    step = fzero.sharded_step(
        make_loss(model, prec.param_dtype or FP32),
        opt,
        mesh,
        stage=stage,
        units=UNITS,
        module=model,
    )
    xs, ys = data(mesh.size, 2)
    state, _ = step(state, (xs[0, mesh.rank], ys[0, mesh.rank]))
    with fzero.comm_ledger() as ledger:
        state, _ = step(state, (xs[1, mesh.rank], ys[1, mesh.rank]))
    # Besides the data, each step checks that the ranks are in the same call (its name and
    # a refusal flag, 9 int64 per rank), then that they called the same units and step as many
    # micro-batches, none with a failed loss (5 int64 per rank, and at stage 3 a word of
    # flags: which units a backward uses the parameters of) and, in the same all-gather,
    # agrees on the losses' weights (5 words per rank).
    control = [(r.op, r.dtype, r.elements) for r in ledger.records if r.control]
    assert control == [
        ("all_gather", torch.int64, 9 * mesh.size),
        ("all_gather", torch.int64, (5 + (stage == 3) + 5) * mesh.size),
    ]
    return fzero.CommLedger(ledger.data).by_op(), fzero.master_params(state, mesh)


def comm16_reference(stage: int, steps: int) -> dict[str, torch.Tensor]:
    """One process, float32 masters and torch.optim.Adam, doing what bfloat16 communication
    does: the loss sees the masters rounded through bfloat16 (an all-gather delivers them
    so at stages 1-3; stage 0 gathers nothing), and each rank's gradient is cast to
    bfloat16, summed with the other's in bfloat16 and halved there."""
    torch.manual_seed(0)
    model = Net()
    loss_fn = make_loss(model, FP32)
    masters = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = torch.optim.Adam(list(masters.values()), lr=0.01, foreach=False)
    xs, ys = data(2, steps)
    for t in range(steps):
        seen = {
            k: (m.to(BF16).float() if stage else m.clone()).requires_grad_()
            for k, m in masters.items()
        }
        per_rank = [
            torch.autograd.grad(loss_fn(seen, (xs[t, r], ys[t, r])), list(seen.values()))
            for r in range(2)
        ]
        for m, g0, g1 in zip(masters.values(), *per_rank):
            m.grad = ((g0.to(BF16) + g1.to(BF16)) / 2).float()
        opt.step()
    return masters


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_16_bit_communication_halves_the_bytes(stage: int) -> None:
    """float32 parameters and compute; gathers and reductions in bfloat16: half the bytes
    of the same step communicating in float32, and bitwise what one process computes
    when it rounds parameters and gradients the same way."""
    full = run(2, comm_bytes, stage, fzero.Precision())[0]
    half = run(2, comm_bytes, stage, fzero.Precision(gather_dtype=BF16, reduce_dtype=BF16))[0]
    ops32 = {k.split(":")[0]: v for k, v in full[0].items()}
    ops16 = {k.split(":")[0]: v for k, v in half[0].items()}
    assert all(k.endswith("bfloat16") for k in half[0]), half[0]
    assert ops16.keys() == ops32.keys() and ops32
    for op, nbytes in ops32.items():
        assert 2 * ops16[op] == nbytes, (op, ops16[op], nbytes)
    close(half[1], comm16_reference(stage, 2), rtol=0, atol=0)


def memory(mesh: fzero.Mesh, stage: int) -> Any:
    model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(4)])
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state, live = least_live(  # the allocator's record, beside fzero's report
        lambda: fzero.shard_state(
            params,
            fzero.optim.adam(lr=0.01),
            mesh,
            stage=stage,
            precision=fzero.Precision(param_dtype=BF16),
        )
    )
    return fzero.memory_report(state), sum(p.numel() for p in params.values()), live


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_matches_the_zero_formula(stage: int) -> None:
    """2-byte parameters and 12 bytes of Adam state (fp32 master, moments) per parameter,
    per rank, measured on the state's tensors; within the padding and Adam's step count.
    Stage 3 holds no 2-byte shard beside the master (FSDP2's layout, 2 bytes a parameter
    under the paper's 16): its shards are the masters, cast as they are gathered."""
    n = 4
    rep, psi, allocated = run(n, memory, stage)[0]
    est = fzero.estimate_memory(psi, n, stage)  # defaults: 2 / 2 / 12 bytes
    if stage == 3:
        assert rep.params == 0
    else:
        assert est.params <= rep.params <= est.params + 2 * n
    assert est.opt_state <= rep.opt_state <= est.opt_state + 12 * n + 8
    # What shard_state left alive, on the allocator: the same bytes, but for the step
    # counter and now and then a few KB that are not fzero's tensors (a bf16 copy beside
    # stage 3's masters, 2 bytes a parameter more: 33 KB here, fails it).
    kept = (0 if stage == 3 else est.params) + est.opt_state
    assert kept <= allocated < kept + kept // 50 + 8192, (allocated, kept)


def stage3_storages(mesh: fzero.Mesh, xs: torch.Tensor, ys: torch.Tensor, donate: bool) -> Any:
    """Bytes per dtype of the storages a stage-3 bf16 state holds (each counted once),
    before and after steps; whether a step that does not donate left its input alone."""
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.01)
    prec = fzero.Precision(param_dtype=BF16, reduce_dtype=FP32)
    state = fzero.shard_state(params, opt, mesh, stage=3, units=UNITS, precision=prec)
    step = fzero.sharded_step(
        make_loss(model, BF16), opt, mesh, stage=3, units=UNITS, donate=donate
    )

    def storages(s: Any) -> dict[str, int]:
        seen, out = set(), {}
        for x in optree.tree_leaves(s, namespace="fzero"):
            if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in seen:
                seen.add(x.untyped_storage().data_ptr())
                key = str(x.dtype)
                out[key] = out.get(key, 0) + x.untyped_storage().nbytes()
        return out

    before = storages(state)
    for t in range(xs.shape[0]):
        old = [b.clone() for b in state.params.buffers]
        new, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
        untouched = all(torch.equal(a, b) for a, b in zip(old, state.params.buffers))
        assert donate or untouched, "a step that does not donate changed its input"
        state = new
    return before, storages(state), fzero.master_params(state, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("donate", [True, False])
def test_stage_3_holds_each_trainable_shard_once_at_full_precision(donate: bool) -> None:
    """No bf16 copy beside the fp32 master: the state's bf16 storages are empty (nothing
    is frozen here) and its fp32 ones are the master and Adam's two moments, 12 bytes per
    parameter owned (measured on the storages, not on fzero's report); and it trains as
    one process doing the same casts."""
    xs, ys = data(2, 3)
    n_params = sum(p.numel() for p in Net().parameters())
    ref = reference(xs, ys, BF16, FP32, scale=False)
    for before, after, masters in fzero.simulate(2, stage3_storages, xs, ys, donate):
        for held in (before, after):
            assert held.get("torch.bfloat16", 0) == 0, held
            owned = held["torch.float32"]  # Adam's step count is an int64
            assert 12 * n_params / 2 <= owned <= 12 * (n_params / 2 + 3), held  # + padding
        for k, m in ref["masters"].items():
            torch.testing.assert_close(masters[k], m, rtol=0, atol=0, msg=k)
            assert not torch.equal(m, dict(Net().named_parameters())[k].detach()), k


def train_stage3_bf16(
    mesh: fzero.Mesh,
    xs: torch.Tensor,
    ys: torch.Tensor,
    frozen: list[str],
    hpz: int | None,
    compile: str | None = None,
) -> Any:
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.01)
    prec = fzero.Precision(param_dtype=BF16, reduce_dtype=FP32)
    state = fzero.shard_state(
        params, opt, mesh, stage=3, units=UNITS, precision=prec, frozen=frozen or None
    )
    step = fzero.sharded_step(
        make_loss(model, BF16),
        opt,
        mesh,
        stage=3,
        units=UNITS,
        module=model,
        reshard_after_forward=True if hpz is None else hpz,
        compile=compile or False,
    )
    for t in range(xs.shape[0]):
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
    return fzero.master_params(state, mesh), fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("frozen", "hpz", "compile"),
    [
        (["layers.2.bias", "head.weight"], None, None), ([], 2, None), (["head"], 2, None),
        (["head"], 2, "aot_eager"),
    ],
)  # fmt: skip
def test_stage_3_masters_as_shards_with_frozen_leaves_and_hpz(
    frozen: list[str], hpz: int | None, compile: str | None
) -> None:
    """4 ranks, stage 3, bfloat16 compute over float32 masters that are the shards: frozen
    leaves (held in bfloat16, no master) stay bitwise their cast, and with hpZ the
    backward's gathers (from slices of the forward's bfloat16 buffers; compiled, from
    the bfloat16 rows of the first of its two gathers) change nothing; against torch on
    one process."""
    xs, ys = data(4, 3)
    names = tuple(k for k in Net().state_dict() if k.startswith(tuple(frozen)))
    ref = reference(xs, ys, BF16, FP32, scale=False, frozen=names)
    for masters, params in fzero.simulate(4, train_stage3_bf16, xs, ys, frozen, hpz, compile):
        for k, m in ref["masters"].items():
            # 4 float32 gradients summed in another order than autograd's: not bitwise.
            torch.testing.assert_close(masters[k], m, rtol=1e-5, atol=1e-6, msg=k)
            assert params[k].dtype == BF16 and torch.equal(params[k], masters[k].to(BF16)), k
            assert (m - ref["start"][k]).abs().max() > 1e-3, k  # it trained
        for k, v in ref["fixed"].items():
            assert params[k].dtype == BF16 and torch.equal(params[k], v), k


def setup_rise(mesh: fzero.Mesh, stage: int) -> tuple[int, int, int]:
    """Peak resident rise of an eager bf16 `shard_state` (every allocation of 64 KiB or
    more mapped on its own, so RSS follows live tensors), its state's bytes, and Ψ."""
    map_every_allocation()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    del model
    prec = fzero.Precision(param_dtype=BF16)
    units = [str(i) for i in range(16)]

    def make() -> Any:
        return fzero.shard_state(
            params, fzero.optim.adam(lr=0.01), mesh, stage=stage, units=units, precision=prec
        )

    make()  # once before measuring: code pages, lazily made runtime state
    with peak_rss_rise() as rise:
        state = make()
    return rise["rise"], fzero.memory_report(state).total, sum(p.numel() for p in params.values())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("stage", "per_param"), [(2, 2 + 12 / 4), (3, 12 / 4)])
def test_eager_bf16_setup_peaks_at_the_state_it_makes(stage: int, per_param: float) -> None:
    """An eager bf16 setup at 4 ranks, measured in resident memory: it peaks at the state
    it returns (stage 2: the bf16 replicas, 2 bytes a parameter, and 12 over 4 of fp32
    master shard and Adam's moments; stage 3: the 12 over 4 alone) plus about a bucket.
    Before, it also cast the whole tree to bf16 (2 bytes a parameter), and packed and
    broadcast the whole model's fp32 masters (and at stage 3 its bf16 shards) only to drop
    them: about 7 bytes a parameter at either stage here."""
    bucket = (512 * 512 + 512) * 4
    for rise, held, psi in run(4, setup_rise, stage):
        assert held <= per_param * psi + 64 * 1024, (held / psi, psi)
        assert rise <= per_param * psi + 2 * bucket + 2**20, (rise / psi, psi)


def bad(mesh: fzero.Mesh, params: dict, prec: Any) -> None:
    fzero.shard_state(params, fzero.optim.sgd(lr=0.1), mesh, stage=2, precision=prec)


@pytest.mark.multiprocess
def test_bad_precision_input_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match="param_dtype must be a floating-point"):
        fzero.Precision(param_dtype=torch.int32)
    with pytest.raises(TypeError, match="reduce_dtype"):
        fzero.Precision(reduce_dtype="bfloat16")  # type: ignore[arg-type]
    params = {"ok": torch.ones(3), "big": torch.tensor([1.0, 7e4])}
    with pytest.raises(
        ValueError,
        match=r"rank 0: params leaf 'big' holds \|x\| = 7e\+04.*"
        r"overflows param_dtype torch.float16",
    ):
        run(2, bad, params, fzero.Precision(param_dtype=FP16))
    run(2, bad, params, fzero.Precision(param_dtype=BF16))  # bfloat16 has float32's range
    with pytest.raises(TypeError, match=r"loss_scale must be a fzero\.DynamicLossScale"):
        fzero.simulate(
            1,
            lambda m: fzero.shard_state(
                params, fzero.optim.sgd(lr=0.1), m, stage=0, loss_scale=2.0**16
            ),
        )
    with pytest.raises(ValueError, match="backoff_factor"):
        fzero.DynamicLossScale(backoff_factor=2.0).init()
    for wrong in (
        dict(init_scale=float("inf")), dict(init_scale=1e39), dict(init_scale=1e-46),
        dict(growth_factor=1.0),
    ):  # fmt: skip
        with pytest.raises(ValueError, match="init_scale float32 holds"):  # all would skip
            fzero.DynamicLossScale(**wrong).init()


def autocast_loss(model: nn.Module) -> Any:
    def loss_fn(params: dict, batch: Any) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=BF16):
            out = functional_call(model, params, (x,))
        return ((out.float() - y) ** 2).mean()

    return loss_fn


def train_autocast(mesh: fzero.Mesh, xs: torch.Tensor, ys: torch.Tensor, stage: int) -> Any:
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.01)
    scale = fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=3)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS, loss_scale=scale)
    step = fzero.sharded_step(
        autocast_loss(model), opt, mesh, stage=stage, units=UNITS, module=model
    )
    for t in range(xs.shape[0]):
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
    return fzero.gather_params(state.params, mesh), float(state.scaler.scale)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loss_scaling_composes_with_autocast(stage: int) -> None:
    """float32 parameters, torch.autocast(bfloat16) inside loss_fn, a loss scaler and an
    inf on one rank at step 2: bitwise what torch.amp.GradScaler does on one process."""
    xs, ys = data(2, 4, inf_at=(2, 0))
    torch.manual_seed(0)
    model = Net()
    loss_fn = autocast_loss(model)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.Adam(list(params.values()), lr=0.01, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    for t in range(xs.shape[0]):
        opt.zero_grad()
        sum(scaler.scale(loss_fn(params, (xs[t, r], ys[t, r]))) for r in range(2)).backward()
        for p in params.values():
            p.grad /= 2
        scaler.step(opt)
        scaler.update()
    got, scale = fzero.simulate(2, train_autocast, xs, ys, stage)[0]
    assert scale == scaler.get_scale() == 128.0  # backed off once, at the inf
    close(got, {k: p.detach() for k, p in params.items()}, rtol=0, atol=0)


def with_buffers(mesh: fzero.Mesh, buffer_dtype: Any) -> Any:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    prec = fzero.Precision(param_dtype=BF16, buffer_dtype=buffer_dtype)
    state = fzero.shard_state(
        params, fzero.optim.sgd(lr=0.1), mesh, stage=2, buffers=buffers, precision=prec
    )
    return {k: v.dtype for k, v in state.buffers.items()}


@pytest.mark.multiprocess
def test_buffers_stay_float32_unless_asked() -> None:
    kept = fzero.simulate(1, with_buffers, None)[0]
    assert kept["1.running_mean"] == FP32 and kept["1.num_batches_tracked"] == torch.int64
    cast = fzero.simulate(1, with_buffers, BF16)[0]
    assert cast["1.running_mean"] == BF16 and cast["1.num_batches_tracked"] == torch.int64


def resume(mesh: fzero.Mesh, path: str, stage: int, load_stage: int) -> Any:
    """Train 4 steps; or 2, save, load (at `load_stage`), 2 more: the same, bitwise."""
    xs, ys = data(mesh.size, 4, inf_at=(1, 0))
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=FP16, reduce_dtype=FP32)
    scale = fzero.DynamicLossScale(init_scale=2.0**8, growth_interval=2)
    opt = fzero.optim.adam(lr=0.01)

    def run_steps(state: Any, stage: int, steps: range) -> Any:
        step = fzero.sharded_step(make_loss(model, FP16), opt, mesh, stage=stage, units=UNITS)
        for t in steps:
            state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
        return state

    kw = {"units": UNITS, "precision": prec, "loss_scale": scale}
    straight = run_steps(fzero.shard_state(params, opt, mesh, stage=stage, **kw), stage, range(4))
    half = run_steps(fzero.shard_state(params, opt, mesh, stage=stage, **kw), stage, range(2))
    fzero.checkpoint.save(half, path, mesh)
    loaded = fzero.checkpoint.load(path, mesh, opt, params, stage=load_stage, precision=prec)
    resumed = run_steps(loaded, load_stage, range(2, 4))
    return [
        (
            fzero.master_params(s, mesh),
            fzero.gather_params(s.params, mesh),
            float(s.scaler.scale),
            int(s.scaler.growth_tracker),
            s.step,
        )
        for s in (straight, resumed)
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize(("stage", "load_stage"), [(0, 0), (1, 1), (2, 3), (3, 3), (3, 1)])
def test_mixed_precision_checkpoints_resume_bitwise(
    tmp_path: Any, stage: int, load_stage: int
) -> None:
    """Masters, scale and growth count survive a checkpoint, across stages too: resuming
    trains exactly like never stopping (an inf at step 1 included)."""
    for straight, resumed in run(2, resume, str(tmp_path / "ckpt"), stage, load_stage):
        for a, b in zip(straight[:2], resumed[:2]):
            assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
        assert straight[2:] == resumed[2:]


def save_mixed_dtypes(mesh: fzero.Mesh, path: str) -> Any:
    params = {"a": {"w": torch.ones(3)}, "b": {"w": torch.ones(3, dtype=torch.float64)}}
    prec = fzero.Precision(param_dtype=BF16)
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=2, units=["a", "b"], precision=prec)
    step = fzero.sharded_step(
        lambda p, x: (p["a"]["w"] * p["b"]["w"] * x).sum(), opt, mesh, stage=2
    )
    state, _ = step(state, torch.tensor(1.0 + mesh.rank / 3))
    fzero.checkpoint.save(state, path, mesh)
    loaded = fzero.checkpoint.load(path, mesh, opt, params, stage=3, precision=prec)
    return fzero.master_params(state, mesh), fzero.master_params(loaded, mesh)


@pytest.mark.multiprocess
def test_masters_of_several_dtypes_checkpoint_in_their_own_dtypes(tmp_path: Any) -> None:
    """float32 and float64 originals in separate units keep masters of both dtypes: each is
    saved in its own (save refused them, NotImplementedError), and loads back bitwise."""
    for saved, loaded in run(2, save_mixed_dtypes, str(tmp_path / "c")):
        assert saved["b"]["w"].dtype == torch.float64 and saved["a"]["w"].dtype == torch.float32
        assert not torch.equal(saved["b"]["w"], torch.ones(3, dtype=torch.float64))  # moved
        fzero.assert_trees_close(loaded, saved, rtol=0, atol=0)
        assert loaded["b"]["w"].dtype == torch.float64


def test_step_zero_rounding_through_the_gather_dtype_leaves_integer_leaves_exact() -> None:
    # Stages 1-2 round the step-0 parameters through gather_dtype as a gather would; an
    # integer leaf (a batch counter) is never gathered in it: 1001 is not a bfloat16.
    from fzero._core._stages import STAGES
    from fzero._state._precision import compute_params

    prec = fzero.Precision(param_dtype=torch.float32, gather_dtype=BF16)
    out = compute_params({"w": torch.full((2,), 1001.0), "n": torch.tensor(1001)}, prec, STAGES[1])
    assert torch.equal(out["n"], torch.tensor(1001))
    assert torch.equal(out["w"], torch.full((2,), 1001.0).to(BF16).float())


def sgd16_reference(n: int, stage: int, steps: int, lr: float) -> tuple[dict, float]:
    """One process doing what a bfloat16 reduction over `n` ranks does, on float32
    parameters with plain SGD (linear in the gradient): each rank's float32 gradient cast
    to bfloat16 and divided by `n` there, as the burst buffers every stage reduces from
    do, then summed in rank order in bfloat16 (stages 1-3: gloo's reduce-scatter runs as
    point-to-point messages summed in rank order). Also returns the largest gradient
    element seen, for the stage-0 bound."""
    torch.manual_seed(0)
    model = Net()
    loss_fn = make_loss(model, FP32)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(list(params.values()), lr=lr, foreach=False)
    xs, ys = data(n, steps, seed=n)
    biggest = 0.0
    for t in range(steps):
        per_rank = [
            torch.autograd.grad(loss_fn(params, (xs[t, r], ys[t, r])), list(params.values()))
            for r in range(n)
        ]
        for k, p in enumerate(params.values()):
            terms = [g[k].to(BF16) for g in per_rank]
            biggest = max(biggest, max(float(x.abs().max()) for x in terms))
            terms = [x / n for x in terms]
            total = terms[0]
            for x in terms[1:]:
                total = total + x
            p.grad = total.float()
        opt.step()
    return {k: p.detach() for k, p in params.items()}, biggest


def train_sgd16(mesh: fzero.Mesh, steps: int, lr: float, stage: int, hooks: bool) -> Any:
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.sgd(lr=lr)
    prec = fzero.Precision(reduce_dtype=BF16)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS, precision=prec)
    module = model if hooks else None
    step = fzero.sharded_step(make_loss(model, FP32), opt, mesh, stage=stage, module=module)
    xs, ys = data(mesh.size, steps, seed=mesh.size)
    for t in range(steps):
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
    return fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [3, 4])
def test_16_bit_reduction_over_more_than_two_ranks(n: int, stage: int) -> None:
    """bfloat16 gradient reduction on 3 and 4 ranks, against one process rounding the same
    way. Stages 1-3 sum in rank order on gloo: bitwise (each term divided before the
    sum, in the burst buffer). Stage 0's all-reduce sums in
    gloo's ring order, which one process cannot replay: each of its n - 1 bfloat16
    additions rounds by at most 2^-9 of the running sum, so per step the mean differs by
    at most (n - 1) 2^-8 max|g|, times lr per SGD update. That bound must stay well under
    what losing one rank's gradient would move (lr max|g| / n), or the test could not
    fail."""
    steps, lr = 3, 0.1
    expected, biggest = sgd16_reference(n, stage, steps, lr)
    atol = 0.0
    if stage == 0:
        atol = steps * lr * (n - 1) * 2.0**-8 * biggest
        assert atol < lr * biggest / n / 2
    for got in run(n, train_sgd16, steps, lr, stage, hooks=n == 4):
        close(got, expected, rtol=0, atol=atol)


def _train_local(
    mesh: fzero.Mesh,
    xs: torch.Tensor,
    ys: torch.Tensor,
    stage: int,
    m: int,
    rdt: Any = FP32,
    compile: Any = False,
) -> Any:
    """`m` different micro-batches a rank, accumulated locally (DDP's no_sync) under bf16
    compute and a `rdt` reduction; `compile`: sharded_step's."""
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=BF16, reduce_dtype=rdt)
    opt = fzero.optim.adam(lr=0.01)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS, precision=prec)
    ledger = None if compile else fzero.UnitLedger()  # a compiled step keeps none
    step = fzero.sharded_step(
        make_loss(model, BF16), opt, mesh, stage=stage, units=UNITS, accumulate="local",
        ledger=ledger, compile=compile,
    )  # fmt: skip
    for t in range(xs.shape[0]):
        rows = range(mesh.rank * m, (mesh.rank + 1) * m)
        state, _ = step(state, [(xs[t, r], ys[t, r]) for r in rows])
    return fzero.master_params(state, mesh), ledger and ledger.live_grads


@pytest.mark.multiprocess
@pytest.mark.parametrize(("n", "stage"), [(1, 0), (2, 0), (2, 1), (2, 3)])
def test_local_accumulation_sums_in_the_float32_reduce_dtype(n: int, stage: int) -> None:
    """FSDP2 accumulates without gradient sync in `reduce_dtype`: three bf16 micro-batch
    gradients summed in float32 match one process summing them so (to float32's
    reassociation: the sums are ordered differently). Before, the eager sum was in
    bf16, 1e-3 off."""
    m = 3
    xs, ys = data(n * m, 3)
    ref = reference(xs, ys, BF16, FP32, scale=False)
    for masters, live in run(n, _train_local, xs, ys, stage, m):
        close(masters, ref["masters"], rtol=0, atol=1e-6)
        assert live == 0  # the wider sums counted at their own size, in and out
        assert fzero._core._tree.max_abs_diff(masters, ref["start"]) > 1e-3


def local16_reference(xs: torch.Tensor, ys: torch.Tensor, n: int, m: int) -> dict:
    """torch.optim.Adam on float32 masters, one process: each rank's `m` bf16 micro-batch
    gradients summed in bf16, the ranks' sums summed in bf16 and divided by `n` (exact
    at 1-2 ranks), then the mean over the micro-batches taken in float32."""
    torch.manual_seed(0)
    model = Net()
    loss_fn = make_loss(model, BF16)
    masters = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    opt = torch.optim.Adam(list(masters.values()), lr=0.01, foreach=False)
    for t in range(xs.shape[0]):
        total: list[torch.Tensor] = []
        for r in range(n):
            sums: list[torch.Tensor] = []
            for j in range(r * m, (r + 1) * m):
                p = {k: v.detach().to(BF16).requires_grad_() for k, v in masters.items()}
                g = torch.autograd.grad(loss_fn(p, (xs[t, j], ys[t, j])), list(p.values()))
                sums = [a + b for a, b in zip(sums, g)] if sums else list(g)
            total = [a + b for a, b in zip(total, sums)] if total else sums
        for v, g in zip(masters.values(), total):
            v.grad = (g / n).float() / m
        opt.step()
    return {k: v.detach() for k, v in masters.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("n", "stage", "compile"),
    [
        (1, 0, False),
        (2, 0, False),
        (2, 1, False),
        (2, 3, False),
        pytest.param(2, 3, "aot_eager", marks=pytest.mark.slow),
    ],
)
def test_local_accumulation_in_bf16_takes_the_mean_in_float32_at_every_stage(
    n: int, stage: int, compile: Any
) -> None:
    """Reduced in bf16, three micro-batches' summed gradients are divided by three in the
    masters' float32 at every stage, eager or compiled. Eager stage 0 and compiled steps
    divided in bf16 before, where eager stages 1-3 widened first: 2e-3 apart on BERT
    after two steps (found by a fuzzer)."""
    m = 3
    xs, ys = data(n * m, 3)
    want = local16_reference(xs, ys, n, m)
    torch.manual_seed(0)
    start = {k: v.detach() for k, v in Net().named_parameters()}
    assert fzero._core._tree.max_abs_diff(want, start) > 1e-3
    for masters, _ in run(n, _train_local, xs, ys, stage, m, BF16, compile):
        if compile:  # within a float32 ulp of the masters (4.7e-5 off when divided in bf16)
            close(masters, want, rtol=0, atol=1e-7)
        else:
            assert differences(masters, want) == []


def _seen_through_a_narrower_gather(mesh: fzero.Mesh, stage: int) -> list[list[str]]:
    """fp16 compute, bf16 travel: per step, the leaves the loss saw other than the
    masters rounded straight to bf16, then to fp16."""
    torch.manual_seed(0)
    model = Net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    prec = fzero.Precision(param_dtype=FP16, gather_dtype=BF16, reduce_dtype=FP32)
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS, precision=prec)
    seen: list[dict[str, torch.Tensor]] = []

    def loss_fn(p: dict, batch: Any) -> torch.Tensor:
        seen.append({k: v.detach().clone() for k, v in p.items()})
        return make_loss(model, FP16)(p, batch)

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=stage, units=UNITS)
    xs, ys = data(mesh.size, 3)
    off = []
    for t in range(3):
        masters = fzero.master_params(state, mesh)
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
        want = {k: m.to(BF16).to(FP16) for k, m in masters.items()}
        off.append([k for k in want if not torch.equal(seen[t][k], want[k])])
    moved = fzero.master_params(state, mesh)
    assert fzero._core._tree.max_abs_diff(moved, params) > 1e-3
    return off


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_gather_narrower_than_the_compute_dtype_rounds_the_masters_once(stage: int) -> None:
    """Step 0's parameters (stages 1-2) and stage 3's every gather rounded the masters to
    fp16 and then to bf16 (a fuzzer found 10 of GPT-2's 28 leaves off the masters rounded
    straight to bf16, as stages 1-2 gather them after an update)."""
    for off in run(2, _seen_through_a_narrower_gather, stage):
        assert off == [[], [], []]


def _kept_masters(mesh: fzero.Mesh, stage: int, mixed: bool) -> tuple[Any, Any, Any]:
    params = {"w": torch.randn(6, 3, generator=torch.Generator().manual_seed(0))}
    opt = fzero.optim.sgd(lr=0.5)
    precision = fzero.Precision(param_dtype=torch.bfloat16) if mixed else None
    state = fzero.shard_state(params, opt, mesh, stage=stage, precision=precision)
    kept = fzero.master_params(state, mesh)
    before = {k: v.clone() for k, v in kept.items()}
    step = fzero.sharded_step(lambda p, x: (p["w"].float() * x).sum(), opt, mesh, stage=stage)
    state, _ = step(state, torch.ones(6, 3))
    return kept, before, fzero.master_params(state, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mixed", [False, True])
def test_a_kept_master_params_is_a_snapshot_at_every_stage(mixed: bool) -> None:
    # At stages 0-2 without masters (and stage 0's masters) it was the state's own
    # tensors: the next step changed a "best so far" kept from it.
    for stage in range(4):
        for kept, before, after in run(2, _kept_masters, stage, mixed):
            assert torch.equal(kept["w"], before["w"]), (stage, mixed)
            assert not torch.equal(after["w"], before["w"])  # the step moved the state


def _bf16_model_fp32_masters(
    mesh: fzero.Mesh, xs: torch.Tensor, ys: torch.Tensor, stage: int
) -> Any:
    torch.manual_seed(0)
    model = Net().to(BF16)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.01)
    prec = fzero.Precision(master_dtype=FP32)  # no param_dtype: the model's own, bf16
    state = fzero.shard_state(params, opt, mesh, stage=stage, units=UNITS, precision=prec)
    step = fzero.sharded_step(make_loss(model, BF16), opt, mesh, stage=stage, units=UNITS)
    for t in range(xs.shape[0]):
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
    return fzero.master_params(state, mesh), fzero.gather_params(state.params, mesh)


def _bf16_reference(xs: torch.Tensor, ys: torch.Tensor) -> tuple[dict, dict]:
    """torch.optim.Adam on float32 copies of a bfloat16 model's values, the loss on their
    bfloat16 cast, over two ranks' micro-batches: (the bf16 start, the trained masters)."""
    torch.manual_seed(0)
    start = {k: v.detach().to(BF16) for k, v in Net().named_parameters()}
    masters = {k: v.float().requires_grad_() for k, v in start.items()}
    opt = torch.optim.Adam(list(masters.values()), lr=0.01, foreach=False)
    loss_fn = make_loss(Net(), BF16)
    for t in range(xs.shape[0]):
        opt.zero_grad()
        shared = {k: m.to(BF16) for k, m in masters.items()}
        sum(loss_fn(shared, (xs[t, r], ys[t, r])) for r in range(2)).backward()
        for m in masters.values():
            m.grad /= 2
        opt.step()
    return start, {k: m.detach() for k, m in masters.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_master_dtype_alone_keeps_masters_of_a_bf16_model(stage: int) -> None:
    """`Precision(master_dtype=float32)` over a bfloat16 model (DeepSpeed's bf16 with fp32
    masters): the optimizer updates float32 masters. It was ignored without a word: the
    bf16 parameters were updated in place (found by a second reader). Against
    torch.optim.Adam on float32 copies of the bf16 values, the loss on their bf16 cast."""
    xs, ys = data(2, 4)
    start, masters = _bf16_reference(xs, ys)
    for got, params in run(2, _bf16_model_fp32_masters, xs, ys, stage):
        for k, m in masters.items():
            assert got[k].dtype == FP32 and params[k].dtype == BF16
            assert not torch.equal(got[k], start[k].float())  # trained
            torch.testing.assert_close(got[k], m, rtol=0, atol=0, msg=k)
            assert torch.equal(params[k], m.to(BF16))


def _bf16_masters_resumed(
    mesh: fzero.Mesh, xs: torch.Tensor, ys: torch.Tensor, stages: tuple[int, int], folder: str
) -> Any:
    """Two steps under `Precision(master_dtype=float32)`, a checkpoint, and the rest of the
    steps from it loaded at another stage with the same precision."""
    torch.manual_seed(0)
    model = Net().to(BF16)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt, prec = fzero.optim.adam(lr=0.01), fzero.Precision(master_dtype=FP32)
    state = fzero.shard_state(params, opt, mesh, stage=stages[0], units=UNITS, precision=prec)
    step = fzero.sharded_step(make_loss(model, BF16), opt, mesh, stage=stages[0], units=UNITS)
    for t in range(2):
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
    fzero.checkpoint.save(state, folder, mesh)
    like = {k: torch.empty_like(v, device="meta") for k, v in params.items()}
    state = fzero.checkpoint.load(
        folder, mesh, opt, like, stage=stages[1], units=UNITS, precision=prec
    )
    step = fzero.sharded_step(make_loss(model, BF16), opt, mesh, stage=stages[1], units=UNITS)
    for t in range(2, xs.shape[0]):
        state, _ = step(state, (xs[t, mesh.rank], ys[t, mesh.rank]))
    return fzero.master_params(state, mesh), fzero.gather_params(state.params, mesh)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stages", [(1, 1), (3, 3), (0, 2)])
def test_master_dtype_alone_resumes_with_its_masters(
    stages: tuple[int, int], tmp_path: Any
) -> None:
    """The checkpoint holds the float32 masters; loaded with the same precision, the
    parameters computed in float32 with no masters, 3e-4 off torch.optim after four steps
    (a reader of this stop's diff): they compute in params_like's bfloat16 again."""
    xs, ys = data(2, 4)
    start, masters = _bf16_reference(xs, ys)
    for got, params in run(2, _bf16_masters_resumed, xs, ys, stages, str(tmp_path / "ck")):
        for k, m in masters.items():
            assert got[k].dtype == FP32 and params[k].dtype == BF16, k
            assert not torch.equal(got[k], start[k].float())  # trained
            torch.testing.assert_close(got[k], m, rtol=0, atol=0, msg=k)
