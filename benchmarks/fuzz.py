"""Fuzz the planner with random programs: plan, run, compare with the unsharded run.

    python benchmarks/fuzz.py --programs 2000 --seed 0
    python benchmarks/fuzz.py --replay 1234          # one program, by its seed

Program ``i`` of a campaign is drawn from seed ``S * 1_000_000 + i``, so any program is
replayed alone with ``--replay``. The programs run in a worker process on 8 simulated CPU
devices; one that runs past ``--timeout`` seconds is a hang: the worker is killed and a
fresh one goes on with the next program. Each failure prints its seed, what went wrong and
a reproducer (the program as Python source, with its arguments, mesh, hardware, pins,
donation and budget). The summary counts programs, crashes, wrong numerics, hangs, plans
whose compiled memory is over their tight budget, and clean errors on inputs that have no
plan (each with its reason); and how many programs drew grouped, strided and dilated
convolutions, their gradients and FFTs, with pins or budgets.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import selectors
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def program_seed(seed: int, i: int) -> int:
    return seed * 1_000_000 + i


def worker(seeds: list[int]) -> None:
    """Check each seed's program and write one JSON line per program to stdout."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    import warnings
    warnings.simplefilter("ignore")
    from autoshard.testing import fuzz
    out = sys.stdout
    for seed in seeds:
        case = fuzz.generate(fuzz.RandomDraw(seed))
        out.write(json.dumps({"start": seed, "features": features(case)}) + "\n")
        out.flush()
        started = time.perf_counter()
        outcome = fuzz.check(case)
        record = {"seed": seed, "kind": outcome.kind, "detail": outcome.detail,
                  "seconds": time.perf_counter() - started, "features": features(case)}
        if outcome.failed:
            record["reproducer"] = case.reproducer()
        out.write(json.dumps(record) + "\n")
        out.flush()


def features(case) -> list[str]:
    """The kinds of op a program drew, and whether it also has pins or a budget."""
    extras = (["pinned"] if case.pins else []) + ([f"budget_{case.budget}"] if case.budget
                                                   else [])
    return list(case.features) + extras


def spawn(seeds: list[int]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                             ",".join(map(str, seeds))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            bufsize=1)


def campaign(seeds: list[int], timeout_s: float, report) -> list[dict]:
    """Run every seed's program in workers; a program past ``timeout_s`` is a hang."""
    records, pending = [], list(seeds)
    while pending:
        proc = spawn(pending)
        selector = selectors.DefaultSelector()
        selector.register(proc.stdout, selectors.EVENT_READ)
        current, deadline = None, time.monotonic() + 120   # the first program imports jax
        drawn: list[str] = []   # the current program's features
        while True:
            if not selector.select(timeout=max(0.0, deadline - time.monotonic())):
                proc.kill()
                proc.wait()
                seed = current if current is not None else pending[0]
                record = {"seed": seed, "kind": "hang", "features": drawn,
                          "detail": f"no result within {timeout_s:g} s" if current is not None
                          else "the worker did not start"}
                records.append(report(record))
                pending = pending[pending.index(seed) + 1:]
                break
            line = proc.stdout.readline()
            if not line:   # the worker died (a crash below Python: abort, segfault)
                proc.wait()
                if current is None:
                    pending = []
                    break
                records.append(report({"seed": current, "kind": "crash", "features": drawn,
                                       "detail": f"the worker died (exit {proc.returncode})"}))
                pending = pending[pending.index(current) + 1:]
                break
            message = json.loads(line)
            if "start" in message:
                current, deadline = message["start"], time.monotonic() + timeout_s
                drawn = message["features"]
                continue
            records.append(report(message))
            current = None
            pending = pending[1:]
            if not pending:
                proc.wait()
                break
        selector.close()
    return records


FAILURES = ("crash", "wrong", "hang", "over_budget")


def printer(verbose: bool, total: int):
    seen = collections.Counter()

    def report(record: dict) -> dict:
        kind = record["kind"]
        seen[kind] += 1
        done = sum(seen.values())
        if done % 100 == 0 or done == total:
            print(f"[{done}/{total}] " + ", ".join(f"{k} {n}" for k, n in sorted(seen.items())),
                  flush=True)
        if kind in FAILURES:
            print(f"\n=== seed {record['seed']}: {kind.upper()}\n{record['detail'].rstrip()}")
            if record.get("reproducer"):
                print(f"--- reproducer (python benchmarks/fuzz.py --replay {record['seed']}):\n"
                      f"{record['reproducer']}")
        elif kind in ("infeasible", "refused") and verbose:
            print(f"seed {record['seed']}: {kind}: {record['detail']}")
        sys.stdout.flush()
        return record
    return report


def summary(records: list[dict], seconds: float) -> str:
    counts = collections.Counter(r["kind"] for r in records)
    failed = [r["seed"] for r in records if r["kind"] in FAILURES]
    lines = [f"programs: {len(records)} in {seconds:.0f} s "
             f"({len(records) / max(seconds, 1e-9):.2f} programs/s)",
             f"  ok:            {counts['ok']}",
             f"  crashes:       {counts['crash']}",
             f"  wrong numbers: {counts['wrong']}",
             f"  hangs:         {counts['hang']}",
             f"  over budget:   {counts['over_budget']} (compiled memory above a tight budget)",
             f"  clean errors on inputs with no plan: {counts['infeasible']} "
             "(each budget below what the arguments need at their most split)",
             f"  budgets refused above that floor: {counts['refused']} (each below what the "
             "unsplit program needs, and below every plan the planner can express)"]
    lines += feature_lines(records)
    if failed:
        lines.append(f"  failing seeds: {failed}")
    return "\n".join(lines)


def feature_lines(records: list[dict]) -> list[str]:
    """How many programs had each kind of op, alone and with pins or a budget, and how
    many of those failed."""
    lines = ["programs with (failed among them):"]
    for name in ("grouped_conv", "batch_grouped_conv", "strided_conv", "dilated_conv",
                 "transposed_conv", "conv_grad", "conv", "fft"):
        having = [r for r in records if name in r.get("features", ())]
        pinned = sum("pinned" in r["features"] for r in having)
        budgeted = sum(any(f.startswith("budget_") for f in r["features"]) for r in having)
        failed = sum(r["kind"] in FAILURES for r in having)
        lines.append(f"  {name + ':':19} {len(having):5} ({failed} failed); pinned {pinned}, "
                     f"with a budget {budgeted}")
    return lines


def replay(seed: int) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    from autoshard.testing import fuzz
    case = fuzz.generate(fuzz.RandomDraw(seed))
    print(case.reproducer())
    outcome = fuzz.check(case)
    print(f"\n# seed {seed}: {outcome.kind}\n{outcome.detail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds one program may take before it counts as a hang")
    parser.add_argument("--replay", type=int, help="check one program by its seed")
    parser.add_argument("--verbose", action="store_true", help="print clean errors too")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker([int(s) for s in args.worker.split(",")])
        return 0
    if args.replay is not None:
        replay(args.replay)
        return 0
    started = time.monotonic()
    seeds = [program_seed(args.seed, i) for i in range(args.programs)]
    records = campaign(seeds, args.timeout, printer(args.verbose, len(seeds)))
    print("\n" + summary(records, time.monotonic() - started))
    return 1 if any(r["kind"] in FAILURES for r in records) else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))   # the checkout's autoshard package
    sys.exit(main())
