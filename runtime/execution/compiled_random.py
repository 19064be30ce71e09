"""Random ops in an Inductor-compiled step draw the numbers the eager step draws, or are refused.

Under ``fallback_random`` (:data:`~mutwo.runtime.execution.backends.INDUCTOR_OPTIONS`) Inductor
calls aten's own kernel for each random op, on the default generator, in the graph's order. What
can still differ is the layout a kernel fills: a random kernel draws element after element in
memory order (TensorIterator's), so the same op writing a tensor laid out otherwise puts the same
numbers in other places, and a CPU normal draws another count of numbers on a non-contiguous
tensor than on a contiguous one. Two ops reach their kernel in another layout than eager's:

* ``bernoulli_``, what dropout traces to on the CPU (``nn.Dropout``, ``F.dropout``, the attention
  dropout of ``nn.MultiheadAttention`` and of SDPA's math kernel). AOTAutograd functionalizes it
  into ``bernoulli.p``, whose result is contiguous, so a mask eager draws into a transposed buffer
  (MultiheadAttention's output, transposed back from sequence-first) is drawn in another order:
  issue 40's TinyLM drew the masks after its attentions so. Rewritten here to draw into a contiguous
  buffer whose dimensions run in the target's memory order, then permuted back: eager draws the
  same numbers into that buffer (the kernel's order is the memory order; ``tests/test_compiled_random.py``),
  and its functional form keeps it contiguous.
* ``rand_like``, ``randn_like``, ``randint_like``: Inductor hands them their input as it laid it
  out (contiguous where eager's was channels-last). Rewritten to take the layout from an
  ``empty_like`` of the input, which AOTAutograd decomposes into ``empty_strided`` with eager's
  strides, a layout Inductor keeps.

Every other random op Inductor runs in eager's layout (:data:`EXACT_RANDOM_OPS` says why), or the
step is refused in one sentence naming the op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx
from torch._ops import OpOverloadPacket

from mutwo.ir.graph import Graph
from mutwo.ir.to_fx import NODE_ID_META
from mutwo.runtime.capture.tracing import quiet_torch_errors
from mutwo.runtime.execution.errors import BackendError, CompileError

aten = torch.ops.aten

#: In-place random ops that fill the tensor they are given. Their functional forms (``uniform``,
#: ``normal_functional``, ...) fill a tensor laid out as their input, which is eager's layout when
#: that is a new buffer (``empty_like`` and ``empty`` decompose into ``empty_strided``); a tensor
#: the step computes Inductor may lay out otherwise, so filling one is refused.
FILLING = frozenset({aten.normal_, aten.uniform_, aten.exponential_, aten.geometric_, aten.log_normal_,
                     aten.cauchy_, aten.random_})  # fmt: skip
#: Random ops that take only the layout (and dtype) of their first argument.
LIKE = frozenset({aten.rand_like, aten.randn_like, aten.randint_like})
#: The SDPA kernels of CUDA that draw their dropout from the CUDA generator (philox seed and offset).
CUDA_ATTENTION = frozenset({aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_efficient_attention,
                            aten._scaled_dot_product_cudnn_attention, aten._flash_attention_forward,
                            aten._efficient_attention_forward})  # fmt: skip

#: Their backward kernels: they draw nothing, but make the forward's dropout mask again from the
#: philox seed and offset the forward returned, by each element's logical position.
CUDA_ATTENTION_BACKWARD = frozenset({
    aten._scaled_dot_product_flash_attention_backward, aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward, aten._flash_attention_backward,
    aten._efficient_attention_backward})  # fmt: skip

#: Random ops whose compiled draws equal eager's, and why (the rest are refused).
EXACT_RANDOM_OPS: dict[OpOverloadPacket, str] = {
    aten.bernoulli_: "rewritten here to draw into a contiguous buffer in memory order",
    aten.bernoulli: "its result is contiguous, in eager and compiled alike",
    aten.native_dropout: "Inductor keeps its input at eager's strides under fallback_random",
    aten.rand: "a new contiguous tensor", aten.randn: "a new contiguous tensor",
    aten.randint: "a new contiguous tensor", aten.randperm: "a new contiguous tensor",
    aten.multinomial: "a new contiguous tensor; it reads its probabilities by index",
    **dict.fromkeys(LIKE, "rewritten here to take eager's layout from an empty_like"),
    **dict.fromkeys(FILLING, "fills a new buffer, which Inductor makes at eager's strides"),
    **dict.fromkeys(CUDA_ATTENTION, "an Inductor fallback at eager's strides (sdpa_constraint); BERT's compiled "
                                    "step passes --check on the H100"),
    **dict.fromkeys(CUDA_ATTENTION_BACKWARD, "it draws nothing: it makes the forward's mask again from the seed and "
                                             "offset the forward returned, by position, in any layout"),
}  # fmt: skip

#: Ops that make a new, uninitialized buffer, at eager's strides in the compiled step too.
NEW_BUFFERS = frozenset({aten.empty_like, aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided})


def draw_as_eager(module: fx.GraphModule, graph: Graph, inputs: Sequence[torch.Tensor], backend: str) -> None:
    """Make every random op of ``module`` (lowered from ``graph``; ``inputs`` in slot order, for their
    layouts) draw under Inductor what it draws eagerly, or raise :class:`BackendError` naming the
    first op that would not."""
    refused = undrawable(module, graph, backend)
    if refused is not None:
        raise BackendError(refused)
    random = [node for node in module.graph.nodes if _is_random(node, graph)]
    for node in random:
        if node.target.overloadpacket in LIKE:
            _like_from_empty(module.graph, node)
    masks = [node for node in random if node.target.overloadpacket is aten.bernoulli_]
    if masks:
        values = _eager_values(module, inputs)
        for node in masks:
            _bernoulli_in_eager_layout(module.graph, node, values[node.args[0]])
    module.graph.lint()
    module.recompile()


def undrawable(module: fx.GraphModule, graph: Graph, backend: str) -> str | None:
    """Why ``backend`` (an Inductor one) cannot run ``module`` (lowered from ``graph``) drawing the
    random numbers eager draws, in one sentence naming the first op that would not; None when it can."""
    for node in module.graph.nodes:
        if _is_random(node, graph):
            why = refusal(node)
            if why is not None:
                return (f"the {backend} backend cannot draw the random numbers of {_describe(node, graph)} as eager "
                        f"does: {why}; use --backend eager or cudagraphs, which run aten's kernels on eager's "
                        "tensors")  # fmt: skip
    return None


def refusal(node: fx.Node) -> str | None:
    """Why the random op ``node`` would draw other numbers compiled, or None when it draws eager's."""
    packet = node.target.overloadpacket
    if node.kwargs.get("generator") is not None:
        return "it draws from a generator of its own"
    if packet not in EXACT_RANDOM_OPS:
        return "Inductor may run it on another layout or draw another count of numbers"
    if packet in FILLING and getattr(node.args[0].target, "overloadpacket", None) not in NEW_BUFFERS:
        return "it fills a tensor the step computes, which Inductor may lay out otherwise"
    return None


