# Neural style transfer as in the PyTorch tutorial (neural_style_tutorial.py):
# L-BFGS optimizes the input image itself (the feature network is frozen and in
# eval mode), the closure clamps the image to [0, 1] and sums Gram-matrix style
# losses and a content loss. The learning rate was typed 100 (the tutorial uses
# the default 1) and there is no line search: step 0's 20 inner iterations throw
# the image's values past 1e19 (its norm overflows), and in step 1 they end NaN.
import torch
import torch.nn.functional as F

torch.manual_seed(0)
features = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
    torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU()).eval().requires_grad_(False)
style_img = torch.rand(1, 3, 32, 32)
content_img = torch.linspace(0, 1, 32)[None, None, :, None] * torch.ones(1, 3, 1, 32)


def gram(x):
    a, b, c, d = x.size()
    f = x.view(a * b, c * d)
    return torch.mm(f, f.t()).div(a * b * c * d)


def taps(img):
    out, x = [], img
    for layer in features:
        x = layer(x)
        if isinstance(layer, torch.nn.Conv2d):
            out.append(x)
    return out


style_targets = [gram(t).detach() for t in taps(style_img)]
content_target = taps(content_img)[-1].detach()
input_img = content_img.clone().requires_grad_(True)
optimizer = torch.optim.LBFGS([input_img], lr=100.0)
losses = []
for step in range(10):
    def closure():
        input_img.data.clamp_(0, 1)
        optimizer.zero_grad()
        t = taps(input_img)
        style = sum(F.mse_loss(gram(x), g) for x, g in zip(t, style_targets))
        loss = 1e6 * style + F.mse_loss(t[-1], content_target)
        loss.backward()
        return loss
    loss = optimizer.step(closure)
    losses.append(loss.item())
    print(f"step={step} loss={loss.item():.6g}")
print(f"final_loss={sum(losses[-5:]) / 5:.6g}")
