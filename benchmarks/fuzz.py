"""Run memplan's structural fuzzer (``memplan.fuzz``) over a range of seeds.

Run ``python benchmarks/fuzz.py --programs 1000 --start-seed 0 --out DIR`` to draw the programs of seeds
``0..999`` with :func:`memplan.fuzz.structural_program`, check each with :func:`memplan.fuzz.check_program`
(memplan's default pipeline unless ``--passes`` says otherwise), print a running count and a final
table (programs, ill-conditioned programs skipped, findings by kind), and write into ``DIR`` a
minimised, runnable reproducer ``seed<seed>_<kind>.py`` for each failure.

Seed ranges split a long run into several (``--start-seed 0 --programs 5000`` and ``--start-seed 5000
--programs 5000``). With ``--out``, every checked seed is logged in ``DIR/log.jsonl``; ``--resume``
skips the seeds logged there and counts them in the table, so an interrupted run picks up where it
stopped.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from memplan.fuzz import CHECKS, FAMILIES, NEAR_TIE, OVERESTIMATE, Finding, check_program, minimise, same_failure, structural_program

__all__ = ["main", "run"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=100, help="how many seeds to check (default 100)")
    parser.add_argument("--start-seed", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--out", default=None, help="folder for reproducers and the log (none: print only)")
    parser.add_argument("--passes", default=None, help="pipeline, e.g. 'chunk' or 'rewrite,chunk' (default: memplan's)")
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated checks (default: all, {','.join(CHECKS)})")
    parser.add_argument("--families", default=None, help="comma-separated families to draw from (default: all)")
    parser.add_argument("--size", default="default", choices=("default", "small"))
    parser.add_argument("--max-overhead", type=float, default=0.3, help="memplan.optimize's max_overhead (default 0.3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: the programs are small, and threads only add waiting)")
    parser.add_argument("--no-minimise", action="store_true", help="write the failing programs as drawn")
    parser.add_argument("--max-tries", type=int, default=150, help="checks the minimiser may run per failure")
    parser.add_argument("--resume", action="store_true", help="skip the seeds logged in OUT/log.jsonl")
    args = parser.parse_args(argv)
    for check in args.checks.split(","):
        if check not in CHECKS:
            parser.error(f"unknown check {check!r}: choose among {', '.join(CHECKS)}")
    if args.families:
        for family in args.families.split(","):
            if family not in FAMILIES:
                parser.error(f"unknown family {family!r}: choose among {', '.join(FAMILIES)}")
    if args.resume and not args.out:
        parser.error("--resume needs --out (the log is OUT/log.jsonl)")
    return args


class _Tally:
    """Counts of programs, skips and findings by kind, with the seeds of each kind."""

    def __init__(self) -> None:
        self.programs = 0
        self.skipped = 0
        self.failing = 0
        self.seconds = 0.0
        self.kinds: collections.Counter[str] = collections.Counter()
        self.seeds: dict[str, list[int]] = collections.defaultdict(list)

    def add(self, seed: int, kinds: Sequence[str], seconds: float) -> None:
        self.programs += 1
        self.seconds += seconds
        if "ill-conditioned" in kinds:
            self.skipped += 1
            return
        found = list(dict.fromkeys(kinds))
        if any(kind not in (OVERESTIMATE, NEAR_TIE) for kind in found):
            self.failing += 1
        for kind in found:
            self.kinds[kind] += 1
            self.seeds[kind].append(seed)

    def line(self, total: int) -> str:
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.kinds.items())) or "none"
        return f"[{self.programs}/{total}] skipped {self.skipped}, failing {self.failing} ({kinds})"

    def table(self) -> str:
        rows = [("programs", str(self.programs), ""),
                ("ill-conditioned (skipped)", str(self.skipped), ""),
                ("failing programs", str(self.failing), "")]
        for kind, count in sorted(self.kinds.items(), key=lambda item: (-item[1], item[0])):
            seeds = self.seeds[kind]
            shown = ", ".join(map(str, seeds[:12])) + (", ..." if len(seeds) > 12 else "")
            rows.append((f"  {kind}" + (" (not a failure)" if kind in (OVERESTIMATE, NEAR_TIE) else ""), str(count), shown))
        width = max(len(r[0]) for r in rows)
        lines = [f"{'':{width}}  {'count':>6}  seeds", "-" * (width + 30)]
        lines += [f"{name:{width}}  {count:>6}  {seeds}" for name, count, seeds in rows]
        per = self.seconds / self.programs if self.programs else 0.0
        lines.append(f"{self.seconds:.0f} s checking, {per:.2f} s a program")
        return "\n".join(lines)


def _logged(out: str) -> dict[int, dict[str, Any]]:
    path = os.path.join(out, "log.jsonl")
    if not os.path.exists(path):
        return {}
    entries = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                entry = json.loads(line)
                entries[entry["seed"]] = entry
    return entries


def _write_repro(finding: Finding, args: argparse.Namespace, settings: dict[str, Any]) -> str:
    """Minimise the finding's program (unless told not to) and write it as a script; return its path."""
    program = finding.program
    original = len(program.statements)
    if not args.no_minimise:
        program = minimise(program, same_failure(finding, **settings), max_tries=args.max_tries)
    header = [
        f"{finding.kind} found by the {finding.check!r} check of memplan.fuzz.check_program"
        f" (passes={args.passes!r}, max_overhead={args.max_overhead}):",
        f"    {finding.where + ': ' if finding.where else ''}{' '.join(finding.message.split())[:600]}",
        "",
        f"Drawn by memplan.fuzz.structural_program({finding.seed}, size={args.size!r}) with {original} statements;"
        f" {'minimised to' if not args.no_minimise else 'written with'} {len(program.statements)}.",
        "Run this file to print the findings of all checks on it.",
    ]
    path = os.path.join(args.out, f"seed{finding.seed}_{finding.kind}.py")
    with open(path, "w") as f:
        f.write(program.to_source(header="\n".join(header), passes=args.passes))
    return path


