"""The classic two-layer network (PyTorch's "learning PyTorch with examples"),
trained with manual SGD, once with torch.relu and once with relu_ext.relu.

    python examples/two_layer_net.py

Both runs start from the same seed; because relu_ext is bit-exact, the two
loss curves are identical, step for step.
"""

from __future__ import annotations

from typing import Callable

import torch

import relu_ext

N, D_IN, H, D_OUT = 64, 1000, 100, 10


def train(relu: Callable[[torch.Tensor], torch.Tensor], steps: int = 500, lr: float = 1e-6, seed: int = 0,
          device: str = "cpu") -> list[float]:
    """Trains the network with `relu` as its activation; returns the loss at every step."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D_IN, generator=g).to(device)
    y = torch.randn(N, D_OUT, generator=g).to(device)
    w1 = torch.randn(D_IN, H, generator=g).to(device).requires_grad_()
    w2 = torch.randn(H, D_OUT, generator=g).to(device).requires_grad_()
    losses = []
    for _ in range(steps):
        loss = (relu(x.mm(w1)).mm(w2) - y).pow(2).sum()
        losses.append(loss.item())
        loss.backward()
        with torch.no_grad():
            w1 -= lr * w1.grad
            w2 -= lr * w2.grad
            w1.grad.zero_()
            w2.grad.zero_()
    return losses


def main() -> None:
    ref = train(torch.relu)
    ours = train(relu_ext.relu)
    for step in (0, 99, 199, 299, 399, 499):
        print(f"step {step:3d}  torch.relu {ref[step]:14.6f}  relu_ext.relu {ours[step]:14.6f}")
    print("identical trajectories:", ref == ours, f"| loss fell {ref[0] / ref[-1]:.3g}x")


if __name__ == "__main__":
    main()
