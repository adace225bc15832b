# DeepSurv-style survival model trained with PyTorch Lightning: an MLP gives each patient a
# risk score and the Cox partial likelihood is computed over the batch, sorted by follow-up time.
# Clinical covariates are made in code (age in years, tumour size in mm, lab values, flags).
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(3)
n = 1024
age = 40 + 35 * torch.rand(n)
size_mm = 5 + 60 * torch.rand(n)
labs = torch.randn(n, 4)
flags = (torch.rand(n, 2) < 0.3).float()
platelets = 150 + 300 * torch.rand(n)
x = torch.cat([age[:, None], size_mm[:, None], platelets[:, None], labs, flags], 1)
true_risk = 0.04 * (age - 55) + 0.03 * (size_mm - 35) + 0.5 * labs[:, 0] - 0.4 * flags[:, 0] - 0.004 * (platelets - 300)
time = torch.distributions.Exponential(0.1 * torch.exp(true_risk)).sample()
censor = torch.distributions.Exponential(torch.full((n,), 0.05)).sample()
event = (time <= censor).float()
duration = torch.minimum(time, censor)


class DeepSurv(L.LightningModule):
    def __init__(self, d_in, lr):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_in, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1))
        self.lr = lr
        self.losses = []

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def partial_likelihood(self, risk, duration, event):
        order = torch.argsort(duration, descending=True)
        risk, event = risk[order], event[order]
        log_risk_set = torch.log(torch.cumsum(torch.exp(risk), dim=0))
        return -((risk - log_risk_set) * event).sum() / event.sum().clamp(min=1)

    def training_step(self, batch, batch_idx):
        xb, db, eb = batch
        loss = self.partial_likelihood(self(xb), db, eb)
        self.losses.append(loss.item())
        print(f"step={self.global_step} loss={loss.item():.6f}")
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


loader = DataLoader(TensorDataset(x, duration, event), batch_size=128, shuffle=True)
model = DeepSurv(x.shape[1], lr=3e-2)
trainer = L.Trainer(max_epochs=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, loader)
print(f"final_loss={sum(model.losses[-5:]) / 5:.6f}")
