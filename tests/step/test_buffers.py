"""Buffers (BatchNorm statistics) carried through steps, with each cross-rank policy."""

from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import fzero
from tests.support import run

N, B, STEPS = 3, 4, 3  # simulated ranks; the gloo tests pass their own world size


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # No bias before BatchNorm: its true gradient is zero, so Adam would amplify round-off.
    return nn.Sequential(
        nn.Linear(3, 5, bias=False), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2)
    ).double()


def data(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(STEPS, n * B, 3, generator=g, dtype=torch.float64),
        torch.randn(STEPS, n * B, 2, generator=g, dtype=torch.float64),
    )


def loss_and_buffers(model: nn.Module, params: dict, buffers: dict, batch: tuple) -> tuple:
    x, y = batch
    state = {**params, **buffers}
    out = functional_call(model, state, (x,))  # writes BatchNorm's new statistics into `state`
    return ((out - y) ** 2).mean(), {k: state[k] for k in buffers}


def reference(
    policy: str, n: int = N, absent: tuple[int, int] | None = None
) -> tuple[dict, list[dict]]:
    """One process: each rank's micro-batch with its own batch statistics (DDP semantics),
    the mean of their gradients, torch.optim.Adam, and the buffer policy applied by hand.
    `absent`: (step, rank) where that rank has no data: the mean and the policy over the
    others, its own statistics kept where they are its own ("local")."""
    model = make_model()
    xs, ys = data(n)
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    start = {k: v.detach().clone() for k, v in model.named_buffers()}
    per_rank = [dict(start) for _ in range(n)]
    opt = torch.optim.Adam(params.values(), lr=0.05, foreach=False)
    for t in range(STEPS):
        opt.zero_grad()
        losses, new = [], []
        ran = [r for r in range(n) if (t, r) != absent]
        for r in ran:
            sl = slice(r * B, (r + 1) * B)
            # BatchNorm updates the statistics it is given in place: give each rank its own.
            mine = {k: v.clone() for k, v in per_rank[r].items()}
            loss, bufs = loss_and_buffers(model, params, mine, (xs[t, sl], ys[t, sl]))
            losses.append(loss)
            new.append(bufs)
        (sum(losses) / len(ran)).backward()
        opt.step()
        for r in range(n):
            if policy == "broadcast":
                per_rank[r] = dict(new[0])
            elif policy == "mean":
                per_rank[r] = {
                    k: (sum(b[k] for b in new) / len(ran) if v.is_floating_point() else new[0][k])
                    for k, v in new[0].items()
                }
            elif r in ran:
                per_rank[r] = new[ran.index(r)]
    return {k: v.detach() for k, v in params.items()}, per_rank


def train(
    mesh: fzero.Mesh,
    stage: int,
    policy: str,
    compile: str | bool = False,
    absent: tuple[int, int] | None = None,
) -> tuple[Any, dict]:
    model = make_model()
    xs, ys = data(mesh.size)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt = fzero.optim.adam(lr=0.05)
    state = fzero.shard_state(
        params, opt, mesh, stage=stage, units=["0", "3"], buffers=dict(model.named_buffers())
    )
    step = fzero.sharded_step(
        lambda p, bufs, batch: loss_and_buffers(model, p, bufs, batch),
        opt,
        mesh,
        stage=stage,
        module=model,
        buffer_sync=policy,
        compile=compile,
    )
    sl = slice(mesh.rank * B, (mesh.rank + 1) * B)
    for t in range(STEPS):
        state, _ = step(state, None if (t, mesh.rank) == absent else (xs[t, sl], ys[t, sl]))
    return fzero.gather_params(state.params, mesh), state.buffers


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("policy", ["broadcast", "mean", "local"])
def test_buffers_follow_the_policy_and_params_train_like_ddp(stage: int, policy: str) -> None:
    expected, expected_buffers = reference(policy)
    results = run(N, train, stage, policy)
    for rank, (params, buffers) in enumerate(results):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"rank {rank}")
        fzero.assert_trees_close(
            buffers,
            expected_buffers[rank],
            rtol=1e-12,
            atol=1e-14,
            what=f"{policy} buffers, rank {rank}",
        )
    if policy == "local":  # each rank saw other data, so their statistics really differ
        assert not torch.equal(results[0][1]["1.running_mean"], results[1][1]["1.running_mean"])


def train_and_predict(mesh: fzero.Mesh, stage: int, x: torch.Tensor) -> tuple[Any, dict, Any]:
    """`train` compiled ("mean"), then a compiled `sharded_forward` of the module in
    eval mode (its running statistics) on `x`."""
    params, buffers = train(mesh, stage, "mean", "aot_eager")
    model = make_model().eval()
    state = fzero.shard_state(
        params, fzero.optim.sgd(0.0), mesh, stage=stage, units=["0", "3"], buffers=buffers
    )
    forward = fzero.sharded_forward(
        lambda p, bufs, x: functional_call(model, {**p, **bufs}, (x,)), mesh, compile="aot_eager"
    )
    return params, buffers, forward(state, x)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stage", [0, 3])
