"""A Hugging Face accelerate training loop on CPU (Gloo), as a torchrun-launched job.

Usage: accelerate_loop.py OUT_DIR (under elrun or torchrun, --nproc-per-node 2). Accelerator()
reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), prepares a
tiny classifier, its optimizer and a seeded synthetic data loader (which it shards across the
ranks), trains 3 epochs and saves its state with save_state to OUT_DIR/state. Rank 0 prints one
line, `RESULT {json}`: the distributed type and process count accelerate saw, the loss averaged
over the ranks (accelerator.gather) at every step, the final accuracy and a weights checksum.
"""
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

import job_common


def main():
    out_dir = sys.argv[1]
    accelerator = Accelerator(cpu=True)
    set_seed(5)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(96, 6, generator=gen)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True,
                                         generator=torch.Generator().manual_seed(4))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    losses = []
    for _ in range(3):
        for inputs, targets in loader:
            loss = torch.nn.functional.cross_entropy(model(inputs), targets)
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            losses.append(accelerator.gather(loss.detach()).mean().item())
    with torch.no_grad():
        correct = accelerator.gather((model(x).argmax(dim=1) == y).sum()).sum().item()
    accelerator.save_state(os.path.join(out_dir, "state"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        weights = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
        job_common.report({
            "distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
            "backend": accelerator.state.backend, "losses": losses,
            "accuracy": correct / (len(x) * accelerator.num_processes),
            "weights_sum": weights.sum().item(), "weights_norm": weights.norm().item()})
    job_common.leave()  # Not accelerator.end_training(): it destroys the process group.


if __name__ == "__main__":
    main()
