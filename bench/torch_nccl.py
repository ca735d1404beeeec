"""torch.distributed (NCCL) on the sizes of examples/nccl_bench.rs, for the same device call:
torchrun --nproc-per-node 2 bench/torch_nccl.py"""
import os
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if rank == 0:
        print(f"== torch.distributed {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {world} GPUs ==")
    for op in ["AllReduce", "AllGather", "ReduceScatter"]:
        for dtype in [torch.float32, torch.bfloat16]:
            for nbytes in [8 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]:
                elements = nbytes // torch.tensor([], dtype=dtype).element_size()
                if op == "AllReduce":
                    x = torch.ones(elements, device="cuda", dtype=dtype)
                    once = lambda: dist.all_reduce(x)
                elif op == "AllGather":
                    x = torch.ones(elements // world, device="cuda", dtype=dtype)
                    out = torch.empty(elements, device="cuda", dtype=dtype)
                    once = lambda: dist.all_gather_into_tensor(out, x)
                else:
                    x = torch.ones(elements, device="cuda", dtype=dtype)
                    out = torch.empty(elements // world, device="cuda", dtype=dtype)
                    once = lambda: dist.reduce_scatter_tensor(out, x)
                iterations = 50 if nbytes >= 256 << 20 else 100
                for _ in range(iterations):  # as many warm-up calls as timed ones, as nccl_bench
                    once()
                torch.cuda.synchronize()
                dist.barrier()
                start = time.perf_counter()
                for _ in range(iterations):
                    once()
                torch.cuda.synchronize()
                seconds = (time.perf_counter() - start) / iterations
                factor = 2 * (world - 1) / world if op == "AllReduce" else (world - 1) / world
                if rank == 0:
                    size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
                    print(f"{op:<15} {str(dtype).split('.')[-1]:<8} {size:>10} {seconds * 1e6:12.1f} {nbytes * factor / seconds / 1e9:12.1f}")
                dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
