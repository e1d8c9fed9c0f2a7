"""Fuzz the checkpoint loaders with byte mutations of a real checkpoint; print the outcomes by kind.

    .venv/bin/python benchmarks/checkpoint_fuzz.py --count 10000 [--seed 0] [--timeout 20]

One small committed checkpoint of a DLRM with module extra state (so its shard holds a byte item too)
is written once. Each case mutates one of its files (``.metadata``, the ``.distcp`` shard,
``host_state.pt``, ``meta.json``) with 1-4 byte edits (flip, set, insert, delete, truncate, duplicate a
span), then loads it with ``load_unsharded`` into a model (every third case also with
``to_lightning_checkpoint``) and classifies the result:

- ``loaded``: no error (e.g. a flipped bit inside tensor values, which no check detects);
- ``refused:<type>``: one of the documented refusals (``CheckpointCorruptError``, ``UnsafeCheckpointError``,
  ``UncommittedCheckpointError``, ``CheckpointMismatchError``, torch's ``weights_only`` refusal of host_state.pt);
- ``raw:<type>``: any other exception (a bug), ``changed``: refused after the model changed (a bug);
- ``hang``: the case ran past ``--timeout`` seconds; ``crash``: the worker process died (e.g. a segfault).

The cases run in a worker process; a crash is recorded and the worker restarts after that case. The
exit status is 1 if any case was raw, changed, a hang or a crash. The mutation of a case is a pure
function of the seed and its number, so a case reruns alone with ``--start N --count 1``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGETS = (".metadata", "shard", "host_state.pt", "meta.json")
OPS = ("flip", "set", "insert", "delete", "truncate", "duplicate")
Mutation = tuple[str, float, int, int]  # (op, position as a fraction of the file, a byte or length, another)


def apply_mutations(blob: bytes, mutations: Sequence[Mutation]) -> bytes:
    """``blob`` with each mutation applied in turn; positions are fractions so that any file size works."""
    data = bytearray(blob)
    for op, where, a, b in mutations:
        at = min(int(where * len(data)), max(len(data) - 1, 0))
        if op == "flip" and data:
            data[at] ^= 1 << (a % 8)
        elif op == "set" and data:
            data[at] = a % 256
        elif op == "insert":
            data[at:at] = bytes([a % 256]) * (1 + b % 16)
        elif op == "delete":
            del data[at : at + 1 + b % 64]
        elif op == "truncate":
            del data[at:]
        elif op == "duplicate":
            span = bytes(data[at : at + 1 + b % 256])
            data[at:at] = span * (1 + a % 8)
    return bytes(data)


def random_case(seed: int, number: int) -> tuple[str, list[Mutation]]:
    rng = random.Random(seed * 1_000_003 + number)
    mutations = [(rng.choice(OPS), rng.random(), rng.randrange(256), rng.randrange(1 << 16)) for _ in range(rng.randint(1, 4))]
    return rng.choice(TARGETS), mutations


class Harness:
    """A pristine checkpoint, and one load of it with one file replaced by mutated bytes."""

    def __init__(self, root: Path) -> None:
        import warnings

        warnings.filterwarnings("ignore")
        from lightning_recsys.testing.crafted_checkpoints import extra_state_ranker, host_state, read_index_trusting, write_checkpoint

        source = extra_state_ranker(seed=0)
        self.path = write_checkpoint(source, root / "last.ckpt", host_state(source))
        self.data = self.path.resolve()
        shard = next(iter(read_index_trusting(self.data).storage_data.values())).relative_path
        self.names = {".metadata": ".metadata", "shard": shard, "host_state.pt": "host_state.pt", "meta.json": "meta.json"}
        self.original = {target: (self.data / name).read_bytes() for target, name in self.names.items()}
        self.make_model = lambda: extra_state_ranker(seed=1)

    def run(self, target: str, mutated: bytes, *, also_dict: bool = False) -> str:
        import pickle

        import torch

        from lightning_recsys.checkpoint import (
            CheckpointCorruptError,
            CheckpointMismatchError,
            UncommittedCheckpointError,
            UnsafeCheckpointError,
            load_unsharded,
            to_lightning_checkpoint,
        )

        path = self.data / self.names[target]
        path.write_bytes(mutated)
        try:
            model = self.make_model()
            before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
            outcome = "loaded"
            loads = [lambda: load_unsharded(self.path, model)] + ([lambda: to_lightning_checkpoint(self.path)] if also_dict else [])
            for load in loads:
                try:
                    load()
                except (UnsafeCheckpointError, CheckpointCorruptError, CheckpointMismatchError, UncommittedCheckpointError) as error:
                    outcome = f"refused:{type(error).__name__}"
                except pickle.UnpicklingError as error:
                    outcome = "refused:weights_only" if "Weights only load failed" in str(error) else f"raw:{type(error).__name__}"
                except Exception as error:  # noqa: BLE001 - what the fuzzer looks for
                    outcome = f"raw:{type(error).__name__}: {str(error)[:200]}"
                if outcome != "loaded":
                    after = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
                    if not all(torch.equal(after[k], v) for k, v in before.items()):
                        outcome = "changed"
                    break
            return outcome
        finally:
            path.write_bytes(self.original[target])


def _worker(seed: int, start: int, count: int, timeout: int) -> None:
    """Run cases start..start+count-1, one JSON line each, flushed (the parent sees how far a crashed worker got)."""
    root = Path(tempfile.mkdtemp(prefix="ckpt-fuzz-"))
    harness = Harness(root)

    def hang(*_: Any) -> None:
        raise TimeoutError

    signal.signal(signal.SIGALRM, hang)
    for number in range(start, start + count):
        target, mutations = random_case(seed, number)
        mutated = apply_mutations(harness.original[target], mutations)
        signal.alarm(timeout)
        try:
            outcome = harness.run(target, mutated, also_dict=number % 3 == 0)
        except TimeoutError:
            outcome = "hang"
        finally:
            signal.alarm(0)
        print(json.dumps({"n": number, "target": target, "outcome": outcome}), flush=True)
    shutil.rmtree(root, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=20, help="seconds per case before it counts as a hang")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.seed, args.start, args.count, args.timeout)
        return 0
    began = time.monotonic()
    outcomes: collections.Counter[str] = collections.Counter()
    by_target: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    bad: list[dict[str, Any]] = []
    next_case, end = args.start, args.start + args.count
    while next_case < end:
        command = [sys.executable, __file__, "--worker", "--seed", str(args.seed), "--start", str(next_case),
                   "--count", str(end - next_case), "--timeout", str(args.timeout)]
        worker = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        assert worker.stdout is not None
        for line in worker.stdout:
            try:
                case = json.loads(line)
            except ValueError:
                continue
            kind = case["outcome"].split(":")[0] if case["outcome"].startswith("raw:") else case["outcome"]
            outcomes[kind] += 1
            by_target[case["target"]][kind] += 1
            if kind in ("raw", "changed", "hang"):
                bad.append(case)
            next_case = case["n"] + 1
        if worker.wait() != 0 and next_case < end:
            target, _ = random_case(args.seed, next_case)
            outcomes["crash"] += 1
            by_target[target]["crash"] += 1
            bad.append({"n": next_case, "target": target, "outcome": f"crash (exit {worker.returncode})"})
            next_case += 1
    seconds = time.monotonic() - began
    print(f"checkpoint fuzz: {args.count} mutated checkpoints (seed {args.seed}, cases {args.start}..{end - 1}) in {seconds:.0f} s")
    for kind, n in sorted(outcomes.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:40s} {n}")
    print("by file: " + "; ".join(f"{t}: " + ", ".join(f"{k} {n}" for k, n in sorted(c.items())) for t, c in sorted(by_target.items())))
    failures = sum(outcomes[k] for k in ("raw", "changed", "hang", "crash"))
    print(f"crashes {outcomes['crash']}, hangs {outcomes['hang']}, raw exceptions {outcomes['raw']}, model changed on refusal {outcomes['changed']}")
    for case in bad[:20]:
        print("  FAILED", json.dumps(case))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
