"""One line of tools/pytorch-eval.sh's `lanes` part: N jobs run at once, with their
own memory or with the shared lane, against the same job run alone.

usage: lanes_report.py ALONE.json HOW MOST_ADMITTED T0 T1 RUN.json...
"""
import json
import sys


def main():
    alone = json.load(open(sys.argv[1]))
    how, admitted = sys.argv[2], sys.argv[3]
    t0, t1 = float(sys.argv[4]), float(sys.argv[5])
    runs = []
    for path in sys.argv[6:]:
        try:
            runs.append(json.load(open(path)))
        except (OSError, ValueError) as e:
            print(f"  {path}: no result ({e})")
    steps = sum(r["steps"] for r in runs)
    same = sum(r["losses"] == alone["losses"] for r in runs)
    wall = t1 - t0
    print(f"{how} memory: {len(runs)} jobs, at most {admitted} admitted at once, "
          f"{wall:.3f} s in all, {steps / wall:.2f} steps/s, "
          f"losses bit-identical to the job alone in {same}/{len(runs)}")


if __name__ == "__main__":
    main()
