import torch
from torch import nn
from common import MLP

class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 5, 3)        # 5 output channels: uneven over 2 ranks
        self.fc = nn.Linear(5, 3)
    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x)).mean((2, 3))
        return self.fc(x)

class TinyTransformer(nn.Module):
    def __init__(self, vocab=11, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)                  # 11 rows: uneven
        self.block = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)
    def forward(self, tokens):
        return self.head(self.block(self.emb(tokens)))

def build(name):
    torch.manual_seed(0)
    m = {"mlp": MLP, "cnn": CNN, "transformer": TinyTransformer}[name]()
    return m, [c for c in m.children()]

def batch(name, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    if name == "mlp":
        return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    if name == "cnn":
        return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    t = torch.randint(0, 11, (2, 6), generator=g)
    return t, torch.randint(0, 11, (2, 6), generator=g)

def loss_fn(name, out, y):
    if name == "transformer":
        return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())
    return nn.functional.cross_entropy(out, y)
