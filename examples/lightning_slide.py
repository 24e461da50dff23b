"""Train a slide classifier from slide files inside PyTorch Lightning, with a ``TiledModel``.

    python examples/lightning_slide.py --size 2048 --slides 4 --epochs 2 --budget 512MiB

Writes ``--slides`` synthetic pyramidal TIFFs of three sizes (``examples/train_slide.py``'s slide,
one seed each, ``--size`` and 3/4 and 1/2 of it a side; odd seeds labelled 1), opens each with
``tilec.slide`` (read by region, background made white) and trains a small ResNet-18 classifier on
them under ``Trainer(precision="bf16-mixed")`` on the CPU (``"16-mixed"`` on a GPU), validating on
the last slide each epoch. The LightningModule compiles its model once per input shape, on first
use, into a ``TiledModel`` that it calls as it would call the model: the first shape by the budget
search, each later one like the first (``tilec.compile(..., like=)``: a search narrowed to the
first plan's cuts). ``--frame N`` frames every slide to N pixels a side
over its tissue instead (``Slide.framed``: cropped or padded with white): one plan, and the model
sees the padding. Lightning's autocast, optimizer, gradient clipping, checkpoints and loops work
as usual. The ``TiledModel`` is kept out of the module's registered children, so checkpoints hold
the model's parameters once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import tilec

sys.path.insert(0, str(Path(__file__).parent))
import train_slide  # noqa: E402  (the synthetic slides, their normalisation and the example models)


class SlideNet(nn.Module):
    """uint8 slide (1, 3, H, W) -> class logits (1, K): normalised in the model's own dtype, so each
    tile converts only its own region."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.register_buffer("mean", torch.tensor(train_slide.MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(train_slide.STD).view(1, 3, 1, 1))

    def forward(self, slide: torch.Tensor) -> torch.Tensor:
        return self.backbone((slide.to(self.mean.dtype) - self.mean) / self.std)


class Slides(Dataset):
    """``(path, label)`` pairs -> ``(tilec.slide(path, level), label)``, masked to the tissue if
    ``mask``, framed to ``frame`` (rows, cols) over its tissue if given. A slide is not a tensor: batches
    are single slides (``single``)."""

    def __init__(self, items, level: int = 0, mask: bool = True, frame: tuple[int, int] | None = None):
        self.items, self.level, self.mask, self.frame = list(items), level, mask, frame

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        path, label = self.items[index]
        slide = tilec.slide(path, level=self.level)
        slide = slide.masked() if self.mask else slide
        return (slide.framed(*self.frame) if self.frame else slide), torch.tensor([label])


def single(items):
    """The collate function of batches of one slide."""
    (item,) = items
    return item


class TiledClassifier(L.LightningModule):
    """``model`` (uint8 slide -> logits) trained by cross-entropy through a ``TiledModel``
    compiled per input shape with ``compile_options`` (``tilec.compile``'s: a ``memory_budget``
    or a ``grid``, ``autocast="cpu:bfloat16"`` to budget for mixed precision); with a budget, a
    later shape like the first (``like=``). ``tiled=False`` trains the model itself, for comparison.

    Each plan is compiled with the model's modules in the modes they had when it was given (the
    modes it trains in), whichever loop calls first: Lightning validates before it trains, in eval
    mode, and a plan traced in eval mode tiles BatchNorm by its running statistics, which cannot
    train. A plan traced in training mode serves eval mode too (``docs/modes.md``)."""

    def __init__(self, model: nn.Module, lr: float = 1e-3, tiled: bool = True, **compile_options):
        super().__init__()
        self.model, self.lr, self.tiled, self.compile_options = model, lr, tiled, compile_options
        self.compiled = {}  # slide shape -> TiledModel, a plain dict: not a registered child
        self.training_modes = {name: module.training for name, module in model.named_modules()}

    def forward(self, slide):
        if not self.tiled:
            return self.model(torch.as_tensor(slide[...]))
        shape = tuple(slide.shape)
        if shape not in self.compiled:
            modes = {name: module.training for name, module in self.model.named_modules()}
            for name, module in self.model.named_modules():
                module.training = self.training_modes[name]
            like = next(iter(self.compiled.values()), None) if "memory_budget" in self.compile_options else None
            try:
                self.compiled[shape] = tilec.compile(self.model, [(shape, "uint8")], name="lightning_slide",
                                                     like=like, **self.compile_options)
            finally:
                for name, module in self.model.named_modules():
                    module.training = modes[name]
        return self.compiled[shape](slide)

    def training_step(self, batch, index):
        slide, label = batch
        loss = F.cross_entropy(self(slide).float(), label)
        self.log("train_loss", loss, batch_size=1, prog_bar=True)
        return loss

    def validation_step(self, batch, index):
        slide, label = batch
        logits = self(slide).float()
        self.log("val_loss", F.cross_entropy(logits, label), batch_size=1, prog_bar=True)
        self.log("val_acc", (logits.argmax(1) == label).float().mean(), batch_size=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)


def write_slides(folder: Path, size: int, count: int) -> list[tuple[Path, int]]:
    """``count`` synthetic pyramidal TIFFs with labels (odd seeds: 1), seed ``k``'s ``size * (4 -
    k % 3) // 4`` pixels a side."""
    folder.mkdir(parents=True, exist_ok=True)
    items = []
    for seed in range(count):
        side = size * (4 - seed % 3) // 4
        npy, tiff = folder / f"slide_{side}_{seed}.npy", folder / f"slide_{side}_{seed}.tif"
        if not tiff.exists():
            train_slide.write_slide(npy, side, seed=seed)
            train_slide.write_tiff(tiff, npy, smallest=min(256, side))
            npy.unlink()
        items.append((tiff, seed % 2))
    return items


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048, help="the largest slide's side in pixels")
    parser.add_argument("--frame", type=int, help="side of a frame every slide is seen in (default: each slide at "
                                                  "its own size)")
    parser.add_argument("--slides", type=int, default=4, help="slides written; the last one validates")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--budget", default="512MiB", help="memory budget of the plan")
    parser.add_argument("--dir", type=Path, default=Path("out/lightning_slides"))
    args = parser.parse_args(argv)
    items = write_slides(args.dir, args.size, args.slides)
    torch.manual_seed(0)
    model = SlideNet(train_slide.load_example("resnet18").ResNet18(num_classes=2).train())
    module = TiledClassifier(model, memory_budget=args.budget, autocast="cpu:bfloat16")
    trainer = L.Trainer(accelerator="cpu", precision="bf16-mixed", max_epochs=args.epochs, logger=False,
                        enable_checkpointing=False, log_every_n_steps=1)
    frame = (args.frame, args.frame) if args.frame else None
    train = DataLoader(Slides(items[:-1], frame=frame), batch_size=1, shuffle=True, collate_fn=single)
    validate = DataLoader(Slides(items[-1:], frame=frame), batch_size=1, collate_fn=single)
    trainer.fit(module, train, validate)
    print({name: round(float(value), 4) for name, value in trainer.callback_metrics.items()},
          f"{len(module.compiled)} plan(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
