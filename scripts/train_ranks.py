"""Data parallelism over processes for train_builtin.py on a CPU host (--ranks).

Why: on the 2-core hosts each training step runs two threads inside each operator, and small
operators (layer norms, softmaxes, the per-item losses, the Python between them) do not split well.
Two processes of one thread each, each on half of every batch, keep the cores busier: the vision
stage's first 200 steps took 78.4 s against 88.7 s, the joint stage's first 150 steps 207.7 s against
223.9 s (session 50, AMD EPYC Zen 2, scripts/bench/train_ranks.sh).

The decoder pre-stage gained nothing this way (its first 250 steps 64.6 s against 64.8 s): its steps
are short, and averaging its 3.2 M gradients over gloo (~9 ms, and the copies around it) ate what the
split forward and backward saved (0.206 s against 0.234 s). It runs on rank 0 with every thread, as
in one process, while the others wait; they then load its weights from the cache entry rank 0 writes
(train_builtin.cached_stage, solo), so it is the same entry as one process's.

How: rank 0 is the process the user started; it starts ranks 1.. as copies of itself (the same argv,
an environment variable naming the rank) before it packs, and the ranks meet through a file in --work
(torch.distributed, gloo) once the training packs exist (Ranks.join). Every rank builds the same model from the same seed, draws
the same batch indices, trains on its share of them (share(): every world-th row) and averages the
gradients with the others before each optimizer step (average_gradients), so that every rank holds
the same weights bit for bit after every step (same_weights checks it at the end of each stage). What
a rank draws for its own rows (augmentation, pasted boxes, kept patches, extra turns) comes from a
stream of its own (seed()); rank 0's streams are those of one process, so --ranks 1 computes exactly
as before. Held-out checks run on rank 0 with every thread while the others wait (main_wide), and
their results reach every rank, so gates decide the same everywhere. Only rank 0 writes files.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ENV_RANK = "VLMOPT_TRAIN_RANK"
ENV_WORLD = "VLMOPT_TRAIN_WORLD"
ENV_INIT = "VLMOPT_TRAIN_RANKS_INIT"
# A rank waits this long for another in one collective: the others wait out rank 0's decoder pre-stage
# (10-15 minutes on the 2-core hosts); a rank that died closes its sockets, which the others see at once.
TIMEOUT = datetime.timedelta(hours=2)


class Ranks:
    """This process's place among the training processes; with world 1, one process's behaviour throughout."""

    def __init__(self, rank: int = 0, world: int = 1, threads: int = 1, children: list | None = None,
                 logs: list[Path] | None = None, init: Path | None = None):
        self.rank, self.world, self.threads = rank, world, threads
        self.children, self.logs, self.init = children or [], logs or [], init

    def join(self) -> None:
        """Rank 0: meets the ranks it started (they wait for it there); call it once the packs are in --work."""
        if self.init is None:
            return
        try:
            dist.init_process_group("gloo", init_method=f"file://{self.init}", rank=0, world_size=self.world,
                                    timeout=TIMEOUT)
        except BaseException:
            self.abort()
            raise
        self.init = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, rows):
        """This rank's rows of a batch (a list, array or tensor): every world-th from its rank."""
        return rows[self.rank::self.world]

    def seed(self, seed: int):
        """The seed of a stream that draws for this rank's own rows: rank 0's is a single-process run's."""
        return seed if self.rank == 0 else [seed, self.rank]

    def average_gradients(self, params) -> None:
        """Each parameter's gradient becomes the mean over the ranks (as one flat all-reduce). A parameter
        no rank's loss reached keeps no gradient (the optimizer skips it, as in one process); one that
        only some reached gets zeros on the others."""
        if self.world == 1:
            return
        params = [p for p in params if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        used = [p for p, h in zip(params, has.tolist()) if h]
        for p in used:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not used:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in used])
        dist.all_reduce(flat)
        flat.div_(self.world)  # a power of two in practice: exact
        offset = 0
        for p in used:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n

    def broadcast_json(self, value=None):
        """Rank 0's value (JSON-serialisable) on every rank, as JSON gives it back (tuples become lists)."""
        if self.world == 1:
            return json.loads(json.dumps(value))
        data = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8) if self.main else None
        size = torch.tensor([data.numel() if self.main else 0], dtype=torch.int64)
        dist.broadcast(size, 0)
        if not self.main:
            data = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(data, 0)
        return json.loads(bytes(data.tolist()).decode())

    def split_threads(self) -> None:
        """From here on each rank runs its own share of the threads (the data-parallel stages)."""
        torch.set_num_threads(self.threads)

    @contextlib.contextmanager
    def all_threads(self):
        """Within: this process runs every rank's threads (rank 0 while the others wait)."""
        torch.set_num_threads(self.threads * self.world)
        try:
            yield
        finally:
            torch.set_num_threads(self.threads)

    def main_wide(self, fn):
        """fn() on rank 0 with every rank's threads (the others wait); its JSON-able result on every rank."""
        if self.world == 1:
            return json.loads(json.dumps(fn()))
        value = None
        if self.main:
            with self.all_threads():
                value = fn()
        return self.broadcast_json(value)

    def same_weights(self, module: torch.nn.Module, what: str) -> None:
        """Raises unless every rank holds rank 0's weights bit for bit."""
        if self.world == 1:
            return
        flat = torch.cat([v.detach().reshape(-1).float() for v in module.state_dict().values()])
        ref = flat.clone()
        dist.broadcast(ref, 0)
        differs = torch.tensor([0 if torch.equal(ref, flat) else 1], dtype=torch.int32)
        dist.all_reduce(differs)
        if int(differs):
            raise RuntimeError(f"--ranks: after the {what}, {int(differs)} rank(s) hold other weights than rank 0 "
                               "(a draw from torch's RNG that depends on the rank's rows?)")

    def finish(self) -> None:
        """After the last collective, on every rank; rank 0 then waits for the others and raises, with the
        tail of its log, if one failed."""
        if self.world == 1:
            return
        dist.barrier()
        dist.destroy_process_group()
        for rank, (child, log) in enumerate(zip(self.children, self.logs), start=1):
            if child.wait() != 0:
                raise RuntimeError(f"--ranks: rank {rank} exited with {child.returncode}; its log {log}:\n"
                                   + tail(log))

    def abort(self) -> None:
        """Rank 0 on an error: stops the other ranks."""
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(unreadable: {e})"


