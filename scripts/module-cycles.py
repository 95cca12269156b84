#!/usr/bin/env python3
"""Import loops between modules of one crate: an edge A -> B when a file of
module A names `crate::B…` (or a sibling through `super::B`), where neither
module contains the other. Prints every strongly connected component of more
than one module; exits 1 when there is one."""
import os, re, sys
from collections import defaultdict

def modules(src):
    files = {}
    for root, _, names in os.walk(src):
        for n in names:
            if not n.endswith(".rs"): continue
            p = os.path.join(root, n)
            rel = os.path.relpath(p, src)[:-3].split(os.sep)
            if rel[-1] in ("lib", "main", "mod"): rel = rel[:-1]
            files[p] = tuple(rel)
    return files

def paths_in(text):
    text = re.sub(r"//[^\n]*", "", text)
    out = []
    for m in re.finditer(r"\bcrate::((?:\w+::)*\w+)", text):
        out.append(("crate", m.group(1).split("::")))
    for m in re.finditer(r"\buse\s+crate::\{([^;]*)\}", text, re.S):
        for part in re.split(r",", m.group(1)):
            part = part.strip().split("::")[0].strip("{} ")
            if part: out.append(("crate", [part]))
    for m in re.finditer(r"\bsuper::((?:\w+::)*\w+)", text):
        out.append(("super", m.group(1).split("::")))
    return out

def resolve(mods, here, kind, segs):
    base = () if kind == "crate" else here[:-1]
    best = None
    cur = base
    for s in segs:
        cur = cur + (s,)
        if cur in mods: best = cur
        else: break
    return best

def scc(nodes, edges):
    index, low, st, on, res, c = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)
    def strong(v):
        index[v] = low[v] = c[0]; c[0] += 1; st.append(v); on.add(v)
        for w in edges[v]:
            if w not in index: strong(w); low[v] = min(low[v], low[w])
            elif w in on: low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = st.pop(); on.discard(w); comp.append(w)
                if w == v: break
            res.append(comp)
    for v in nodes:
        if v not in index: strong(v)
    return res

bad = 0
for crate in sorted(os.listdir("crates")):
    src = os.path.join("crates", crate, "src")
    if not os.path.isdir(src): continue
    files = modules(src)
    mods = set(files.values())
    edges = defaultdict(set)
    for p, here in files.items():
        if here and here[-1] == "tests": continue
        text = open(p).read()
        text = re.split(r"#\[cfg\(test\)\]\s*mod tests\s*\{", text)[0]
        for kind, segs in paths_in(text):
            t = resolve(mods, here, kind, segs)
            if t is None or t == here: continue
            if t[:len(here)] == here or here[:len(t)] == t: continue
            if t and t[-1] == "tests": continue
            edges[here].add(t)
    for comp in scc(sorted(mods), edges):
        if len(comp) > 1:
            bad = 1
            print(crate, ": ", " <-> ".join("::".join(m) for m in sorted(comp)))
sys.exit(bad)
