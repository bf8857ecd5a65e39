"""DDP and FSDP2 (gloo, 2 processes on this machine): relu_ext.ReLU, nn.ReLU under relu_ext.install(),
and nn.ReLU under relu_ext.save_compact() train with the same gradients as nn.ReLU; so do the family's
ReLU6 and LeakyReLU, converted and installed, and BatchNorm -> ReLU outputs that save_compact()
rebuilds from the BatchNorm."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import relu_ext
from relu_ext.compact.deferred import Deferred

pytestmark = pytest.mark.torch_version  # the risk it checks: see tests/tiers.py


class _Unfinished:
    """A stand-in for the CUDA event of a check (relu_ext.compact.deferred): never done until waited on."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


def _node_names(y: torch.Tensor) -> set[str]:
    seen, todo = set(), [y.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo.extend(f for f, _ in fn.next_functions)
    return {fn.name() for fn in seen}


def _worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        grads = {}
        runs = (("ours", relu_ext.ReLU), ("installed", torch.nn.ReLU), ("compact", torch.nn.ReLU), ("ref", torch.nn.ReLU),
                ("family_ours", None), ("family_installed", None), ("family_ref", None),
                ("bn_recompute", "bn"), ("bn_pending", "bn"), ("bn_ref", "bn"))
        replayed = dict.fromkeys(("bn_recompute", "bn_pending"), 0)
        for name, act in runs:
            hold = relu_ext.install() if name.endswith("installed") else None  # spawned: each process installs
            torch.manual_seed(0)
            if act == "bn":  # Linear -> BatchNorm1d -> ReLU: the ReLU outputs the next Linear keeps are replayed
                model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.BatchNorm1d(128), torch.nn.ReLU(),
                                            torch.nn.Linear(128, 64), torch.nn.BatchNorm1d(64),
                                            torch.nn.ReLU(inplace=True), torch.nn.Linear(64, 1))
            elif act is None:  # the family: ReLU6 and LeakyReLU, swapped by convert() or reached by install()
                model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU6(), torch.nn.Linear(128, 64),
                                            torch.nn.LeakyReLU(0.1, inplace=True), torch.nn.Linear(64, 1))
                if name == "family_ours":
                    relu_ext.convert(model)
            else:
                model = torch.nn.Sequential(torch.nn.Linear(16, 128), act(), torch.nn.Linear(128, 64), act(inplace=True),
                                            torch.nn.Linear(64, 1))
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            torch.manual_seed(100 + rank)  # each rank its own data
            # bn_pending: no check comes back before backward (it reads each tensor as it is), see test_pending.
            Deferred.stand_in = _Unfinished if name == "bn_pending" else None
            for _ in range(3):
                opt.zero_grad()
                sc = {"compact": relu_ext.save_compact(min_saving=0.0), "bn_recompute": relu_ext.save_compact(),
                      "bn_pending": relu_ext.save_compact()}.get(name)
                with sc or contextlib.nullcontext():
                    loss = ddp(torch.randn(64, 16)).square().mean()  # 64 x 128 ReLU outputs: compacted / replayed
                loss.backward()
                if name in replayed:
                    replayed[name] += sc.replayed  # (after backward: reading it waits for the checks)
                opt.step()
            Deferred.stand_in = None
            grads[name] = [p.grad.clone() for p in model.parameters()] + [p.detach().clone() for p in model.parameters()]
            grads[name + "_nodes"] = _node_names(ddp(torch.randn(2, 16)))
            if hold is not None:
                hold.remove()
        grads["replayed"] = replayed
        if rank == 0:
            torch.save(grads, out_file)
        dist.barrier()  # (see _fsdp_worker)
    finally:
        dist.destroy_process_group()


