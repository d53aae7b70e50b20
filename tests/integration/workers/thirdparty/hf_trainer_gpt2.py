"""Hugging Face transformers' Trainer on a tiny GPT-2, on CPU (Gloo), as a torchrun-launched job.

Usage: hf_trainer_gpt2.py OUT_DIR (under elrun or torchrun, --nproc-per-node 2). The model is
built from a GPT2Config (2 layers, 32-wide, 64-token vocabulary): nothing is downloaded (run with
HF_HUB_OFFLINE=1). Trainer reads the launcher's environment, trains 8 steps on seeded synthetic
token sequences, evaluates, and saves the model to OUT_DIR/final. Rank 0 prints one line,
`RESULT {json}`: the parallel mode and world size Trainer saw, the loss logged at every step,
the train and eval losses and a checksum of the final weights.
"""
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed

import job_common

VOCAB, SEQ = 64, 16


class Tokens(torch.utils.data.Dataset):
    """Seeded random sequences that repeat with period 4, so there is something to learn."""

    def __init__(self, count, seed):
        gen = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, VOCAB, (count, 4), generator=gen).repeat(1, SEQ // 4)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main():
    out_dir = sys.argv[1]
    set_seed(3)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, ddp_backend="gloo", report_to="none",
                             max_steps=8, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", seed=3,
                             disable_tqdm=True, dataloader_num_workers=0,
                             ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(64, 1), eval_dataset=Tokens(32, 2))
    train = trainer.train()
    evaluation = trainer.evaluate()
    trainer.save_model(os.path.join(out_dir, "final"))  # Rank 0 writes, the others wait.
    if args.process_index == 0:
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        job_common.report({
            "world_size": args.world_size, "parallel_mode": str(args.parallel_mode),
            "distributed": torch.distributed.is_initialized(),
            "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
            "global_step": train.global_step, "train_loss": train.training_loss,
            "step_losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "eval_loss": evaluation["eval_loss"],
            "weights_sum": weights.sum().item(), "weights_norm": weights.norm().item()})
    job_common.leave()


if __name__ == "__main__":
    main()
