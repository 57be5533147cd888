"""Train a tiny Hugging Face Llama with the overlap layers swapped in, next to its dense twin.

Every rank builds the same tiny ``LlamaForCausalLM`` (random weights, same seed; nothing is
downloaded), keeps a dense copy, swaps ``OverlapAttention`` / ``OverlapMLP`` into the original over
tensor parallelism across the whole world (``overlap_layers.swap``), and trains both with the
ordinary loop (``clip_grad_norm_``, AdamW) on batches of random tokens (the same on every rank).
It prints the two losses side by side each step; they match.
It shows that a swapped model trains as the dense one does, and the few lines a training loop adds.

Run it from a checkout or an install:

    python examples/train_tiny_llama.py                    # CPU: starts 2 gloo ranks itself
    python examples/train_tiny_llama.py --steps 5 --nprocs 4
    python examples/train_tiny_llama.py --block          # whole decoder layers as OverlapTransformerBlock
    python examples/train_tiny_llama.py --sequence-parallel [--ulysses]   # hidden states sharded by position
    torchrun --nproc-per-node 2 examples/train_tiny_llama.py   # GPUs: NCCL, one GPU per rank

Extras: ``pip install "overlap_layers[hf]"`` (transformers >= 5). The recipe, per rank::

    model = LlamaForCausalLM(config)                    # same weights on every rank
    overlap_layers.swap(model, group=tp_group)          # in place; every parameter a DTensor
    optimizer = torch.optim.AdamW(model.parameters())
    loss = model(input_ids=ids, labels=ids).loss        # the same batch on every rank of tp_group
    loss.backward()                                     # every gradient complete
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # the whole model's norm
    optimizer.step()

(``examples/train_fsdp_dcp.py`` adds FSDP2 and DCP checkpoints.)
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
import sys

import torch
import torch.distributed as dist

try:
    import overlap_layers
except ImportError:  # run from a checkout without installing: use the repository's package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import overlap_layers
from overlap_layers.launch import run_ranks  # noqa: E402

VOCAB = 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nprocs", type=int, default=2, help="CPU ranks to start when not under torchrun")
    p.add_argument("--tol", type=float, default=1e-3, help="largest |dense - overlap| loss difference accepted")
    p.add_argument("--block", action="store_true",
                   help="swap whole decoder layers (OverlapTransformerBlock) instead of attention and MLP one by one")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard the hidden states along the sequence between the decoder layers "
                        "(swap(..., sequence_parallel=True); --seq must divide by the world size)")
    p.add_argument("--ulysses", action="store_true", help="with --sequence-parallel: UlyssesAttention as the attention")
    return p.parse_args(argv)


def build_model(seed: int, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # the same weights on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).to(device)


def train(device: torch.device, args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    model = build_model(args.seed, device)
    dense = copy.deepcopy(model)
    overlap_layers.swap(model, group=dist.group.WORLD, block=args.block,  # TP over the whole world
                        sequence_parallel=args.sequence_parallel, attention="ulysses" if args.ulysses else "overlap")
    runs = [("dense", dense, torch.optim.AdamW(dense.parameters(), lr=args.lr)),
            ("overlap", model, torch.optim.AdamW(model.parameters(), lr=args.lr))]
    # Batches of random tokens from a small random corpus (so the loss has something to learn),
    # drawn with one seeded generator: the same batches on every rank.
    gen = torch.Generator().manual_seed(args.seed + 1)
    corpus = torch.randint(0, VOCAB, (4 * args.batch, args.seq), generator=gen)
    worst = 0.0
    if rank == 0:
        print(f"TP over {world} ranks on {device.type}; {args.steps} steps of AdamW (clipped), batch {args.batch} x {args.seq}")
    for step in range(args.steps):
        ids = corpus[torch.randint(0, len(corpus), (args.batch,), generator=gen)].to(device)
        losses = []
        for name, m, opt in runs:
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()  # every gradient complete: no other call before clipping
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
        diff = abs(losses[0] - losses[1])
        worst = max(worst, diff)
        if rank == 0:
            print(f"step {step:3d}  dense {losses[0]:.6f}  overlap {losses[1]:.6f}  |diff| {diff:.2e}", flush=True)
    if worst > args.tol:  # identical on every rank: every rank exits alike
        raise SystemExit(f"losses diverged: max |diff| {worst:.3e} > {args.tol}")
    if rank == 0:
        print(f"losses match (max |diff| {worst:.2e} <= {args.tol})")


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        import transformers  # noqa: F401 - before any rank starts
    except ImportError:
        raise SystemExit('this example needs transformers: pip install "overlap_layers[hf]"') from None
    run_ranks(train, args, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
