#!/usr/bin/env python3
"""Checks that nccl-safe's modules form layers that only point down.

Reads every `crate::...` and `super::...` path in src/ (outside comments and `#[cfg(test)]`
items), maps it to the module it names (root re-exports such as `crate::Communicator` are
followed to their module), collapses modules to their top-level module, and fails when:

  * the top-level modules import each other in a cycle,
  * a module imports one from a higher layer than its own (LAYERS below, bottom first), or
  * the submodules of a module folder, at any depth (`diag/hooks/`, `diag/settings.rs`, ...
    inside `diag/`; `diag/hooks/on/`, `diag/hooks/off.rs` inside `diag/hooks/`), import
    each other in a cycle (`super::x`, `crate::diag::x`, and names the folder's `mod.rs`
    re-exports from a submodule, all count), or
  * a submodule imports one that FOLDER_RULES below forbids it (inside `diag/`,
    `supervise/` never imports `observe/`: supervision stays below the observers; the
    hooks and `diag/mod.rs` may import both). Imports are counted as for the cycles.

A file that is a test-only module (`#[cfg(test)] mod tests;`) is not read, as a
`#[cfg(test)]` item inside a file is not.

`crate::host` is the crate nccl-host (re-exported), below every layer: it depends only on
nccl-sys, so Cargo keeps it from importing nccl-safe. Its own modules (nccl-host/src) are
checked for cycles the same way, without layers, and so are nccl-launch's.

The crates form layers too: nccl-sys, nccl-host, nccl-safe (the core), nccl-launch (the
launchers) above it. The core must not name the launchers (`nccl_launch` in its code, a
normal dependency on it; its tests, examples and doc examples use it as a dev-dependency)
and holds no socket code (`std::net`, TCP/UDP types): sockets and tokens live in
nccl-launch.

Prints the layer picture with the edges found. Exit status 1 on a violation.
Usage: scripts/check-layers.py [--dot]   (--dot: print the module graph in Graphviz form)
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SRC = os.path.join(ROOT, "src")
# Other crates of the workspace whose modules are checked for cycles (no layers).
CYCLE_ONLY_CRATES = [os.path.join(ROOT, "nccl-host", "src"), os.path.join(ROOT, "nccl-launch", "src")]

# Bottom first. A module may import modules of its own layer or below, never above, and
# no cycle may form inside a layer.
LAYERS = [
    ("leaves", ["version", "discovery", "error"]),
    ("provider and library", ["types", "library", "id", "stream", "param"]),
    ("teardown lanes", ["teardown"]),
    ("diagnostics hooks", ["diag"]),
    ("the wrapper", ["config", "buffer", "comm", "ops", "group", "memory", "register", "comm_ref"]),
    # What the crate nccl-launch (the layer above the core) uses of the core's internals.
    ("the launchers' seam", ["seam"]),
]
LAYER_OF = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}

# Inside a module folder: (folder, submodule, submodule it must not import, why).
FOLDER_RULES = [
    ("diag", "supervise", "observe",
     "supervision (the watchdog, the claim, the clique's state) stays below the observers "
     "(flight record, desync report, fingerprint check): it asks for their words through "
     "the clique's `Observers` table, which the hooks give it"),
]


def module_of(path, src):
    rel = os.path.relpath(path, src)[:-3]  # strip .rs
    parts = rel.split(os.sep)
    if parts[-1] == "mod":
        parts = parts[:-1]
    if parts == ["lib"]:
        return ""
    return "::".join(parts)


TEST_CFG = re.compile(r"#\[cfg\((?:all\()?\s*test\b[^\]]*\]")


def strip_test_items(text):
    """Removes test-only items (`#[cfg(test)]`, `#[cfg(all(test, ..))]`: a module, a fn, a
    use) by brace matching."""
    out, i = [], 0
    while True:
        m = TEST_CFG.search(text, i)
        if m is None:
            out.append(text[i:])
            break
        j = m.start()
        out.append(text[i:j])
        k = m.end()
        # The item ends at its matching closing brace, or at a ';' before any '{'.
        semi, brace = text.find(";", k), text.find("{", k)
        if brace < 0 or (0 <= semi < brace):
            i = semi + 1
            continue
        depth, p = 0, brace
        while p < len(text):
            if text[p] == "{":
                depth += 1
            elif text[p] == "}":
                depth -= 1
                if depth == 0:
                    break
            p += 1
        i = p + 1
    return "".join(out)


def strip_comments(text):
    """Removes string literals (one line each; doc text built by macros is in them), then
    block and line comments."""
    text = re.sub(r'"(?:[^"\\\n]|\\.)*"', '""', text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return "\n".join(re.sub(r"//.*$", "", line) for line in text.split("\n"))


def root_reexports(src):
    """Maps names re-exported at the crate root (`pub use comm::{Communicator, ..}`)."""
    lib = strip_comments(open(os.path.join(src, "lib.rs")).read())
    names = {}
    for m in re.finditer(r"pub use ([a-z_]+)(?:::([a-z_]+))?::\{([^}]*)\}", lib):
        for name in m.group(3).split(","):
            name = name.strip()
            if name:
                names[name] = m.group(1)
    for m in re.finditer(r"pub use ([a-z_]+)(?:::[a-z_]+)*::([A-Za-z_0-9]+);", lib):
        names[m.group(2)] = m.group(1)
    return names


def use_tree_heads(tree):
    """First path segment of every item of a `use crate::{...}` tree."""
    heads, depth, cur = [], 0, ""
    for ch in tree:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            heads.append(cur.strip())
            cur = ""
        else:
            cur += ch
    heads.append(cur.strip())
    return [re.split(r"::|\s|\{", h)[0] for h in heads if h]


def tarjan(graph):
    """Strongly connected components of `graph` (node -> list of nodes)."""
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
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
            sccs.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def folder_reexports(src, folder, subs):
    """Names a folder's mod.rs brings in from its submodules (`pub(crate) use x::{A, B}`,
    `use x::A;`), mapped to the submodule."""
    path = os.path.join(src, folder.replace("::", os.sep), "mod.rs")
    if not os.path.exists(path):
        return {}
    text = strip_comments(open(path).read())
    names = {}
    for m in re.finditer(r"\buse (?:self::)?([a-z_]+)::\{([^}]*)\}", text):
        if m.group(1) in subs:
            for name in m.group(2).split(","):
                name = name.strip().split(" as ")[-1].strip()
                if name:
                    names[name] = m.group(1)
    for m in re.finditer(r"\buse (?:self::)?([a-z_]+)(?:::[a-z_]+)*::([A-Za-z_0-9]+)(?: as ([A-Za-z_0-9]+))?;", text):
        if m.group(1) in subs:
            names[m.group(3) or m.group(2)] = m.group(1)
    return names


def submodule_cycles(src, files, rules=()):
    """Cycles among the direct submodules of each module folder (at any depth), with an
    example import for each edge; and the imports `rules` (FOLDER_RULES) forbid."""
    by_folder = {}
    for f in files:
        parts = module_of(f, src).split("::")
        for d in range(1, len(parts)):
            by_folder.setdefault("::".join(parts[:d]), set()).add(parts[d])
    problems = []
    for folder, subs in sorted(by_folder.items()):
        names = folder_reexports(src, folder, subs)
        depth = folder.count("::") + 1
        edges = {}
        for f in files:
            parts = module_of(f, src).split("::")
            if len(parts) <= depth or "::".join(parts[:depth]) != folder:
                continue
            me = parts[depth]
            text = strip_comments(strip_test_items(open(f).read()))
            found = []
            # `super::` from a direct submodule names the folder's; from one below, as many
            # more `super::` as it stands deeper.
            prefix = r"\b" + r"super::" * (len(parts) - depth)
            for pat in (prefix, r"\bcrate::" + folder + "::"):
                for m in re.finditer(pat + r"\{([^;]*)\}", text):
                    found += [(h, m.start()) for h in use_tree_heads(m.group(1))]
                for m in re.finditer(pat + r"([A-Za-z_][A-Za-z0-9_]*)", text):
                    found.append((m.group(1), m.start()))
            for name, pos in found:
                dest = name if name in subs else names.get(name)
                if dest is None or dest == me:
                    continue
                line = text.count("\n", 0, pos) + 1
                edges.setdefault((me, dest), f"{os.path.relpath(f, ROOT)}:{line}")
        for (rule_folder, low, high, why) in rules:
            if rule_folder == folder and (low, high) in edges:
                problems.append(f"inside {folder}: {low} imports {high} at {edges[(low, high)]}: {why}")
        graph = {s: sorted(b for (a, b) in edges if a == s) for s in subs}
        for comp in tarjan(graph):
            if len(comp) > 1:
                cyc = sorted(comp)
                where = [f"{a} -> {b} ({edges[(a, b)]})" for (a, b) in sorted(edges) if a in cyc and b in cyc]
                problems.append(f"import cycle inside {folder}: " + ", ".join(cyc) + "\n      " + "\n      ".join(where))
    return problems


TEST_MOD = re.compile(r"#\[cfg\((?:all\()?\s*test\b[^\]]*\]\s*(?:pub(?:\([^)]*\))?\s+)?mod ([a-z_0-9]+);")


def rust_files(src):
    """The crate's source files, without those of test-only modules."""
    files = []
    for root, _, names in os.walk(src):
        files += [os.path.join(root, n) for n in names if n.endswith(".rs")]
    test_only = set()
    for f in files:
        base = os.path.basename(f)
        here = os.path.dirname(f) if base in ("mod.rs", "lib.rs", "main.rs") else f[:-3]
        for m in TEST_MOD.finditer(strip_comments(open(f).read())):
            test_only.add(os.path.join(here, m.group(1) + ".rs"))
            test_only.add(os.path.join(here, m.group(1), "mod.rs"))
    return [f for f in files if f not in test_only]


