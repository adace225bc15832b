import torch
import torch.nn.functional as F

torch.manual_seed(0)


class ActorCritic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.affine = torch.nn.Linear(4, 32)
        self.action_head = torch.nn.Linear(32, 2)
        self.value_head = torch.nn.Linear(32, 1)

    def forward(self, x):
        h = F.relu(self.affine(x))
        return F.softmax(self.action_head(h), dim=-1), self.value_head(h)


model = ActorCritic()
optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
eps = 1.1920928955078125e-07
history = []
for step in range(40):
    # one episode per update; the episode of step 17 ends at its first move (a terminal start state)
    length = 1 if step == 17 else 4 + step % 5
    log_probs, values, rewards = [], [], []
    state = torch.randn(4)
    for t in range(length):
        probs, value = model(state.unsqueeze(0))
        action = int(torch.randint(0, 2, (1,)))  # exploration: a uniformly drawn action
        log_probs.append(torch.log(probs[0, action]))
        values.append(value.squeeze())
        rewards.append(1.0 - 0.5 * action)
        state = state + 0.1 * torch.randn(4)
    R, returns = 0.0, []
    for r in rewards[::-1]:
        R = r + 0.99 * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    returns = (returns - returns.mean()) / (returns.std() + eps)
    policy_losses, value_losses = [], []
    for log_prob, value, R in zip(log_probs, values, returns):
        advantage = R - value.item()
        policy_losses.append(-log_prob * advantage)
        value_losses.append(F.smooth_l1_loss(value.view(1), torch.tensor([R])))
    loss = torch.stack(policy_losses).sum() + torch.stack(value_losses).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    history.append(loss.item())
    print(f"step={step} loss={loss.item():.4f}")
print(f"final_loss={sum(history[-5:]) / 5:.4f}")
