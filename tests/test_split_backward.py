"""Split backward (runtime/split_backward.py): B (input gradients) then W (weight gradients)
must accumulate what one ``torch.autograd.backward(roots, grad_outputs, inputs=params + inputs)``
accumulates, with no product computed twice.

Every comparison runs the same computation twice -- on deep copies of the module and clones of the
inputs -- once with the plain backward (the reference) and once split. ``torch.equal`` is used
where B + W perform the same arithmetic as the reference (same kernels, each gradient summed from
the same contributions in one engine call); a tolerance only where the summation order of three or
more contributions may legitimately differ, as each test says.
"""

from __future__ import annotations

import copy
import functools
import random
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torchpipedream.model.split_backward import WeightGradients, backward_inputs

Forward = Callable[..., Any]


def _as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _grads(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    return [t.grad for t in tensors]


def _compare(make: Callable[[], nn.Module], forward: Forward, shapes: Sequence[tuple[int, ...]], *,
             inputs_require_grad: bool = True, existing_grad: bool = False, autocast: bool = False,
             exact: bool = True, seed: int = 0) -> tuple[list[Any], list[Any]]:
    """Run ``forward(module, *inputs)`` on a module and on its deep copy; backward the copy in one
    call (the reference) and the original split (B, then W). Checks that B leaves the params'
    gradients alone and gives the inputs theirs, then that W completes the params'."""
    torch.manual_seed(seed)
    module = make()
    ref_module = copy.deepcopy(module)
    data = [torch.randn(*s) for s in shapes]
    xs = [d.clone().requires_grad_(inputs_require_grad) for d in data]
    ref_xs = [d.clone().requires_grad_(inputs_require_grad) for d in data]
    params, ref_params = list(module.parameters()), list(ref_module.parameters())
    if existing_grad:
        for p, q in zip(params, ref_params):
            g = torch.randn_like(p)
            p.grad, q.grad = g.clone(), g.clone()
    before = [None if p.grad is None else p.grad.clone() for p in params]
    held = [p.grad for p in params]  # the buffers AccumulateGrad must add into in place
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = _as_tuple(forward(module, *xs))
        ref_out = _as_tuple(forward(ref_module, *ref_xs))
    grad_outputs = [torch.randn_like(o) if o.numel() > 1 else None for o in out]
    if all(g is None for g in grad_outputs):
        grad_outputs = None
    inputs = xs if inputs_require_grad else []
    ref_inputs = ref_xs if inputs_require_grad else []
    torch.autograd.backward(ref_out, grad_tensors=grad_outputs, inputs=ref_params + ref_inputs)

    work = backward_inputs(out, grad_outputs, inputs, params)
    assert isinstance(work, WeightGradients)
    for p, b in zip(params, before):  # B touched no weight gradient
        assert (p.grad is None) == (b is None) and (b is None or torch.equal(p.grad, b))
    _check(_grads(inputs), _grads(ref_inputs), exact=True)  # inputs: complete after B
    work.run()
    _check(_grads(params), _grads(ref_params), exact=exact)
    _check(_grads(inputs), _grads(ref_inputs), exact=True)  # W does not touch them
    for p, h in zip(params, held):
        if h is not None:
            assert p.grad is h, "an existing .grad must be accumulated into in place"
    return _grads(params), _grads(ref_params)


def _check(got: Sequence[torch.Tensor | None], want: Sequence[torch.Tensor | None], *, exact: bool) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g is None) == (w is None), f"gradient {i}: {g is None=} {w is None=}"
        if g is None:
            continue
        assert g.dtype == w.dtype and g.shape == w.shape
        if exact:
            assert torch.equal(g, w), f"gradient {i} differs by {(g - w).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


