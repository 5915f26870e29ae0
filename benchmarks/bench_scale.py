"""One rank's start-up as the world grows: 8 to 8,192 ranks on torch's fake process group, and the rendezvous
store's traffic of the process groups on 8 and 16 real gloo processes.

    python benchmarks/bench_scale.py                      # worlds 8 64 1024 8192; store traffic on 8 and 16
    python benchmarks/bench_scale.py --worlds 8 64 --store-worlds 8 --work /tmp/scale

Start-up (each world in a fresh process, rank 0 of `world` ranks on the fake backend, whose collectives do
nothing): the config read and checked at that world size, the plan resolved on described H100 nodes of 8, the
grid and its process groups, the device mesh made of them, the datasets of a generated corpus (two indexed
datasets blended, their document, sample and shuffle indices and the blend read from the cache a first run
built), the model and optimizer built as a run builds them (on the meta device, where a GPU run puts them on
the GPU), and a checkpoint's metadata read (DCP's .metadata of a checkpoint saved by `world` ranks, written
here with one chunk per rank and tensor as DCP records a ZeRO-1 checkpoint's sharded optimizer state; up to
--metadata-world ranks, since it grows as tensors x world: 8,192 ranks' would take gigabytes to build here). The
layout is fixed (tp 2, ulysses 4, pp 1, Llama-3.1-8B's shapes at seq_len 8192) and so is the global batch (1,024
sequences): the same job on more ranks, dp growing. Recorded per world: wall time of each stage, new_group and
split_group calls and the process groups they created, this rank's communicators, the peak host memory
(ru_maxrss) of the process.

`--before` adds, after the grid, what the grid did before each rank created only its own groups: every rank
called new_group for every group of every kind, and DeviceMesh created its own.

Store traffic (gloo, N processes on this machine, a TCPStore wrapped to count): each rank's store operations
and the distinct keys it touched while the grid and its mesh are built, after init_process_group.
Wall times on a shared machine vary with its load: cpu_s (the process's CPU seconds over the stages) is the
steadier figure.

Prints markdown tables; --out-dir DIR or --record (benchmarks/results/) writes them as scale.json (scale_before.json
with --before).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import add_output_args, output_dir, write_bytes, write_text  # noqa: E402

LAYOUT = ["parallel.tp=2", "parallel.sp=4", "parallel.pp=1", "parallel.virtual_stages=1"]
JOB = LAYOUT + ["data.seq_len=8192", "training.global_batch_size=1024", "training.train_steps=1000",
                "training.eval_interval=0", "data.tokenizer=NullTokenizer", "training.mlp_chunk_tokens=0",
                "training.loss_chunk_tokens=0", "checkpoint.save_interval=0"]
DOCS, MEAN_LEN = 200_000, 400          # per dataset: 200K documents, about 80M tokens in all


def make_corpus(work: Path) -> list[str]:
    """Two indexed datasets of random documents (uint32 tokens below the vocabulary), once."""
    from megalysses.data.indexed import IndexedDatasetBuilder

    prefixes = []
    for i in range(2):
        prefix = work / f"corpus{i}_text_document"
        prefixes.append(str(prefix))
        if Path(f"{prefix}.idx").exists():
            continue
        rng = np.random.default_rng(i)
        lengths = rng.integers(1, 2 * MEAN_LEN, DOCS)
        builder = IndexedDatasetBuilder(f"{prefix}.bin", np.int32)
        builder.add_documents(rng.integers(0, 128000, int(lengths.sum()), dtype=np.int32), lengths)
        builder.finalize(f"{prefix}.idx")
    return prefixes


class Counted:
    """new_group / split_group calls and the groups they returned, counted around torch.distributed's own."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls, self.groups, self.dist = 0, 0, dist
        self.originals = {name: getattr(dist, name) for name in ("new_group", "split_group")}

    def __enter__(self) -> "Counted":
        for name, fn in self.originals.items():
            def counted(*args, _fn=fn, **kwargs):
                self.calls += 1
                group = _fn(*args, **kwargs)
                self.groups += group is not None and group != self.dist.GroupMember.NON_GROUP_MEMBER
                return group
            setattr(self.dist, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.originals.items():
            setattr(self.dist, name, fn)


def old_groups(grid_layout, timeout) -> None:
    """What the grid did before: every rank creates every group of every kind, and a DeviceMesh its own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from megalysses.grid import GROUP_AXES

    for kind in list(GROUP_AXES) + ["embed"]:
        for ranks in grid_layout.groups(kind):
            if len(ranks) > 1:
                dist.new_group(ranks, timeout=timeout)
    d = grid_layout.degrees
    ranks = grid_layout.ranks.permute(0, 3, 1, 2).reshape(d.pp, d.tp, d.dp * d.sp)
    DeviceMesh("cpu", ranks.flatten().view(ranks.shape), mesh_dim_names=("pp", "tp", "grad"))


def checkpoint_metadata(path: Path, model, world: int) -> None:
    """DCP's .metadata of a checkpoint of `model` saved by `world` ranks: each tensor's fp32 optimizer state
    (two moments and the master) in one chunk per rank, as a ZeRO-1 checkpoint records it; the weights per tp rank."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)
    import torch

    meta, storage = {}, {}
    for name, p in model.named_parameters():
        n = p.numel()
        for kind, parts in (("model", 2), ("exp_avg", world), ("exp_avg_sq", world), ("master", world)):
            fqn = f"{kind}.{name}"
            size, chunks = -(-n // parts), []
            for r in range(parts):
                chunks.append(ChunkStorageMetadata(offsets=torch.Size([r * size]), sizes=torch.Size([size])))
                storage[MetadataIndex(fqn, torch.Size([r * size]))] = f"__{r}_0.distcp"
            meta[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([size * parts]),
                                              chunks)
    write_bytes(path, ".metadata", pickle.dumps(Metadata(state_dict_metadata=meta, storage_data=storage)))


def one_world(world: int, work: Path, before: bool, metadata_world: int) -> dict:
    """Rank 0's start-up in a fake world of `world` ranks (run in a fresh process): seconds per stage and counts."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megalysses.config.checks import validate_config
    from megalysses.config.io import load_config
    from megalysses.grid import GridLayout, ParallelGrid
    from megalysses.plan import Machine, resolve
    from megalysses.training.data import TrainingData
    from megalysses.training.build import build_run

    warnings.filterwarnings("ignore", message="Set timeout is now only supported")
    out, t = {"world": world}, time.perf_counter()

    def stage(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        out[name] = round(now - t, 3)
        t = now

    paths = json.dumps(make_corpus(work))
    t, cpu = time.perf_counter(), time.process_time()
    cfg = load_config(str(ROOT / "configs/llama3_8b_1m.yaml"),
                      JOB + [f"data.paths={paths}", f"data.cache_dir={work / 'cache'}", f"logging.run_dir={work}/run"])
    validate_config(cfg, world_size=world)
    stage("config_s")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    run = resolve(cfg, Machine.described("H100", ranks_per_node=8), world)
    stage("plan_s")
    with Counted() as counted:
        grid = ParallelGrid.for_plan(run, cfg.parallel.timeout_seconds)
        mesh = grid.device_mesh(torch.device("meta"))
        if before:      # after the grid: torch names a rank's own groups by how many groups it already has
            old_groups(GridLayout(run.degrees), timedelta(seconds=60))
    out.update(new_group_calls=counted.calls, groups_created=counted.groups,
               communicators=len(getattr(grid, "communicators", [])))
    stage("grid_s")
    data = TrainingData(cfg, grid, run, torch.device("cpu"))
    out["train_samples"] = len(data.train)
    stage("data_s")
    model = build_run(cfg, run, grid, torch.device("meta"), mesh=mesh).model
    stage("model_s")
    ckpt = work / f"ckpt_{world}"
    if metadata_world < 0:            # a run of its own writes the metadata, outside the measured one's memory
        checkpoint_metadata(ckpt, model, world)
        return {}
    if world <= metadata_world:      # its chunks grow as tensors x world: past this, extrapolated (scale.md)
        t = time.perf_counter()
        FileSystemReader(str(ckpt)).read_metadata()
        out["metadata_mib"] = round((ckpt / ".metadata").stat().st_size / 2**20, 1)
        stage("checkpoint_metadata_s")
    out["cpu_s"] = round(time.process_time() - cpu, 3)
    dist.destroy_process_group()
    out["peak_host_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


class CountingStore:
    """Builds a dist.Store subclass that forwards to a real store and counts each operation and key."""

    @staticmethod
    def wrap(inner):
        import torch.distributed as dist

        class Store(dist.Store):
            def __init__(self) -> None:
                super().__init__()
                self.ops, self.keys, self.counting = 0, set(), False

            def _count(self, keys) -> None:
                if self.counting:
                    self.ops += 1
                    self.keys.update(keys)

            def set(self, key, value):
                self._count([key])
                return inner.set(key, value)

            def get(self, key):
                self._count([key])
                return inner.get(key)

            def add(self, key, value):
                self._count([key])
                return inner.add(key, value)

            def compare_set(self, key, expected, desired):
                self._count([key])
                return inner.compare_set(key, expected, desired)

            def wait(self, keys, timeout=None):
                self._count(keys)
                return inner.wait(keys) if timeout is None else inner.wait(keys, timeout)

            def check(self, keys):
                self._count(keys)
                return inner.check(keys)

            def delete_key(self, key):
                self._count([key])
                return inner.delete_key(key)

            def num_keys(self):
                return inner.num_keys()

            def set_timeout(self, timeout):
                return inner.set_timeout(timeout)

        return Store()


def store_rank(rank: int, world: int, port: int, before: bool, out_dir: str) -> None:
    """One gloo rank: its store operations while the grid (tp 2, ulysses 2, dp = world / 4: the same groups per
    rank at 8 and 16) and its mesh are built."""
    import torch
    import torch.distributed as dist

    from megalysses.degrees import Degrees
    from megalysses.grid import GridLayout, ParallelGrid

    torch.set_num_threads(1)
    inner = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    store = CountingStore.wrap(inner)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    store.counting = True
    t = time.perf_counter()
    grid = ParallelGrid(Degrees.of_world(world, tp=2, sp=2), timeout_seconds=120)
    grid.device_mesh(torch.device("cpu"))
    if before:
        old_groups(GridLayout(Degrees.of_world(world, tp=2, sp=2)), timedelta(seconds=120))
    seconds = time.perf_counter() - t
    store.counting = False
    dist.barrier()
    write_text(Path(out_dir), f"{rank}.json", json.dumps({"ops": store.ops, "keys": len(store.keys), "s": seconds}))
    dist.destroy_process_group()


def store_traffic(world: int, before: bool) -> dict:
    """The most store operations and keys of any rank, and the slowest rank's grid time, on `world` gloo ranks."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(store_rank, args=(world, port, before, out_dir), nprocs=world, start_method="spawn")
        ranks = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(world)]
    return {"world": world, "store_ops_per_rank": max(r["ops"] for r in ranks),
            "store_keys_per_rank": max(r["keys"] for r in ranks), "grid_s": round(max(r["s"] for r in ranks), 3)}


def table(rows: list[dict], keys: list[str]) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=[8, 64, 1024, 8192])
    ap.add_argument("--store-worlds", type=int, nargs="*", default=[8, 16])
    ap.add_argument("--work", default=None, help="where the corpus, its cache and the checkpoints' metadata go")
    ap.add_argument("--metadata-world", type=int, default=1024,
                    help="the largest world whose checkpoint metadata is built and read (tensors x world chunks)")
    ap.add_argument("--before", action="store_true", help="replay every rank creating every group (the old grid)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    add_output_args(ap)
    args = ap.parse_args(argv)
    folder = output_dir(ap, args)
    work = Path(args.work or tempfile.mkdtemp(prefix="scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        print(json.dumps(one_world(args.one, work, args.before, args.metadata_world)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    startup = []
    for world in [args.worlds[0]] + args.worlds:      # the first run builds the corpus and its cache: not recorded
        base = [sys.executable, __file__, "--one", str(world), "--work", str(work), "--metadata-world"]
        if world <= args.metadata_world and not (work / f"ckpt_{world}" / ".metadata").exists():
            subprocess.run(base + ["-1"], check=True, capture_output=True, env=env)
        cmd = base + [str(args.metadata_world)] + (["--before"] if args.before else [])
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            print(r.stdout + r.stderr, file=sys.stderr)
            return 1
        startup.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(startup[-1]), file=sys.stderr, flush=True)
    startup = startup[1:]
    for row in startup:
        row["total_s"] = round(sum(v for k, v in row.items() if k.endswith("_s") and k != "cpu_s"), 3)
    stores = [store_traffic(w, args.before) for w in args.store_worlds]
    print(table(startup, ["world", "config_s", "plan_s", "grid_s", "data_s", "model_s", "checkpoint_metadata_s",
                          "total_s", "cpu_s", "new_group_calls", "groups_created", "communicators", "metadata_mib",
                          "peak_host_mib"]))
    print()
    print(table(stores, ["world", "store_ops_per_rank", "store_keys_per_rank", "grid_s"]))
    if folder is not None:
        write_text(folder, "scale_before.json" if args.before else "scale.json",
                   json.dumps({"startup": startup, "store": stores}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
