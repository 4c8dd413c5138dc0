"""benchmarks/zero_infinity_ranks.py without DeepSpeed: the collective byte counter on a real 2-rank gloo
group, the ranks' data slices, and the DeepSpeed config's global batch (DeepSpeed itself is not needed:
the harness imports it lazily)."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import zero_infinity as zi  # noqa: E402
import zero_infinity_ranks as zr  # noqa: E402


def _count_worker(rank: int, init_file: str, out_dir: str) -> None:
    counter = zr.CollectiveBytes()
    counter.install()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        dist.all_reduce(torch.ones(1000))  # 4000 B payload
        dist.all_gather_into_tensor(torch.empty(2000), torch.ones(1000))  # 8000 B gathered
        dist.reduce_scatter_tensor(torch.empty(1000), torch.ones(2000))  # 8000 B unreduced
        dist.broadcast(torch.ones(250), src=0)  # 1000 B from rank 0
        Path(out_dir, f"{rank}.json").write_text(json.dumps(counter.snapshot()))
    finally:
        dist.destroy_process_group()


def test_collective_bytes_follow_the_ring_model_on_two_ranks(tmp_path):
    mp.spawn(_count_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    totals = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for rank, t in enumerate(totals):
        assert t["all_reduce/calls"] == 1 and t["all_reduce/sent"] == 4000  # 2 (N-1)/N x 4000
        assert t["all_gather_into_tensor/payload"] == 8000 and t["all_gather_into_tensor/sent"] == 4000
        assert t["reduce_scatter_tensor/payload"] == 8000 and t["reduce_scatter_tensor/sent"] == 4000
        assert t["broadcast/sent"] == (1000 if rank == 0 else 0)
        assert t["sent"] == 12000 + t["broadcast/sent"]


def test_rank_slices_partition_the_one_rank_batch():
    steps, global_batch = 2, 16
    whole = list(zr.RankData(32, global_batch, steps, 0, 1).train_dataloader())
    halves = [list(zr.RankData(32, global_batch // 2, steps, r, 2).train_dataloader()) for r in range(2)]
    assert len(whole) == steps and all(len(h) == steps for h in halves)
    for step in range(steps):
        rows = sorted(map(tuple, whole[step][0].tolist()))
        parts = [halves[r][step][0] for r in range(2)]
        assert all(p.shape[0] == global_batch // 2 for p in parts)
        assert sorted(map(tuple, torch.cat(parts).tolist())) == rows


def test_deepspeed_config_counts_the_ranks_in_the_global_batch():
    config = zi.preset("tiny")
    hp = {"learning_rate": 3e-4, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8}
    one = zi.deepspeed_config(config, 2, 8, "/tmp/x", hp)
    two = zi.deepspeed_config(config, 2, 4, "/tmp/x", hp, world_size=2)
    assert one["train_batch_size"] == two["train_batch_size"] == 16
    assert two["train_micro_batch_size_per_gpu"] * two["gradient_accumulation_steps"] * 2 == 16
