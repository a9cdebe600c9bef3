"""The demo's workload against placement policies for large blocks: a quick sequential model.

16 workers (as `examples/inference_server.rs` with its defaults on 16 cores) serve LLM-shaped
requests: a prefill, 8-128 decode steps, 12 layers, KV blocks of batch x tokens x 3 KiB
regrown every 64 tokens (the new one before the old one is freed), 2-4 activations per layer
and step drawn from gpt2_decode's short-lived allocations. The workers' operations are
interleaved at random, one at a time; frees take effect at once; no caches.

Blocks of 512 KiB and more are placed in one address range at 64 KiB granules (classes of
eight per doubling up to 4 MiB, as the pool's); smaller ones count their class size. The
footprint is the 2 MiB pages holding at least one live large block plus the small bytes: a
wholly free page is assumed to go where it is needed at no cost, as the pool's loans do.
The figure printed is peak footprint / peak live bytes asked for.

Policies: `first` (address-ordered first fit), `best` (tightest run; each run's far end a
candidate), `pages` (fewest pages holding nothing yet, then tightest), `home` (first fit from
an address range of the worker's own, so that one worker's blocks share pages).

    python3 docs/models/demo_placement.py first,best,pages,home 400000
"""
import gzip, os, random, bisect, sys
P=2<<20; G=64<<10; LARGE=512<<10
def load_sizes(path):
    ev=[]
    for line in gzip.open(path,'rt'):
        if line[0]=='o': continue
        op,i,sz,st=line.strip().split(','); ev.append((op,int(i),int(sz)))
    born={}; size={}; out=[]
    for k,(op,i,sz) in enumerate(ev):
        if op=='a': born[i]=k; size[i]=sz
        elif i in born and k-born[i]<=16 and size[i]>0: out.append(size[i])
    out.sort(); return out
SIZES=load_sizes(os.path.join(os.path.dirname(__file__), '..', '..', 'benches', 'traces', 'gpt2_decode.csv.gz'))
def cls(n):
    if n>4<<20: return (n+G-1)//G*G
    u=(n+255)//256
    if u<=8: return u*256
    k=u.bit_length()-1  # 2^k <= u
    step=1<<(k-3) if k>=3 else 1
    return (u+step-1)//step*step*256
def worker(rng, wid):
    """yields ('a',id,size) / ('f',id)"""
    n=0
    def nid():
        nonlocal n; n+=1; return (wid,n)
    while True:
        batch=rng.randint(1,8); prompt=int(round(16*(512/16)**rng.random())); steps=rng.randint(8,128)
        kvb=lambda cap: batch*((cap+63)//64)*64*3072
        tokens=prompt; cap=(tokens+63)//64*64; kv=[]
        def acts(f):
            ids=[]
            for _ in range(rng.randint(2,4)):
                i=nid(); ids.append(i); yield ('a',i,f())
            for i in ids: yield ('f',i)
        for _ in range(12):
            i=nid(); kv.append(i); yield ('a',i,kvb(cap))
            yield from acts(lambda: min(rng.choice(SIZES)*max(1,min(16,prompt//16)),64<<20))
        for st in range(steps):
            tokens+=1
            if tokens>cap:
                cap+=64
                for L in range(12):
                    i=nid(); yield ('a',i,kvb(cap)); yield ('f',kv[L]); kv[L]=i
            for _ in range(12):
                yield from acts(lambda: rng.choice(SIZES))
            i=nid(); yield ('a',i,rng.choice(SIZES)*batch); yield ('f',i)
        for i in kv: yield ('f',i)

class Space:
    def __init__(s, policy):
        s.policy=policy; s.free=[(0,1<<44)]  # sorted list of (addr,len) runs
        s.pages={}; s.touched=0
    def take(s,a,n):
        j=bisect.bisect_right(s.free,(a,1<<62))-1; ra,rl=s.free[j]
        assert ra<=a and a+n<=ra+rl
        new=[]
        if a>ra: new.append((ra,a-ra))
        if a+n<ra+rl: new.append((a+n,ra+rl-a-n))
        s.free[j:j+1]=new
        for pg in range(a//P,(a+n-1)//P+1):
            c=s.pages.get(pg,0); s.pages[pg]=c+1
            if c==0: s.touched+=1
    def give(s,a,n):
        for pg in range(a//P,(a+n-1)//P+1):
            s.pages[pg]-=1
            if s.pages[pg]==0: del s.pages[pg]; s.touched-=1
        j=bisect.bisect_left(s.free,(a,0))
        na,nl=a,n
        if j<len(s.free) and s.free[j][0]==a+n: nl+=s.free[j][1]; s.free.pop(j)
        if j>0 and s.free[j-1][0]+s.free[j-1][1]==a: na=s.free[j-1][0]; nl+=s.free[j-1][1]; s.free.pop(j-1); j-=1
        s.free.insert(j,(na,nl))
    def newpages(s,a,n):
        return sum(1 for pg in range(a//P,(a+n-1)//P+1) if pg not in s.pages)
    def place(s,n,home):
        pol=s.policy
        if pol=='first':
            for a,l in s.free:
                if l>=n: return a
        if pol=='home':
            j=bisect.bisect_right(s.free,(home,1<<62))-1
            for a,l in s.free[max(j,0):]:
                st=max(a,home)
                if a+l-st>=n: return st
        best=None
        for a,l in s.free:
            if l<n: continue
            cands=[a] if l>=1<<43 else [a,a+l-n]
            for c in cands:
                if pol=='best': key=(l,c)
                elif pol=='pages': key=(s.newpages(c,n),l,c)
                if best is None or key<best[0]: best=(key,c)
        return best[1]

def run(policy, workers=16, events=400000, seed=1):
    rng=random.Random(seed); sp=Space(policy)
    gens=[worker(random.Random(seed*100+w),w) for w in range(workers)]
    blocks={}; live=0; peak_live=0; small=0; peak_res=0
    for _ in range(events):
        w=rng.randrange(workers); e=next(gens[w])
        if e[0]=='a':
            _,i,sz=e; n=cls(sz)
            if n>=LARGE:
                a=sp.place(n, w<<38); sp.take(a,n); blocks[i]=(a,n,sz)
            else:
                blocks[i]=(None,n,sz); small+=n
            live+=sz; peak_live=max(peak_live,live)
        else:
            a,n,sz=blocks.pop(e[1]); live-=sz
            if a is None: small-=n
            else: sp.give(a,n)
        res=sp.touched*P+small
        peak_res=max(peak_res,res)
    return peak_res/peak_live
if __name__=='__main__':
    pols=sys.argv[1].split(',')
    for seed in (1,2,3):
        print(seed, ' '.join(f"{p}={run(p,seed=seed,events=int(sys.argv[2])):.3f}" for p in pols), flush=True)
