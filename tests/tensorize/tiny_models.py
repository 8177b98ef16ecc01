"""The small model the tensorize_ tests tensorize: an embedding and two Linears."""

import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, vocab=101, d=48, hidden=80, n_out=7):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, n_out)

    def forward(self, idx):
        return self.fc2(torch.relu(self.fc1(self.emb(idx)))).mean(1)