def top_level_edges(src, files):
    """The crate's top-level modules, and the imports between them: (from, to) -> an
    example "file:line"."""
    modules = {module_of(f, src) for f in files}
    tops = {m.split("::")[0] for m in modules if m}
    reexports = root_reexports(src)
    edges = {}
    for f in sorted(files):
        mod = module_of(f, src)
        if not mod:
            continue
        top = mod.split("::")[0]
        text = strip_comments(strip_test_items(open(f).read()))
        targets = []
        for m in re.finditer(r"\bcrate::\{([^;]*)\}", text):
            targets += [(h, m.start()) for h in use_tree_heads(m.group(1))]
        for m in re.finditer(r"\bcrate::([A-Za-z_][A-Za-z0-9_]*)", text):
            targets.append((m.group(1), m.start()))
        parent = mod.rsplit("::", 1)[0] if "::" in mod else ""
        for m in re.finditer(r"\bsuper::([A-Za-z_][A-Za-z0-9_]*)", text):
            # super:: from a submodule stays inside its top-level module unless it is a
            # top-level module's own file (then super is the crate root).
            if parent:
                continue
            targets.append((m.group(1), m.start()))
        for name, pos in targets:
            if name in ("self", "nccl_call", "Result"):
                continue
            dest = name if name in tops else reexports.get(name)
            if dest is None or dest == top:
                continue
            line = text.count("\n", 0, pos) + 1
            edges.setdefault((top, dest), f"{os.path.relpath(f, ROOT)}:{line}")
    return tops, edges


