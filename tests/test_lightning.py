"""examples/lightning_slide.py: a TiledModel inside Lightning's Trainer, from slide files. Three
float64 steps over slides of three sizes framed to one (one plan), after Lightning's sanity
validation (the first call, in eval mode, without gradients: the plan is compiled there) and with
a validation loop in between, leave the same parameters and validation loss as the same Trainer on
the untiled model; under bf16-mixed autocast the loops run and train."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

L = pytest.importorskip("lightning")
tifffile = pytest.importorskip("tifffile")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "lightning_slide.py"


def _example():
    spec = importlib.util.spec_from_file_location("lightning_slide_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _slides(folder: Path, sizes=((41, 53),) * 3) -> list[tuple[Path, int]]:
    """Two-level tiled TIFFs of random pixels, one of each of ``sizes``, labelled by seed parity."""
    items = []
    for seed, size in enumerate(sizes):
        image = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
        with tifffile.TiffWriter(folder / f"slide{seed}.tif") as writer:
            for k, level in enumerate((image, image[::2, ::2])):
                writer.write(level, tile=(16, 16), compression="zlib", photometric="rgb", subfiletype=k)
        items.append((folder / f"slide{seed}.tif", seed % 2))
    return items


def _backbone() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(3, 2, 1),
                         nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 2))


def _fit(example, items, precision: str, steps: int, model_dtype=torch.float64, frame=None, **options):
    torch.manual_seed(0)
    model = example.SlideNet(_backbone()).to(model_dtype).train()
    module = example.TiledClassifier(model, lr=0.05, **options)
    trainer = L.Trainer(accelerator="cpu", precision=precision, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    train = DataLoader(example.Slides(items[:2], mask=False, frame=frame), batch_size=1, collate_fn=example.single)
    validate = DataLoader(example.Slides(items[2:], mask=False, frame=frame), batch_size=1,
                          collate_fn=example.single)
    trainer.fit(module, train, validate)
    return model, module, trainer.callback_metrics


def test_tiled_training_in_lightning_equals_plain_in_float64(tmp_path):
    example, items = _example(), _slides(tmp_path, [(41, 53), (30, 60), (50, 37)])
    plain, _, plain_metrics = _fit(example, items, "64-true", 3, frame=(44, 52), tiled=False)
    tiled, module, tiled_metrics = _fit(example, items, "64-true", 3, frame=(44, 52), grid=(2, 2), dtype="float64")
    assert list(module.compiled) == [(1, 3, 44, 52)]
    assert abs(plain_metrics["val_loss"] - tiled_metrics["val_loss"]).item() <= 1e-10
    for (name, want), got in zip(plain.state_dict().items(), tiled.state_dict().values(), strict=True):
        assert (want.double() - got.double()).abs().max().item() <= 1e-10, name
    assert "compiled" not in dict(module.named_children())


def test_bf16_mixed_training_and_validation_run(tmp_path):
    example, items = _example(), _slides(tmp_path)
    before = _backbone().state_dict()
    model, _, metrics = _fit(example, items, "bf16-mixed", 2, model_dtype=torch.float32, grid=(2, 2),
                             autocast="cpu:bfloat16")
    assert torch.isfinite(metrics["val_loss"]) and 0 <= metrics["val_acc"] <= 1
    assert not torch.equal(model.backbone[0].weight, before["0.weight"])
