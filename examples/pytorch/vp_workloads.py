"""The models run under each allocator, with random weights and inputs from fixed seeds:
ResNet-50 inference at varied batch sizes, GPT-2 generating tokens and a short training
loop of a 4-layer GPT-2 with AdamW, each from 4 threads on 4 CUDA streams.

Every output a workload produces goes into ``outputs`` (name -> CPU tensor) for the
comparison between allocators. Weights are made on the CPU from the seed, so both
allocators start from the same bits; inputs come from per-thread CUDA generators, so no
thread's draw depends on another's timing. Each workload returns its throughput and the
wall time of its timed part (after one warm-up pass, from the moment all threads are
released together).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time

import torch


class NoStream:
    """Stands for a CUDA stream in a dry run on the CPU (--device cpu)."""

    def synchronize(self):
        pass


def stream_for(device: str):
    return torch.cuda.Stream() if device == "cuda" else NoStream()


def on(stream):
    return torch.cuda.stream(stream) if isinstance(stream, torch.cuda.Stream) else contextlib.nullcontext()


def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def run_threads(n: int, body, device: str = "cuda"):
    """Run body(t, stream, barrier) on n threads, thread t on its own new CUDA stream;
    body calls barrier.wait() where its timed part starts. Returns (wall seconds from the
    release to the last thread's end, per-thread results); re-raises the first error."""
    barrier = threading.Barrier(n + 1)
    streams = [stream_for(device) for _ in range(n)]
    results, errors, ends = [None] * n, [None] * n, [0.0] * n

    def main(t):
        try:
            with on(streams[t]):
                results[t] = body(t, streams[t], barrier)
                streams[t].synchronize()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[t] = e
            barrier.abort()
        finally:
            ends[t] = time.perf_counter()

    threads = [threading.Thread(target=main, args=(t,), name=f"worker{t}") for t in range(n)]
    for th in threads:
        th.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    start = time.perf_counter()
    for th in threads:
        th.join()
    for e in errors:
        if e is not None and not isinstance(e, threading.BrokenBarrierError):
            raise e
    for e in errors:
        if e is not None:
            raise e
    return max(ends) - start, results


def resnet50(cfg, outputs: dict) -> dict:
    import torchvision

    dev = cfg.device
    dtype = torch.float16 if dev == "cuda" else torch.float32
    torch.manual_seed(cfg.seed)
    model = torchvision.models.resnet50(weights=None).eval()
    model = model.to(device=dev, dtype=dtype, memory_format=torch.channels_last)
    sizes = [1, 8, 32] if cfg.quick else [1, 4, 8, 16, 32, 64, 128, 16, 2]
    threads = cfg.threads

    def body(t, stream, barrier):
        # Each thread walks the sizes from its own starting point: at any moment the
        # threads ask for different batch sizes.
        mine = sizes[t % len(sizes):] + sizes[: t % len(sizes)]
        g = torch.Generator(device=dev)
        g.manual_seed(cfg.seed * 1000 + t)
        with torch.inference_mode():
            warm = torch.randn(2, 3, 224, 224, device=dev, dtype=dtype, generator=g)
            model(warm.contiguous(memory_format=torch.channels_last))
            stream.synchronize()
            barrier.wait()
            for i, bs in enumerate(mine):
                x = torch.randn(bs, 3, 224, 224, device=dev, dtype=dtype, generator=g)
                y = model(x.contiguous(memory_format=torch.channels_last))
                outputs[f"resnet50/t{t}/b{i}_bs{bs}"] = y.float().cpu()
        return sum(mine)

    wall, images = run_threads(threads, body, dev)
    return {"throughput": sum(images) / wall, "unit": "img/s", "wall_s": wall,
            "detail": f"{threads} threads, batches {sizes}"}


def gpt2_generate(cfg, outputs: dict) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    dev = cfg.device
    conf = GPT2Config()  # GPT-2 small: 12 layers, 768 wide, 50257 tokens
    torch.manual_seed(cfg.seed + 1)
    base = GPT2LMHeadModel(conf).eval()
    threads = cfg.threads
    # One copy per thread, made here (on the CPU) and moved to the GPU on the thread's own
    # stream: its weights are allocated, used and freed there.
    copies = [copy.deepcopy(base) for _ in range(threads)]
    del base
    calls = 1 if cfg.quick else 3
    new_tokens = 16 if cfg.quick else 32
    batch, prompt = 4, 32
    eos = conf.eos_token_id

    def generate(model, ids, n):
        return model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=eos,
        )

    def body(t, stream, barrier):
        model = copies[t].to(dev)
        copies[t] = None
        g = torch.Generator(device=dev)
        g.manual_seed(cfg.seed * 1000 + 100 + t)
        with torch.inference_mode():
            warm = torch.randint(0, conf.vocab_size, (batch, prompt), device=dev, generator=g)
            generate(model, warm, 2)
            stream.synchronize()
            barrier.wait()
            for c in range(calls):
                ids = torch.randint(0, conf.vocab_size, (batch, prompt), device=dev, generator=g)
                seq = generate(model, ids, new_tokens)
                outputs[f"gpt2_generate/t{t}/c{c}/tokens"] = seq.cpu()
            logits = model(ids).logits[:, -1, :]
            outputs[f"gpt2_generate/t{t}/last_logits"] = logits.float().cpu()
        stream.synchronize()
        del model
        return batch * new_tokens * calls

    wall, tokens = run_threads(threads, body, dev)
    return {"throughput": sum(tokens) / wall, "unit": "tok/s", "wall_s": wall,
            "detail": f"{threads} threads, batch {batch}, {calls}x{new_tokens} new tokens"}


