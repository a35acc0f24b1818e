"""A hand-written training loop: one process, no resume, prints every epoch.

examples/custom_loop.py is the same loop on the engine's library API: DDP over N
processes, resume from the latest snapshot, output and logger plugins on rank 0.
Compare them with ``diff -u examples/custom_loop_before.py examples/custom_loop.py``.

    python examples/custom_loop_before.py --epochs 3
"""

import argparse

import torch
from torch import nn


def make_dataset(size=2048, seed=0):
    """Four classes that a small network learns in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 16, generator=g)
    targets = (inputs @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return torch.utils.data.TensorDataset(inputs, targets)


def train(args):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=64, shuffle=True)
    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros((), device=device)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            total += loss.detach()  # no .item() here: it would wait for the device
        loss = {"train/epoch_loss": total / len(loader)}
        print(f"epoch {epoch}: loss {loss['train/epoch_loss']:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    train(parser.parse_args())
