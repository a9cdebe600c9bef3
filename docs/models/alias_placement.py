"""Why a warm pass still moves pages: a sequential model of placement with lent pages.

One address range of 2 MiB pages. A page, once it has memory, keeps that memory at that
address until the model remaps it; one physical page may show at many addresses (a loan,
as `Device::alias`), and serves one of them at a time: it is free when none of its
addresses holds a live block. A block goes to the free run (any window of it, slid a page at
a time) whose pages cost least: a page holding a live block or showing free memory costs 0,
a page with no memory a map (4), a page whose memory is busy at another address a remap
(`--remap`; 7, as the pool's `cheapest.rs`); the lowest among equals. A map lends a free
physical page (`--lender`) or makes a new one when none is free, so the physical peak is the
most pages in use at once. Frees take effect at once; streams are ignored (every trace is
played as one stream).

Options:
  --remap N       what a page whose memory is busy elsewhere costs (default 7; 1e9: never
                  remapped while any other window will do).
  --split         blocks under 512 KiB placed in a range of their own, as the pool's chunks.
  --granule       blocks of 512 KiB and more rounded to 64 KiB, as the pool's extents.
  --lender WHICH  the free physical page a map lends: `oldest` (made first; the default),
                  `low` (the lowest address it shows at now) or `high` (the highest, as the
                  pool's `PageMap::lend` chooses).
  --cache BYTES   blocks up to BYTES kept by class on free (the caches, unbounded, LIFO); a
                  block above BYTES first sends the cached blocks of 512 KiB and more back
                  (the pool's rung 0).
  --empty         the caches emptied at the end of each pass (when nothing is live).
  --passes N      passes of the trace in one pool (default 4).

Printed per trace: peak physical / peak live, then per pass (maps + remaps) / peak, as
`replay --warm` counts them (the second figure is the issue's warm pass).

    python3 docs/models/alias_placement.py --split --remap 1e9 --lender low benches/traces/*.gz
"""
import bisect, itertools, sys

from traces import events

P = 2 << 20
GRANULE = 64 << 10
LARGE = 512 << 10
SMALL_BASE = 1 << 40
TOP = 1 << 44


def load(path):
    return [(a, i, sz) for a, i, sz, _ in events(path)]


def size_class(sz):
    """Four classes per doubling, as a size-class cache rounds."""
    if sz <= 512:
        return 512
    b = 1 << ((sz - 1).bit_length() - 1)
    q = b // 4 if b >= 2048 else 512
    return (sz + q - 1) // q * q


