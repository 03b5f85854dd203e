#!/usr/bin/env python3
"""Checks that no library of src/ includes a header of a library above it.

The libraries, their folders and their dependencies are read from the mt_layer(...) calls of
CMakeLists.txt: a source file belongs to the library whose folder is the longest prefix of its
path (src/parallel/layout/x.cpp to mt_layout, src/parallel/x.cpp to mt_parallel), and a header it
includes with #include "..." must belong to the same library or to one it links, directly or
through others. Prints one line per offending include and exits 1 when there is any.

usage: check_layers.py [REPOSITORY_ROOT]
"""
import os
import re
import sys


def read_layers(cmake_text):
    """{library: (folder, [mt_* dependencies])} from the mt_layer calls."""
    layers = {}
    for m in re.finditer(r"^\s*mt_layer\(([^)]*)\)", cmake_text, re.M):
        words = m.group(1).split()
        name, folder, deps, key = words[0], words[0], [], None
        for w in words[1:]:
            if w in ("FOLDER", "DEPS"):
                key = w
            elif key == "FOLDER":
                folder = w
            elif key == "DEPS" and w.startswith("mt_"):
                deps.append(w[len("mt_"):])
        layers[name] = (folder, deps)
    return layers


def closure(layers, name):
    seen, todo = set(), [name]
    while todo:
        for d in layers[todo.pop()][1]:
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def library_of(layers, path):
    """The library whose folder is the longest prefix of `path` (relative to src/), or None."""
    best = None
    for name, (folder, _) in layers.items():
        if path.startswith(folder + "/") and (best is None or len(folder) > len(layers[best][0])):
            best = name
    return best


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    with open(os.path.join(root, "CMakeLists.txt"), encoding="utf-8") as f:
        layers = read_layers(f.read())
    if not layers:
        print("check_layers: no mt_layer(...) call in CMakeLists.txt")
        return 1
    src = os.path.join(root, "src")
    include = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
    bad = 0
    for dirpath, _, files in os.walk(src):
        for fn in sorted(files):
            if not fn.endswith((".h", ".cpp", ".cu", ".cuh")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, fn), src).replace(os.sep, "/")
            lib = library_of(layers, rel)
            if lib is None:
                continue  # src/main.cpp: the executable, above every library
            allowed = closure(layers, lib) | {lib}
            with open(os.path.join(dirpath, fn), encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    m = include.match(line)
                    if not m:
                        continue
                    target = library_of(layers, m.group(1))
                    if target is not None and target not in allowed:
                        print(f"src/{rel}:{n}: mt_{lib} includes {m.group(1)} of mt_{target}, which it does not link")
                        bad += 1
    if bad:
        print(f"{bad} include(s) against the layering (CMakeLists.txt mt_layer DEPS)")
        return 1
    print(f"layering ok: {len(layers)} libraries")
    return 0


if __name__ == "__main__":
    sys.exit(main())
