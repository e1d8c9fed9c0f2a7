"""Kill a rank mid-fit under ``torchrun --max-restarts 1``, N times in a row: does the job come back every time?

    python benchmarks/restart_soak.py                     # 20 runs, 1 node x 2 ranks
    python benchmarks/restart_soak.py --runs 3 --nodes 2  # two torchrun launches (node ranks 0 and 1), 2D

Each run is one torchrun job (two launches for ``--nodes 2``) of a tiny DLRM with
``ModelCheckpoint(every_n_train_steps=3, save_last=True)`` and ``fit(ckpt_path="last")``. In the
first attempt one rank SIGKILLs itself after step ``--kill-at-step``; torchrun restarts the
workers, which resume from the newest committed checkpoint and finish. The restarted workers then
fit the same model again without a fault (the reference), and global rank 0 compares the two:
the batches and examples trained into each final model, and the final weights bit for bit.

Prints one line per run and a summary: how many came back, and the seconds from the kill to the
first training step after the resume (the restart, imports, rendezvous, planning and checkpoint
load). ``--json`` writes every run's record. Exit code 1 if any run did not come back or differed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KILL_RANK_ENV = "RESTART_SOAK_KILL_RANK"
PLAN_ENV = "RESTART_SOAK_PLAN"  # "point:step,point:step,...": where attempt a's victim dies
PROGRESS_ENV = "RESTART_SOAK_PROGRESS"  # a file: rank 0 appends "<attempt> <step> <unix time>" after each faulted-fit step
STEP_SLEEP_ENV = "RESTART_SOAK_STEP_SLEEP"  # seconds every rank waits after each step of attempt 0's faulted fit
KILL_POINTS = ("after_step", "in_step", "overlapped_sync", "sync_save", "async_save", "validation")
KILL_FILE = "killed_at.txt"
RESULT_FILE = "result.json"
TABLE_SIZES = [40, 64, 24]


# ----------------------------------------------------------------------------- the job (run by torchrun)
def _job(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_recsys import DCPCheckpointIO, EmbeddingOptimizerConfig, ReplicaSyncConfig, TwoDRecStrategy
    from lightning_recsys.checkpoint import load_unsharded
    from lightning_recsys.data import SyntheticClickLogDataModule
    from lightning_recsys.models import DLRMRanker

    work = Path(args.work_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    plan = parse_plan(os.environ[PLAN_ENV])
    points = {point for point, _ in plan}
    now = {"step": 0, "faulted_fit": True}  # what the writer patch below needs to know

    def kill_here(point: str, step: int) -> None:
        """SIGKILL this rank if it is this attempt's victim at ``point`` of ``step``: a lost process, no cleanup."""
        victim = (int(os.environ[KILL_RANK_ENV]) + attempt) % int(os.environ["WORLD_SIZE"])
        if now["faulted_fit"] and attempt < len(plan) and plan[attempt] == (point, step) and rank == victim:
            with open(work / KILL_FILE, "a") as f:
                f.write(f"{time.time()}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    if points & {"sync_save", "async_save"}:
        write_data = FileSystemWriter.write_data

        def write_data_then_die(self: Any, *a: Any, **k: Any) -> Any:
            kill_here("async_save" if "async_save" in points else "sync_save", now["step"])  # inside DCP's write of the checkpoint of this step (in the background for async)
            return write_data(self, *a, **k)

        FileSystemWriter.write_data = write_data_then_die  # type: ignore[method-assign]

    class TrainedExamples(Callback):
        """The global batches (epoch, index) and examples trained into the model; saved with each checkpoint."""

        def __init__(self) -> None:
            self.batches: list[list[int]] = []
            self.examples = 0
            self.first_step_at: float | None = None

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.batches.append([trainer.current_epoch, batch_idx])
            self.examples += batch.batch_size * trainer.world_size  # every rank gets an equal slice of the global batch
            if self.first_step_at is None:
                self.first_step_at = time.time()

        def state_dict(self) -> dict[str, Any]:
            return {"batches": self.batches, "examples": self.examples}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            self.batches, self.examples = list(state_dict["batches"]), int(state_dict["examples"])

    class KillInEarlyAttempts(Callback):
        """SIGKILL rank (kill_rank + a) % world_size in attempt a, at the plan's a-th point and step.

        Points: after the step (``after_step``; ``overlapped_sync``: with the overlapped replica sync
        in flight), inside it after backward (``in_step``), inside DCP's write of that step's
        checkpoint (``sync_save``, ``async_save``), or in the validation that follows it (``validation``)."""

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            now["step"] = trainer.global_step + 1  # the step this batch makes

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            kill_here("in_step", trainer.global_step + 1)

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            kill_here("after_step", trainer.global_step)
            kill_here("overlapped_sync", trainer.global_step)

        def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            if trainer.state.fn == "fit":
                kill_here("validation", trainer.global_step)

    class Progress(Callback):
        """For an outside fault (benchmarks/lost_link.py): rank 0 reports each step; attempt 0's steps are slowed so
        that the fault lands mid-fit."""

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if os.environ.get(PROGRESS_ENV) and rank == 0:
                with open(os.environ[PROGRESS_ENV], "a") as f:
                    f.write(f"{attempt} {trainer.global_step} {time.time()}\n")
            if attempt == 0:
                time.sleep(float(os.environ.get(STEP_SLEEP_ENV, "0")))

    def model(embedding_device: str) -> DLRMRanker:
        torch.manual_seed(1234)
        return DLRMRanker(
            table_sizes=TABLE_SIZES, num_dense_features=4, embedding_dim=8, dense_arch_layer_sizes=[8, 8],
            over_arch_layer_sizes=[8, 1], dense_optimizer="adagrad", dense_lr=0.1, embedding_device=embedding_device,
        )

    def fit(name: str, callbacks: list[Callback]) -> TrainedExamples:
        trained = TrainedExamples()
        now["faulted_fit"] = name == "faulted"
        validation = {"limit_val_batches": 1, "val_check_interval": 4} if "validation" in points else {"limit_val_batches": 0}
        trainer = pl.Trainer(
            accelerator="cpu", devices=args.nproc_per_node, num_nodes=args.nodes, max_epochs=args.epochs,
            strategy=TwoDRecStrategy(
                sharding_group_size=args.sharding_group_size, process_group_timeout=args.timeout,
                embedding_optimizer=EmbeddingOptimizerConfig(name="rowwise_adagrad", lr=0.1),
                replica_sync=ReplicaSyncConfig(overlap=True) if "overlapped_sync" in points else None,
                checkpoint_io=DCPCheckpointIO(async_save="async_save" in points),
            ),
            callbacks=[ModelCheckpoint(dirpath=work / name, every_n_train_steps=3, save_last=True, save_top_k=-1), trained, *callbacks],
            num_sanity_val_steps=0, logger=False, enable_progress_bar=False, enable_model_summary=False, **validation,
        )
        data = SyntheticClickLogDataModule(
            table_sizes=TABLE_SIZES, num_dense_features=4, global_batch_size=8 * trainer.world_size,
            train_batches=args.batches_per_epoch, val_batches=1, seed=7,
        )
        trainer.fit(model("meta"), datamodule=data, ckpt_path="last")
        trainer.save_checkpoint(work / name / "final.ckpt")
        return trained

    faulted = fit("faulted", [KillInEarlyAttempts(), Progress()])
    reference = fit("reference", [])  # the same fit, in the same processes, without a fault
    if rank != 0:
        return
    states = []
    for name in ("faulted", "reference"):
        fresh = model("cpu")
        load_unsharded(work / name / "final.ckpt", fresh)
        states.append(fresh.state_dict())
    different = sorted(k for k in states[1] if not torch.equal(states[0][k], states[1][k]))
    result = {
        "attempt": attempt,
        "first_step_at": faulted.first_step_at,
        "faulted": {"batches": faulted.batches, "examples": faulted.examples},
        "reference": {"batches": reference.batches, "examples": reference.examples},
        "weights_differ": different,
    }
    (work / RESULT_FILE).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_plan(text: str) -> list[tuple[str, int]]:
    """``"in_step:7,sync_save:9"`` -> ``[("in_step", 7), ("sync_save", 9)]``; refuses unknown points."""
    plan = []
    for item in filter(None, text.split(",")):
        point, _, step = item.partition(":")
        if point not in KILL_POINTS or not step.isdigit():
            raise ValueError(f"kill plan item {item!r} must be <point>:<step> with point one of {list(KILL_POINTS)}")
        plan.append((point, int(step)))
    return plan


def run_once(
    work_dir: Path, *, nodes: int = 1, nproc_per_node: int = 2, sharding_group_size: int | None = None, kill_rank: int = 1,
    kill_at_step: int = 7, kills: int = 1, kill_point: str = "after_step", plan: str | None = None, epochs: int = 2, batches_per_epoch: int = 6, timeout: float = 60.0,
    launch_timeout: float = 300.0,
) -> dict[str, Any]:
    """One job with ``kills`` kill-and-restarts at ``kill_point`` (attempt a: step kill_at_step + 3a), or the kills of
    ``plan`` (``"point:step,..."``), under ``--max-restarts`` that many; returns its record (``came_back``,
    ``recovery_s`` from the last kill, the comparison with the uninterrupted fit) and each launch's ``outputs``."""
    work_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    job = [
        __file__, "--job", "--work-dir", str(work_dir), "--nodes", str(nodes), "--nproc-per-node", str(nproc_per_node),
        "--epochs", str(epochs), "--batches-per-epoch", str(batches_per_epoch), "--timeout", str(timeout),
    ]
    plan = plan or ",".join(f"{kill_point}:{kill_at_step + 3 * a}" for a in range(kills))
    kills = len(parse_plan(plan))
    if sharding_group_size is not None:
        job += ["--sharding-group-size", str(sharding_group_size)]
    env = {**os.environ, KILL_RANK_ENV: str(kill_rank), PLAN_ENV: plan}
    launches = [
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node),
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", str(kills),
         "--monitor-interval", "0.5", *job]
        for node in range(nodes)
    ]
    started = time.time()
    procs = [subprocess.Popen(c, cwd=work_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in launches]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, launch_timeout - (time.time() - started)))[0])
    except subprocess.TimeoutExpired:
        outputs.append(f"timed out after {launch_timeout:.0f}s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    record: dict[str, Any] = {"exit_codes": [p.returncode for p in procs], "wall_s": round(time.time() - started, 1)}
    result_file, kill_file = work_dir / RESULT_FILE, work_dir / KILL_FILE
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    kill_times = [float(line) for line in kill_file.read_text().split()] if kill_file.exists() else []
    killed_at = kill_times[-1] if kill_times else None
    record["killed"] = len(kill_times) == kills
    record["came_back"] = all(code == 0 for code in record["exit_codes"]) and result is not None and result["attempt"] == kills
    if result is not None:
        record["same_batches"] = result["faulted"]["batches"] == result["reference"]["batches"]
        record["examples"] = [result["faulted"]["examples"], result["reference"]["examples"]]
        record["weights_differ"] = result["weights_differ"]
        if killed_at is not None and result["first_step_at"] is not None:
            record["recovery_s"] = round(result["first_step_at"] - killed_at, 1)
    record["ok"] = bool(
        record["came_back"] and record.get("same_batches") and record["examples"][0] == record["examples"][1]
        and not record["weights_differ"] and record["killed"]
    )
    record["outputs"] = outputs
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--sharding-group-size", type=int, default=None, help="default: one group per node (2D with --nodes 2)")
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at-step", type=int, default=7)
    parser.add_argument("--kill-point", default="after_step", choices=KILL_POINTS, help="where in the step the rank dies")
    parser.add_argument("--kills", type=int, default=1, help="kill-and-restarts per job (attempt a kills rank kill_rank+a at step kill_at_step+3a)")
    parser.add_argument("--plan", default=None, help='instead of the three above: "point:step,..." per attempt, e.g. "in_step:7,sync_save:9"')
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches-per-epoch", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=60.0, help="process_group_timeout of the job, seconds")
    parser.add_argument("--json", default=None, help="write every run's record here")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        _job(args)
        return 0
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="restart_soak-"))
    records = []
    for run in range(args.runs):
        record = run_once(
            root / f"run{run:02d}", nodes=args.nodes, nproc_per_node=args.nproc_per_node, sharding_group_size=args.sharding_group_size,
            kill_rank=args.kill_rank, kill_at_step=args.kill_at_step, kills=args.kills, kill_point=args.kill_point, plan=args.plan, epochs=args.epochs, batches_per_epoch=args.batches_per_epoch,
            timeout=args.timeout,
        )
        records.append(record)
        print(
            f"run {run + 1}/{args.runs}: came_back={record['came_back']} same_batches={record.get('same_batches')} "
            f"examples={record.get('examples')} weights_equal={not record.get('weights_differ', ['?'])} "
            f"kill_to_first_step_s={record.get('recovery_s')} wall_s={record['wall_s']}",
            flush=True,
        )
        if not record["ok"]:
            print("\n".join(o[-3000:] for o in record["outputs"]), flush=True)
        record.pop("outputs")
    back = sum(r["came_back"] for r in records)
    ok = sum(r["ok"] for r in records)
    recovery = [r["recovery_s"] for r in records if "recovery_s" in r]
    print(f"\n{args.nodes} node(s) x {args.nproc_per_node}: {back} of {args.runs} came back; {ok} of {args.runs} equal to the uninterrupted fit")
    if recovery:
        print(
            f"kill -> first step after resume: median {statistics.median(recovery):.1f}s, min {min(recovery):.1f}s, "
            f"max {max(recovery):.1f}s (n={len(recovery)})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))
    return 0 if ok == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
