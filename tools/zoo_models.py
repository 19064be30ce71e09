"""The model zoo swept by ``python -m mutwo.tools.zoo``: tiny models a user might bring, built
without downloads (torchvision with ``weights=None``, transformers from small configs, RNNs).

Each entry builds ``(model, batch, loss_fn)`` on CPU. ``ci`` marks the cheap subset the test
suite sweeps; ``expect`` is ``"ok"`` or the start of the sentence mutwo must refuse the model
with.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from mutwo.tools.workloads import ImageClassifier

Built = tuple[nn.Module, Any, Callable[[Any, Any], torch.Tensor]]

#: torchvision classifiers above this many parameters are left out of the CPU sweep (their
#: Adam state alone takes gigabytes); the table says so.
MAX_PARAMETERS = 150_000_000


@dataclass(frozen=True)
class ZooModel:
    """One model of the sweep."""

    name: str
    family: str
    build: Callable[[], Built]
    ci: bool = False
    expect: str = "ok"


# -- torchvision ---------------------------------------------------------------------------------
#: Input sizes for the classifiers that need more than the default 32x32 (or accept a smaller
#: ``image_size``), and keyword arguments they are built with.
_IMAGE_SIZE = {"inception_v3": 80, "googlenet": 48, "maxvit_t": 224, "alexnet": 64, "squeezenet1_0": 48,
               "squeezenet1_1": 48, "vgg11": 32, "swin_t": 64, "swin_s": 64, "swin_b": 64, "swin_v2_t": 64,
               "swin_v2_s": 64, "swin_v2_b": 64}  # fmt: skip
_VIT = {"vit_b_16": 16, "vit_b_32": 32, "vit_l_16": 16, "vit_l_32": 32, "vit_h_14": 14}
_CI_VISION = {"squeezenet1_1"}


def _logits(output: Any) -> torch.Tensor:
    # GoogLeNet and Inception return a named tuple with auxiliary logits in training mode.
    return output[0] if isinstance(output, tuple) else output


def _classification_loss(output: Any, batch: Any) -> torch.Tensor:
    return F.cross_entropy(_logits(output), batch[1])


def _torchvision(name: str) -> Callable[[], Built]:
    def build() -> Built:
        import torchvision

        kwargs: dict[str, Any] = {"num_classes": 10}
        size = _IMAGE_SIZE.get(name, 32)
        if name in _VIT:
            size = _VIT[name] * 2
            kwargs["image_size"] = size
        if name in ("googlenet", "inception_v3"):
            kwargs["init_weights"] = False  # scipy's truncated normal is slow and not needed here
        if name == "inception_v3":
            kwargs["aux_logits"] = False  # the auxiliary head needs 299 px inputs: too slow on CPU
        net = torchvision.models.get_model(name, weights=None, **kwargs)
        images = torch.randn(2, 3, size, size)
        return ImageClassifier(net), (images, torch.randint(0, 10, (2,))), _classification_loss

    return build


#: The smallest classifier of each torchvision family: swept first, so that a sweep cut short
#: still covers every family.
_FIRST = ["squeezenet1_1", "mobilenet_v3_small", "resnet18", "densenet121", "mobilenet_v2", "efficientnet_b0",
          "efficientnet_v2_s", "convnext_tiny", "regnet_x_400mf", "regnet_y_400mf", "shufflenet_v2_x0_5",
          "mnasnet0_5", "googlenet", "inception_v3", "alexnet", "vgg11", "swin_t", "swin_v2_t", "vit_b_32",
          "maxvit_t", "resnext50_32x4d", "wide_resnet50_2"]  # fmt: skip


def _torchvision_models() -> list[ZooModel]:
    import torchvision

    every = torchvision.models.list_models(module=torchvision.models)
    ordered = [n for n in _FIRST if n in every] + [n for n in every if n not in _FIRST]
    return [ZooModel(name, "torchvision", _torchvision(name), ci=name in _CI_VISION) for name in ordered]


# -- transformers --------------------------------------------------------------------------------
_VOCAB, _SEQ = 64, 8


def _model_loss(output: Any, batch: Any) -> torch.Tensor:
    return output.loss


def _text(cls_name: str, config_name: str, labels: str = "ids", **config: Any) -> Callable[[], Built]:
    """A transformers text model from a tiny config; ``labels`` is ``ids`` (language modelling,
    the ids tensor itself, as users pass it), ``class`` (one label per sequence) or ``decoder``
    (sequence-to-sequence: separate decoder labels)."""

    def build() -> Built:
        import transformers

        model_config = getattr(transformers, config_name)(vocab_size=_VOCAB, **config)
        model_config._attn_implementation = "sdpa" if cls_name not in _EAGER_ATTENTION else "eager"
        model = getattr(transformers, cls_name)(model_config)
        ids = torch.randint(0, _VOCAB, (2, _SEQ))
        batch: dict[str, torch.Tensor] = {"input_ids": ids}
        if labels == "ids":
            batch["labels"] = ids  # the same tensor twice, like the usual causal-LM batch
        elif labels == "class":
            batch["labels"] = torch.randint(0, 2, (2,))
        else:
            batch["labels"] = torch.randint(0, _VOCAB, (2, _SEQ // 2))
        return model, batch, _model_loss

    return build


#: Families whose attention has no SDPA form in every supported transformers version.
_EAGER_ATTENTION = {"GPTNeoForCausalLM"}


def _vit() -> Built:
    import transformers

    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                    image_size=16, patch_size=4, num_labels=3)  # fmt: skip
    model = transformers.ViTForImageClassification(config)
    batch = {"pixel_values": torch.randn(2, 3, 16, 16), "labels": torch.randint(0, 3, (2,))}
    return model, batch, _model_loss


def _whisper() -> Built:
    import transformers

    config = transformers.WhisperConfig(vocab_size=_VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1,
                                        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
                                        max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        decoder_start_token_id=1)  # fmt: skip
    model = transformers.WhisperForConditionalGeneration(config)
    batch = {"input_features": torch.randn(2, 8, 16), "labels": torch.randint(3, _VOCAB, (2, 6))}
    return model, batch, _model_loss


_BERTLIKE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 32}  # fmt: skip
_DECODER = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 32}  # fmt: skip
_ENC_DEC = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
            "decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64,
            "max_position_embeddings": 32}  # fmt: skip


def _transformers_models() -> list[ZooModel]:
    text = [
        ("bert", _text("BertForMaskedLM", "BertConfig", **_BERTLIKE), True),
        ("bert-classifier", _text("BertForSequenceClassification", "BertConfig", labels="class", **_BERTLIKE), False),
        ("roberta", _text("RobertaForMaskedLM", "RobertaConfig", pad_token_id=1, **_BERTLIKE), False),
        ("distilbert", _text("DistilBertForMaskedLM", "DistilBertConfig", dim=32, n_layers=2, n_heads=2,
                             hidden_dim=64, max_position_embeddings=32), False),  # fmt: skip
        ("gpt2", _text("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=2, n_positions=32), False),
        ("gpt-neo", _text("GPTNeoForCausalLM", "GPTNeoConfig", hidden_size=32, num_layers=2, num_heads=2,
                          attention_types=[[["global", "local"], 1]], window_size=4,
                          max_position_embeddings=32), False),  # fmt: skip
        ("llama", _text("LlamaForCausalLM", "LlamaConfig", **_DECODER), True),
        ("mistral", _text("MistralForCausalLM", "MistralConfig", sliding_window=4, **_DECODER), False),
        ("t5", _text("T5ForConditionalGeneration", "T5Config", labels="decoder", d_model=32, d_ff=64, d_kv=16,
                     num_layers=1, num_heads=2, decoder_start_token_id=0), True),  # fmt: skip
        ("bart", _text("BartForConditionalGeneration", "BartConfig", labels="decoder", **_ENC_DEC), False),
    ]
    models = [ZooModel(name, "transformers", build, ci=ci) for name, build, ci in text]
    models.append(ZooModel("vit-hf", "transformers", _vit))
    models.append(ZooModel("whisper", "transformers", _whisper))
    return models


# -- recurrent networks --------------------------------------------------------------------------
class _RecurrentLM(nn.Module):
    def __init__(self, cell: type[nn.RNNBase], layers: int, bidirectional: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(_VOCAB, 16)
        self.rnn = cell(16, 16, num_layers=layers, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(32 if bidirectional else 16, _VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(ids))
        return self.head(hidden)


def _recurrent(cell: type[nn.RNNBase], layers: int = 1, bidirectional: bool = False) -> Callable[[], Built]:
    def build() -> Built:
        ids = torch.randint(0, _VOCAB, (2, _SEQ))

        def loss_fn(logits: torch.Tensor, batch: Any) -> torch.Tensor:
            return F.cross_entropy(logits.reshape(-1, _VOCAB), batch[0].reshape(-1))

        return _RecurrentLM(cell, layers, bidirectional), (ids,), loss_fn

    return build


def _recurrent_models() -> list[ZooModel]:
    return [
        ZooModel("lstm", "rnn", _recurrent(nn.LSTM), ci=True),
        ZooModel("lstm-2layer-bidirectional", "rnn", _recurrent(nn.LSTM, 2, True)),
        ZooModel("gru", "rnn", _recurrent(nn.GRU)),
        ZooModel("rnn-tanh", "rnn", _recurrent(nn.RNN)),
    ]


# -- what mutwo refuses -------------------------------------------------------------------------
class _OneLayer(nn.Module):
    """A linear layer; the subclasses below each add one construct mutwo refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)