class MLP(nn.Module):
    def __init__(self, n: int = 4, d: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _call(module: nn.Module, *xs: torch.Tensor) -> Any:
    return module(*xs)


# --- the stages of a pipeline ---------------------------------------------------------------

def test_mlp_chain_exact() -> None:
    """Exact: B computes each input product, W each weight product, with the same kernels."""
    _compare(MLP, _call, [(5, 8)])


def test_scalar_loss_without_grad_outputs_exact() -> None:
    """Exact: a last stage's scalar loss, grad_outputs None (implicit ones, as autograd)."""
    _compare(MLP, lambda m, x: m(x).pow(2).mean(), [(5, 8)])


def test_first_stage_without_inputs_exact() -> None:
    """Exact: no inputs, so B does nothing and W is the whole backward in one engine call."""
    _compare(MLP, _call, [(5, 8)], inputs_require_grad=False)


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def test_residual_block_exact() -> None:
    """Exact: the skip connection adds into the input's gradient in B, as in the reference."""
    _compare(Residual, _call, [(5, 8)])


class TwiceLinear(nn.Module):
    """The same Linear applied before and after another layer: its weight and bias are reached
    from two boundary nodes, one upstream of the other along the input path."""

    def __init__(self, between: bool = True) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.between = between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.between:
            return self.a(torch.relu(self.b(torch.relu(self.a(x)))))
        return self.a(torch.relu(self.a(x)))


@pytest.mark.parametrize("between", [True, False])
def test_weight_used_twice_exact(between: bool) -> None:
    """Exact: both uses of the shared weight are summed once, in one W engine call (two
    contributions, so the order of the sum cannot matter) -- no double counting."""
    _compare(lambda: TwiceLinear(between), _call, [(5, 8)])


class ThreeTimes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) @ self.w @ self.w


def test_matrix_used_three_times_along_the_input_path() -> None:
    """Tolerance: three contributions to one gradient, which the engine may sum in either order."""
    _compare(ThreeTimes, _call, [(5, 8)], exact=False)


class TiedEmbedding(nn.Module):
    """Embedding and output projection sharing one matrix (a single-stage language model)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(h.shape[0]) % 10
        z = torch.tanh(self.body(h + self.embed(ids)))
        return z @ self.embed.weight.t()


@pytest.mark.parametrize("inputs_require_grad", [True, False])
def test_tied_embedding_exact(inputs_require_grad: bool) -> None:
    """Exact: two contributions to the tied matrix, summed in one call."""
    _compare(TiedEmbedding, _call, [(5, 8)], inputs_require_grad=inputs_require_grad)


class TransformerBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def test_transformer_block_exact() -> None:
    """Exact: LayerNorm, packed-projection attention, GELU; LayerNorm's backward kernel computes
    its input gradient in B and its affine gradients in W from the same reductions."""
    _compare(TransformerBlock, _call, [(2, 5, 16)])


class SDPABlock(nn.Module):
    """Separate q/k/v projections (parallel boundary nodes: one W call) and SDPA."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_sdpa_block_exact() -> None:
    """Exact."""
    _compare(SDPABlock, _call, [(2, 5, 8)])


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn, self.conv2 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.bn(self.conv1(x))))


def test_conv_batchnorm_exact() -> None:
    """Exact: convolution and batch-norm backward kernels with output masks (input in B, weight
    and bias in W)."""
    _compare(ConvBN, _call, [(2, 3, 8, 8)])


class SeveralOutputs(nn.Module):
    """Outputs: two depend on the first input, one on the second, one on no input at all."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 3), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.relu(self.a(x))
        return self.b(h), self.c(h) * self.scale, self.d(y), self.scale * 2


def test_several_outputs_with_grad_outputs_exact() -> None:
    """Exact: a tuple of roots with their grad_outputs; an input feeding only part of the
    graph; an output that depends on no input (W starts at that root)."""
    _compare(SeveralOutputs, _call, [(5, 8), (5, 8)])


class Chunked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.p = nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first, second = self.a(x).chunk(2, dim=1)
        pt = self.p.t()
        return first, second, pt, x @ pt, x


def test_roots_sharing_nodes_and_passthrough_exact() -> None:
    """Exact: two outputs of one node, a root that is also an intermediate of another root,
    an input passed through as an output."""
    _compare(Chunked, _call, [(5, 8)])


def test_accumulates_into_existing_grad_exact() -> None:
    """Exact: params with a .grad already are added into, in place (checked by identity)."""
    _compare(MLP, _call, [(5, 8)], existing_grad=True)
    _compare(TwiceLinear, _call, [(5, 8)], existing_grad=True)
    _compare(MLP, _call, [(5, 8)], existing_grad=True, inputs_require_grad=False)


class PartlyUsed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.unused = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def test_params_not_reached_get_no_gradient() -> None:
    """Exact; the unused Linear's parameters keep .grad None, as in the reference."""
    got, _ = _compare(PartlyUsed, _call, [(5, 8)])
    assert got[2] is None and got[3] is None


@pytest.mark.parametrize("make", [MLP, TwiceLinear, TiedEmbedding, TransformerBlock])
def test_bf16_autocast_exact(make: Callable[[], nn.Module]) -> None:
    """Exact: under CPU bf16 autocast (weights cast by ToCopy nodes, cached casts shared by
    several uses of one weight)."""
    _compare(make, _call, [(2, 5, 16)] if make is TransformerBlock else [(5, 8)], autocast=True)


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: g * 3)  # on a boundary node's output: runs again when W restarts it
        k = self.b(torch.relu(h))
        k.register_hook(lambda g: g * 2)
        return torch.tanh(k)


