import faulthandler, os, sys, time, torch, torch.multiprocessing as mp
sys.path.insert(0, os.getcwd())
def work(rank, world, port, backend):
    faulthandler.dump_traceback_later(150, exit=True)
    from tests.test_fully_sharded import _against_fsdp2
    from tests.test_distributed import rank_group
    t = time.time()
    with rank_group(rank, world, port, "cuda") as device:
        print(f"rank {rank} joined {time.time()-t:.1f}s", flush=True)
        _against_fsdp2(rank, world, device, "mlp-kept", backend)
        print(f"rank {rank} {backend} done {time.time()-t:.1f}s", flush=True)
if __name__ == "__main__":
    from tests.test_distributed import _free_port
    mp.spawn(work, args=(2, _free_port(), sys.argv[1]), nprocs=2)