def _is_random(node: fx.Node, graph: Graph) -> bool:
    """Whether ``node`` draws random numbers (as the IR decides: an attention kernel only with dropout)."""
    return node.op == "call_function" and NODE_ID_META in node.meta and graph.node(node.meta[NODE_ID_META]).is_random


def _describe(node: fx.Node, graph: Graph) -> str:
    return f"%{graph.node(node.meta[NODE_ID_META]).id} ({node.target})"


def _like_from_empty(graph: fx.Graph, node: fx.Node) -> None:
    """``rand_like(x)`` -> ``rand_like(empty_like(x))``: the same op on a buffer at eager's strides."""
    with graph.inserting_before(node):
        layout = _copied(graph.call_function(aten.empty_like.default, (node.args[0],)), node)
    node.args = (layout, *node.args[1:])


def _bernoulli_in_eager_layout(graph: fx.Graph, node: fx.Node, value: torch.Tensor) -> None:
    """Rewrite ``bernoulli_`` of a non-contiguous target (``value``: its eager layout) to draw into a
    contiguous buffer in the target's memory order (functionalized, ``bernoulli_`` becomes
    ``bernoulli.p``, which draws in the target's logical order instead)."""
    if value.is_contiguous():
        return
    target = node.args[0]
    with graph.inserting_before(node):
        drawn = _bernoulli_in_memory_order(graph, node, value)
        fresh = getattr(target.target, "overloadpacket", None) in NEW_BUFFERS and len(target.users) == 1
        if not fresh:  # the target is read elsewhere: write the mask into it
            drawn = _copied(graph.call_function(aten.copy_.default, (target, drawn)), node)
    node.replace_all_uses_with(drawn)
    graph.erase_node(node)
    if fresh:  # a buffer only the mask was drawn into
        graph.erase_node(target)


def _bernoulli_in_memory_order(graph: fx.Graph, node: fx.Node, value: torch.Tensor) -> fx.Node:
    """``bernoulli_`` (``node``) of a contiguous buffer whose dimensions run in the memory order of a
    target laid out as ``value``, permuted back to the target's: the numbers eager draws into the
    target, in the places eager draws them."""
    shape, stride = list(value.shape), value.stride()
    order = sorted(range(len(shape)), key=lambda d: -stride[d])  # outermost first, as TensorIterator walks it
    inverse = [order.index(d) for d in range(len(shape))]
    buffer = _copied(graph.call_function(aten.empty.memory_format, ([shape[d] for d in order],),
                                         {"dtype": value.dtype, "device": value.device}), node)  # fmt: skip
    probability = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
    if isinstance(probability, fx.Node):  # bernoulli_.Tensor: each probability moves with its element
        expanded = _copied(graph.call_function(aten.expand.default, (probability, shape)), node)
        probability = _copied(graph.call_function(aten.permute.default, (expanded, order)), node)
    drawn = _copied(graph.call_function(node.target, (buffer, probability)), node)
    return _copied(graph.call_function(aten.permute.default, (drawn, inverse)), node)


def _copied(new: fx.Node, node: fx.Node) -> fx.Node:
    """``new`` with ``node``'s meta: its IR id, hence its phase for phase-bounded fusion."""
    new.meta = dict(node.meta)
    return new


def _eager_values(module: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> dict[fx.Node, torch.Tensor]:
    """Fake tensors laid out as each tensor node of ``module`` is in an eager run on ``inputs``
    (fake tensors follow eager's layout rules). The module is left without them: AOTAutograd
    traces it again, and the FX graph cache keys what it holds."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    try:
        with quiet_torch_errors():
            FakeTensorProp(module, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)
    except Exception as error:  # the tracing AOTAutograd would do next: its failure, in one line
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CompileError(f"Inductor could not compile the step: tracing it for the layouts of its random ops "
                           f"failed ({type(error).__name__}: {first}); run it with --backend eager") from None
    values = {node: node.meta.pop("val") for node in module.graph.nodes if "val" in node.meta}
    return {node: value for node, value in values.items() if isinstance(value, torch.Tensor)}
