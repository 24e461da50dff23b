"""Published models as their packages build them, tiled against plain PyTorch in float64.

    python benchmarks/published.py [NAME ...]
    python benchmarks/published.py --untiled [NAME ...]

For each of torchvision's and timm's classifiers and backbones and torchvision's and
segmentation_models_pytorch's (smp) segmentation models in ``MODELS`` (random weights, 10 classes, 3
for segmentation, a (2, 3, 64, 64) input, a 2x2 grid), in a process of its own with one
thread: compiled in eval mode, one step; compiled in training mode, one step (BatchNorm with batch
statistics) then an eval-mode forward (``tests/support/exactness.py``'s ``max_errors``). Prints a
markdown row per model and mode: the largest absolute difference of any output, input gradient,
parameter gradient or buffer; where that is above 1e-10, the largest difference relative to the
tensor's own largest magnitude among the tensors above it, and which, and beside it the size of
plain's own rounding there: the larger of the same tensor's differences from plain when plain
itself runs channels-last (``ChannelsLast``: other kernels and summation orders throughout) and
with its two samples swapped (``Swapped``: other orders of the sums over the batch; only where the
model draws no random masks in that mode, which would fall on other samples); or the one-line error
tilec refused the model with. torchvision, timm and smp are imported as ``tests/support/published.py``
does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

TOLERANCE = 1e-10

#: name: (package, constructor, keyword arguments): ``torchvision.models``' or its ``segmentation``'s
#: (``weights=None``, 10 or 3 classes), or ``timm.create_model``'s (``pretrained=False``).
MODELS = {
    **{name: ("torchvision", name, {}) for name in (
        "resnet18", "resnet50", "resnext50_32x4d", "convnext_tiny", "efficientnet_b0", "efficientnet_v2_s",
        "mobilenet_v2", "mobilenet_v3_large", "regnet_y_400mf", "densenet121", "vgg11_bn", "squeezenet1_1",
        "shufflenet_v2_x0_5", "mnasnet0_5", "alexnet", "mobilenet_v3_small", "regnet_x_400mf", "wide_resnet50_2",
        "efficientnet_b3", "shufflenet_v2_x1_0", "convnext_small", "resnet152")},
    "googlenet": ("torchvision", "googlenet", {"aux_logits": False, "init_weights": False}),
    "deeplabv3_resnet50": ("torchvision.segmentation", "deeplabv3_resnet50", {"weights_backbone": None}),
    "fcn_resnet50": ("torchvision.segmentation", "fcn_resnet50", {"weights_backbone": None}),
    "lraspp_mobilenet_v3_large": ("torchvision.segmentation", "lraspp_mobilenet_v3_large", {"weights_backbone": None}),
    **{f"timm {name}": ("timm", name, {"num_classes": 10}) for name in (
        "resnet18", "resnet10t", "convnext_atto", "convnextv2_atto", "efficientnet_b0", "tf_efficientnet_b0",
        "mobilenetv3_large_100", "regnety_008", "rexnet_100", "ghostnet_100", "densenet121", "dla34",
        "hrnet_w18_small", "cspresnet50", "res2net50_14w_8s", "resnest14d", "ecaresnet26t", "seresnext26d_32x4d",
        "skresnet18", "nf_resnet26", "nf_regnet_b0", "resnetv2_50x1_bit", "ese_vovnet19b_dw", "xception41",
        "efficientvit_b0", "mobileone_s0", "repvgg_a0", "gernet_s", "cspdarknet53", "fastvit_t8",
        "convmixer_768_32", "resnet50d", "resnetaa50d", "tresnet_m", "dm_nfnet_f0", "mixnet_s", "lcnet_050", "dpn68",
        "selecsls42b", "regnetz_b16", "cs3darknet_s", "efficientnetv2_rw_t", "hardcorenas_a", "tinynet_a",
        "mobilenetv4_conv_small", "fbnetv3_b", "resnet18d", "seresnet18", "gcresnet33ts", "lambda_resnet26t",
        "resnetblur18", "vovnet39a", "hrnet_w18_small_v2", "regnetx_002", "mobilevitv2_050", "repghostnet_050",
        "efficientnet_lite0", "semnasnet_050", "spnasnet_100", "densenetblur121d", "res2next50", "resnext26ts",
        "eca_nfnet_l0", "convnext_pico", "inception_next_tiny", "edgenext_xx_small", "starnet_s1", "rdnet_tiny",
        "focalnet_tiny_srf", "ghostnetv2_100", "repvit_m1", "mambaout_femto", "poolformerv2_s12", "convformer_s18",
        "hgnetv2_b0", "hgnet_tiny", "resnet50_gn", "regnety_016", "resnetrs50", "cspresnext50", "darknet53",
        "regnetz_c16_evos", "convnext_zepto_rms", "mobilenetv4_hybrid_medium", "gc_efficientnetv2_rw_t",
        "fastvit_sa12", "pvt_v2_b0", "mobilevit_xxs", "legacy_seresnet18", "efficientnet_b0_gn", "mobilenetv1_100",
        "rexnetr_100", "dla46_c", "vovnet57a", "mobilenetv4_conv_medium", "fasternet_t0", "shvit_s1", "cs3edgenet_x",
        "nf_ecaresnet26", "skresnext50_32x4d", "tinynet_e", "swiftformer_xs", "ghostnetv3_100")},
    "timm resnet18 features_only": ("timm", "resnet18", {"features_only": True}),
    **{f"smp {arch} {encoder}": ("smp", arch, {"encoder_name": encoder}) for arch, encoder in (
        ("Unet", "resnet34"), ("UnetPlusPlus", "resnet34"), ("FPN", "resnet34"), ("PSPNet", "resnet34"),
        ("DeepLabV3", "resnet34"), ("DeepLabV3Plus", "resnet34"), ("Linknet", "resnet34"), ("MAnet", "resnet34"),
        ("UPerNet", "resnet34"), ("Segformer", "resnet34"), ("Unet", "tu-efficientnet_b0"),
        ("DeepLabV3Plus", "tu-efficientnet_b0"), ("Unet", "tu-convnext_atto"), ("UnetPlusPlus", "tu-convnext_atto"),
        ("FPN", "tu-convnext_atto"), ("DPT", "tu-convnext_atto"))},
}


def build(name: str):
    """A fresh model ``name`` of ``MODELS``."""
    from support.published import load

    package, constructor, options = MODELS[name]
    if package == "timm":
        return load("timm").create_model(constructor, pretrained=False, **options)
    if package == "smp":
        return getattr(load("segmentation_models_pytorch"), constructor)(encoder_weights=None, classes=3, **options)
    classes = 3 if package.endswith("segmentation") else 10
    return getattr(load(f"torchvision.models{package.removeprefix('torchvision')}"), constructor)(
        weights=None, num_classes=classes, **options)


def one(name: str, mode: str) -> dict:
    """One model in one mode, in this process."""
    from tilec.errors import TilecError

    from support.exactness import max_errors

    torch.set_num_threads(1)
    train = mode == "train"
    options = {"grid": (2, 2), "counter": True, "eval_after": train}
    try:
        torch.manual_seed(0)
        errors = max_errors(build(name).train(train), (2, 3, 64, 64), **options)
    except TilecError as error:
        return {"model": name, "mode": mode, "refused": str(error)}
    record = {"model": name, "mode": mode, "worst": max(errors.values())}
    beyond = sorted((key for key, value in errors.items() if not value <= TOLERANCE), key=errors.get, reverse=True)
    if beyond:
        torch.manual_seed(0)
        relative = max_errors(build(name).train(train), (2, 3, 64, 64), relative=True, **options)
        record["relative_of"] = max(beyond, key=relative.get)
        record["relative"] = relative[record["relative_of"]]
        record["plain"] = 0.0
        for reordered in (ChannelsLast, Swapped):
            torch.manual_seed(0)
            model = build(name).train(train)
            if reordered is Swapped and train and draws_masks(model):
                continue
            plain = max_errors(model, (2, 3, 64, 64), tiled=reordered(model), relative=True, **options)
            record["plain"] = max(record["plain"], plain[record["relative_of"]])
    return record


def draws_masks(model: nn.Module) -> bool:
    """Whether ``model`` draws random masks in training mode: a dropout or stochastic depth module
    (or a model's ``drop_rate``) with a positive probability."""
    return any(("Drop" in type(m).__name__ or "StochasticDepth" in type(m).__name__ or hasattr(m, "drop_rate"))
               and any(getattr(m, key, 0) for key in ("p", "drop_prob", "drop_rate")) for m in model.modules())


class ChannelsLast(nn.Module):
    """``model`` run plain but channels-last, sharing its parameters (their 4-D ones converted on the
    first forward, after ``max_errors`` has made them float64; a Conv3d's weight stays as it is),
    drawing tilec's dropout masks as the reference does."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        from support.exactness import counted

        for tensor in (*self.model.parameters(), *self.model.buffers()):
            if tensor.dim() == 4:
                tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
        return counted(self.model)(x.contiguous(memory_format=torch.channels_last))


class Swapped(nn.Module):
    """``model`` run plain on the input's two samples in the other order, its outputs put back."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        from torch.utils._pytree import tree_map

        return tree_map(lambda t: t[[1, 0]] if isinstance(t, torch.Tensor) and t.dim() else t, self.model(x[[1, 0]]))


def row(record: dict) -> str:
    if "refused" in record or "crashed" in record:
        what = "refused" if "refused" in record else "crashed"
        return f"| {record['model']} | {record['mode']} | {what}: {record[what]} | | |"
    relative = f"{record['relative']:.1e} ({record['relative_of']})" if "relative" in record else ""
    plain = f"{record['plain']:.1e}" if "plain" in record else ""
    return f"| {record['model']} | {record['mode']} | {record['worst']:.1e} | {relative} | {plain} |"


def untiled(names: list[str]) -> None:
    """``--untiled``: per model and mode, traced at (2, 3, 256, 256) (a last stage of 8 x 8 at stride
    32), the nodes before its last image op that run untiled (in stored segments, where the maps
    around them are kept whole: ``tilec.report.untiled_nodes``), the first three with why."""
    from tilec.errors import TilecError
    from tilec.report import untiled_nodes
    from tilec.trace import trace

    print("| model | traced in | untiled before its last image op |")
    print("|---|---|---|")
    for name in names:
        for mode in ("eval", "train"):
            try:
                graph = trace(build(name).train(mode == "train"), (2, 3, 256, 256))
            except TilecError as error:
                print(f"| {name} | {mode} | refused: {str(error)[:100]} |", flush=True)
                continue
            found = untiled_nodes(graph)
            named = ", ".join(f"{node.op} ({node.path}: {why})" for node, why in found[:3])
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            print(f"| {name} | {mode} | {named or 'none'}{more} |", flush=True)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        print(json.dumps(one(argv[1], argv[2])))
        return
    if argv[:1] == ["--untiled"]:
        untiled(argv[1:] or list(MODELS))
        return
    print("| model | compiled in | worst absolute | worst relative, where the absolute is above 1e-10 "
          "| plain's own, same tensor |")
    print("|---|---|--:|---|--:|")
    for name in argv or list(MODELS):
        for mode in ("eval", "train"):
            done = subprocess.run([sys.executable, __file__, "--one", name, mode], capture_output=True, text=True,
                                  cwd=ROOT)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            failed = {"model": name, "mode": mode, "crashed": (done.stderr.strip().splitlines() or ["?"])[-1]}
            print(row(json.loads(lines[-1]) if lines else failed), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
