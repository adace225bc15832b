# Ordinal regression of defect severity grades (0-4) from inspection-sensor
# features with a cumulative-link (proportional odds) head, trained with
# PyTorch Lightning in bf16 mixed precision with gradient accumulation.
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
torch.set_num_threads(1)
N_GRADES, N_FEAT = 5, 12

x = torch.randn(1200, N_FEAT)
latent = x[:, :4] @ torch.tensor([1.2, -0.8, 0.6, 0.9]) + 0.3 * torch.randn(1200)
grade = torch.bucketize(latent, torch.tensor([-1.2, 0.05, 0.07, 1.2]))
dataset = TensorDataset(x, grade)


class CumulativeLinkModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(N_FEAT, 64), nn.GELU(), nn.Linear(64, 1))
        self.cutpoints = nn.Parameter(torch.linspace(-2.0, 2.0, N_GRADES - 1))

    def forward(self, features):
        score = self.net(features)
        cum = torch.sigmoid(self.cutpoints - score)
        return torch.cat([cum[:, :1], cum[:, 1:] - cum[:, :-1], 1 - cum[:, -1:]], dim=1)

    def training_step(self, batch, batch_idx):
        features, target = batch
        probs = self(features)
        loss = -torch.log(probs.gather(1, target[:, None])).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)


class StepPrinter(L.Callback):
    def __init__(self, accumulate):
        self.accumulate, self.window, self.losses = accumulate, [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.window.append(outputs["loss"].item())
        if (batch_idx + 1) % self.accumulate == 0:
            self.losses.append(sum(self.window) / len(self.window))
            print(f"step={trainer.global_step - 1} loss={self.losses[-1]:.6f}")
            self.window = []


printer = StepPrinter(accumulate=2)
trainer = L.Trainer(max_epochs=4, accelerator="cpu", precision="bf16-mixed", gradient_clip_val=1.0,
                    accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[printer])
trainer.fit(CumulativeLinkModel(), DataLoader(dataset, batch_size=32, shuffle=True))
print(f"final_loss={sum(printer.losses[-5:]) / 5:.6f}")