def test_tensor_hooks_on_intermediates_apply_once_exact() -> None:
    """Exact: gradient-changing tensor hooks act once, although W re-runs their nodes."""
    _compare(Hooked, _call, [(5, 8)])


class Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w = ctx.saved_tensors
        return (g @ w.t() if ctx.needs_input_grad[0] else None,
                x.t() @ g if ctx.needs_input_grad[1] else None)


class WithCustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(torch.relu(Matmul.apply(x, self.w)))


def test_custom_autograd_function_exact() -> None:
    """Exact (a custom Function computes all its gradients in B and again in W, discarding the
    ones not asked for; the results are unchanged)."""
    _compare(WithCustomFunction, _call, [(5, 8)])


def test_non_leaf_input_exact() -> None:
    """Exact: an input that is not a leaf (its .grad retained, as backward(inputs=...) does),
    whose gradient W must not add again."""
    torch.manual_seed(0)
    module = nn.Linear(8, 8)
    ref = copy.deepcopy(module)
    base = torch.randn(5, 8, requires_grad=True)
    ref_base = base.detach().clone().requires_grad_()
    x, ref_x = base * 2, ref_base * 2
    out, ref_out = module(x), ref(ref_x)
    g = torch.randn_like(out)
    torch.autograd.backward([ref_out], [g], inputs=list(ref.parameters()) + [ref_x])
    backward_inputs([out], [g], [x], list(module.parameters())).run()
    _check(_grads([*module.parameters(), x]), _grads([*ref.parameters(), ref_x]), exact=True)
    assert base.grad is None and ref_base.grad is None


# --- activation checkpointing ---------------------------------------------------------------

class Checkpointed(nn.Module):
    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.shared = shared
        self.recomputations = 0

    def region(self, t: torch.Tensor) -> torch.Tensor:
        self.recomputations += 1
        t = torch.relu(self.b(torch.relu(self.a(t))))
        return self.a(t) if self.shared else t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(checkpoint(self.region, x, use_reentrant=False))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
def test_non_reentrant_checkpoint_region_exact(shared: bool, autocast: bool) -> None:
    """Exact: a non-reentrant checkpoint region (its saved tensors unpacked once in B and again
    in W, from a recomputation for each), with and without a weight shared inside it."""
    _compare(lambda: Checkpointed(shared), _call, [(5, 8)], autocast=autocast)


def test_checkpoint_region_recomputed_once_for_b_and_once_for_w() -> None:
    """The W calls share one recomputation of the region where torch offers
    ``GraphExecGroup``; the whole backward recomputes once."""
    torch.manual_seed(0)
    module = Checkpointed()
    x = torch.randn(5, 8, requires_grad=True)
    out = module(x)
    module.recomputations = 0
    work = backward_inputs([out], [torch.ones_like(out)], [x], list(module.parameters()))
    assert module.recomputations == 1
    work.run()
    has_group = hasattr(torch.utils.checkpoint, "GraphExecGroup")
    assert module.recomputations == 2 if has_group else module.recomputations >= 2


class SelectiveCheckpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def save_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            products = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return CheckpointPolicy.MUST_SAVE if op in products else CheckpointPolicy.PREFER_RECOMPUTE

        return checkpoint(lambda t: torch.tanh(self.b(torch.relu(self.a(t)))), x, use_reentrant=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts, save_products))


def test_selective_checkpoint_region_is_refused_clearly() -> None:
    """Selective activation checkpointing consumes its saved activations in B's recomputation;
    W says so with a NotImplementedError instead of a bare autograd error."""
    torch.manual_seed(0)
    module = SelectiveCheckpointed()
    x = torch.randn(5, 8, requires_grad=True)
    out = module(x)
    work = backward_inputs([out], [torch.ones_like(out)], [x], list(module.parameters()))
    with pytest.raises(NotImplementedError, match="selective activation checkpoint"):
        work.run()


# --- work done: no product computed twice ---------------------------------------------------

class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _products(counts: Counter[str]) -> int:
    return sum(counts[k] for k in ("mm", "addmm", "bmm", "baddbmm", "matmul"))