def cycles(tops, edges, what):
    """The import cycles among `tops`, described, and the strongly connected components."""
    graph = {t: sorted(b for (a, b) in edges if a == t) for t in tops}
    sccs = tarjan(graph)
    problems = []
    for comp in sccs:
        if len(comp) > 1:
            cyc = sorted(comp)
            where = [f"{a} -> {b} ({edges[(a, b)]})" for (a, b) in sorted(edges) if a in cyc and b in cyc]
            problems.append(f"import cycle{what}: " + ", ".join(cyc) + "\n      " + "\n      ".join(where))
    return graph, sccs, problems


SOCKETS = re.compile(r"\bstd::net\b|\b(?:TcpStream|TcpListener|UdpSocket|ToSocketAddrs)\b")


def crate_layers(files):
    """The core above nccl-launch: it names no launcher and holds no socket code."""
    problems = []
    for f in sorted(files):
        text = strip_comments(open(f).read())
        for pat, what in ((re.compile(r"\bnccl_launch\b"), "names the launchers (nccl_launch)"),
                          (SOCKETS, "holds socket code (sockets live in nccl-launch)")):
            m = pat.search(text)
            if m:
                line = text.count("\n", 0, m.start()) + 1
                problems.append(f"the core {what} at {os.path.relpath(f, ROOT)}:{line}")
    deps = re.search(r"^\[dependencies\]\n(.*?)^\[", open(os.path.join(ROOT, "Cargo.toml")).read(), re.S | re.M)
    if deps and re.search(r"^nccl-launch\b", deps.group(1), re.M):
        problems.append("nccl-safe depends on nccl-launch (a layer above it; a dev-dependency only)")
    launch_toml = os.path.join(ROOT, "nccl-launch", "Cargo.toml")
    if not re.search(r"^nccl-safe\s*=", open(launch_toml).read(), re.M):
        problems.append("nccl-launch does not depend on nccl-safe")
    return problems


