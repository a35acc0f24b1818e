"""The loop of examples/custom_loop_before.py on the engine's library API.

Ten lines changed (``diff -u examples/custom_loop_before.py examples/custom_loop.py``)
and the loop gets: DDP over N processes (the global batch of 64 split between them, a
distributed sampler reshuffled every epoch), a snapshot after every epoch and automatic
resume from the latest one, output and logger plugins (TensorBoard, CSV...) on rank 0
only, and ``runs/custom_loop/summary.json`` with every rank's final weights digest.

    python examples/custom_loop.py --epochs 3            # 2 processes on a CPU machine
    python examples/custom_loop.py --epochs 5            # resumes after epoch 3
    torchrun --nproc-per-node 2 examples/custom_loop.py  # adopts torchrun's workers
"""

import argparse

import torch
from torch import nn

import engine


def make_dataset(size=2048, seed=0):
    """Four classes that a small network learns in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 16, generator=g)
    targets = (inputs @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return torch.utils.data.TensorDataset(inputs, targets)


def train(ctx, args):
    device = ctx.device
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = ctx.wrap(model, optimizer)
    loader = ctx.loader(make_dataset(), batch_size=64)
    for epoch in ctx.epochs(args.epochs):
        model.train()
        total = torch.zeros((), device=device)
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(inputs), targets)
            loss.backward()
            optimizer.step()
            total += loss.detach()  # no .item() here: it would wait for the device
        loss = ctx.reduce({"train/epoch_loss": total / len(loader)})
        ctx.log(loss)
        ctx.print(f"epoch {epoch}: loss {loss['train/epoch_loss']:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    engine.launch(train, parser.parse_args())
