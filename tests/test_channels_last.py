"""Training channels-last (``memory_format: channels_last``): the config option, and a channels-last
model through mutwo's capture, recompute and rewrite, bitwise equal to eager training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import fx

from mutwo import optimize
from mutwo.ir.to_fx import NODE_ID_META, to_fx
from mutwo.tools.config import Config, ModelSpec
from mutwo.tools.mutwo_opt import EXIT_OK, EXIT_USAGE, main
from mutwo.tools.workloads import Workload, channels_last
from tests import models

REPO = Path(__file__).resolve().parent.parent
CNN_CONFIG = """\
model: {source: torchvision, name: resnet18}
batch_size: 8
input: {image_size: 32}
optimizer: {name: sgd, lr: 0.1, momentum: 0.9}
memory_format: channels_last
budget: min
passes: profile,select,rewrite
"""


def laid_out_channels_last(workload: Workload) -> Workload:
    return channels_last(workload, "test cnn")


def test_the_option_lays_out_4d_parameters_and_images_only() -> None:
    work = laid_out_channels_last(models.cnn())
    conv = work.model.net[0].weight
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    images, labels = work.batch
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    assert labels.is_contiguous()  # 1-D: untouched


def test_a_model_without_4d_tensors_is_refused() -> None:
    from mutwo.tools.config import ConfigError

    with pytest.raises(ConfigError, match="model 'mlp' and its batch have none; remove memory_format"):
        channels_last(models.mlp(), "mlp")


def test_a_channels_last_cnn_with_recompute_trains_bitwise_like_eager() -> None:
    mine, eager = laid_out_channels_last(models.cnn(batch_size=8)), laid_out_channels_last(models.cnn(batch_size=8))
    my_opt = torch.optim.SGD(mine.model.parameters(), lr=0.1, momentum=0.9)
    eager_opt = torch.optim.SGD(eager.model.parameters(), lr=0.1, momentum=0.9)
    step = optimize(mine.model, my_opt, mine.batch, mine.loss_fn, budget="min")
    assert step.last is not None and step.last.plan.entries, "min should make select recompute something"
    for _ in range(3):
        assert torch.equal(step(mine.batch), models.eager_step(eager, eager_opt))
    for (name, mine_p), eager_p in zip(mine.model.named_parameters(), eager.model.parameters(), strict=True):
        assert torch.equal(mine_p, eager_p), name
        assert mine_p.stride() == eager_p.stride(), f"{name}: the update changed the layout"


def test_the_recomputed_activations_keep_the_channels_last_strides() -> None:
    """A recompute clone replays its op from the same inputs, so it must give the original's
    strides: the kernels after it (and their speed) depend on them. The IR records no strides, so
    the final graph is run node by node and each 4-D clone's output compared with its original's."""
    work = laid_out_channels_last(models.cnn(batch_size=8))
    step = optimize(work.model, torch.optim.SGD(work.model.parameters(), lr=0.1), work.batch, work.loss_fn,
                    budget="min")  # fmt: skip
    optimized = step.last
    assert optimized is not None
    strides: dict[int, tuple[int, ...]] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node: fx.Node) -> object:
            out = super().run_node(node)
            if NODE_ID_META in node.meta and isinstance(out, torch.Tensor) and out.dim() == 4:
                strides[node.meta[NODE_ID_META]] = out.stride()
            return out

    with torch.no_grad():
        Recorder(to_fx(optimized.graph)).run(*[t.clone() for t in optimized.inputs])
    clones = [n for n in optimized.graph if n.origin is not None and n.id in strides]
    assert clones, "the CNN's plan should recompute some 4-D activation"
    for clone in clones:
        assert strides[clone.id] == strides[clone.origin], (clone.name, strides[clone.id], strides[clone.origin])
        assert strides[clone.id][1] == 1, f"{clone.name} is not channels-last"  # NHWC: channels innermost


def test_mutwo_opt_memory_format_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "cnn.yaml"
    config.write_text(CNN_CONFIG)
    out = tmp_path / "out"
    assert main(["-q", "--device", "cpu", "--check", "-o", str(out), str(config)]) == EXIT_OK
    assert '"equivalent": true' in (out / "summary.json").read_text()
    bad = tmp_path / "bad"
    assert main(["-q", "--device", "cpu", "--memory-format", "nhwc", "-o", str(bad), str(config)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown memory format 'nhwc'; use one of contiguous, channels_last" in err and not bad.exists()


def test_mutwo_opt_refuses_it_without_images(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    code = main(["-q", "--device", "cpu", "--memory-format", "channels_last", "-o", str(out),
                 str(REPO / "examples" / "tiny_mlp.yaml")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and len(err.splitlines()) == 1 and "remove memory_format" in err
    assert not out.exists()


def test_the_default_is_contiguous() -> None:
    assert Config(name="x", path=Path("x.yaml"), model=ModelSpec("python", "m.py:f")).memory_format == "contiguous"
