# Matrix factorisation trained with Bayesian Personalised Ranking on implicit
# feedback, following guoyang9/BPR-pytorch: one sampled negative per observed
# (user, item) pair, loss summed over the batch, plain SGD with L2 through
# weight_decay. The learning rate was raised to speed up the sweep.
import torch

torch.manual_seed(4)
user_num, item_num, factor_num = 1500, 2500, 32
taste = torch.randn(user_num, 6)
style = torch.randn(item_num, 6)
score = taste @ style.T
train_pairs = torch.nonzero(score > 4.0)
train_mat = torch.zeros(user_num, item_num, dtype=torch.bool)
train_mat[train_pairs[:, 0], train_pairs[:, 1]] = True


class BPR(torch.nn.Module):
    def __init__(self, user_num, item_num, factor_num):
        super().__init__()
        self.embed_user = torch.nn.Embedding(user_num, factor_num)
        self.embed_item = torch.nn.Embedding(item_num, factor_num)
        torch.nn.init.normal_(self.embed_user.weight, std=0.01)
        torch.nn.init.normal_(self.embed_item.weight, std=0.01)

    def forward(self, user, item_i, item_j):
        user = self.embed_user(user)
        item_i = self.embed_item(item_i)
        item_j = self.embed_item(item_j)
        prediction_i = (user * item_i).sum(dim=-1)
        prediction_j = (user * item_j).sum(dim=-1)
        return prediction_i, prediction_j


model = BPR(user_num, item_num, factor_num)
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.001)

losses = []
for step in range(60):
    idx = torch.randint(0, len(train_pairs), (4096,))
    user, item_i = train_pairs[idx, 0], train_pairs[idx, 1]
    item_j = torch.randint(0, item_num, (4096,))
    prediction_i, prediction_j = model(user, item_i, item_j)
    loss = - (prediction_i - prediction_j).sigmoid().log().sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item() / 4096)
    print(f"step={step} loss={loss.item() / 4096:.6f}")
print(f"final_loss={sum(losses[-5:]) / 5:.6f}")
