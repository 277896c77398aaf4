"""Summarizes a kernel trace of tools/kernel-trace/trace.c: the program's CUDA graph launches
(one per decode step and GPU), matched across GPUs in launch order, the last STEPS of them
(default 20) after the first WARMUP (default 3) of the most launched graph size. Per step and
GPU: the span from the first kernel's start to the last one's end, the time in NCCL kernels
(which includes waiting for the other GPUs to arrive), the time in the rest, and the idle time
between kernels; then the median, and the kernels of the median step by total time.

    python3 tools/kernel-trace/summarize.py TRACE.csv
"""
import collections, csv, os, statistics, sys

rows = list(csv.DictReader(open(sys.argv[1])))
steps_wanted = int(os.environ.get("STEPS", 20))
warmup = int(os.environ.get("WARMUP", 3))

# One graph launch = the kernels of one (device, correlation id) with a graph id.
launches = collections.defaultdict(list)
for r in rows:
    if r["graph"] != "0":
        launches[(int(r["device"]), int(r["correlation"]))].append(
            (int(r["start_ns"]), int(r["end_ns"]), r["name"]))
if not launches:
    sys.exit("no CUDA graph launches in the trace")
by_device = collections.defaultdict(list)
for (device, _), kernels in launches.items():
    by_device[device].append(sorted(kernels))
size = collections.Counter(len(k) for ks in by_device.values() for k in ks).most_common(1)[0][0]
for device in by_device:
    by_device[device] = sorted((k for k in by_device[device] if len(k) == size),
                               key=lambda k: k[0][0])[warmup:]
devices = sorted(by_device)
count = min(len(by_device[d]) for d in devices)
chosen = {d: by_device[d][count - min(count, steps_wanted):count] for d in devices}


def busy(kernels):
    """Time covered by at least one kernel (streams may overlap)."""
    total, end = 0, 0
    for s, e, _ in kernels:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def is_nccl(name):
    return "nccl" in name.lower()


print(f"{len(devices)} GPU(s), graph launches of {size} kernels, {len(chosen[devices[0]])} steps "
      f"after {warmup}; times in us")
print("| GPU | step span | NCCL kernels | other kernels | idle between kernels |")
print("|---|---|---|---|---|")
for d in devices:
    spans, nccl, other, idle = [], [], [], []
    for k in chosen[d]:
        span = k[-1][1] - k[0][0]
        spans.append(span)
        nccl.append(sum(e - s for s, e, n in k if is_nccl(n)))
        other.append(sum(e - s for s, e, n in k if not is_nccl(n)))
        idle.append(span - busy(k))
    m = statistics.median
    print(f"| {d} | {m(spans) / 1e3:.1f} | {m(nccl) / 1e3:.1f} ({len([1 for *_, n in chosen[d][0] if is_nccl(n)])} launches) "
          f"| {m(other) / 1e3:.1f} | {m(idle) / 1e3:.1f} |")

# The kernels of the median step of the first GPU, grouped by name.
d = devices[0]
ordered = sorted(chosen[d], key=lambda k: k[-1][1] - k[0][0])
median_step = ordered[len(ordered) // 2]
total = collections.defaultdict(int)
calls = collections.Counter()
for s, e, n in median_step:
    key = n[:60]
    total[key] += e - s
    calls[key] += 1
print(f"\nGPU {d}'s median step, by kernel:")
for key, ns in sorted(total.items(), key=lambda x: -x[1])[:15]:
    print(f"{ns / 1e3:9.1f} us  x{calls[key]:4d}  mean {ns / calls[key] / 1e3:7.2f}  {key}")
