"""save_compact() on architectures beyond the benchmark's and test_remade's transformers, each with a
pattern of its own, from timm's and transformers' configs with random weights: a training step under
install() + save_compact(), in float32 and under bfloat16 autocast, gives PyTorch's loss and every
gradient bit for bit (strides included), with the model's own pattern taken (the ops remade, the
replays). A sweep of 57 such models found none that differs (docs/performance.md, session 48); these
keep its patterns covered."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import pytest
import torch

import relu_ext
from conftest import assert_same_step, train_step

pytestmark = [pytest.mark.native, pytest.mark.torch_version]  # the risk it checks: see tests/tiers.py


def _timm(name: str, side: int, **kwargs: Any) -> Callable[[], tuple[torch.nn.Module, Any]]:
    """timm's `name` (10 classes, `kwargs` to create_model) and a batch of two `side` x `side` images.
    (A residual block whose last BatchNorm starts at zero, timm's default for some, passes no gradient
    to what its branch saved, so a rebuild there could be wrong unseen: those models get
    ``zero_init_last=False``.)"""

    def make() -> tuple[torch.nn.Module, Any]:
        timm = pytest.importorskip("timm")
        return timm.create_model(name, pretrained=False, num_classes=10, **kwargs), torch.randn(2, 3, side, side)

    return make


def _whisper() -> tuple[torch.nn.Module, Any]:
    """transformers' Whisper, 2 + 2 layers of 64, and two 16-bin spectrograms with labels."""
    tf = pytest.importorskip("transformers")
    config = tf.WhisperConfig(vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=256, decoder_ffn_dim=256, num_mel_bins=16,
                              max_source_positions=50, max_target_positions=64, dropout=0.1, decoder_start_token_id=1,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2)
    g = torch.Generator().manual_seed(0)
    inputs = {"input_features": torch.randn(2, 16, 100, generator=g), "labels": torch.randint(3, 512, (2, 20), generator=g)}
    return tf.WhisperForConditionalGeneration(config), inputs


def _wav2vec2() -> tuple[torch.nn.Module, Any]:
    """transformers' wav2vec2 classifier, 2 layers of 64, and two one-second waveforms with labels."""
    tf = pytest.importorskip("transformers")
    # (No SpecAugment: its masks come from NumPy's generator, which the two steps would not share.)
    config = tf.Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
                               conv_dim=(32,) * 7, num_labels=3, hidden_dropout=0.1, feat_proj_dropout=0.1,
                               mask_time_prob=0.0)
    g = torch.Generator().manual_seed(0)
    return tf.Wav2Vec2ForSequenceClassification(config), {"input_values": torch.randn(2, 16000, generator=g),
                                                           "labels": torch.tensor([0, 2])}


# Each model, and what its step must remake (ops by name) or replay (a BatchNorm's activation) in
# float32 and under autocast alike: the pattern it is here for.
ZOO: dict[str, tuple[Callable[[], tuple[torch.nn.Module, Any]], frozenset[str]]] = {
    # LayerNorm over channels last (permuted), GELU, layer scale.
    "convnext_atto": (_timm("convnext_atto", 64), frozenset({"layer_norm", "gelu"})),
    # SiLU after BatchNorm, squeeze-and-excitation (a sigmoid gate's product).
    "efficientnet_b0": (_timm("efficientnet_b0", 64), frozenset({"silu", "mul"})),
    # BatchNorm -> ReLU replays, squeeze-and-excitation.
    "regnety_002": (_timm("regnety_002", 64, zero_init_last=False), frozenset({"replayed", "mul"})),
    # Convolutions unfolded into transformer blocks and folded back, SiLU.
    "mobilevit_xxs": (_timm("mobilevit_xxs", 64, zero_init_last=False), frozenset({"silu", "layer_norm"})),
    # Shifted windows (roll, window partition), relative position bias.
    "swin_tiny": (_timm("swin_tiny_patch4_window7_224", 112, img_size=112), frozenset({"layer_norm", "gelu"})),
    # Encoder-decoder over a 1-D convolution stem, cross-attention.
    "whisper": (_whisper, frozenset({"gelu"})),
    # GroupNorm in a convolutional feature encoder, a weight-normed positional convolution.
    "wav2vec2": (_wav2vec2, frozenset({"gelu"})),
}


@contextlib.contextmanager
def _with_amp(ctx: Any, amp: Callable[[], Any]) -> Iterator[None]:
    """`ctx` and `amp()` together: a step's forward runs under both."""
    with ctx, amp():
        yield


@pytest.mark.quick(cover=(), rest=("model",))  # a real model takes seconds: --rest runs each once
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model", ZOO)
def test_more_architectures_train_bit_for_bit(model, dtype):
    """A training step of `model` under install() + save_compact() (bfloat16: under autocast) gives
    PyTorch's loss and gradients bit for bit, every parameter's, with the model's own pattern taken."""
    make, taken = ZOO[model]
    torch.manual_seed(0)
    net, inputs = make()
    net.train()
    zero = [n for n, p in net.named_parameters() if not n.endswith("bias") and p.numel() > 1 and not p.any()]
    assert not zero, f"weights that start at zero hide what their inputs' rebuilds give: {zero}"
    amp = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == torch.bfloat16 else contextlib.nullcontext
    relu_ext.uninstall()
    want = train_step(net, inputs, _with_amp(contextlib.nullcontext(), amp))
    sc = relu_ext.save_compact()
    with relu_ext.install():
        got = train_step(net, inputs, _with_amp(sc, amp))
    found = set(sc.remade_by_op) | ({"replayed"} if sc.replayed else set())
    assert taken <= found and sc.replay_misses == 0, sc.report()
    assert_same_step(got, want)
