"""Small versions of the networks people bring (plain PyTorch, as a user writes them), for the importer's
tests: a ResNet-18, a 2-D U-Net with transposed convolutions and skip concatenations, a 3-D U-Net, a
SegResNet-style network (group norm, bilinear upsampling), and a network of PReLU residual units."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------------------------------------------ ResNet-18
class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (BasicBlock x [2, 2, 2, 2]), ``width`` channels in the first stage."""

    def __init__(self, in_channels: int = 3, num_classes: int = 5, width: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        chans, layers, cin = [width, 2 * width, 4 * width, 8 * width], [], width
        for i, c in enumerate(chans):
            layers.append(nn.Sequential(BasicBlock(cin, c, 1 if i == 0 else 2), BasicBlock(c, c)))
            cin = c
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ------------------------------------------------------------------------------------------------ U-Nets
def _conv(nd: int):
    return nn.Conv2d if nd == 2 else nn.Conv3d


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int, nd: int = 2):
        super().__init__()
        bn = nn.BatchNorm2d if nd == 2 else nn.BatchNorm3d
        conv = _conv(nd)
        self.block = nn.Sequential(conv(cin, cout, 3, padding=1, bias=False), bn(cout), nn.ReLU(True),
                                   conv(cout, cout, 3, padding=1, bias=False), bn(cout), nn.ReLU(True))

    def forward(self, x):
        return self.block(x)


class UNet(nn.Module):
    """The classic U-Net (max-pool down, ConvTranspose up, concatenated skips), ``depth`` levels."""

    def __init__(self, in_channels: int = 2, num_classes: int = 3, width: int = 4, depth: int = 2,
                 nd: int = 2):
        super().__init__()
        pool = nn.MaxPool2d if nd == 2 else nn.MaxPool3d
        up = nn.ConvTranspose2d if nd == 2 else nn.ConvTranspose3d
        chans = [width * 2 ** i for i in range(depth + 1)]
        self.inc = DoubleConv(in_channels, chans[0], nd)
        self.downs = nn.ModuleList(nn.Sequential(pool(2), DoubleConv(chans[i], chans[i + 1], nd))
                                   for i in range(depth))
        self.ups = nn.ModuleList(up(chans[i + 1], chans[i], 2, stride=2) for i in reversed(range(depth)))
        self.convs = nn.ModuleList(DoubleConv(2 * chans[i], chans[i], nd) for i in reversed(range(depth)))
        self.outc = _conv(nd)(chans[0], num_classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up, conv in zip(self.ups, self.convs):
            x = conv(torch.cat([skips.pop(), up(x)], dim=1))
        return self.outc(x)


def unet3d(**kwargs) -> UNet:
    """A function returning a module (the importer takes either)."""
    return UNet(nd=3, **kwargs)


# ------------------------------------------------------------------------------------------------ SegResNet
class ResBlockGN(nn.Module):
    def __init__(self, c: int, groups: int = 2):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.norm2, self.conv2 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, padding=1, bias=False)

    def forward(self, x):
        y = self.conv1(F.relu(self.norm1(x)))
        y = self.conv2(F.relu(self.norm2(y)))
        return y + x


class SegResNet(nn.Module):
    """MONAI's SegResNet shape: pre-activation GN residual blocks, stride-2 conv down, 1x1 conv + bilinear
    upsampling up (nn.Upsample once, F.interpolate once), additive skips."""

    def __init__(self, in_channels: int = 2, num_classes: int = 3, width: int = 4):
        super().__init__()
        self.conv_init = nn.Conv2d(in_channels, width, 3, padding=1, bias=False)
        self.down0 = ResBlockGN(width)
        self.down1 = nn.Sequential(nn.Conv2d(width, 2 * width, 3, 2, 1, bias=False), ResBlockGN(2 * width))
        self.down2 = nn.Sequential(nn.Conv2d(2 * width, 4 * width, 3, 2, 1, bias=False),
                                   ResBlockGN(4 * width))
        self.up1_conv = nn.Conv2d(4 * width, 2 * width, 1, bias=False)
        self.up1 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.up1_block = ResBlockGN(2 * width)
        self.up0_conv = nn.Conv2d(2 * width, width, 1, bias=False)
        self.up0_block = ResBlockGN(width)
        self.head_norm = nn.GroupNorm(2, width)
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, x):
        s0 = self.down0(self.conv_init(x))
        s1 = self.down1(s0)
        x = self.down2(s1)
        x = self.up1_block(self.up1(self.up1_conv(x)) + s1)
        x = F.interpolate(self.up0_conv(x), scale_factor=2, mode="bilinear", align_corners=False)
        x = self.up0_block(x + s0)
        return self.head(F.relu(self.head_norm(x)))