class _Branchy(_OneLayer):
    """Python control flow on a tensor's value."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y.relu() if y.sum() > 0 else y


class _MaskedSelect(_OneLayer):
    """Boolean-mask indexing: the output's shape depends on the values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return y[y > 0]


class _Normalizes(_OneLayer):
    """Writes into its input, which the batch passes twice."""

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean())
        return self.linear(x) - target


def _refused(module: type[nn.Module], twice: bool = False) -> Callable[[], Built]:
    def build() -> Built:
        x = torch.randn(2, 8)
        return module(), ((x, x) if twice else (x,)), lambda output, batch: output.square().mean()

    return build


_DATA_DEPENDENT = "the model's forward has data-dependent control flow (it reads a tensor's value in Python)"


def _refused_models() -> list[ZooModel]:
    return [
        ZooModel("python-branch-on-a-value", "refused", _refused(_Branchy), ci=True, expect=_DATA_DEPENDENT),
        ZooModel("boolean-mask-indexing", "refused", _refused(_MaskedSelect), ci=True,
                 expect="the model's forward makes a tensor whose shape depends on tensor values (aten.nonzero"),
        ZooModel("writes-a-batch-tensor-passed-twice", "refused", _refused(_Normalizes, twice=True), ci=True,
                 expect="batch[1] and batch[0] share memory and the training step writes to batch[0] in place"),
    ]  # fmt: skip


def zoo() -> list[ZooModel]:
    """Every model of the sweep, in table order (the cheap ones first)."""
    return _refused_models() + _recurrent_models() + _transformers_models() + _torchvision_models()