def gpt2_train(cfg, outputs: dict) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    dev = cfg.device
    # No dropout: its masks come from the device's one default generator, which threads
    # would draw from in whatever order they run. Eager attention: SDPA's memory-efficient
    # backward has no deterministic kernel under warn_only, and its atomics would make
    # the allocators' results differ by rounding. Backward passes run on autograd's
    # device thread, on the stream of each forward op: the pool sees allocations from
    # that thread on the 4 streams and their frees from the workers.
    conf = GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        bos_token_id=8191, eos_token_id=8191,
    )
    torch.manual_seed(cfg.seed + 2)
    base = GPT2LMHeadModel(conf)
    threads = cfg.threads
    copies = [copy.deepcopy(base) for _ in range(threads)]
    del base
    steps = 8 if cfg.quick else 30
    warmup = 2
    batch, seq = 16, 128

    def body(t, stream, barrier):
        model = copies[t].to(dev).train()
        copies[t] = None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        g = torch.Generator(device=dev)
        g.manual_seed(cfg.seed * 1000 + 200 + t)
        losses = []
        for step in range(steps):
            if step == warmup:
                stream.synchronize()
                barrier.wait()
            ids = torch.randint(0, conf.vocab_size, (batch, seq), device=dev, generator=g)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.detach())
        outputs[f"gpt2_train/t{t}/losses"] = torch.stack(losses).float().cpu()
        for name, p in model.named_parameters():
            outputs[f"gpt2_train/t{t}/param/{name}"] = p.detach().float().cpu()
        stream.synchronize()
        del model, opt
        return batch * seq * (steps - warmup)

    wall, tokens = run_threads(threads, body, dev)
    return {"throughput": sum(tokens) / wall, "unit": "tok/s", "wall_s": wall,
            "detail": f"{threads} threads, 4 layers, batch {batch}x{seq}, {steps} AdamW steps"}


WORKLOADS = {
    "resnet50": resnet50,
    "gpt2_generate": gpt2_generate,
    "gpt2_train": gpt2_train,
}

# How outputs are compared (see compare() in run.py): bit for bit is expected, since every
# kernel here is deterministic (cuDNN deterministic with its heuristics' choice, cuBLAS
# with a fixed CUBLAS_WORKSPACE_CONFIG, no atomics, eager attention in training) and each
# thread's work depends on nothing another thread does; the run lists the ops that warned
# they are not. Where bits differ, floating outputs must agree within (rtol, atol), sized
# for one kernel choice against another (fp16: a few ulps of logits near 100; fp32:
# reduction order over 768 to 50257 terms; training: 30 AdamW steps, whose updates near a
# zero gradient amplify rounding, hence the looser absolute bound). Integer outputs (the
# generated tokens) must be equal.
TOLERANCE = {
    "resnet50": (1e-2, 1e-1),  # fp16 logits, |y| up to ~100 (ulp 0.06)
    "gpt2_generate": (1e-4, 1e-4),
    "gpt2_train": (1e-3, 1e-3),
}
