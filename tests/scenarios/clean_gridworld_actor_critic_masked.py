# Advantage actor-critic on a small grid world with action masking: moves that
# would leave the grid are masked to -inf before the Categorical policy;
# separate actor (RMSprop) and critic (Adam) networks and optimizers.
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributions import Categorical

torch.manual_seed(0)

SIZE, MAX_LEN, GAMMA = 5, 20, 0.95
MOVES = torch.tensor([[-1, 0], [1, 0], [0, -1], [0, 1]])


def observe(pos):
    obs = torch.zeros(SIZE * SIZE)
    obs[pos[0] * SIZE + pos[1]] = 1.0
    return obs


def legal_moves(pos):
    nxt = pos + MOVES
    return ((nxt >= 0) & (nxt < SIZE)).all(1)


actor = nn.Sequential(nn.Linear(SIZE * SIZE, 64), nn.ReLU(), nn.Linear(64, 4))
critic = nn.Sequential(nn.Linear(SIZE * SIZE, 64), nn.ReLU(), nn.Linear(64, 1))
actor_opt = torch.optim.RMSprop(actor.parameters(), lr=7e-4, alpha=0.99, eps=1e-5)
critic_opt = torch.optim.Adam(critic.parameters(), lr=1e-3)

losses = []
for episode in range(120):
    pos = torch.randint(0, SIZE, (2,))
    goal = torch.tensor([SIZE - 1, SIZE - 1])
    log_probs, entropies, values, rewards = [], [], [], []
    for t in range(MAX_LEN):
        obs = observe(pos)
        logits = actor(obs).masked_fill(~legal_moves(pos), float("-inf"))
        dist = Categorical(logits=logits)
        action = dist.sample()
        log_probs.append(dist.log_prob(action))
        entropies.append(dist.entropy())
        values.append(critic(obs).squeeze())
        pos = pos + MOVES[action]
        done = bool((pos == goal).all())
        rewards.append(1.0 if done else -0.01)
        if done:
            break
    returns, R = [], 0.0
    for r in reversed(rewards):
        R = r + GAMMA * R
        returns.insert(0, R)
    returns = torch.tensor(returns)
    values = torch.stack(values)
    advantage = returns - values.detach()
    actor_loss = -(torch.stack(log_probs) * advantage).mean() - 0.01 * torch.stack(entropies).mean()
    critic_loss = F.smooth_l1_loss(values, returns)

    actor_opt.zero_grad()
    actor_loss.backward()
    actor_opt.step()
    critic_opt.zero_grad()
    critic_loss.backward()
    critic_opt.step()
    loss = actor_loss.item() + critic_loss.item()
    losses.append(loss)
    print(f"step={episode} loss={loss:.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
