"""The models run under each allocator, with random weights and inputs from fixed seeds:
ResNet-50 inference at varied batch sizes, GPT-2 generating tokens and a short training
loop of a 4-layer GPT-2 with AdamW, each from 4 threads on 4 CUDA streams. Three more, of
the held-out traces' shapes (ViT-B/16 at varied batches, T5 and a mixture-of-experts
decoder serving requests of varied size), run when named (``run.py --only``).

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


def vit_varbatch(cfg, outputs: dict) -> dict:
    """ViT-B/16 inference at varied batch sizes, each thread from its own starting point
    (held out: the shape of `benches/traces/vit_varbatch`)."""
    import torchvision

    dev = cfg.device
    dtype = torch.float16 if dev == "cuda" else torch.float32
    torch.manual_seed(cfg.seed + 3)
    model = torchvision.models.vit_b_16(weights=None).eval().to(device=dev, dtype=dtype)
    sizes = [1, 8, 32] if cfg.quick else [1, 12, 48, 4, 32, 2, 64, 8, 24, 16]
    threads = cfg.threads

    def body(t, stream, barrier):
        mine = sizes[t % len(sizes):] + sizes[: t % len(sizes)]
        g = torch.Generator(device=dev)
        g.manual_seed(cfg.seed * 1000 + 300 + t)
        with torch.inference_mode():
            model(torch.randn(2, 3, 224, 224, device=dev, dtype=dtype, generator=g))
            stream.synchronize()
            barrier.wait()
            for i, bs in enumerate(mine):
                y = model(torch.randn(bs, 3, 224, 224, device=dev, dtype=dtype, generator=g))
                outputs[f"vit_varbatch/t{t}/b{i}_bs{bs}"] = y.float().cpu()
        return sum(mine)

    wall, images = run_threads(threads, body, dev)
    return {"throughput": sum(images) / wall, "unit": "img/s", "wall_s": wall,
            "detail": f"{threads} threads, batches {sizes}"}


def serve_generations(cfg, outputs: dict, name: str, base, vocab: int, shapes: list) -> dict:
    """Greedy generation from `threads` copies of `base` (made on the CPU, each moved to the
    GPU on its thread's stream), every thread serving `shapes` (batch, prompt length, new
    tokens) from its own starting point: requests of varied size at once."""
    dev = cfg.device
    threads = cfg.threads
    copies = [copy.deepcopy(base) for _ in range(threads)]

    def body(t, stream, barrier):
        model = copies[t].to(dev)
        copies[t] = None
        mine = shapes[t % len(shapes):] + shapes[: t % len(shapes)]
        g = torch.Generator(device=dev)
        g.manual_seed(cfg.seed * 1000 + 400 + t)
        tokens = 0
        with torch.inference_mode():
            warm = torch.randint(3, vocab, (1, 8), device=dev, generator=g)
            model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=2,
                           min_new_tokens=2, do_sample=False, pad_token_id=0)
            stream.synchronize()
            barrier.wait()
            for c, (bs, plen, new) in enumerate(mine):
                ids = torch.randint(3, vocab, (bs, plen), device=dev, generator=g)
                seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                     min_new_tokens=new, do_sample=False, pad_token_id=0)
                outputs[f"{name}/t{t}/c{c}/tokens"] = seq.cpu()
                tokens += bs * new
        stream.synchronize()
        del model
        return tokens

    wall, tokens = run_threads(threads, body, dev)
    return {"throughput": sum(tokens) / wall, "unit": "tok/s", "wall_s": wall,
            "detail": f"{threads} threads, requests (batch, prompt, new) {shapes}"}


def t5_generate(cfg, outputs: dict) -> dict:
    """An encoder-decoder: T5 (6+6 layers, 512 wide) greedy generation, requests of varied
    batch and input length (held out: the shape of `benches/traces/t5_generate`)."""
    from transformers import T5Config, T5ForConditionalGeneration

    conf = T5Config(d_model=512, d_ff=2048, num_layers=6, num_decoder_layers=6, num_heads=8, vocab_size=32128,
                    decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(cfg.seed + 4)
    base = T5ForConditionalGeneration(conf).eval()
    base.generation_config.decoder_start_token_id = 0
    shapes = [(4, 64, 8), (1, 200, 16)] if cfg.quick else [(4, 200, 32), (1, 40, 48), (12, 96, 24), (8, 400, 16)]
    return serve_generations(cfg, outputs, "t5_generate", base, conf.vocab_size, shapes)


def moe_generate(cfg, outputs: dict) -> dict:
    """A Mixtral-style mixture-of-experts decoder (8 layers, hidden 512, 8 experts, top 2)
    greedy generation, requests of varied batch and prompt length: each step's experts see
    a different number of tokens (held out: the shape of `benches/traces/moe_decode`)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    conf = MixtralConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                         max_position_embeddings=4096, pad_token_id=0)
    torch.manual_seed(cfg.seed + 5)
    base = MixtralForCausalLM(conf).eval()
    shapes = [(2, 64, 8), (8, 32, 16)] if cfg.quick else [(2, 300, 32), (8, 64, 48), (16, 32, 24), (1, 500, 40)]
    return serve_generations(cfg, outputs, "moe_generate", base, conf.vocab_size, shapes)


WORKLOADS = {
    "resnet50": resnet50,
    "gpt2_generate": gpt2_generate,
    "gpt2_train": gpt2_train,
}

# Workloads of the held-out traces' shapes, run only when asked for (`run.py --only`): the
# default set stays the three the README's figures were measured on.
HELD_OUT = {
    "vit_varbatch": vit_varbatch,
    "t5_generate": t5_generate,
    "moe_generate": moe_generate,
}
ALL = {**WORKLOADS, **HELD_OUT}

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
    "vit_varbatch": (1e-2, 1e-1),  # fp16 logits, as resnet50's
    "t5_generate": (1e-4, 1e-4),  # tokens only: compared exactly
    "moe_generate": (1e-4, 1e-4),
}
