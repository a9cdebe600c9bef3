"""What a placement that never moves pages needs on a trace, pass after pass.

Replays a trace (gzip CSV: op,id,size,stream) twice in one address space with immediate
frees and no caches, as vrampool's arena rounds (256 B; 64 KiB granules from 512 KiB up),
placing each block first fit or best fit among free runs whose pages are all mapped (else
first fit anywhere), or best fit in two spaces split by size; 2 MiB pages are mapped the
first time a block touches them and never unmapped. Prints, per pass, the allocations that
needed new pages and the MiB newly mapped. The first pass's total over the trace's peak
live bytes is what such a placement holds; the second pass's is its warm-pass churn.

    python3 benches/placement_model.py benches/traces/resnet_varbatch.csv.gz
"""
import gzip, sys, bisect
P=2<<20; G=64<<10
def load(path):
    ops=[]
    for line in gzip.open(path,'rt'):
        if line[0]=='o': continue
        op,i,sz,st=line.strip().split(','); ops.append((op=='a',int(i),int(sz)))
    return ops
def run(ops, policy, passes=2):
    # free runs as sorted list of (addr,len); first/best fit; pages mapped: set; grows by mapping pages (never unmapped)
    free=[(0,1<<40)]; mapped=set(); blocks={}; stats=[]
    def place(n):
        if policy=='first':
            # prefer fully-mapped runs first-fit, else first-fit anywhere
            cand=None
            for idx,(a,l) in enumerate(free):
                if l>=n and all(pg in mapped for pg in range(a//P,(a+n-1)//P+1)): return idx,a
                if cand is None and l>=n: cand=(idx,a)
            return cand
        else:
            best=None; cand=None
            for idx,(a,l) in enumerate(free):
                if l<n: continue
                # best fit among runs whose first n bytes are mapped
                if all(pg in mapped for pg in range(a//P,(a+n-1)//P+1)):
                    if best is None or l<best[0]: best=(l,idx,a)
                elif cand is None: cand=(idx,a)
            return (best[1],best[2]) if best else cand
    for p in range(passes):
        newmap=0; misses=0
        for alloc,i,sz in ops:
            if alloc:
                n=max(256,(sz+255)//256*256)
                if n>=512<<10: n=(n+G-1)//G*G
                idx,a=place(n)
                fa,fl=free[idx]
                if fl==n: free.pop(idx)
                else: free[idx]=(a+n,fl-n)
                pgs=range(a//P,(a+n-1)//P+1)
                miss=[pg for pg in pgs if pg not in mapped]
                if miss: misses+=1; newmap+=len(miss); mapped.update(miss)
                blocks[i]=(a,n)
            elif i in blocks:
                a,n=blocks.pop(i)
                j=bisect.bisect_left(free,(a,0))
                # merge
                if j<len(free) and free[j][0]==a+n: n+=free[j][1]; free.pop(j)
                if j>0 and free[j-1][0]+free[j-1][1]==a: pa,pl=free.pop(j-1); a=pa; n+=pl; j-=1
                free.insert(j,(a,n))
        stats.append((misses,newmap*2))
    # free everything left
    return stats, len(mapped)*2
ops=load(sys.argv[1])
for pol in ('first','best'):
    st,m=run(ops,pol)
    print(pol, 'per pass (allocs needing new pages, MiB newly mapped):', st, 'mapped total MiB', m)
def run_seg(ops, thresh):
    # two independent best-fit spaces: small (< thresh) and large; pages never unmapped
    class S:
        def __init__(s, base): s.free=[(base,1<<39)]
    spaces={0:S(0),1:S(1<<40)}; mapped=set(); blocks={}; out=[]
    for p in range(2):
        newmap=0
        for alloc,i,sz in ops:
            if alloc:
                n=max(256,(sz+255)//256*256)
                if n>=512<<10: n=(n+G-1)//G*G
                sp=spaces[1 if n>=thresh else 0]
                best=None; cand=None
                for idx,(a,l) in enumerate(sp.free):
                    if l<n: continue
                    if all(pg in mapped for pg in range(a//P,(a+n-1)//P+1)):
                        if best is None or l<best[0]: best=(l,idx,a)
                    elif cand is None: cand=(idx,a)
                idx,a=(best[1],best[2]) if best else cand
                fa,fl=sp.free[idx]
                if fl==n: sp.free.pop(idx)
                else: sp.free[idx]=(a+n,fl-n)
                miss=[pg for pg in range(a//P,(a+n-1)//P+1) if pg not in mapped]
                newmap+=len(miss); mapped.update(miss)
                blocks[i]=(a,n,sp)
            elif i in blocks:
                a,n,sp=blocks.pop(i); free=sp.free
                j=bisect.bisect_left(free,(a,0))
                if j<len(free) and free[j][0]==a+n: n+=free[j][1]; free.pop(j)
                if j>0 and free[j-1][0]+free[j-1][1]==a: pa,pl=free.pop(j-1); a=pa; n+=pl; j-=1
                free.insert(j,(a,n))
        out.append(newmap*2)
    return out
for t in (4<<20, 32<<20):
    print('segregated at', t>>20, 'MiB: MiB newly mapped per pass', run_seg(ops,t))
