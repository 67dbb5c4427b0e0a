"""Times moving one TPC-H-like ``lineitem`` table to a device and back, four ways.

    python python/bench.py [--rows 600572] [--device auto|cpu|cuda:N] [--repeat 3]
                           [--ipc lineitem.arrow]

- devarrow: ``Device.to_device_batches`` of the table's record batches (one call, the
  batches pipelined; timed until the data is on the device) and
  ``devarrow.from_device_batches`` of them, the Python figures to hold beside the Rust
  main job's; and beside them, ``Device.to_device`` and ``devarrow.from_device`` of
  each batch in turn;
- PyTorch: per numeric column, ``tensor.cuda()`` and ``.cpu()``, from pageable and from
  pinned host memory;
- CuPy: per numeric column, ``cupy.asarray`` and ``cupy.asnumpy``, pageable and pinned.

torch and cupy are skipped, saying why, when absent or without a GPU. ``--ipc PATH``
also writes the table as an Arrow IPC file, so that the Rust main job moves the same
table (``devarrow --input PATH --batch-size 64K``). Where the main job's binary is found
(``--job BIN``; else the GPU proof's staged binary, else ``devarrow`` on PATH) the bench
runs it on the same table and device and prints Python's share of Rust's GB/s (issue
#32's goal: at least 0.8 both ways). The table has
lineitem's 16 columns and types (integers, decimal(15,2), dates, strings), generated
with numpy (the Rust job generates the real one: crates/cli/src/tpch.rs); at the default
600,572 rows it is scale factor 0.1's row count. Rows come in batches of 65,536.
"""

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np
import pyarrow as pa

import devarrow


def lineitem(rows, seed=7):
    rng = np.random.default_rng(seed)
    dates = np.datetime64("1992-01-02") + rng.integers(0, 2500, rows).astype("timedelta64[D]")

    def dec(lo, hi):
        cents = rng.integers(lo * 100, hi * 100, rows)
        words = np.stack([cents, cents >> 63], 1).astype(np.int64)  # little-endian i128
        return pa.Array.from_buffers(pa.decimal128(15, 2), rows, [None, pa.py_buffer(words.tobytes())])

    def strings(choices):
        return pa.array(np.asarray(choices, dtype=object)[rng.integers(0, len(choices), rows)]).cast(pa.string())

    return pa.table({
        "l_orderkey": pa.array(np.arange(rows, dtype=np.int64) // 4 + 1),
        "l_partkey": pa.array(rng.integers(1, 20_000, rows, dtype=np.int64)),
        "l_suppkey": pa.array(rng.integers(1, 1_000, rows, dtype=np.int64)),
        "l_linenumber": pa.array((np.arange(rows) % 7 + 1).astype(np.int32)),
        "l_quantity": dec(1, 50),
        "l_extendedprice": dec(900, 100_000),
        "l_discount": dec(0, 1),
        "l_tax": dec(0, 1),
        "l_returnflag": strings(["R", "A", "N"]),
        "l_linestatus": strings(["O", "F"]),
        "l_shipdate": pa.array(dates),
        "l_commitdate": pa.array(dates + 30),
        "l_receiptdate": pa.array(dates + 10),
        "l_shipinstruct": strings(["DELIVER IN PERSON", "COLLECT COD", "NONE", "TAKE BACK RETURN"]),
        "l_shipmode": strings(["REG AIR", "AIR", "RAIL", "SHIP", "TRUCK", "MAIL", "FOB"]),
        "l_comment": strings([f"carefully final deposits {i} sleep" for i in range(64)]),
    })


def best(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def report(label, nbytes, seconds):
    print(f"  {label:<44} {nbytes / 1e6:10.1f} MB {seconds * 1e3:10.2f} ms {nbytes / seconds / 1e9:8.2f} GB/s")


def numeric_columns(table):
    cols = {}
    for name in table.column_names:
        t = table.schema.field(name).type
        if pa.types.is_integer(t) or pa.types.is_floating(t):
            cols[name] = table.column(name).to_numpy()
        elif pa.types.is_date32(t):
            cols[name] = table.column(name).cast(pa.int32()).to_numpy()
        elif pa.types.is_decimal(t):  # as its int64 low words: the bytes move alike
            cols[name] = np.frombuffer(table.column(name).combine_chunks().buffers()[1], np.int64)[::2].copy()
    return cols


# Where the GPU proof stages the main job (../shared/gpu/pack).
PROOF_JOB = "/tmp/devarrow-gpu/bin/bin--devarrow-cli--devarrow"


def find_job(given):
    if given:
        return given
    if os.access(PROOF_JOB, os.X_OK):
        return PROOF_JOB
    return shutil.which("devarrow")


def rust_job(job, dev, table, repeat):
    """The main job's devarrow GB/s {direction: GB/s} on the same table and device."""
    import pyarrow.ipc
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "lineitem.arrow"), os.path.join(tmp, "job.json")
        with pa.OSFile(path, "wb") as sink, pyarrow.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=65_536)
        cmd = [job, "--device", dev.id, "--input", path, "--batch-size", "64K",
               "--reps", str(repeat), "--json", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"  rust job: failed ({' '.join(cmd)}): {done.stderr.strip()[-400:]}")
            return None
        points = json.load(open(out))["points"]
        return {m["direction"]: m["gbps"] for p in points for m in p["measurements"]
                if m["method"] == "devarrow"}


