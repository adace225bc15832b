# source: https://github.com/skorch-dev/skorch/issues/481 (torch.log(y_pred) of a softmax output gave -inf)
# expect: NGL015 log_domain
import torch


class NeuralNetClassifier:
    def get_loss(self, y_pred, y_true, X=None, training=False):
        y_pred_log = torch.log(y_pred)
        return self.criterion_(y_pred_log, y_true)