class Model:
    def __init__(self, opts):
        self.o = opts
        self.starts = [0]          # free runs by address
        self.run = {0: TOP}        # start -> length
        self.ends = {TOP: 0}       # end -> start
        self.occupied = {}         # page -> live blocks on it
        self.memory = {}           # page -> physical page it shows
        self.active = {}           # physical page -> the page it last served at
        self.free_phys = set()
        self.phys = 0
        self.maps = self.remaps = 0
        self.blocks = {}
        self.cache = {}
        self.top = {False: 0, True: SMALL_BASE // P}  # highest page with memory, per range

    def take_run(self, a):
        n = self.run.pop(a)
        del self.ends[a + n]
        self.starts.pop(bisect.bisect_left(self.starts, a))
        return n

    def put_run(self, a, n):
        self.run[a] = n
        self.ends[a + n] = a
        bisect.insort(self.starts, a)

    def cost(self, p):
        if self.occupied.get(p, 0):
            return 0
        x = self.memory.get(p)
        if x is None:
            return 4
        return 0 if x in self.free_phys else self.o['remap']

    def place(self, n):
        small = self.o['split'] and n < LARGE
        lo, hi = (SMALL_BASE, TOP) if small else (0, SMALL_BASE if self.o['split'] else TOP)
        best = None
        for start in self.starts[max(0, bisect.bisect_left(self.starts, lo) - 1):]:
            a0, end = max(start, lo), min(start + self.run[start], hi)
            if a0 >= hi:
                break
            if end - a0 < n:
                continue
            for a in itertools.chain([a0], range((a0 + P - 1) // P * P, end - n + 1, P)):
                c = sum(self.cost(p) for p in range(a // P, (a + n - 1) // P + 1))
                if best is None or c < best[0]:
                    best = (c, a, start)
                if c == 0:
                    return a, start
                if a // P > self.top[small]:
                    break  # every later window is pages never mapped: the same cost
        return best[1], best[2]

    def physical(self):
        if not self.free_phys:
            self.phys += 1
            return self.phys - 1
        which = self.o['lender']
        if which == 'low':
            x = min(self.free_phys, key=lambda y: self.active.get(y, TOP))
        elif which == 'high':
            x = max(self.free_phys, key=lambda y: self.active.get(y, -1))
        else:
            x = min(self.free_phys)
        self.free_phys.discard(x)
        return x

    def alloc(self, i, sz):
        cached = self.o['cache']
        if sz <= cached:
            c = size_class(sz)
            if self.cache.get(c):
                self.blocks[i] = (self.cache[c].pop(), c, sz)
                return
            n = c
        else:
            for c, kept in self.cache.items():
                while c >= LARGE and kept:
                    self.release(kept.pop(), c)
            n = max(512, (sz + 511) // 512 * 512)
        if self.o['granule'] and n >= LARGE:
            n = (n + GRANULE - 1) // GRANULE * GRANULE
        a, start = self.place(n)
        m = self.take_run(start)
        if a > start:
            self.put_run(start, a - start)
        if start + m > a + n:
            self.put_run(a + n, start + m - a - n)
        for p in range(a // P, (a + n - 1) // P + 1):
            k = self.occupied.get(p, 0)
            self.occupied[p] = k + 1
            if k:
                continue
            x = self.memory.get(p)
            if x is None or x not in self.free_phys:
                if x is None:
                    self.maps += 1
                    small = p >= SMALL_BASE // P
                    self.top[small] = max(self.top[small], p)
                else:
                    self.remaps += 1
                x = self.memory[p] = self.physical()
            else:
                self.free_phys.discard(x)
            self.active[x] = p
        self.blocks[i] = (a, n, sz)

    def free(self, i):
        a, n, sz = self.blocks.pop(i)
        if sz <= self.o['cache'] and n == size_class(sz):
            self.cache.setdefault(n, []).append(a)
        else:
            self.release(a, n)

    def release(self, a, n):
        for p in range(a // P, (a + n - 1) // P + 1):
            self.occupied[p] -= 1
            if not self.occupied[p]:
                del self.occupied[p]
                self.free_phys.add(self.memory[p])
        if a in self.ends:
            s = self.ends[a]
            n += self.take_run(s)
            a = s
        if a + n in self.run:
            n += self.take_run(a + n)
        self.put_run(a, n)

    def empty_caches(self):
        for c, kept in self.cache.items():
            while kept:
                self.release(kept.pop(), c)


def main(argv):
    o = {'remap': 7, 'split': False, 'granule': False, 'lender': 'oldest', 'cache': 0, 'empty': False,
         'passes': 4}
    paths = []
    it = iter(argv)
    for arg in it:
        if arg == '--remap':
            o['remap'] = int(float(next(it)))
        elif arg == '--cache':
            o['cache'] = int(float(next(it)))
        elif arg == '--passes':
            o['passes'] = int(next(it))
        elif arg == '--lender':
            o['lender'] = next(it)
        elif arg in ('--split', '--granule', '--empty'):
            o[arg[2:]] = True
        else:
            paths.append(arg)
    for path in paths:
        ops, m = load(path), Model(o)
        live = peak_live = 0
        moved = []
        for _ in range(o['passes']):
            before = m.maps + m.remaps
            for alloc, i, sz in ops:
                if alloc:
                    m.alloc(i, sz)
                    live += sz
                    peak_live = max(peak_live, live)
                elif i in m.blocks:
                    live -= m.blocks[i][2]
                    m.free(i)
            for i in list(m.blocks):
                live -= m.blocks[i][2]
                m.free(i)
            if o['empty']:
                m.empty_caches()
            moved.append((m.maps + m.remaps - before) * P)
        peak = m.phys * P
        name = path.split('/')[-1].split('.')[0]
        by_pass = ' '.join(f'{x / peak:.3f}' for x in moved)
        print(f'{name:24s} peak/live {peak / peak_live:.3f}  moved/peak by pass: {by_pass}', flush=True)


if __name__ == '__main__':
    main(sys.argv[1:])
