"""How the model is spread over the processes (docs/fsdp.md).

ddp: every rank holds the whole model, gradients and AdamW moments; DDP all-reduces gradients.
fsdp: FSDP2 (fully_shard) per block, then the root: each rank holds 1/world of all three, and a
block's weights are all-gathered around its forward and backward (HSDP: within groups of ranks).
Both read and write the same checkpoints, so either resumes the other at any world size.
"""

import warnings
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from collectives import any_rank
from world import World, available_memory

# A padded vocabulary's logits are a slice, a view, which FSDP warns an in-place op could bypass its
# backward hook through: nothing here changes logits in place (model.py's forward)
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPT\) returned a view tensor")
# ShardedGradScaler's own found_inf (shape [1]) made into a replicated DTensor: torch's internals, not the run's
warnings.filterwarnings("ignore", message=r"Found a non-scalar tensor with numel=1 and ndim!=0")


def is_fsdp(model) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def build(make_model, world: World, reshard: bool):
    """The model on world.device, sharded under FSDP (the optimizer is made afterwards, on the
    shards; DDP wraps it later, after compile). Under FSDP only rank 0 builds the model whole,
    from the seed; the others build it on the meta device, which allocates nothing, and after
    sharding each fills its shard from rank 0's weights: the same weights as a DDP run's."""
    if world.strategy != "fsdp":
        return make_model().to(world.device)
    with torch.device("meta") if not world.is_master else nullcontext():
        model = make_model()
    full = {"model": model.state_dict() if world.is_master else None}
    shard(model.to(world.device) if world.is_master else model, world, reshard)
    if not world.is_master:
        model.to_empty(device=world.device)  # room for this rank's shards, then rank 0's values
    load_full_state(model, None, world, full)
    return model


def shard(model, world: World, reshard: bool):
    """FSDP2: shard each block, then the root (embeddings, final norm), in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # HSDP when shard_size < world size: a 2-D mesh, sharded within each group of shard_size
    # ranks (a host: all-gathers stay on its fast links) and replicated across the groups
    groups = world.size // world.shard_size
    if groups == 1:
        mesh = init_device_mesh(world.device.type, (world.size,))  # the default group's ranks: its group
    else:  # new groups, which time out after dist_timeout like the default one (else torch's 30 minutes)
        options = {dim: dist.ProcessGroupNCCL.Options() if world.backend == "nccl" else dist.ProcessGroupGloo._Options()
                   for dim in ("replicate", "shard")}  # one each: torch fills in each group's ranks
        for o in options.values():
            o._timeout = world.timeout
        mesh = init_device_mesh(world.device.type, (groups, world.shard_size), mesh_dim_names=("replicate", "shard"),
                                backend_override=options)
    world.mesh = mesh
    # Compute in dtype; gradients are reduced in float32 and the sharded master weights stay
    # float32 (what the optimizer steps). autocast still runs the losses and norms in float32.
    mp = MixedPrecisionPolicy(param_dtype=None if world.dtype == torch.float32 else world.dtype,
                              reduce_dtype=torch.float32)
    for module in (*model.transformer.h, model):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
        module.set_gradient_divide_factor(1.0)  # summed, not averaged: see _summed
        module.set_force_sum_reduction_for_comms(True)  # (else a PREMUL_SUM op, which gloo lacks)


def _summed(_, bucket):
    """DDP's gradient all-reduce as a sum: each rank's backward already divided its losses by the world's
    micro-batch count (train.accumulate_gradients), so float16's scaled values, and where they overflow,
    are a single process's; averaging them here instead would make the grad scaler skip other steps."""
    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda done: done.value()[0])


def wrap(model, raw_model, world: World):
    """What trains: DDP around the (compiled) model when ddp has several ranks."""
    if world.size > 1 and not is_fsdp(raw_model):
        model = DDP(model, device_ids=[world.device.index] if world.device.type == "cuda" else None,
                    gradient_as_bucket_view=True)  # (not a copy of every gradient in its buckets: 4 bytes a parameter)
        model.register_comm_hook(None, _summed)
    return model


