"""The table of benchmarks/results/openb-summary.txt from openb.py's --json output.

    python benchmarks/openb_summary.py [--policy fgd-plus] FILE... > benchmarks/results/openb-summary.txt

Each FILE holds one JSON object per line (openb.py --json, one trace each). Prints, per trace,
the policy's unallocated GPU % at 100 % arrival (mean ± sd over the seeds) beside the
published FGD and best-fit means (Weng et al. ATC'23, fgd_expected_results) and the difference
from FGD; then whether the policy is below FGD on every trace.
"""

from __future__ import annotations

import argparse
import json
import sys

ORDER = [
    "default",
    "cpu050",
    "cpu100",
    "cpu200",
    "cpu250",
    "gpushare40",
    "gpushare60",
    "gpushare80",
    "gpushare100",
    "multigpu20",
    "multigpu30",
    "multigpu40",
    "multigpu50",
    "gpuspec10",
    "gpuspec20",
    "gpuspec25",
    "gpuspec33",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--policy", default="fgd-plus")
    args = parser.parse_args(argv)
    results = {}
    for path in args.files:
        with open(path) as lines:
            for line in lines:
                if line.strip():
                    result = json.loads(line)
                    if args.policy in result["policies"]:
                        results[result["trace"]] = result
    traces = [t for t in ORDER if t in results] + sorted(t for t in results if t not in ORDER)
    seeds = {f"{r['seeds'][0]}-{r['seeds'][-1]}" for r in results.values()}
    print(
        f"unallocated GPU % at 100 % arrival, {args.policy} (ours), seeds {', '.join(sorted(seeds))}, "
        f"vs the published FGD / best-fit means"
    )
    print(f"{'trace':14s} {args.policy:>14s}  FGD pub  BF pub   diff")
    worse = []
    for trace in traces:
        ours = results[trace]["policies"][args.policy]
        published = results[trace].get("published", {})
        fgd = published.get("fgd", {}).get("unallocated_pct_at_100")
        bf = published.get("best-fit", {}).get("unallocated_pct_at_100")
        diff = ours["unallocated_pct_at_100"] - fgd if fgd is not None else None
        if diff is not None and diff > 0:
            worse.append(trace)
        print(
            f"{trace:14s} {ours['unallocated_pct_at_100']:6.2f} ± {ours['unallocated_pct_at_100_sd']:5.2f}  "
            f"{fgd if fgd is not None else float('nan'):7.2f} {bf if bf is not None else float('nan'):7.2f} "
            f"{diff if diff is not None else float('nan'):6.2f}"
        )
    print(
        f"below published FGD on {len(traces) - len(worse)} of {len(traces)} traces"
        + (f"; worse on {', '.join(worse)}" if worse else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
