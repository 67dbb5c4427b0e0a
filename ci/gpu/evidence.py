#!/usr/bin/env python3
"""Prints what a GPU run must show from the main job's JSON (`devarrow --json FILE`):

- the device, its CUDA options, and whether the driver has `cuMemcpyBatchAsync` and how
  many calls devarrow's device made (`device.batched_copies`);
- per batch size: devarrow's GB/s and share of the pinned copy each way, its stage times
  (`stages_s`), the host ceilings (`host_ceilings`: each the better of a memcpy and
  streaming stores, both shown, and devarrow's ratio to it: above 1.0 points to a wrong
  ceiling) and where downloads landed (`downloads_landed`).

    python3 ci/gpu/evidence.py job.json [more.json ...]

Reads older JSON too (a key the job did not write yet prints as "not in this JSON").
Exit status 1 when a file is missing or not JSON, so a proof step that needed it fails.
"""
import json
import sys


def fmt(v, unit=""):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}{unit}"
    return f"{v}{unit}"


def ceiling_line(name, c):
    if not c:
        return f"    {name:8} not measured"
    if "memcpy_gbps" in c:  # since ci/gpu: both ways and the better
        return (f"    {name:8} {fmt(c.get('gbps'))} GB/s ({c.get('best')}); memcpy "
                f"{fmt(c.get('memcpy_gbps'))}, streaming {fmt(c.get('streaming_gbps'))}")
    return f"    {name:8} {c}"


def show(path):
    try:
        with open(path) as f:
            job = json.load(f)
    except (OSError, ValueError) as e:
        print(f"evidence: {path}: {e}")
        return False
    dev = job.get("device", {})
    print(f"== evidence from {path}: commit {job.get('commit')}, build {job.get('build')}")
    print(f"  device {dev.get('id')} ({dev.get('name')}); cuda_options {dev.get('cuda_options')}")
    if "batched_copies" in dev:
        b = dev["batched_copies"]
        print(f"  cuMemcpyBatchAsync available: {b.get('available')}; batched copy calls by "
              f"devarrow's device in this run: {b.get('calls')}")
    else:
        print("  cuMemcpyBatchAsync: not in this JSON")
    for p in job.get("points", []):
        print(f"  -- {p.get('batch_rows')} rows/batch, {p.get('batches')} batches, verified "
              f"{p.get('verified')}")
        for m in p.get("measurements", []):
            if m.get("method") != "devarrow":
                continue
            stages = m.get("stages_s") or {}
            stages = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in sorted(stages.items()) if v)
            print(f"    devarrow {m.get('direction')}: {fmt(m.get('gbps'))} GB/s, "
                  f"{fmt(m.get('percent_of_pinned'), '%')} of pinned; stages_s: {stages or '-'}")
        c = p.get("host_ceilings")
        if c is None:
            print("    host_ceilings: not in this JSON")
        else:
            print(f"    host_ceilings ({c.get('threads')} threads, {c.get('bytes')} bytes):")
            if "pinned" in c:
                print(ceiling_line("pinned", c.get("pinned")))
                print(ceiling_line("faulted", c.get("faulted")))
                print(ceiling_line("gather", c.get("gather")))
                print(f"    devarrow H2D / pinned {fmt(c.get('devarrow_h2d_of_pinned'))}x, "
                      f"H2D / gather {fmt(c.get('devarrow_h2d_of_gather'))}x, "
                      f"D2H / faulted {fmt(c.get('devarrow_d2h_of_faulted'))}x "
                      "(above 1.00x: a wrong ceiling)")
            else:
                print(f"    {c}")
        d = p.get("downloads_landed")
        print(f"    downloads_landed: {d if d is not None else 'not in this JSON'}")
    return True


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    ok = all([show(path) for path in sys.argv[1:]])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