def skip_gradient_sync(model, raw_model, skip: bool):
    """A context for one micro-step with no gradient communication when skip (accumulation): DDP's
    no_sync (which must cover forward too); FSDP2's flag, set anew for every micro-step."""
    if is_fsdp(raw_model):
        raw_model.set_requires_gradient_sync(not skip)
    return model.no_sync() if skip and isinstance(model, DDP) else nullcontext()


def clip_grad_norm(raw_model, max_norm: float) -> torch.Tensor:
    """Clip to the global gradient norm (under FSDP over all the shards). On a CPU from summed squares: its
    float32 norm rounds a shard otherwise than the whole tensor (DDP's and FSDP's grad_norm were 1.6e-4 apart
    on GPT-2's vocabulary); a sum adds up pairwise, within 1e-7 either way. CUDA's norm adds up in a tree."""
    params = [p for p in raw_model.parameters() if p.grad is not None]  # (none: bench.py's FSDP step unsynced)
    if not params or params[0].device.type != "cpu":
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        norm = torch.stack([p.grad.pow(2).sum() for p in params]).sum().sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def all_finite(raw_model, world: World, optimizer=None) -> bool:
    """Whether every weight and optimizer tensor is finite, agreed by all ranks (each checks its own shard)."""
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p
    tensors = list(raw_model.parameters())
    for state in optimizer.state.values() if optimizer else ():  # AdamW's step and moments
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return not any_rank(not all(torch.isfinite(local(t)).all() for t in tensors), world)


def full_state(raw_model, optimizer) -> tuple:
    """(model state dict, optimizer state dict) in full; every rank calls it. Under FSDP the
    shards are gathered to rank 0's CPU memory (the other ranks get empty dicts)."""
    if not is_fsdp(raw_model):
        return raw_model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(raw_model, options=options)
    optim_sd = optimizer_state(raw_model, optimizer, options=options)
    if not model_sd:
        return {}, {}
    model_sd["lm_head.weight"] = model_sd["transformer.wte.weight"]  # tied, as state_dict() has it
    return model_sd, by_position(optim_sd)


def rekey(optim_sd: dict, key: dict) -> dict:
    """An optimizer state dict with each parameter's key k replaced by key[k]: by name (the
    state-dict API's layout) or by position in param_groups (torch.optim's, what a ddp run writes)."""
    return {"state": {key[k]: dict(s) for k, s in optim_sd["state"].items()},
            "param_groups": [{**g, "params": [key[k] for k in g["params"]]} for g in optim_sd["param_groups"]]}


def by_position(optim_sd: dict) -> dict:
    """A name-keyed optimizer state dict in torch.optim's own layout: parameters numbered in order."""
    return rekey(optim_sd, {n: i for i, n in enumerate(n for g in optim_sd["param_groups"] for n in g["params"])})


def load_full_state(raw_model, optimizer, world: World, ckpt: dict):
    """Load the full state rank 0's ckpt holds: "model", and "optimizer" where it has that key (the
    other ranks' values are None). PyTorch's state-dict API broadcasts it tensor by tensor, so no
    rank holds a second whole copy; under FSDP each rank keeps its shard."""
    model_sd, optim_sd = ckpt["model"] or {}, (ckpt["optimizer"] or {}) if "optimizer" in ckpt else None
    if world.size == 1:
        raw_model.load_state_dict(model_sd)
        if optim_sd is not None:
            optimizer.load_state_dict(optim_sd)
        return
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(raw_model, dict(model_sd), options=options)  # a copy: it is changed in place
    if optim_sd is not None:
        if optim_sd:  # rank 0: positions -> names, the layout the API reads
            names = {id(p): n for n, p in raw_model.named_parameters()}
            optim_sd = rekey(optim_sd, dict(enumerate(names[id(p)] for g in optimizer.param_groups
                                                      for p in g["params"])))
        set_optimizer_state_dict(raw_model, optimizer, optim_sd, options=options)


