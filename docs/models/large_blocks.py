"""Two other ways to serve large blocks, modelled before building either.

A large block's trip through the pool's space grows with its size (a bit and a fence word
per 64 KiB granule, a count per 2 MiB page), and a warm pass of a training trace makes
thousands of them. This model asks what two alternatives would cost in memory and in page
moves, on the recorded traces, sequentially (one thread; frees take effect at once; every
stream's memory is everyone's, except in `park`, which keys by stream):

  pages T     Blocks of T MiB and more are rounded up to whole 2 MiB pages and placed best
              fit in a range of their own, so each page holds one block and needs no count,
              and a fence per page would do; smaller blocks go best fit at 512 B in another
              range, pages counted. Pages are mapped while anything lives on them (as the
              shared models). Prints peak mapped / peak live for each T given (comma list,
              MiB; a huge T is one range for everything, the shared best-fit model).

  park L      One range, first fit at 64 KiB granules; pages stay mapped once mapped, and a
              page mapped past the peak is traded for the highest wholly free one (an unmap
              and a map). A freed block of L KiB or more is parked under (stream, size) and
              the next request of that stream and size takes it back (LIFO): no walk, no
              page or fence work. A miss that would map a page first gives parked blocks
              back to the range, oldest first, until it fits on mapped pages. Prints, per
              pass of three: peak mapped / peak live, (maps + unmaps) / peak, and the hits
              and misses among blocks of L KiB and more; L = 0 parks nothing (the baseline).

Usage:
  python3 docs/models/large_blocks.py pages 100000,4,8,16,32 benches/traces/*.csv.gz
  python3 docs/models/large_blocks.py park 0,512,4096 benches/traces/train_gpt2.csv.gz
"""
import bisect
import sys
from collections import OrderedDict

from traces import events

PAGE = 2 << 20
GRANULE = 64 << 10


