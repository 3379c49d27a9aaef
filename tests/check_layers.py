"""The tree's structural rules, checked on the sources (CTest: layering):
  - layers point one way: a file in core/<layer> includes no core/<layer> above its own
    (docs/DESIGN.md); same-level layers do not include each other;
  - only the runtime-options table (core/util/options.cpp) reads the environment in core;
  - no strategy name is compared as a string outside the registry (core/parallel/registry.cpp), but
    for the job layer's StrategyParams::single(), which sits below it.
Prints each breach and exits 1, or prints 'layers ok'."""
import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parents[1])
LEVEL = {"util": 0, "io": 1, "job": 2, "text": 3, "models": 3, "adapters": 3, "schedulers": 3, "metrics": 3,
         "parallel": 4, "training": 5, "pipeline": 5, "engine": 6}
SOURCES = (".h", ".cpp", ".cu", ".cuh")
include = re.compile(r'#include\s+"core/([a-z_]+)/')


def files(*dirs):
    for d in dirs:
        for p in sorted((ROOT / d).rglob("*")):
            if p.suffix in SOURCES and p.is_file():
                yield p


def main():
    breaches = []
    core = ROOT / "core"
    layers_seen = {p.relative_to(core).parts[0] for p in files("core") if len(p.relative_to(core).parts) > 1}
    for unknown in sorted(layers_seen - LEVEL.keys()):
        breaches.append(f"core/{unknown}/: a folder of core with no layer in tests/check_layers.py")
    for p in files("core"):
        rel = p.relative_to(core).parts
        if len(rel) < 2 or rel[0] not in LEVEL:
            continue
        mine = rel[0]
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            m = include.search(line)
            if not m or m.group(1) == mine or m.group(1) not in LEVEL:
                continue
            if LEVEL[m.group(1)] >= LEVEL[mine]:
                breaches.append(f"{p.relative_to(ROOT)}:{n}: {mine} includes core/{m.group(1)} (layer "
                                f"{LEVEL[m.group(1)]} >= {LEVEL[mine]})")
    for p in files("core"):
        if p.relative_to(ROOT).as_posix() == "core/util/options.cpp":
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"\bgetenv\s*\(", line):
                breaches.append(f"{p.relative_to(ROOT)}:{n}: reads the environment (use core/util/options.h)")
    registry = (ROOT / "core/parallel/registry.cpp").read_text(encoding="utf-8")
    names = sorted(set(re.findall(r'^\s*\{"([a-z0-9-]+)",', registry, re.M)), key=len, reverse=True)
    if len(names) < 10:
        breaches.append(f"core/parallel/registry.cpp: found {len(names)} strategy entries, expected 10 or more")
    alt = "|".join(re.escape(n) for n in names)
    compared = re.compile(r'(?:[=!]=\s*(?:std::string\()?"(?:%s)"|"(?:%s)"\s*[=!]=|QLatin1String\("(?:%s)"\)'
                          r'|rfind\("(?:%s))' % (alt, alt, alt, alt))
    for p in files("core", "app", "ui"):
        if p.relative_to(ROOT).as_posix() == "core/parallel/registry.cpp":
            continue
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            m = compared.search(line)
            # The job layer sits below the registry; its StrategyParams::single() names the plain loop.
            if m and not (p.relative_to(ROOT).as_posix() == "core/job/request.h" and '"single"' in m.group(0)):
                breaches.append(f"{p.relative_to(ROOT)}:{n}: compares a strategy name as a string (ask the registry)")
    for b in breaches:
        print(b)
    if breaches:
        return 1
    print("layers ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
