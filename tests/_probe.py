import torch, torch.distributed as dist
def allreduce(rank, ws):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()
def boom(rank, ws):
    if rank == 1:
        raise ValueError("bad")
    dist.barrier()