@pytest.mark.parametrize("n", [1, 4, 7])
def test_chain_of_linears_runs_each_product_once(n: int) -> None:
    """B runs the n input-gradient products (and the ReLU chain), W the n weight-gradient
    products and bias sums, and nothing of the input path: together what the full backward does."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(n)])
    params = list(model.parameters())
    x = torch.randn(8, 16, requires_grad=True)
    g = torch.randn(8, 16)
    ref_out = model(x)
    with _CountOps() as ref:
        torch.autograd.backward([ref_out], [g], inputs=params + [x])
    out = model(x)
    with _CountOps() as b:
        work = backward_inputs([out], [g], [x], params)
    with _CountOps() as w:
        work.run()
    assert _products(ref.counts) == 2 * n
    assert _products(b.counts) == n
    assert _products(w.counts) == n
    assert b.counts["threshold_backward"] == n and w.counts["threshold_backward"] == 0
    assert b.counts["sum"] == 0 and w.counts["sum"] == n  # bias gradients only in W


def test_first_stage_w_is_one_full_backward() -> None:
    """No inputs: B runs nothing at all, W exactly the reference's operators."""
    torch.manual_seed(0)
    model = MLP(3, 16)
    params = list(model.parameters())
    x = torch.randn(8, 16)
    g = torch.randn(8, 16)
    ref_out = model(x)
    with _CountOps() as ref:
        torch.autograd.backward([ref_out], [g], inputs=params)
    for p in params:
        p.grad = None
    out = model(x)
    with _CountOps() as b:
        work = backward_inputs([out], [g], [], params)
    with _CountOps() as w:
        work.run()
    assert sum(b.counts.values()) == 0
    assert w.counts == ref.counts


def test_shared_weight_b_runs_only_input_products() -> None:
    """A Linear used twice along the input path: B still runs only the three input products; W
    runs the three weight products (plus, documented, one input product it discards)."""
    torch.manual_seed(0)
    model = TwiceLinear()
    x = torch.randn(5, 8, requires_grad=True)
    out = model(x)
    with _CountOps() as b:
        work = backward_inputs([out], [torch.randn_like(out)], [x], list(model.parameters()))
    with _CountOps() as w:
        work.run()
    assert _products(b.counts) == 3
    assert 3 <= _products(w.counts) <= 4
    assert w.counts["threshold_backward"] == 0


# --- memory ---------------------------------------------------------------------------------

class _Box:
    """What a saved activation is packed into: dies with the graph that saved it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _tracked_forward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[weakref.ref[_Box]]]:
    """``model(x)`` with every tensor autograd saves wrapped in a box, and weak references to
    the boxes (dead once the graph has let go of them)."""
    boxes: list[weakref.ref[_Box]] = []

    def pack(t: torch.Tensor) -> _Box:
        box = _Box(t.detach())
        boxes.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        return model(x), boxes


@pytest.mark.parametrize("first_stage", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_graph_released_after_run(first_stage: bool, shared: bool) -> None:
    """W keeps the graph alive after the caller drops the outputs, and lets go of every saved
    activation once it has run (without a garbage collection), although the object lives on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh())
    if shared:
        model[2] = model[0]
    x = torch.randn(4, 8, requires_grad=not first_stage)
    out, boxes = _tracked_forward(model, x)
    work = backward_inputs([out], [torch.ones_like(out)], [] if first_stage else [x], list(model.parameters()))
    del out
    assert boxes and all(r() is not None for r in boxes)
    work.run()
    assert all(r() is None for r in boxes)
    assert all(p.grad is not None for p in model.parameters())


def test_graph_released_when_w_is_dropped_without_running() -> None:
    """A dropped WeightGradients (e.g. a failed step) does not keep the graph alive."""
    model = MLP(2)
    x = torch.randn(4, 8, requires_grad=True)
    out, boxes = _tracked_forward(model, x)
    work = backward_inputs([out], [torch.ones_like(out)], [x], list(model.parameters()))
    del out, work
    assert boxes and all(r() is None for r in boxes)


def test_dropped_w_leaves_the_graph_usable() -> None:
    """Exact: after a WeightGradients is dropped unrun, its pre-hooks are gone: a plain
    backward through the same graph gives the reference's gradients."""
    torch.manual_seed(0)
    model = MLP(3)
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8, requires_grad=True)
    out, ref_out = model(x), ref(x)
    g = torch.randn_like(out)
    work = backward_inputs([out], [g], [x], list(model.parameters()))
    del work
    torch.autograd.backward([out], [g], inputs=list(model.parameters()))
    torch.autograd.backward([ref_out], [g], inputs=list(ref.parameters()))
    _check(_grads(list(model.parameters())), _grads(list(ref.parameters())), exact=True)


