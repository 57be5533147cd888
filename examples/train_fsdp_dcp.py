"""Train a tiny Hugging Face Llama with the overlap layers swapped in, with the ordinary training
loop (clipping included) fed by a data loader over the data-parallel ranks, checkpoint it with DCP
and resume from the checkpoint, then save it as a Hugging Face checkpoint and load that into a
meta-built model shard by shard; optionally FSDP2 over data parallelism times tensor parallelism.

Every rank builds the same tiny ``LlamaForCausalLM`` (random weights, same seed; nothing is
downloaded) and swaps ``OverlapAttention`` / ``OverlapMLP`` into it over the ``tp`` axis of a
device mesh: every parameter becomes a DTensor on that axis (sharded ones in the layers'
placements, the others replicated), so ``torch.nn.utils.clip_grad_norm_`` sees the whole model's
norm, AdamW sees one kind of tensor, and DCP saves a checkpoint that reloads into any layout.
With ``--fsdp`` the mesh is ``(dp, tp)`` and FSDP2 shards every decoder layer and the root over
``dp``. The data loader samples over the dp ranks only (``DistributedSampler(num_replicas=dp,
rank=dp_rank)``), so every rank of a tp group gets the same batch and each dp rank its share of
the global batch. The run saves a checkpoint (model and optimizer) halfway, trains on, then builds
a new model (other weights), loads the checkpoint and trains the remaining steps again: the resumed
losses equal the first run's. Last, ``save_pretrained`` writes the model as the unswapped Llama's
checkpoint, and a model built on the meta device, swapped and materialised loads it with
``load_pretrained_shards`` (each rank reads its part of each tensor): its loss equals the model's.

Run it from a checkout or an install:

    python examples/train_fsdp_dcp.py                          # CPU: 2 gloo ranks, tp=2
    python examples/train_fsdp_dcp.py --nprocs 4 --fsdp        # CPU: 4 ranks, dp=2 x tp=2
    torchrun --nproc-per-node 4 examples/train_fsdp_dcp.py --fsdp   # GPUs: NCCL, one GPU per rank

Extras: ``pip install "overlap_layers[hf]"`` (transformers >= 5). The recipe, per rank::

    mesh = init_device_mesh("cuda", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = LlamaForCausalLM(config)                          # same weights on every rank
    overlap_layers.swap(model, mesh=mesh, axis="tp")          # DTensor parameters on mesh["tp"]
    for layer in model.model.layers:                          # --fsdp
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters())
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank)   # dp ranks only
    for (ids,) in DataLoader(dataset, batch_size=batch // dp, sampler=sampler):  # the same on a tp group
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()                                       # every gradient complete: no other call
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    dcp.save(get_state_dict(model, optimizer), checkpoint_id=path)   # and dcp.load + set_state_dict
    model.save_pretrained(hf_path)                            # every rank: the unswapped Llama's checkpoint
    # later: build on the meta device, swap, model.to_empty(device=...), rebuild the rotary tables,
    overlap_layers.integrations.load_pretrained_shards(model, hf_path)   # then fully_shard
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile

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
    p.add_argument("--steps", type=int, default=6, help="training steps of the first run")
    p.add_argument("--save-at", type=int, default=None, help="checkpoint after this many steps (default: half)")
    p.add_argument("--batch", type=int, default=4, help="global batch (split over dp with --fsdp)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-norm", type=float, default=1.0, help="clip_grad_norm_'s max_norm")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 over a dp axis of 2 (the mesh is (2, world / 2))")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (default: a temporary one, removed after)")
    p.add_argument("--nprocs", type=int, default=2, help="CPU ranks to start when not under torchrun")
    p.add_argument("--tol", type=float, default=1e-4, help="largest |first run - resumed run| loss difference")
    return p.parse_args(argv)


def build_model(seed: int, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)  # the same weights on every rank
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).to(device)


def make_mesh(device, fsdp: bool):
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if fsdp:
        if world % 2:
            raise SystemExit(f"--fsdp needs an even number of ranks (dp=2); got {world}")
        return init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("tp",))


def prepare(seed: int, device, mesh, fsdp: bool, lr: float, pretrained=None):
    """A swapped (and with ``fsdp`` fully sharded) model and its AdamW; with ``pretrained`` (a
    ``save_pretrained`` directory) built on the meta device and loaded from it before FSDP2 shards
    it, each rank reading only its part of each tensor."""
    if pretrained is None:
        model = build_model(seed, device)
    else:
        with torch.device("meta"):
            model = build_model(seed, "meta")  # no weights allocated
    overlap_layers.swap(model, mesh=mesh, axis="tp")  # every parameter a DTensor on mesh["tp"]
    if pretrained is not None:
        model.to_empty(device=device)  # this rank's parts only
        rotary = model.model.rotary_emb  # its tables are not in a checkpoint: built anew
        model.model.rotary_emb = type(rotary)(config=model.config).to(device)
        overlap_layers.integrations.load_pretrained_shards(model, pretrained)
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def data(args, dp: int, dp_rank: int) -> list:
    """This rank's batch of each step: a corpus of random tokens (the same on every rank) sampled
    over the data-parallel ranks only, so every rank of a tensor-parallel group gets the same rows
    and each dp rank ``batch / dp`` rows of each global batch (``set_epoch`` reshuffles alike on every
    rank). Listed up front, so that the resumed run replays the same batches."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    gen = torch.Generator().manual_seed(args.seed + 1)
    dataset = TensorDataset(torch.randint(0, VOCAB, (4 * args.batch, args.seq), generator=gen))
    sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch // dp, sampler=sampler, drop_last=True)
    batches, epoch = [], 0
    while len(batches) < args.steps:
        sampler.set_epoch(epoch)
        batches.extend(ids for (ids,) in loader)
        epoch += 1
    return batches[:args.steps]


