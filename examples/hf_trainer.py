"""A transformers model trained by ``Trainer`` through the comera backend: the Llama blocks' MLPs as
tensor-trains, the LM head and its loss fused, nothing else changed in the training code.

    pip install -e ".[hf]"                   # transformers and accelerate (Trainer needs it)
    python examples/hf_trainer.py            # CPU: about a minute

``cc.hf.compile`` compiles the model in place, so ``Trainer`` still sees the model's own ``forward``
signature (a ``torch.compile`` wrapper's ``(*args, **kwargs)`` would make it drop every dataset column).
Leave ``TrainingArguments(torch_compile=...)`` off: accelerate rejects the backend name "comera".
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import comera_compile as cc


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=None, help="Trainer's output directory (default: a temporary one)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config)  # or AutoModelForCausalLM.from_pretrained(...)
    cc.tensorize_(model, cc.TTConfig(rank=16), filter_fn=lambda m, fqn: ".mlp." in fqn)
    # cce_min_vocab=0: fuse even this toy head, whose logits are too small for the cost rule to fuse
    cc.hf.compile(model, options={"cce_min_vocab": 0})
    optimizer = torch.optim.AdamW(cc.param_groups(model, lr=1e-3))  # after tensorize_

    tokens = torch.randint(0, config.vocab_size, (64, 32))  # your tokenized dataset
    train = [{"input_ids": row, "labels": row} for row in tokens]
    with tempfile.TemporaryDirectory() as tmp:
        targs = transformers.TrainingArguments(args.out or tmp, max_steps=args.steps, per_device_train_batch_size=8,
                                               logging_steps=max(1, args.steps // 2), report_to=[],
                                               save_strategy="no", use_cpu=not torch.cuda.is_available())
        trainer = transformers.Trainer(model=model, args=targs, train_dataset=train, optimizers=(optimizer, None))
        with cc.report.collecting() as report:  # what the backend did to each graph it compiled
            result = trainer.train()
    print(report)
    kinds = sorted({r.kind for r in report.rewrites})
    print(f"train loss {result.training_loss:.4f}; rewrites: {kinds}")
    return {"training_loss": result.training_loss, "rewrite_kinds": kinds}


if __name__ == "__main__":
    main()