def sharded_state(raw_model, optimizer) -> tuple:
    """({"model": ..., "optimizer": ...} of this rank's tensors, DTensor shards under FSDP, the
    optimizer's param_groups): what a sharded checkpoint holds, and, filled by DCP, what a resume
    loads. Parameters keyed by name; the tied lm_head.weight is kept once, as wte's."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    model_sd = get_model_state_dict(raw_model)
    model_sd.pop("lm_head.weight", None)
    optim_sd = optimizer_state(raw_model, optimizer)  # creates AdamW's moments if not yet there
    return {"model": model_sd, "optimizer": optim_sd["state"]}, optim_sd["param_groups"]


def optimizer_state(raw_model, optimizer, **options) -> dict:
    """get_optimizer_state_dict. A fresh optimizer (float16's skipped steps leave FSDP's unfused AdamW none)
    it steps with lr 0 to make the moments: that step is not counted, or the first real one would be
    bias-corrected as the second (and a run that saved there would differ from one that did not)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    fresh = not optimizer.state
    optim_sd = get_optimizer_state_dict(raw_model, optimizer, **options)
    for state in [*optimizer.state.values(), *optim_sd.get("state", {}).values()] if fresh else []:
        state["step"] = torch.zeros_like(state["step"])
    return optim_sd


def load_sharded_state(raw_model, optimizer, tensors: dict, param_groups: list):
    """Load what sharded_state gave, after DCP filled it, and the saved param_groups."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    model_sd = {**tensors["model"], "lm_head.weight": tensors["model"]["transformer.wte.weight"]}
    set_model_state_dict(raw_model, model_sd)
    set_optimizer_state_dict(raw_model, optimizer, {"state": tensors["optimizer"], "param_groups": param_groups})


def memory_problem(model_cfg, cfg, world: World):
    """A message when training this model clearly cannot fit this process's memory, else None.
    A lower bound, so only the impossible is refused: weights, gradients and AdamW moments
    (16 bytes a parameter, sharded under FSDP) plus one micro-batch's float32 logits and the input of each block,
    kept for backward (also under activation checkpointing); and the loader's order of windows in host memory."""
    n, per_token = model_cfg.n_params, model_cfg.padded_vocab_size + model_cfg.n_layer * model_cfg.n_embd
    state = 16 * n // (world.shard_size if world.strategy == "fsdp" else 1)
    batch = 4 * cfg.batch_size * cfg.block_size * per_token  # float32 logits and block inputs
    available = available_memory(world.device, world.local_size)
    if state + batch > available:  # (fsdp_shard_size below the world: more processes shrink no shard)
        # (a host's processes share its memory: fewer of them help where each holds the whole model)
        cpu = "fewer processes on this host, or " * (world.local_size > 1 and world.strategy != "fsdp") + "more hosts"
        more = "--fsdp_shard_size=0, which shards over every rank" if world.strategy == "fsdp" and \
            world.shard_size < world.size else (cpu if world.device.type == "cpu" else "more processes") + \
            " with --strategy=fsdp" * (world.strategy != "fsdp")
        smaller = "block_size" if cfg.batch_size == 1 else "batch_size"  # (sharding leaves a batch whole)
        return (f"this model needs at least {(state + batch) / 1e9:,.1f} GB per process ({n / 1e6:,.0f}M "
                f"parameters: {state / 1e9:,.1f} GB of weights, gradients and AdamW moments, {batch / 1e9:,.1f} GB "
                f"of logits and activations for batch_size={cfg.batch_size}), but {world.device} has "
                f"{available / 1e9:,.1f} GB available: choose a smaller " + (f"{smaller}" + " and model" * (
                    state >= available) if batch >= available else f"model or batch_size, or {more}"))
    table, host = 16 * cfg.global_batch_size, available_memory(torch.device("cpu"), world.local_size)
    if table > host:  # the loader's epoch holds every window's start (int64), twice while it is made
        return (f"global_batch_size={cfg.global_batch_size:,} needs at least {table / 1e9:,.1f} GB per process for the "
                f"loader's window order, but this host has {host / 1e9:,.1f} GB available: a global batch of "
                f"{host // 16:,} sequences at most")
    return None


def make_scaler(world: World):
    """The fp16 loss scaler (disabled otherwise); FSDP's agrees on inf/NaN across the shards."""
    if world.strategy == "fsdp" and world.dtype == torch.float16:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
        return ShardedGradScaler(world.device.type)
    return torch.amp.GradScaler(world.device.type, enabled=world.dtype == torch.float16)


def set_activation_checkpointing(raw_model, enabled: bool):
    """Recompute each block's activations in backward instead of keeping them (any strategy)."""
    for block in raw_model.transformer.h:
        block.checkpoint_activations = enabled