# --- random stages --------------------------------------------------------------------------

def _random_program(rng: random.Random, n_params: int) -> tuple[list[tuple[Any, ...]], list[int]]:
    ops = []
    for i in range(rng.randint(1, 9)):
        kind = rng.choice(["linear", "linear", "matmul", "add", "mul", "relu", "tanh", "scale", "checkpoint"])
        ops.append((kind, rng.randrange(2 + i), rng.randrange(2 + i), rng.randrange(n_params),
                    rng.randrange(n_params)))
    roots = sorted({rng.randrange(2, 2 + len(ops)) for _ in range(rng.randint(1, 3))})
    return ops, roots


def _run_program(ops: list[tuple[Any, ...]], roots: list[int], xs: list[torch.Tensor],
                 ws: list[torch.Tensor], bs: list[torch.Tensor]) -> list[torch.Tensor]:
    vals = list(xs)
    for kind, a, b, p, q in ops:
        u, v = vals[a], vals[b]
        if kind == "linear":
            r = F.linear(u, ws[p], bs[q])
        elif kind == "matmul":
            r = u @ ws[p]
        elif kind == "add":
            r = u + v
        elif kind == "mul":
            r = u * v * 0.5
        elif kind == "relu":
            r = torch.relu(u)
        elif kind == "tanh":
            r = torch.tanh(u)
        elif kind == "scale":
            r = u * bs[q]
        else:
            r = checkpoint(lambda s, t, p=p, q=q: torch.tanh(F.linear(s, ws[p], bs[q])) * t, u, v,
                           use_reentrant=False)
        vals.append(r)
    return [vals[i] for i in roots]


def test_random_stages_exact() -> None:
    """Exact, over random stages: shared weights anywhere, inputs with and without gradients,
    several roots, checkpoint regions, autocast, existing gradients (at most two contributions
    per gradient in practice here; the engine sums the same contributions either way)."""
    checked = 0
    for seed in range(120):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        n_params = rng.randint(1, 3)
        ops, roots = _random_program(rng, n_params)
        autocast = rng.random() < 0.3
        wants = [rng.random() < 0.7, rng.random() < 0.5]
        existing = rng.random() < 0.3
        x0 = [torch.randn(4, 6) for _ in range(2)]
        w0 = [torch.randn(6, 6) / 2 for _ in range(n_params)]
        b0 = [torch.randn(6) for _ in range(n_params)]
        results = []
        for split in (False, True):
            xs = [x.clone().requires_grad_(r) for x, r in zip(x0, wants)]
            ws = [w.clone().requires_grad_() for w in w0]
            bs = [b.clone().requires_grad_() for b in b0]
            if existing:
                for t in ws + bs:
                    t.grad = torch.ones_like(t)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                outs = [o for o in _run_program(ops, roots, xs, ws, bs) if o.requires_grad]
            if not outs:
                break
            gen = torch.Generator().manual_seed(seed)
            grads = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
            inputs = [x for x in xs if x.requires_grad]
            if split:
                backward_inputs(outs, grads, inputs, ws + bs).run()
            else:
                torch.autograd.backward(outs, grads, inputs=ws + bs + inputs)
            results.append(_grads(ws + bs + xs))
        if len(results) == 2:
            checked += 1
            _check(results[1], results[0], exact=True)
    assert checked > 80


# --- errors ---------------------------------------------------------------------------------

def test_run_twice_is_an_error() -> None:
    model = MLP(2)
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)
    work = backward_inputs([out], [torch.ones_like(out)], [x], list(model.parameters()))
    work.run()
    with pytest.raises(RuntimeError, match="already"):
        work.run()


def test_bad_arguments() -> None:
    model = MLP(2)
    x = torch.randn(4, 8, requires_grad=True)
    out = model(x)
    with pytest.raises(RuntimeError, match="implicitly"):
        backward_inputs([out], None, [x], list(model.parameters()))
    with pytest.raises(RuntimeError, match="does not require grad"):
        backward_inputs([out.detach()], [torch.ones_like(out)], [x], list(model.parameters()))
    with pytest.raises(RuntimeError, match="does not require grad"):
        backward_inputs([out], [torch.ones_like(out)], [torch.randn(4, 8)], list(model.parameters()))
    with pytest.raises(ValueError, match="leaf"):
        backward_inputs([out], [torch.ones_like(out)], [x], [model.layers[0].weight * 2])
    with pytest.raises(ValueError, match="grad_outputs"):
        backward_inputs([out], [], [x], list(model.parameters()))