def mean_loss(model, ids, dp_group) -> float:
    """The loss on ``ids`` without a step, averaged over the dp ranks."""
    with torch.no_grad():
        value = model(input_ids=ids, labels=ids).loss
    if dp_group is not None:
        dist.all_reduce(value, group=dp_group)
        value /= dist.get_world_size(dp_group)
    return value.item()


def train_step(model, optimizer, ids, max_norm: float, dp_group):
    """The ordinary step; returns (the loss averaged over the dp ranks, the gradient norm)."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    value = loss.detach().clone()
    if dp_group is not None:
        dist.all_reduce(value, group=dp_group)
        value /= dist.get_world_size(dp_group)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return value.item(), float(norm)


def save(model, optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load(model, optimizer, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def train(device: torch.device, args) -> None:
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    save_at = args.steps // 2 if args.save_at is None else args.save_at
    if not 0 < save_at < args.steps:
        raise SystemExit(f"--save-at {save_at} must be between 0 and --steps {args.steps} (exclusive)")
    mesh = make_mesh(device, args.fsdp)
    dp_group = mesh.get_group("dp") if args.fsdp else None
    dp_rank, dp = (mesh.get_coordinate()[0], mesh["dp"].size()) if args.fsdp else (0, 1)
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} must be divisible by dp={dp}")
    made = None
    if args.ckpt is None:  # one temporary directory, named by rank 0
        made = [tempfile.mkdtemp(prefix="overlap_dcp_") if rank == 0 else None]
        dist.broadcast_object_list(made, src=0)
        made = made[0]
    path = os.path.join(args.ckpt or made, f"step{save_at}")
    pretrained = os.path.join(args.ckpt or made, "pretrained")
    batches = data(args, dp, dp_rank)
    if rank == 0:
        shape = f"dp={dp} x tp={mesh['tp'].size()}" if args.fsdp else f"tp={mesh.size()}"
        print(f"{shape} on {device.type}; {args.steps} steps of AdamW with clip_grad_norm_({args.max_norm}), "
              f"batch {args.batch} x {args.seq}; checkpoint after step {save_at}", flush=True)
    try:
        model, optimizer = prepare(args.seed, device, mesh, args.fsdp, args.lr)
        first = []
        for step in range(args.steps):
            loss, norm = train_step(model, optimizer, batches[step].to(device), args.max_norm, dp_group)
            first.append(loss)
            if rank == 0:
                print(f"step {step:3d}  loss {loss:.6f}  grad norm {norm:.4f}", flush=True)
            if step + 1 == save_at:
                save(model, optimizer, path)
                if rank == 0:
                    print(f"saved {path}", flush=True)
        del model, optimizer
        # Resume: a new model with other weights, loaded from the checkpoint, trains on.
        model, optimizer = prepare(args.seed + 1, device, mesh, args.fsdp, args.lr)
        load(model, optimizer, path)
        worst = 0.0
        for step in range(save_at, args.steps):
            loss, _ = train_step(model, optimizer, batches[step].to(device), args.max_norm, dp_group)
            worst = max(worst, abs(loss - first[step]))
            if rank == 0:
                print(f"resumed step {step:3d}  loss {loss:.6f}  (first run {first[step]:.6f})", flush=True)
        # The unswapped Llama's checkpoint, loaded into a model built on the meta device.
        model.save_pretrained(pretrained)  # every rank; rank 0 writes
        reloaded, _ = prepare(args.seed + 2, device, mesh, args.fsdp, args.lr, pretrained=pretrained)
        ids = batches[-1].to(device)
        want, got = mean_loss(model, ids, dp_group), mean_loss(reloaded, ids, dp_group)
        if rank == 0:
            print(f"pretrained checkpoint reloaded shard by shard: loss {got:.6f} (saved model {want:.6f})")
    finally:
        dist.barrier()
        if made is not None and rank == 0:
            shutil.rmtree(made, ignore_errors=True)
    if worst > args.tol or abs(got - want) > args.tol:  # the losses are all-reduced: every rank exits alike
        raise SystemExit(f"the resumed run diverged (max |diff| {worst:.3e}) or the reloaded model differs "
                         f"(|diff| {abs(got - want):.3e}); tolerance {args.tol}")
    if rank == 0:
        print(f"resumed losses match (max |diff| {worst:.2e} <= {args.tol})")


def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        import transformers  # noqa: F401 - before any rank starts
    except ImportError:
        raise SystemExit('this example needs transformers: pip install "overlap_layers[hf]"') from None
    run_ranks(train, args, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
