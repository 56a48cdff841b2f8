"""The source article's distributed example (docs/sources.md), as written there, on a model
small enough for a laptop.

Run it as one process (single device) or under torchrun (DDP, one process per device):

    python examples/seed_002_fit.py
    torchrun --nproc_per_node=2 examples/seed_002_fit.py
"""
import mixprec as mp
from mixprec.strategies import MirroredStrategy

strategy = MirroredStrategy()  # DDP under torchrun; a plain single device in one process
with strategy.scope():
    model = mp.models.Transformer(num_layers=2, d_model=64, num_heads=4, max_seq_len=64,
                                  amp_enabled=True)
    # FP16 parameters in the model, FP32 master weights inside the optimizer.
    optimizer = mp.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fp16_params=True)
    corpus = mp.data.builtin_corpus()  # Python's own stdlib source, byte-level tokens
    train_dataset = mp.data.TokenDataset(corpus.train_path, max_length=64)
    train_loader = mp.data.DistributedDataLoader(train_dataset, batch_size=8, num_workers=0,
                                                 pin_memory=True)

result = model.fit(train_loader, epochs=1, strategy=strategy, mixed_precision=True,
                   max_steps=20, log_interval=5, progress=False)
print(f"trained {result.steps} steps under {result.policy}; loss {result.final_loss:.3f}")