def test_ddp_gloo_matches_nn_relu(tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    grads = torch.load(out)
    assert len(grads["ours"]) == len(grads["installed"]) == len(grads["compact"]) == len(grads["ref"]) == 12
    for a, b, c, d in zip(grads["ours"], grads["installed"], grads["compact"], grads["ref"]):
        assert torch.equal(a, d) and torch.equal(b, d) and torch.equal(c, d)
    assert "ReluExtBackward0" in grads["ours_nodes"] and "ReluExtBackward0" in grads["installed_nodes"]
    assert "ReluBackward0" not in grads["installed_nodes"] and "ReluBackward0" in grads["ref_nodes"]
    for a, b, c in zip(grads["family_ours"], grads["family_installed"], grads["family_ref"]):
        assert torch.equal(a, c) and torch.equal(b, c)
    for name in ("family_ours", "family_installed"):
        assert {"HardtanhExtBackward0", "LeakyReluExtBackward0"} <= grads[name + "_nodes"], grads[name + "_nodes"]
    assert "HardtanhBackward0" in grads["family_ref_nodes"]
    assert len(grads["bn_recompute"]) == len(grads["bn_pending"]) == len(grads["bn_ref"]) == 20
    for a, b, c in zip(grads["bn_recompute"], grads["bn_pending"], grads["bn_ref"]):
        assert torch.equal(a, c) and torch.equal(b, c)
    # 3 steps, 2 ReLU outputs each (the second one 64 x 64 = 4096 elements)
    assert grads["replayed"] == {"bn_recompute": 3 * 2, "bn_pending": 3 * 2}


def _fsdp_worker(rank: int, world: int, init_file: str, out_file: str, version: int) -> None:
    """FSDP2 (fully_shard, each Linear and the whole model) or FSDP (version 1, each Linear wrapped):
    parameters all-gathered for the forward, gradients reduce-scattered; relu_ext's modules, install()
    and save_compact() inside it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        out: dict[str, object] = {}
        for name in ("ref", "ours", "installed", "compact", "bn_ref", "bn_recompute"):
            hold = relu_ext.install() if name == "installed" else None
            torch.manual_seed(0)
            norm = name.startswith("bn")
            layers = [torch.nn.Linear(16, 128), *([torch.nn.BatchNorm1d(128)] if norm else []), torch.nn.ReLU(),
                      torch.nn.Linear(128, 64), *([torch.nn.BatchNorm1d(64)] if norm else []),
                      torch.nn.ReLU6(inplace=True) if norm else torch.nn.LeakyReLU(0.1, inplace=True),
                      torch.nn.Linear(64, 1)]
            model = torch.nn.Sequential(*layers)
            if name == "ours":
                relu_ext.convert(model)
            if version == 2:
                for layer in model:
                    if isinstance(layer, torch.nn.Linear):
                        fully_shard(layer, mesh=mesh)
                fully_shard(model, mesh=mesh)
            else:
                model = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                                 auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                                                 use_orig_params=True)  # (summon_full_params with_grads needs it)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            torch.manual_seed(100 + rank)  # each rank its own data
            counts = [0, 0, 0]
            for _ in range(3):
                opt.zero_grad()
                sc = relu_ext.save_compact(min_saving=0.0) if name in ("compact", "bn_recompute") else None
                with sc or contextlib.nullcontext():
                    loss = model(torch.randn(64, 16)).square().mean()
                if sc is not None:
                    counts = [counts[0] + sc.compacted, counts[1] + sc.replayed, counts[2] + sc.replay_misses]
                loss.backward()
                opt.step()
            if version == 2:  # sharded (DTensor) parameters and gradients, gathered whole on every rank
                out[name] = [t.full_tensor().clone() for p in model.parameters() for t in (p.detach(), p.grad)]
            else:
                with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
                    out[name] = [t.clone() for p in model.parameters() for t in (p.detach(), p.grad)]
            out[name + "_nodes"] = _node_names(model(torch.randn(2, 16)))
            out[name + "_counts"] = counts
            if hold is not None:
                hold.remove()
        if rank == 0:
            torch.save(out, out_file)
        # Neither rank closes its connections while the other may still use them: gloo can abort a
        # process whose peer has hung up.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.full  # each version is a two-process run: DDP is the quick tier's distributed case
@pytest.mark.parametrize("version", [2, 1], ids=["fsdp2", "fsdp1"])
def test_fsdp_gloo_matches_nn_relu(tmp_path, version):
    out = tmp_path / "fsdp.pt"
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "init"), str(out), version), nprocs=2, join=True)
    got = torch.load(out)
    assert len(got["ref"]) == 12 and len(got["bn_ref"]) == 20
    for name, ref in (("ours", "ref"), ("installed", "ref"), ("compact", "ref"), ("bn_recompute", "bn_ref")):
        assert len(got[name]) == len(got[ref]), name
        for i, (a, b) in enumerate(zip(got[name], got[ref])):
            assert torch.equal(a, b), (name, i)
    for name in ("ours", "installed"):
        assert {"ReluExtBackward0", "LeakyReluExtBackward0"} <= got[name + "_nodes"], got[name + "_nodes"]
    assert "ReluBackward0" in got["ref_nodes"] and "ReluExtBackward0" not in got["ref_nodes"]
    assert got["compact_counts"] == [3, 0, 0]  # the ReLU output (the next Linear keeps it), each step
    # Both activation outputs after a BatchNorm, each step: rebuilt from it under FSDP2. FSDP (version
    # 1) hands the BatchNorm views of its flat parameter, whose bias the graph does not keep: the
    # recipe is not tried, and the outputs (mostly zeros) are compacted.
    assert got["bn_recompute_counts"] == ([0, 6, 0] if version == 2 else [6, 0, 0])
