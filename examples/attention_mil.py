"""A slide classifier with gated attention pooling over its feature map (Ilse et al.'s attention-MIL,
as whole-slide pipelines pool patch features), end to end on the image.

``examples/resnet18.py``'s ResNet-18 trunk (BatchNorm frozen, as fine-tuning a pretrained backbone
often does; ``--attr trained_batch_norm``: with batch statistics) gives a 512-channel map; its pixels
are the instances. Each is scored by a gated MLP, ``w^T (tanh(V h) * sigmoid(U h))``; the softmax of
the scores over all pixels weights their sum, which a linear layer classifies. The model flattens the
pixels as such code does (``flatten(2).transpose(1, 2)``): tilec rewrites the pooling onto rows and
columns (``tilec/unflatten.py``), so that it runs tile by tile with the trunk, the softmax's
normaliser and the weighted sum by sweeps over the tiles.
"""

import runpy
from pathlib import Path

import torch
from torch import nn

INPUT_SHAPE = (1, 3, 224, 224)
ResNet18 = runpy.run_path(str(Path(__file__).with_name("resnet18.py")))["ResNet18"]


class AttentionMIL(nn.Module):
    def __init__(self, num_classes: int = 2, hidden: int = 128):
        super().__init__()
        trunk = ResNet18()
        self.trunk = nn.Sequential(trunk.conv1, trunk.bn1, trunk.relu, trunk.maxpool, trunk.layer1, trunk.layer2,
                                   trunk.layer3, trunk.layer4)
        self.attention_v = nn.Linear(512, hidden)
        self.attention_u = nn.Linear(512, hidden)
        self.attention_w = nn.Linear(hidden, 1)
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        instances = self.trunk(x).flatten(2).transpose(1, 2)  # (N, pixels, 512)
        scores = self.attention_w(torch.tanh(self.attention_v(instances)) * torch.sigmoid(self.attention_u(instances)))
        weights = torch.softmax(scores, dim=1)  # over all pixels of the map
        return self.classifier((weights * instances).sum(1))


def attention_mil() -> nn.Module:
    """Frozen BatchNorm: the trunk in eval mode, its BatchNorm parameters not trained."""
    model = AttentionMIL().eval()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.requires_grad_(False)
    return model


def trained_batch_norm() -> nn.Module:
    """The same with BatchNorm training on batch statistics (``--attr trained_batch_norm``)."""
    return AttentionMIL().train()


model = attention_mil
