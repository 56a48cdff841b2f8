"""The source article's low-level loop (docs/sources.md) with mixprec's GradScaler, unchanged
except for the import.

    scaler = GradScaler(init_scale=256) ... scaler.scale(loss).backward(); scaler.step(opt);
    scaler.update()

FP16 autocast runs here on the CPU (slowly, where the CPU has no FP16 units) so that loss
scaling is really exercised.
"""
import torch
from torch import nn

import mixprec as mp
from mixprec.amp import GradScaler

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
criterion = nn.CrossEntropyLoss()
train_loader = [(torch.randn(16, 32), torch.randint(0, 4, (16,))) for _ in range(20)]

scaler = GradScaler(init_scale=256, growth_interval=500)
for inputs, labels in train_loader:
    with mp.autocast("16-mixed"):
        outputs = model(inputs)
        loss = criterion(outputs.float(), labels)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
print(f"loss {loss.item():.3f}, scale {scaler.get_scale():g}, skipped {scaler.num_skipped_steps}")