# ------------------------------------------------------------------------------------------------ PReLU units
class ResidualUnit(nn.Module):
    """MONAI's ResidualUnit shape: (conv, norm, PReLU) twice, a 1x1 conv on the residual path when the
    channels change."""

    def __init__(self, cin: int, cout: int, per_channel: bool):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout)
        self.act1 = nn.PReLU(cout if per_channel else 1)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout)
        self.act2 = nn.PReLU(cout if per_channel else 1)
        self.residual = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        y = self.act1(self.bn1(self.conv1(x)))
        y = self.act2(self.bn2(self.conv2(y)))
        return y + self.residual(x)


class PReLUNet(nn.Module):
    def __init__(self, in_channels: int = 2, num_classes: int = 3, width: int = 4):
        super().__init__()
        self.unit1 = ResidualUnit(in_channels, width, per_channel=False)
        self.unit2 = ResidualUnit(width, width, per_channel=True)
        self.out = nn.Conv2d(width, num_classes, 1)

    def forward(self, x):
        return self.out(self.unit2(self.unit1(x)))


def perturb(module: nn.Module, seed: int = 0) -> nn.Module:
    """Norm weights, biases and running statistics moved off their initial 1/0 (a check that reads a
    scale where a shift belongs, or the wrong statistics, then fails)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if t.is_floating_point() and ("bn" in name or "norm" in name or "downsample.1" in name
                                          or "block.1" in name or "block.4" in name or "act" in name):
                t.add_(0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype))
                if name.endswith("running_var"):
                    t.abs_().add_(0.5)
    return module


# ------------------------------------------------------------------------------------------------ the rest
class Sink2d(nn.Module):
    """Every other operator of the importer's table once (no training: a forward check on one rank)."""

    def __init__(self, c: int = 4, k: int = 3, size: int = 8):
        super().__init__()
        self.reflect = nn.Conv2d(2, c, 3, padding=1, padding_mode="reflect")
        self.inorm = nn.InstanceNorm2d(c, affine=True, track_running_stats=True)
        self.circular = nn.Conv2d(c, c, 3, padding=(1, 2), dilation=(1, 2), padding_mode="circular", groups=2)
        self.ln = nn.LayerNorm([c, size, size])
        self.replicate = nn.Conv2d(c, c, 3, bias=False)
        self.wide = nn.Conv2d(c, c, 5, padding=1)
        self.act = nn.LeakyReLU(0.2)
        self.prelu = nn.PReLU(c)
        self.down = nn.AvgPool2d(2)
        self.up = nn.ConvTranspose2d(c, c, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.gate = nn.Conv2d(c, c, 1)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Conv2d(c, k, 1)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        y = F.gelu(self.inorm(self.reflect(x)), approximate="tanh")
        y = F.silu(self.ln(self.circular(y)))
        y = self.replicate(F.pad(y, (1, 1, 1, 1), mode="replicate"))
        y = self.act(self.wide(F.pad(y, (1, 1, 1, 1), mode="reflect")))  # a pad layer: wide pads too
        y = F.elu(self.prelu(y), 0.5) + torch.sigmoid(y) * torch.tanh(self.gate(y))
        z = self.up(self.down(y)) + F.interpolate(self.pool(y), scale_factor=2, mode="nearest")
        z = F.interpolate(F.avg_pool2d(z, 2), scale_factor=2, mode="bilinear", align_corners=True)
        z = F.pad(F.relu(self.drop(z)), (1, 1, 0, 0), value=0.5)
        return F.softmax(self.head(z), dim=1)


class Sink3d(nn.Module):
    """3-D: group norm, trilinear and nearest upsampling, the max over space into a linear head."""

    def __init__(self, c: int = 4, k: int = 3):
        super().__init__()
        self.conv = nn.Conv3d(2, c, 3, padding=1, padding_mode="replicate")
        self.gn = nn.GroupNorm(2, c)
        self.down = nn.Conv3d(c, c, 2, stride=2)
        self.fc = nn.Linear(2 * c, k)

    def forward(self, x):
        y = F.relu(self.gn(self.conv(x)))
        z = F.interpolate(self.down(y), scale_factor=2, mode="trilinear") * F.interpolate(
            F.max_pool3d(y, 2), scale_factor=2, mode="nearest")
        feats = torch.cat([z.amax((2, 3, 4)), y.mean((-3, -2, -1))], dim=1)
        return self.fc(feats)
