"""Summarise an ncu --csv gpu__time_duration report by kernel name (dev tool).
Usage: python ci/tools/ncu_sum.py REPORT.csv [--order] (--order: also every kernel in launch order)."""
import csv
import sys
from collections import defaultdict

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]
ki, vi = hdr.index("Kernel Name"), hdr.index("Metric Value")
tot, cnt = defaultdict(float), defaultdict(int)
order = []
for r in rows[1:]:
    try:
        v = float(r[vi].replace(",", ""))
    except ValueError:
        continue
    name = r[ki].split("(")[0][:60]
    order.append((name, v))
    tot[name] += v
    cnt[name] += 1
unit = hdr and rows[1][hdr.index("Metric Unit")] if len(rows) > 1 else "?"
s = sum(tot.values())
print(f"kernels {sum(cnt.values())}, total {s:.0f} {unit}")
for k, v in sorted(tot.items(), key=lambda x: -x[1])[:40]:
    print(f"{v:10.0f} {cnt[k]:4d}  {k}")
if "--order" in sys.argv:
    for i, (k, v) in enumerate(order):
        print(f"{i:4d} {v:9.0f}  {k}")
