"""The recorded traces (`benches/traces/*.csv.gz`), as the models read them."""
import gzip


def events(path):
    """Every event of the trace at `path`, in order: (is_alloc, id, size, stream)."""
    out = []
    for line in gzip.open(path, "rt"):
        if line[0] == "o":  # the header
            continue
        op, i, sz, st = line.strip().split(",")
        out.append((op == "a", int(i), int(sz), st))
    return out
