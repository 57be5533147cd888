"""A tiny Hugging Face mixture-of-experts model with ``OverlapMoE`` swapped in (expert parallel),
trained next to its dense twin.

Every rank builds the same tiny ``MixtralForCausalLM`` (or ``--model qwen3_moe``:
``Qwen3MoeForCausalLM`` with q/k-norm) with random weights (same seed; nothing is downloaded),
keeps a dense copy and swaps the overlap layers into the original over the whole world
(``overlap_layers.swap``): each MoE block becomes ``OverlapMoE`` with the experts split over the
ranks (EP 2 by default: 2 of 4 experts per rank); each rank routes its share of the tokens and
the outputs are all-gathered, so every token is computed once. Attention runs tensor parallel.
The loss includes HF's load-balancing aux loss (``output_router_logits=True``). Both models train
with the ordinary loop (``clip_grad_norm_``, AdamW) on batches of random tokens (the same on every
rank); the losses print side by side.

It shows expert parallelism swapped into a model, aux loss included, matching the dense model.

Run it from a checkout or an install:

    python examples/moe_example.py                         # CPU: starts 2 gloo ranks itself
    python examples/moe_example.py --model qwen3_moe --steps 3
    torchrun --nproc-per-node 2 examples/moe_example.py    # GPUs: NCCL, one GPU per rank

Extras: ``pip install "overlap_layers[hf]"`` (transformers >= 5).
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
    p.add_argument("--model", default="mixtral", choices=["mixtral", "qwen3_moe"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nprocs", type=int, default=2, help="CPU ranks to start when not under torchrun")
    p.add_argument("--tol", type=float, default=1e-3, help="largest |dense - overlap| loss difference accepted")
    return p.parse_args(argv)


def build_model(name: str, seed: int, device):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)  # the same weights on every rank
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.02)
    if name == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=96, num_local_experts=4, **common))
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=48, num_experts=4,
                                                   norm_topk_prob=True, **common))
    return model.to(device)


def train(device: torch.device, args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    model = build_model(args.model, args.seed, device)
    dense = copy.deepcopy(model)
    overlap_layers.swap(model, group=dist.group.WORLD)  # EP (MoE) and TP (attention) over the whole world
    runs = [("dense", dense, torch.optim.AdamW(dense.parameters(), lr=args.lr)),
            ("overlap", model, torch.optim.AdamW(model.parameters(), lr=args.lr))]
    # Batches of random tokens from a small random corpus (so the loss has something to learn),
    # drawn with one seeded generator: the same batches on every rank.
    gen = torch.Generator().manual_seed(args.seed + 1)
    corpus = torch.randint(0, VOCAB, (4 * args.batch, args.seq), generator=gen)
    worst = 0.0
    if rank == 0:
        print(f"{args.model}: EP over {world} ranks on {device.type}; {args.steps} steps of AdamW (clipped), "
              f"batch {args.batch} x {args.seq}; loss = LM loss + aux loss")
    for step in range(args.steps):
        ids = corpus[torch.randint(0, len(corpus), (args.batch,), generator=gen)].to(device)
        losses, aux = [], []
        for name, m, opt in runs:
            opt.zero_grad(set_to_none=True)
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()  # every gradient complete: no other call before clipping
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            losses.append(out.loss.item())
            aux.append(out.aux_loss.item())
        diff = max(abs(losses[0] - losses[1]), abs(aux[0] - aux[1]))
        worst = max(worst, diff)
        if rank == 0:
            print(f"step {step:3d}  dense {losses[0]:.6f} (aux {aux[0]:.4f})  overlap {losses[1]:.6f} "
                  f"(aux {aux[1]:.4f})  |diff| {diff:.2e}", flush=True)
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
