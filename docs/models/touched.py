"""How many 2 MiB pages a placement that never moves a block touches over one pass of a
trace, divided by the pass's peak live bytes: what a pool must hold mapped so that the
next pass maps nothing (issue 11's warm pass), whatever it unmaps in between.

Sequential, as ../../../shared/models: frees take effect at once, no caches, no streams
(each trace's events in file order), sizes rounded to 512 B. Placements:

  first      first fit, lowest address
  best       best fit (tightest hole, lowest address among equals)
  oracle-T   best fit, blocks living more than T events at the low end of their hole and the
             others at the high end: a placement told every block's lifetime in advance

    python3 docs/models/touched.py benches/traces/*.csv.gz          # all placements
    python3 docs/models/touched.py --first benches/traces/llama_decode_server.csv.gz

The holes are scanned in address order (a quick model, not a fast one: minutes on the
largest traces).
"""
import bisect
import gzip
import sys

PAGE = 2 << 20


def load(path):
    events = []
    for line in gzip.open(path, "rt"):
        if line.startswith("op"):
            continue
        op, i, size, _stream = line.strip().split(",")
        events.append((op, int(i), int(size)))
    born, life = {}, {}
    for k, (op, i, _) in enumerate(events):
        if op == "a":
            born[i] = k
        elif i in born:
            life[i] = k - born.pop(i)
    for i in born:
        life[i] = len(events)
    return events, life


class Holes:
    """Free address ranges, by start address."""

    def __init__(self):
        self.starts = [0]
        self.size = {0: 1 << 44}

    def take(self, a, n):
        j = bisect.bisect_right(self.starts, a) - 1
        h = self.starts[j]
        hs = self.size.pop(h)
        del self.starts[j]
        if a > h:
            bisect.insort(self.starts, h)
            self.size[h] = a - h
        if a + n < h + hs:
            bisect.insort(self.starts, a + n)
            self.size[a + n] = h + hs - (a + n)

    def give(self, a, n):
        j = bisect.bisect_left(self.starts, a)
        if j < len(self.starts) and self.starts[j] == a + n:
            n += self.size.pop(a + n)
            del self.starts[j]
        if j > 0 and self.starts[j - 1] + self.size[self.starts[j - 1]] == a:
            self.size[self.starts[j - 1]] += n
        else:
            bisect.insort(self.starts, a)
            self.size[a] = n

    def first(self, n):
        return next(h for h in self.starts if self.size[h] >= n)

    def best(self, n, high=False):
        fit = None
        for h in self.starts:
            hs = self.size[h]
            if hs >= n and (fit is None or hs < fit[0]):
                fit = (hs, h)
        return fit[1] + fit[0] - n if high else fit[1]


def touched(events, life, mode, threshold=0):
    holes, blocks, pages = Holes(), {}, set()
    live = peak = 0
    for op, i, size in events:
        if op == "a":
            n = max(512, (size + 511) // 512 * 512)
            if mode == "first":
                a = holes.first(n)
            elif mode == "best":
                a = holes.best(n)
            else:
                a = holes.best(n, high=life[i] <= threshold)
            holes.take(a, n)
            blocks[i] = (a, n, size)
            live += size
            peak = max(peak, live)
            pages.update(range(a // PAGE, (a + n - 1) // PAGE + 1))
        elif i in blocks:
            a, n, size = blocks.pop(i)
            live -= size
            holes.give(a, n)
    return len(pages) * PAGE / peak


def main(args):
    first_only = "--first" in args
    for path in (a for a in args if not a.startswith("--")):
        events, life = load(path)
        figures = [f"first {touched(events, life, 'first'):.3f}"]
        if not first_only:
            figures.append(f"best {touched(events, life, 'best'):.3f}")
            for t in (100, 1000, 10000):
                figures.append(f"oracle-{t} {touched(events, life, 'oracle', t):.3f}")
        print(path.split("/")[-1], *figures, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
