#!/usr/bin/env python3
"""Fails when the files (modules) of a crate import each other in a circle.

For every crate of the workspace: a node per module file, an edge from file A to module
M when A names M through `crate::...`, `super::...` or (in a module with children) a
child's name; an edge to an ancestor of A is not counted (a module may use what its
parents hold), and the crate root (lib.rs) is not a node. Prints the circles and exits 1
if there is any. Comments are ignored.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = [c for c in ["crates/abi", "crates/cuda", "crates/bridge", "crates/cli",
          "tests/support", "tests/cuda-emu", "tests/interop"]
          if os.path.isdir(os.path.join(ROOT, c, "src"))]


def modules(src):
    mods = {}
    for dirpath, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                rel = os.path.relpath(os.path.join(dirpath, f), src)[:-3].split(os.sep)
                if rel[-1] == "mod":
                    rel = rel[:-1]
                if rel not in (["lib"], ["main"]):
                    mods[tuple(rel)] = os.path.join(dirpath, f)
    return mods


def code(path):
    return "\n".join(re.sub(r"//.*", "", line) for line in open(path).read().splitlines())


def resolve(mods, path):
    """The deepest module that `path` (a tuple of names from the crate root) lies in."""
    for n in range(len(path), 0, -1):
        if tuple(path[:n]) in mods:
            return tuple(path[:n])
    return None


def edges(mods, me, text):
    out = set()
    for m in re.finditer(r"\bcrate::((?:\w+::)*\w+|\{[^}]*\})", text):
        first = m.group(1)
        names = re.findall(r"\w+(?:::\w+)*", first) if first.startswith("{") else [first]
        for n in names:
            out.add(resolve(mods, n.split("::")))
    for m in re.finditer(r"\b((?:super::)+)((?:\w+::)*\w+)", text):
        up = m.group(1).count("super::")
        base = me[: len(me) - up]
        out.add(resolve(mods, list(base) + m.group(2).split("::")))
    for child in [k for k in mods if len(k) == len(me) + 1 and k[: len(me)] == me]:
        if re.search(r"\b" + child[-1] + r"::", text):
            out.add(child)
    return {e for e in out if e and e != me and e != me[: len(e)]}


def cycles(graph):
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


status = 0
for crate in CRATES:
    mods = modules(os.path.join(ROOT, crate, "src"))
    graph = {m: edges(mods, m, code(p)) for m, p in mods.items()}
    found = cycles(graph)
    print(f"{crate}: {len(mods)} files, {sum(map(len, graph.values()))} imports, "
          f"{len(found)} circle(s)")
    for comp in found:
        status = 1
        names = ["::".join(c) for c in comp]
        print("  circle:", " <-> ".join(names))
        for a in comp:
            for b in sorted(graph[a] & set(comp)):
                print(f"    {'::'.join(a)} -> {'::'.join(b)}")
sys.exit(status)