def pages_of(a, n):
    return range(a // PAGE, (a + n - 1) // PAGE + 1)


class BestFit:
    """Free runs of one range by (length, address); coalescing."""

    def __init__(self):
        self.runs = [(1 << 40, 0)]
        self.by_start = {0: 1 << 40}
        self.by_end = {1 << 40: 0}

    def _add(self, a, n):
        bisect.insort(self.runs, (n, a))
        self.by_start[a] = n
        self.by_end[a + n] = a

    def _drop(self, a):
        n = self.by_start.pop(a)
        del self.by_end[a + n]
        self.runs.pop(bisect.bisect_left(self.runs, (n, a)))
        return n

    def alloc(self, n):
        m, a = self.runs[bisect.bisect_left(self.runs, (n, -1))]
        self._drop(a)
        if m > n:
            self._add(a + n, m - n)
        return a

    def free(self, a, n):
        if a in self.by_end:
            b = self.by_end[a]
            n += self._drop(b)
            a = b
        if a + n in self.by_start:
            n += self._drop(a + n)
        self._add(a, n)


class FirstFit:
    """Free runs of one range by address; coalescing; `fit` takes a predicate on the run."""

    def __init__(self):
        self.len = {0: 1 << 40}
        self.end = {1 << 40: 0}
        self.starts = [0]

    def fit(self, n, ok):
        for a in self.starts:
            if self.len[a] >= n and ok(a, n):
                return a
        return None

    def take(self, a, n):
        m = self.len.pop(a)
        del self.end[a + m]
        self.starts.remove(a)
        if m > n:
            self.len[a + n] = m - n
            self.end[a + m] = a + n
            bisect.insort(self.starts, a + n)

    def free(self, a, n):
        if a in self.end:
            b = self.end.pop(a)
            n += self.len.pop(b)
            self.starts.remove(b)
            a = b
        if a + n in self.len:
            m = self.len.pop(a + n)
            del self.end[a + n + m]
            self.starts.remove(a + n)
            n += m
        self.len[a] = n
        self.end[a + n] = a
        bisect.insort(self.starts, a)


def whole_pages(ops, threshold):
    small, large = BestFit(), BestFit()
    count, blocks = {}, {}
    small_pages = large_pages = peak = live = peak_live = 0
    for alloc, i, sz, _ in ops:
        if alloc:
            if sz >= threshold:
                n = -(-sz // PAGE) * PAGE
                blocks[i] = (True, large.alloc(n), n, sz)
                large_pages += n // PAGE
            else:
                n = max(512, -(-sz // 512) * 512)
                a = small.alloc(n)
                for p in pages_of(a, n):
                    count[p] = count.get(p, 0) + 1
                    small_pages += count[p] == 1
                blocks[i] = (False, a, n, sz)
            peak = max(peak, small_pages + large_pages)
            live += sz
            peak_live = max(peak_live, live)
        elif i in blocks:
            is_large, a, n, sz = blocks.pop(i)
            live -= sz
            if is_large:
                large_pages -= n // PAGE
                large.free(a, n)
            else:
                for p in pages_of(a, n):
                    count[p] -= 1
                    if count[p] == 0:
                        del count[p]
                        small_pages -= 1
                small.free(a, n)
    return peak * PAGE / peak_live


def parked(ops, least, passes=3):
    space, count, mapped = FirstFit(), {}, set()
    parked_by_age, parked_by_key = OrderedDict(), {}
    peak, out = 0, []
    moves = {}

    def hold(a, n):
        nonlocal peak
        for p in pages_of(a, n):
            count[p] = count.get(p, 0) + 1
            if p not in mapped:
                if len(mapped) >= peak:
                    free = [q for q in mapped if count.get(q, 0) == 0]
                    if free:
                        mapped.discard(max(free))
                        moves["unmaps"] += 1
                mapped.add(p)
                moves["maps"] += 1
                peak = max(peak, len(mapped))

    def release(a, n):
        for p in pages_of(a, n):
            count[p] -= 1
        space.free(a, n)

    def unpark_oldest():
        (s, n, a) = next(iter(parked_by_age))
        del parked_by_age[(s, n, a)]
        parked_by_key[(s, n)].remove(a)
        release(a, n)

    def on_mapped(a, n):
        return all(p in mapped for p in pages_of(a, n))

    for _ in range(passes):
        moves.update(maps=0, unmaps=0, hits=0, misses=0)
        blocks, live, peak_live = {}, 0, 0
        for alloc, i, sz, s in ops:
            if alloc:
                n = max(GRANULE, -(-sz // GRANULE) * GRANULE)
                spare = parked_by_key.get((s, n))
                if least and sz >= least and spare:
                    a = spare.pop()
                    del parked_by_age[(s, n, a)]
                    moves["hits"] += 1
                else:
                    if least and sz >= least:
                        moves["misses"] += 1
                    a = space.fit(n, on_mapped)
                    while a is None and parked_by_age:
                        unpark_oldest()
                        a = space.fit(n, on_mapped)
                    if a is None:
                        a = space.fit(n, lambda a, n: True)
                    space.take(a, n)
                    hold(a, n)
                blocks[i] = (a, n, sz, s)
                live += sz
                peak_live = max(peak_live, live)
            elif i in blocks:
                a, n, sz, s = blocks.pop(i)
                live -= sz
                if least and sz >= least:
                    parked_by_age[(s, n, a)] = None
                    parked_by_key.setdefault((s, n), []).append(a)
                else:
                    release(a, n)
        for a, n, _, _ in blocks.values():
            release(a, n)
        out.append((peak * PAGE / peak_live, (moves["maps"] + moves["unmaps"]) / peak, moves["hits"], moves["misses"]))
    return out


def main():
    what, values, paths = sys.argv[1], [int(v) for v in sys.argv[2].split(",")], sys.argv[3:]
    for path in paths:
        name = path.split("/")[-1].split(".")[0]
        ops = events(path)
        if what == "pages":
            row = "  ".join(f"{t} MiB {whole_pages(ops, t << 20):.3f}" for t in values)
            print(f"{name:24s} {row}", flush=True)
        else:
            for least in values:
                row = "  ".join(f"{r:.3f} {m:.3f} {h}/{x}" for r, m, h, x in parked(ops, least << 10))
                print(f"{name:24s} park {least:>5} KiB: {row}", flush=True)


if __name__ == "__main__":
    main()
