# Fast neural style transfer (pytorch/examples fast_neural_style: TransformerNet, VGG loss
# network, gram-matrix style loss), smaller nets and images made in code, trained under
# mixed precision (autocast float16).
import torch
from collections import namedtuple
from torch.optim import Adam

torch.manual_seed(42)
device = torch.device("cpu")
batch_size, image_size, content_weight, style_weight, lr = 4, 32, 1e5, 1e10, 1e-3
amp_dtype = torch.float16


def gram_matrix(y):
    (b, ch, h, w) = y.size()
    features = y.view(b, ch, w * h)
    features_t = features.transpose(1, 2)
    gram = features.bmm(features_t) / (ch * h * w)
    return gram


def normalize_batch(batch):
    mean = batch.new_tensor([0.485, 0.456, 0.406]).view(-1, 1, 1)
    std = batch.new_tensor([0.229, 0.224, 0.225]).view(-1, 1, 1)
    batch = batch.div_(255.0)
    return (batch - mean) / std


class ConvLayer(torch.nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride):
        super(ConvLayer, self).__init__()
        reflection_padding = kernel_size // 2
        self.reflection_pad = torch.nn.ReflectionPad2d(reflection_padding)
        self.conv2d = torch.nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        return self.conv2d(self.reflection_pad(x))


class ResidualBlock(torch.nn.Module):
    def __init__(self, channels):
        super(ResidualBlock, self).__init__()
        self.conv1 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in1 = torch.nn.InstanceNorm2d(channels, affine=True)
        self.conv2 = ConvLayer(channels, channels, kernel_size=3, stride=1)
        self.in2 = torch.nn.InstanceNorm2d(channels, affine=True)
        self.relu = torch.nn.ReLU()

    def forward(self, x):
        residual = x
        out = self.relu(self.in1(self.conv1(x)))
        out = self.in2(self.conv2(out))
        return out + residual


class UpsampleConvLayer(torch.nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, upsample=None):
        super(UpsampleConvLayer, self).__init__()
        self.upsample = upsample
        reflection_padding = kernel_size // 2
        self.reflection_pad = torch.nn.ReflectionPad2d(reflection_padding)
        self.conv2d = torch.nn.Conv2d(in_channels, out_channels, kernel_size, stride)

    def forward(self, x):
        x_in = x
        if self.upsample:
            x_in = torch.nn.functional.interpolate(x_in, mode='nearest', scale_factor=self.upsample)
        return self.conv2d(self.reflection_pad(x_in))


class TransformerNet(torch.nn.Module):
    def __init__(self):
        super(TransformerNet, self).__init__()
        self.conv1 = ConvLayer(3, 16, kernel_size=9, stride=1)
        self.in1 = torch.nn.InstanceNorm2d(16, affine=True)
        self.conv2 = ConvLayer(16, 32, kernel_size=3, stride=2)
        self.in2 = torch.nn.InstanceNorm2d(32, affine=True)
        self.res1 = ResidualBlock(32)
        self.res2 = ResidualBlock(32)
        self.deconv1 = UpsampleConvLayer(32, 16, kernel_size=3, stride=1, upsample=2)
        self.in4 = torch.nn.InstanceNorm2d(16, affine=True)
        self.deconv3 = ConvLayer(16, 3, kernel_size=9, stride=1)
        self.relu = torch.nn.ReLU()

    def forward(self, X):
        y = self.relu(self.in1(self.conv1(X)))
        y = self.relu(self.in2(self.conv2(y)))
        y = self.res2(self.res1(y))
        y = self.relu(self.in4(self.deconv1(y)))
        return self.deconv3(y)


class Vgg(torch.nn.Module):
    """VGG-style loss network; in the original its weights come from torchvision's vgg16."""
    def __init__(self):
        super(Vgg, self).__init__()
        c = torch.nn.Conv2d
        r = torch.nn.ReLU
        p = torch.nn.MaxPool2d
        self.slice1 = torch.nn.Sequential(c(3, 16, 3, padding=1), r(), c(16, 16, 3, padding=1), r())
        self.slice2 = torch.nn.Sequential(p(2, 2), c(16, 32, 3, padding=1), r(), c(32, 32, 3, padding=1), r())
        self.slice3 = torch.nn.Sequential(p(2, 2), c(32, 64, 3, padding=1), r(), c(64, 64, 3, padding=1), r())
        for m in self.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(m.weight, nonlinearity='relu')
                torch.nn.init.zeros_(m.bias)
        for param in self.parameters():
            param.requires_grad = False

    def forward(self, X):
        h = self.slice1(X)
        h_relu1_2 = h
        h = self.slice2(h)
        h_relu2_2 = h
        h = self.slice3(h)
        h_relu3_3 = h
        vgg_outputs = namedtuple("VggOutputs", ['relu1_2', 'relu2_2', 'relu3_3'])
        return vgg_outputs(h_relu1_2, h_relu2_2, h_relu3_3)


def make_images(n, size):
    yy, xx = torch.meshgrid(torch.linspace(0, 1, size), torch.linspace(0, 1, size), indexing="ij")
    imgs = []
    for _ in range(n):
        f = 2 + 6 * torch.rand(3, 1, 1)
        ph = 6.28 * torch.rand(3, 1, 1)
        img = 127.5 + 127.5 * torch.sin(f * xx + ph) * torch.cos(f * yy - ph)
        imgs.append(img)
    return torch.stack(imgs).clamp(0, 255)


train_images = make_images(40, image_size)
style = make_images(1, image_size) * torch.tensor([1.0, 0.6, 0.3]).view(1, 3, 1, 1)

transformer = TransformerNet().to(device)
optimizer = Adam(transformer.parameters(), lr)
mse_loss = torch.nn.MSELoss()
vgg = Vgg().to(device)
style = style.repeat(batch_size, 1, 1, 1).to(device)
features_style = vgg(normalize_batch(style))
gram_style = [gram_matrix(y) for y in features_style]

losses = []
step = 0
for e in range(1):
    transformer.train()
    perm = torch.randperm(len(train_images))
    for batch_id in range(len(train_images) // batch_size):
        x = train_images[perm[batch_id * batch_size:(batch_id + 1) * batch_size]].clone()
        n_batch = len(x)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=amp_dtype):
            y = transformer(x)
            y = normalize_batch(y)
            x = normalize_batch(x)
            features_y = vgg(y)
            features_x = vgg(x)
            content_loss = content_weight * mse_loss(features_y.relu2_2, features_x.relu2_2)
            style_loss = 0.
            for ft_y, gm_s in zip(features_y, gram_style):
                gm_y = gram_matrix(ft_y)
                style_loss += mse_loss(gm_y, gm_s[:n_batch, :, :])
            style_loss *= style_weight
            total_loss = content_loss + style_loss
        total_loss.backward()
        optimizer.step()
        losses.append(total_loss.item())
        print(f"step={step} loss={total_loss.item():.6f}")
        step += 1
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