def start(world: int, threads: int, work: Path) -> Ranks:
    """The Ranks of this process. Rank 0 (no ENV_RANK set) with world > 1 starts ranks 1..world-1 as
    copies of this script with `--work work` (their stdout and stderr in work/rank-N.log), to meet them
    through a file there (join()); a started rank reads its rank from the environment and meets rank 0. threads: each rank's torch
    threads; rank 0 keeps every rank's threads until split_threads(): a pre-stage it trains alone then
    computes bit for bit as in one process (dropping to one thread before it, and back, did not: the
    count-tag phase came out other in the last bits). Call it before packing: the others start up
    meanwhile and wait for rank 0's join(), which comes once the packs are in work."""
    if ENV_RANK in os.environ:
        rank, world, init = int(os.environ[ENV_RANK]), int(os.environ[ENV_WORLD]), os.environ[ENV_INIT]
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=TIMEOUT)
        return Ranks(rank, world, threads)
    torch.set_num_threads(threads * world)
    if world == 1:
        return Ranks(0, 1, threads)
    init = work / f".ranks-{os.getpid()}"  # the file store wants a file no earlier run left behind
    init.unlink(missing_ok=True)
    children, logs = [], []
    for rank in range(1, world):
        log = work / f"rank-{rank}.log"
        env = dict(os.environ, **{ENV_RANK: str(rank), ENV_WORLD: str(world), ENV_INIT: str(init)})
        with open(log, "w") as out:
            children.append(subprocess.Popen([sys.executable, *sys.argv, "--work", str(work)], env=env,
                                             stdout=out, stderr=out,
                                             stdin=subprocess.DEVNULL))
        logs.append(log)
    ranks = Ranks(0, world, threads, children, logs, init)
    atexit.register(ranks.abort)  # an error on rank 0 stops the others (after finish(): nothing to stop)
    return ranks