def own_buffers(table):
    """The table's batches as the Rust job reads them: through Arrow IPC, at offset 0."""
    import pyarrow.ipc
    sink = pa.BufferOutputStream()
    with pyarrow.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=65_536)
    return list(pyarrow.ipc.open_stream(sink.getvalue()))


def bench_devarrow(dev, table, repeat):
    batches = table.to_batches(max_chunksize=65_536)
    nbytes = table.nbytes

    def up_and_wait(upload):
        for b in upload():
            b.synchronize()  # until the copies complete, as the Rust job times them

    on_device = dev.to_device_batches(batches)
    up = best(lambda: up_and_wait(lambda: dev.to_device_batches(batches)), repeat)
    report("devarrow to_device_batches (+ wait)", nbytes, up)
    down = best(lambda: devarrow.from_device_batches(on_device), repeat)
    report("devarrow from_device_batches", nbytes, down)
    report("  to_device of each batch (+ wait)", nbytes,
           best(lambda: up_and_wait(lambda: [dev.to_device(b) for b in batches]), repeat))
    report("  from_device of each batch", nbytes,
           best(lambda: [devarrow.from_device(b) for b in on_device], repeat))
    # Where Python's time goes beside the Rust job's: the table's batches are slices of
    # its columns' buffers (offsets, bitmaps at a bit offset), the job's are batches read
    # from an IPC file, each with buffers of its own at offset 0.
    own = own_buffers(table)
    report("  to_device_batches, own buffers (+ wait)", nbytes,
           best(lambda: up_and_wait(lambda: dev.to_device_batches(own)), repeat))
    report("  to_device_batches, enqueued (no wait)", nbytes,
           best(lambda: dev.to_device_batches(batches), repeat))
    # Where one call's host time goes: the transfer's own stages (its stats, reset
    # around the call) against the call's wall time; the rest is outside the transfer
    # (pyarrow's export, the import's checks, the wrapping of the results, Python).
    calls = []
    for _ in range(repeat):
        dev.transfer_stats(reset=True)
        t0 = time.perf_counter()
        dev.to_device_batches(batches)
        wall = time.perf_counter() - t0
        calls.append((wall, dev.transfer_stats(reset=True)["to_device"]))
    wall, stages = min(calls, key=lambda c: c[0])
    named = {k: v for k, v in stages.items() if k not in ("batches", "bytes")}
    inside = sum(named.values())
    print("    one call (the fastest): " + f"{wall * 1e3:.2f} ms wall; the transfer's stages "
          + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in named.items() if v > 0)
          + f" ms (in all {inside * 1e3:.2f}); outside the transfer {(wall - inside) * 1e3:.2f} ms")
    stats = dev.transfer_stats()
    print(f"  downloads landed: {stats['pinned_downloads']} pinned, "
          f"{stats['pageable_downloads']} pageable"
          + (f" ({stats['host_memory_note']})" if stats["host_memory_note"] else ""))
    return {"host_to_device": nbytes / up / 1e9, "device_to_host": nbytes / down / 1e9}


