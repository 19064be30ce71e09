"""Recurrent layers whose forward depends on grad mode: run them as in training, wherever the graph runs.

On CPU, ``nn.LSTM`` traces to ``aten.mkldnn_rnn_layer`` (oneDNN), which returns the workspace its
backward needs only when grad mode is on at *run* time; the captured graph runs under
``torch.no_grad()`` (its backward is explicit), so the workspace came back undefined and
``mkldnn_rnn_layer_backward`` refused it. ``mutwo::mkldnn_rnn_layer`` is the same op called with
grad mode on (its inputs never require grad there, so nothing is recorded); capture swaps it in.
On CUDA, cuDNN's RNN reads raw weight pointers while tracing, which fake tensors do not have:
capture refuses it (``tracing.explain_capture_failure``).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten


@torch.library.custom_op("mutwo::mkldnn_rnn_layer", mutates_args=())
def mkldnn_rnn_layer(input: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                     hx: torch.Tensor, cx: torch.Tensor, reverse: bool, batch_sizes: list[int], mode: int,
                     hidden_size: int, num_layers: int, has_biases: bool, bidirectional: bool, batch_first: bool,
                     train: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``aten.mkldnn_rnn_layer`` in grad mode, so that a training call returns its workspace."""
    with torch.enable_grad():
        outputs = aten.mkldnn_rnn_layer.default(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode,
                                                hidden_size, num_layers, has_biases, bidirectional, batch_first,
                                                train)  # fmt: skip
    return tuple(t.detach() for t in outputs)  # type: ignore[return-value]


@mkldnn_rnn_layer.register_fake
def _(input: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, hx: torch.Tensor,
      cx: torch.Tensor, reverse: bool, batch_sizes: list[int], mode: int, hidden_size: int, num_layers: int,
      has_biases: bool, bidirectional: bool, batch_first: bool,
      train: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return aten.mkldnn_rnn_layer.default(input, w0, w1, w2, w3, hx, cx, reverse, batch_sizes, mode, hidden_size,
                                         num_layers, has_biases, bidirectional, batch_first, train)  # fmt: skip


def run_rnn_layers_in_training_mode(graph: fx.Graph) -> None:
    """Make every oneDNN recurrent layer of ``graph`` call :func:`mkldnn_rnn_layer`."""
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.mkldnn_rnn_layer.default:
            node.target = torch.ops.mutwo.mkldnn_rnn_layer.default
