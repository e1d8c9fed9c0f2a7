"""Codec speed: GB/s of each QComms codec, encode and decode, against a plain cast (the floor).

One thread by default (``torch.set_num_threads(1)``): the codecs run inside the training step,
next to everything else. GB/s counts the fp32 values (4 bytes each) going in (encode) or coming
out (decode), so every row compares with every other. The floor is a plain cast between fp32 and
the wire element type: ``x.to(dtype)`` to encode, ``q.to(torch.float32)`` to decode. Each time is
the best of ``--repeats`` calls (the machine may be shared), the median goes to the JSON too.

    python benchmarks/codec_speed.py                        # table; JSON in benchmarks/results/
    python benchmarks/codec_speed.py --quick --json /tmp/codec_speed.json
    python benchmarks/codec_speed.py --device cuda          # adds FBGEMM's fused kernels
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lightning_recsys.parallel.comms.qcomms import make_codec

RESULTS = Path(__file__).resolve().parent / "results"
CODECS: dict[str, torch.dtype] = {  # codec -> the element type its floor casts to
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}
FBGEMM_CODECS = ("fp8_e4m3", "fp8_e5m2", "int8")


def _time(fn: Callable[[], Any], repeats: int, device: torch.device) -> tuple[float, float]:
    """(best, median) seconds of one call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def _payload(values: int, block: int, device: torch.device) -> torch.Tensor:
    """Embedding-like values: one block per row, rows of magnitudes from 1e-3 to 1e3."""
    generator = torch.Generator().manual_seed(0)
    rows = values // block
    x = torch.randn(rows, block, generator=generator) * torch.logspace(-3, 3, rows).unsqueeze(1)
    return x.to(device)


def run(values_list: list[int], block: int, repeats: int, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for values in values_list:
        x = _payload(values, block, device)
        gbytes = x.numel() * 4 / 1e9
        cases = [(name, False) for name in CODECS]
        if device.type == "cuda":
            cases += [(name, True) for name in FBGEMM_CODECS]
        for name, fbgemm in cases:
            codec = make_codec(name, block, fbgemm=True) if fbgemm else make_codec(name, block)
            ctx = codec.create_context()
            encoded = codec.encode(x, ctx)
            wire = x.to(CODECS[name])
            for direction, fn, floor in (
                ("encode", lambda: codec.encode(x, ctx), lambda: x.to(CODECS[name])),
                ("decode", lambda: codec.decode(encoded, ctx), lambda: wire.to(torch.float32)),
            ):
                best, median = _time(fn, repeats, device)
                floor_best, _ = _time(floor, repeats, device)
                rows.append({
                    "values": values, "codec": name, "kernel": "fbgemm" if fbgemm else "torch", "direction": direction,
                    "best_s": best, "median_s": median, "gb_per_s": gbytes / best,
                    "floor_gb_per_s": gbytes / floor_best, "time_vs_floor": best / floor_best,
                })
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| values | codec | kernel | direction | best ms | GB/s | cast floor GB/s | time / floor |",
        "|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['values']} | {r['codec']} | {r['kernel']} | {r['direction']} | {r['best_s'] * 1e3:.3f} | "
            f"{r['gb_per_s']:.2f} | {r['floor_gb_per_s']:.2f} | {r['time_vs_floor']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", type=int, nargs="+", default=[1 << 16, 1 << 18, 1 << 20, 1 << 22], help="fp32 values per payload")
    parser.add_argument("--block", type=int, default=64, help="values per scale block (one embedding row of dim 64)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="one small payload, 3 repeats (a smoke run)")
    parser.add_argument("--json", type=Path, default=RESULTS / "codec_speed.json")
    args = parser.parse_args()
    if args.quick:
        args.values, args.repeats = [1 << 12], 3
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = run(args.values, args.block, args.repeats, device)
    settings = {"device": str(device), "threads": args.threads, "block": args.block, "repeats": args.repeats,
                "torch": torch.__version__}
    print(f"QComms codec speed ({settings}); GB/s of fp32 values\n")
    print(_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"settings": settings, "results": rows}, indent=2))
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