def test_buffers_thread_through_a_compiled_step(stage: int) -> None:
    """Compiled (`compile=`): the graph takes each micro-batch's buffers and returns the
    new ones (BatchNorm's in-place update of its statistics inside the graph); the same
    training and statistics as DDP's, averaged over the ranks. A compiled forward reads
    them: the one-process module's predictions with the reference's state."""
    expected, expected_buffers = reference("mean")
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    model = make_model().eval()
    want = functional_call(model, {**expected, **expected_buffers[0]}, (x,))
    for rank, (params, buffers, out) in enumerate(run(N, train_and_predict, stage, x)):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"rank {rank}")
        fzero.assert_trees_close(buffers, expected_buffers[rank], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("stage", "policy", "compile"),
    [(0, "mean", False), (3, "broadcast", False), (2, "local", False), (0, "mean", "aot_eager"),
     (3, "broadcast", "aot_eager"), (1, "local", "aot_eager")],
)  # fmt: skip
def test_a_rank_without_data_keeps_its_buffers_out(stage: int, policy: str, compile: Any) -> None:
    """Rank 0 has no data on the second step: the gradient is the others' mean and the
    buffers follow the policy over the ranks that ran (its own kept, "local"). Compiled,
    it runs its last batch through the graph again for the collectives alone, on copies of
    its buffers, whose new values it drops."""
    absent = (1, 0)
    expected, expected_buffers = reference(policy, absent=absent)
    results = run(N, train, stage, policy, compile, absent)
    for rank, (params, buffers) in enumerate(results):
        fzero.assert_trees_close(params, expected, rtol=1e-10, atol=1e-12, what=f"rank {rank}")
        fzero.assert_trees_close(
            buffers, expected_buffers[rank], rtol=1e-12, atol=1e-14, what=f"rank {rank}"
        )
    # The absence mattered: the whole world's mean would be other values.
    everyone, _ = reference(policy)
    assert fzero._core._tree.max_abs_diff(expected, everyone) > 1e-6


@pytest.mark.multiprocess
def test_a_loss_without_new_buffers_is_a_clear_error() -> None:
    model = make_model()

    def fn(mesh: fzero.Mesh) -> None:
        params = {k: v.detach() for k, v in model.named_parameters()}
        opt = fzero.optim.sgd(lr=0.1)
        state = fzero.shard_state(params, opt, mesh, stage=0, buffers=dict(model.named_buffers()))
        step = fzero.sharded_step(
            lambda p, b, x: functional_call(model, {**p, **b}, (x,)).sum(), opt, mesh, stage=0
        )
        step(state, torch.randn(4, 3, dtype=torch.float64))

    with pytest.raises(TypeError, match=r"must return \(loss, new_buffers\)"):
        run(1, fn)


def misshapen_buffers(mesh: fzero.Mesh, how: str) -> str:
    model = make_model()
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = fzero.optim.sgd(lr=0.1)
    state = fzero.shard_state(params, opt, mesh, stage=2, buffers=dict(model.named_buffers()))

    def loss_fn(p: dict, b: dict, x: torch.Tensor) -> Any:
        loss, new = loss_and_buffers(model, p, b, (x, x[:, :2]))
        if how == "aux nested the other way":  # has_aux wants ((loss, new), aux)
            return (loss, {"rows": x.detach()}), new
        return loss, {**new, "1.running_mean": x.mean(1)}  # a batch-sized "statistic"

    step = fzero.sharded_step(loss_fn, opt, mesh, stage=2, has_aux=how.startswith("aux"))
    try:  # ranks of different batch sizes: their sync would have stopped gloo itself
        step(state, torch.randn(3 + mesh.rank, 3, dtype=torch.float64))
    except (TypeError, fzero.PeerError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("how", "says"),
    [
        ("aux nested the other way", "missing ['1.num_batches_tracked'"),
        ("a batch-sized buffer", "'1.running_mean' is (3,), expected (5,) torch.float64"),
    ],
)
def test_new_buffers_shaped_unlike_the_states_are_a_clear_error(how: str, says: str) -> None:
    """Before, both stepped without a word: the aux dict became the state's buffers, and
    a buffer of each rank's batch size went into the ranks' agreement as it was (in a
    random run, "mean" aborted the process inside gloo's all-reduce)."""
    messages = run(2, misshapen_buffers, how)
    assert says in messages[0] and "((loss, new_buffers), aux)" in messages[0]
    assert all(m != "no error" for m in messages)


def export_with_buffers(mesh: fzero.Mesh) -> Any:
    params, buffers = train(mesh, 2, "mean")
    model = make_model()
    opt = fzero.optim.adam(lr=0.05)
    state = fzero.shard_state(params, opt, mesh, stage=2, buffers=buffers)
    out = fzero.checkpoint.export_torch(state, None, mesh)
    return None if out is None else (out[0], buffers, list(dict(model.named_buffers())))


@pytest.mark.multiprocess
def test_export_includes_buffers_so_a_plain_module_loads_it_strictly() -> None:
    model_sd, buffers, names = run(2, export_with_buffers)[0]
    plain = make_model()
    plain.load_state_dict(model_sd, strict=True)
    for name in names:
        assert torch.equal(dict(plain.named_buffers())[name], buffers[name])