def bench_torch(cols, repeat):
    try:
        import torch
    except ImportError as e:
        print(f"  torch: skipped (not installed: {e})")
        return
    if not torch.cuda.is_available():
        print("  torch: skipped (torch.cuda.is_available() is False: no GPU for it)")
        return
    nbytes = sum(c.nbytes for c in cols.values())
    for pinned in [False, True]:
        host = {k: torch.from_numpy(v) for k, v in cols.items()}
        if pinned:
            host = {k: v.pin_memory() for k, v in host.items()}
        kind = "pinned" if pinned else "pageable"

        def up():
            out = {k: v.cuda(non_blocking=pinned) for k, v in host.items()}
            torch.cuda.synchronize()
            return out

        dev = up()
        report(f"torch .cuda() per column ({kind})", nbytes, best(up, repeat))

        def down():
            if pinned:
                outs = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in dev.items()}
                for k, v in dev.items():
                    outs[k].copy_(v, non_blocking=True)
                torch.cuda.synchronize()
            else:
                [v.cpu() for v in dev.values()]

        report(f"torch .cpu() per column ({kind})", nbytes, best(down, repeat))


def bench_cupy(cols, repeat):
    try:
        import cupy
        import cupyx
    except ImportError as e:
        print(f"  cupy: skipped (not installed: {e})")
        return
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - cupy raises its own runtime errors
        print(f"  cupy: skipped (no GPU for it: {e})")
        return
    nbytes = sum(c.nbytes for c in cols.values())
    for pinned in [False, True]:
        host = cols
        if pinned:
            host = {}
            for k, v in cols.items():
                p = cupyx.empty_pinned(v.shape, v.dtype)
                p[...] = v
                host[k] = p
        kind = "pinned" if pinned else "pageable"

        def up():
            out = {k: cupy.asarray(v) for k, v in host.items()}
            cupy.cuda.Device().synchronize()
            return out

        dev = up()
        report(f"cupy asarray per column ({kind})", nbytes, best(up, repeat))
        if pinned:
            outs = {k: cupyx.empty_pinned(v.shape, v.dtype) for k, v in cols.items()}
            report(f"cupy asnumpy per column ({kind})", nbytes,
                   best(lambda: [cupy.asnumpy(v, out=outs[k]) for k, v in dev.items()], repeat))
        else:
            report(f"cupy asnumpy per column ({kind})", nbytes,
                   best(lambda: [cupy.asnumpy(v) for v in dev.values()], repeat))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=600_572)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ipc", help="also write the table to this Arrow IPC file (.arrow)")
    parser.add_argument("--job", help="the main job's binary (devarrow), run on the same table")
    args = parser.parse_args()
    dev = devarrow.device(args.device)
    print(f"devarrow {devarrow.__version__} ({devarrow.GIT_COMMIT}) on {dev.id} ({dev.name}): {dev.reason}")
    table = lineitem(args.rows)
    print(f"lineitem-like table: {table.num_rows} rows, {table.num_columns} columns, {table.nbytes / 1e6:.1f} MB"
          f" (best of {args.repeat})")
    if args.ipc:
        import pyarrow.ipc
        with pa.OSFile(args.ipc, "wb") as sink, pyarrow.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=65_536)
        print(f"  written to {args.ipc}: the Rust job moves it with "
              f"`devarrow --input {args.ipc} --batch-size 64K`")
    python = bench_devarrow(dev, table, args.repeat)
    job = find_job(args.job)
    rust = rust_job(job, dev, table, args.repeat) if job else None
    if job is None:
        print("  rust job: skipped (no --job, no staged binary, no devarrow on PATH)")
    elif rust:
        for direction, label in [("host_to_device", "to device"), ("device_to_host", "from device")]:
            gbps = rust.get(direction)
            if gbps:
                print(f"  python / rust main job ({label}): {python[direction]:.2f} / {gbps:.2f} GB/s"
                      f" = {python[direction] / gbps:.2f}x (goal: 0.8x)")
    cols = numeric_columns(table)
    print(f"per-column peers: {len(cols)} numeric columns, {sum(c.nbytes for c in cols.values()) / 1e6:.1f} MB")
    bench_torch(cols, args.repeat)
    bench_cupy(cols, args.repeat)


if __name__ == "__main__":
    main()