def run(args: argparse.Namespace) -> _Tally:
    """Check the seeds ``args`` names; return the tally (the caller prints it)."""
    settings = {"passes": args.passes, "max_overhead": args.max_overhead}
    checks = tuple(args.checks.split(","))
    families = args.families.split(",") if args.families else None
    tally = _Tally()
    logged = _logged(args.out) if args.resume else {}
    log = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log = open(os.path.join(args.out, "log.jsonl"), "a")
    interactive = sys.stdout.isatty()
    seeds = range(args.start_seed, args.start_seed + args.programs)
    try:
        for seed in seeds:
            if seed in logged:
                tally.add(seed, logged[seed]["kinds"], logged[seed]["seconds"])
                continue
            start = time.perf_counter()
            try:
                model, inputs = structural_program(seed, families=families, size=args.size)
            except Exception as e:  # a generator bug: count it, keep going
                findings = [Finding("invalid", f"structural_program raised {type(e).__name__}: {e}", seed, check="generate")]
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # memplan's advice to users (fallbacks, replanning)
                    findings = check_program(model, inputs, checks=checks, **settings)
            seconds = time.perf_counter() - start
            kinds = [f.kind for f in findings]
            tally.add(seed, kinds, seconds)
            if log is not None:
                log.write(json.dumps({"seed": seed, "kinds": kinds, "seconds": round(seconds, 3),
                                      "messages": [str(f) for f in findings]}) + "\n")
                log.flush()
            for finding in findings:
                if finding.failed:
                    print(f"\r{' '.join(str(finding).split())[:300]}", flush=True)
            if args.out:
                written = set()
                for finding in findings:
                    if finding.failed and finding.program is not None and finding.kind not in written:
                        written.add(finding.kind)
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            print(f"  -> {_write_repro(finding, args, settings)}", flush=True)
            if interactive:
                print(f"\r{tally.line(len(seeds))}", end="", flush=True)
            elif tally.programs % 25 == 0:
                print(tally.line(len(seeds)), flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
    finally:
        if log is not None:
            log.close()
    if interactive:
        print()
    return tally


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    torch.set_num_threads(args.threads)
    tally = run(args)
    print(tally.table())
    return 1 if tally.failing else 0


if __name__ == "__main__":
    sys.exit(main())
