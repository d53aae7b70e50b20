"""PyTorch Lightning's Trainer with strategy="ddp" on CPU (Gloo), as a torchrun-launched job.

Usage: lightning_ddp.py OUT_DIR (under elrun or torchrun, --nproc-per-node 2). A tiny regression
model fits a seeded synthetic data set for 3 epochs; Lightning must find the launcher's
environment (TorchElasticEnvironment) and train in the launched processes instead of starting
its own. Lightning writes its checkpoint and CSV metrics under OUT_DIR; rank 0 prints one line,
`RESULT {json}`: the cluster environment, every rank's pid and parent pid, every rank's loss at
every step, the global step and a checksum of the final weights.
"""
import os
import sys

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import job_common


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main():
    out_dir = sys.argv[1]
    pl.seed_everything(7, workers=True)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 8, generator=gen)
    y = torch.tanh(x[:, :4].sum(dim=1, keepdim=True)) + 0.05 * torch.randn(64, 1, generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)  # Lightning adds a DistributedSampler.
    model = Regressor()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, default_root_dir=out_dir,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         deterministic=True)
    trainer.fit(model, loader)

    mine = {"pid": os.getpid(), "ppid": os.getppid(), "losses": model.losses,
            "env": type(trainer.strategy.cluster_environment).__name__}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if trainer.global_rank == 0:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        job_common.report({
            "world_size": trainer.world_size, "global_step": trainer.global_step,
            "cluster_environment": [r["env"] for r in ranks],
            "pids": [r["pid"] for r in ranks], "ppids": [r["ppid"] for r in ranks],
            "losses": [r["losses"] for r in ranks],
            "epoch_loss": trainer.callback_metrics["train_loss_epoch"].item(),
            "weights_sum": weights.sum().item(), "weights_norm": weights.norm().item()})
    job_common.leave()


if __name__ == "__main__":
    main()