def main():
    files = rust_files(SRC)
    tops, edges = top_level_edges(SRC, files)

    if "--dot" in sys.argv:
        print("digraph layers {")
        for (a, b) in sorted(edges):
            print(f'  "{a}" -> "{b}";')
        print("}")

    problems = []
    unknown = sorted(t for t in tops if t not in LAYER_OF)
    for t in unknown:
        problems.append(f"module '{t}' is in no layer: add it to LAYERS in {sys.argv[0]}")
    # Cycles: strongly connected components of the top-level graph (Tarjan).
    graph, sccs, found = cycles(tops, edges, "")
    problems += found
    for (a, b), at in sorted(edges.items()):
        if a in LAYER_OF and b in LAYER_OF and LAYER_OF[b] > LAYER_OF[a]:
            problems.append(
                f"{a} (layer '{LAYERS[LAYER_OF[a]][0]}') imports {b} (layer '{LAYERS[LAYER_OF[b]][0]}', above it) at {at}"
            )

    print("Layers, top first, with what each imports:")
    for i in reversed(range(len(LAYERS))):
        name, ms = LAYERS[i]
        print(f"  {i}. {name}")
        for m in ms:
            if m in tops:
                deps = ", ".join(graph.get(m, [])) or "-"
                print(f"       {m:<10} -> {deps}")
    inner = submodule_cycles(SRC, files, FOLDER_RULES)
    problems += inner
    crates = crate_layers(files)
    problems += crates
    print(f"crates: nccl-launch above nccl-safe; {len(crates)} violations (the core names no launcher, holds no socket)")
    print(f"{len(tops)} top-level modules, {len(edges)} edges between them, "
          f"{sum(1 for c in sccs if len(c) > 1)} cycles; {len(inner)} cycles or forbidden imports inside module folders")
    for (folder, low, high, _) in FOLDER_RULES:
        print(f"inside {folder}: {low} never imports {high}")
    for src in CYCLE_ONLY_CRATES:
        crate_files = rust_files(src)
        crate_tops, crate_edges = top_level_edges(src, crate_files)
        name = os.path.basename(os.path.dirname(os.path.abspath(src)))
        _, crate_sccs, found = cycles(crate_tops, crate_edges, f" inside {name}")
        crate_inner = submodule_cycles(src, crate_files)
        problems += found + crate_inner
        print(f"{name}: {len(crate_tops)} modules, {len(crate_edges)} edges between them, "
              f"{sum(1 for c in crate_sccs if len(c) > 1)} cycles; {len(crate_inner)} cycles inside module folders")
    if problems:
        print("\nFAILED:")
        for p in problems:
            print("  - " + p)
        return 1
    print("OK: no import cycle (between modules, inside a module folder or inside nccl-host), every import points down (supervise below observe inside diag), the core names no launcher and holds no socket")
    return 0


if __name__ == "__main__":
    sys.exit(main())
