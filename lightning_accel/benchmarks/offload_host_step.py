"""The host optimizer step of ``bench offload``: L2L's host step against torch's and DeepSpeed's kernels.

Mparam/s of L2L's host step against torch's
kernels, DeepSpeed's CPU Adam (when importable) and a plain memory copy; the per-call cost
of stepping block by block; the bf16 shadows written in the update's pass (:mod:`.shadow_fold`),
in a pass of their own after it, or chunk by chunk after torch's kernel; compiled kernels
moving the bytes of AdamW and of the fold at trivial arithmetic (their memory limits); and the
time spent in ``AdamW.step`` inside a Lightning fit, l2l_offload against plain training with
``AdamW(fused=True)``, in fp32 and in bf16.

All contenders step the same tensors (one AdamW state, shared) in interleaved rounds
(A B C A B C ...), so a noisy neighbour hits all of them alike; each figure is the median
over rounds. The parameters are shaped like GPT blocks (width 1024 by default: GPT-2
medium's, 12.6M parameters each).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_accel.bench import format_table
from lightning_accel.offload.host_step import host_update, step_params
from lightning_accel.offload import shadow_kernel
from lightning_accel.offload.shadow_fold import without_c_kernel

# bytes an AdamW step moves per parameter: reads param, grad, exp_avg, exp_avg_sq (16),
# writes param, exp_avg, exp_avg_sq (12); a copy moving as much copies 14 bytes each way
ADAMW_BYTES_PER_PARAM = 28

_FOLDED = "l2l_offload host step, bf16 shadows folded"
_COMPILED = "  same, folded by torch.compile (no C kernel)"
_LIMIT = "  the compiled fold's bytes at trivial arithmetic (its memory limit)"
# masters per chunk of the chunked contender: 1 MiB, the best of a 64 KiB..4 MiB sweep on the
# 2-core x86_64 machine (64 KiB: 0.48x fused, 256 KiB: 0.73x, 1 MiB: 0.77x, 4 MiB: 0.77x)
_CHUNK = 2**18


def _streams(t: list[torch.Tensor]) -> None:
    """AdamW's memory traffic (read p, g, m, v; write p, m, v) with one add per stream."""
    p, g, m, v = t
    p.copy_(p + g)
    m.copy_(m + g)
    v.copy_(v + g)


def _streams_shadow(t: list[torch.Tensor], low: torch.Tensor) -> None:
    """The same plus the bf16 shadow store: the bytes of the compiled fold, 32 B a parameter with
    the shadow's write-allocate (inductor emits no non-temporal stores; the C kernel's do not
    read the line first: 30 B)."""
    _streams(t)
    low.copy_(t[0])


def _stream_rows(numel: int, compile: Callable[..., Any] = torch.compile) -> dict[str, Callable[[], None]]:
    """Compiled kernels moving AdamW's bytes with and without the shadow store, over ``numel``
    elements: the memory limit of each pass, whatever the arithmetic costs (``compile``: a test
    passes the identity, saving two compilations)."""
    t = [torch.zeros(numel) for _ in range(4)]
    low = torch.empty(numel, dtype=torch.bfloat16)
    try:
        plain = compile(_streams, dynamic=True, fullgraph=True)
        shadow = compile(_streams_shadow, dynamic=True, fullgraph=True)
        plain(t), shadow(t, low)
    except Exception:  # no C++ compiler here: no rows, as the fold then takes two passes
        return {}
    return {"  AdamW's bytes at trivial arithmetic (compiled)": lambda: plain(t), _LIMIT: lambda: shadow(t, low)}


def _chunked(opt: torch.optim.Optimizer, shadows: dict[torch.Tensor, torch.Tensor]) -> Callable[[], None]:
    """torch's fused AdamW kernel over ``_CHUNK``-element chunks, each chunk's shadow cast right
    after its update, while its masters should still be in cache."""
    group = opt.param_groups[0]
    kw = dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], weight_decay=group["weight_decay"],
              eps=group["eps"], amsgrad=False, maximize=False)

    def step() -> None:
        for p in group["params"]:
            state = opt.state[p]
            state["step"] += 1
            flat = [p.detach().view(-1), p.grad.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)]
            low = shadows[p].view(-1) if p in shadows else None
            for k in range(0, p.numel(), _CHUNK):
                pc, gc, mc, vc = (t[k:k + _CHUNK] for t in flat)
                torch._fused_adamw_([pc], [gc], [mc], [vc], [], [state["step"]], **kw)
                if low is not None:
                    low[k:k + _CHUNK].copy_(pc)
    return step


def _block(n_embd: int) -> list[nn.Parameter]:
    """The parameters of one GPT block of width ``n_embd`` (12 n^2 + 13 n)."""
    shapes = [(3 * n_embd, n_embd), (3 * n_embd,), (n_embd, n_embd), (n_embd,), (4 * n_embd, n_embd), (4 * n_embd,),
              (n_embd, 4 * n_embd), (n_embd,), (n_embd,), (n_embd,), (n_embd,), (n_embd,)]
    return [nn.Parameter(torch.randn(s) * 0.02) for s in shapes]


def _blocks(total: float, n_embd: int) -> list[list[nn.Parameter]]:
    per = 12 * n_embd**2 + 13 * n_embd
    blocks = [_block(n_embd) for _ in range(max(1, round(total / per)))]
    for p in (p for b in blocks for p in b):
        p.grad = torch.randn_like(p) * 1e-3
    return blocks


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.3g}"


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _rounds(contenders: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each contender over interleaved rounds (after one warm-up call each)."""
    for fn in contenders.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: _median(t) for name, t in times.items()}


def _deepspeed_adam(params: list[nn.Parameter]) -> tuple[Callable[[], None] | None, str]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

        opt = DeepSpeedCPUAdam(params, lr=1e-4, weight_decay=0.01, adamw_mode=True)
    except Exception as err:  # not installed, or its JIT build failed: no row
        return None, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:80]
    return opt.step, ""


def host_step_table(total_params: float, rounds: int, n_embd: int = 1024) -> tuple[str, dict[str, float]]:
    """One size: Mparam/s per contender (the copy row is the memory-bandwidth limit)."""
    blocks = _blocks(total_params, n_embd)
    params = [p for b in blocks for p in b]
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)  # foreach/fused unset: what users write
    fused = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    fused.state = opt.state  # one state: the contenders differ only in how they step it
    shadows = {p: p.detach().to(torch.bfloat16) for p in params if p.ndim >= 2}
    # bf16 compute, as on a GPU: the matrices' gradients come from the device in bf16, the host widens
    # them to fp32 (every contender steps those) and the folded update reads the bf16 ones
    low_grads = {p: p.grad.to(torch.bfloat16) for p in shadows}
    for p, low in low_grads.items():
        p.grad = low.float()

    def l2l_fp32() -> None:  # a CPU device in fp32: the shadows are the masters, nothing to refresh
        with host_update(opt, True):
            opt.step()

    def l2l_bf16() -> None:  # each matrix's shadow written in the update's pass, its bf16 gradient read
        with host_update(opt, True, lambda: shadows, low_grads=lambda: low_grads):
            opt.step()

    def l2l_bf16_compiled() -> None:  # the same where the C kernel cannot be built (it reads the fp32 gradients)
        with without_c_kernel(), host_update(opt, True, lambda: shadows, low_grads=lambda: low_grads):
            opt.step()

    def fused_then_refresh() -> None:  # what l2l_offload did before: the shadows in a second pass
        fused.step()
        for p, low in shadows.items():
            low.copy_(p)

    def per_block() -> None:
        for b in blocks:
            step_params(opt, b, fuse=True)

    # the copy moves what AdamW moves for up to 64M params (256 MiB each way at most)
    copy_params = min(n, 64 * 2**20 * 8 // ADAMW_BYTES_PER_PARAM)
    src = torch.empty(copy_params * ADAMW_BYTES_PER_PARAM // 8, dtype=torch.float32)
    dst = torch.empty_like(src)
    # an in-place pass a += b moving the same bytes (read a and b, write a: 12 B/element);
    # unlike a copy it writes lines it has just read, as the optimizer does (no write-allocate)
    a = torch.zeros(copy_params * ADAMW_BYTES_PER_PARAM // 12, dtype=torch.float32)
    b = torch.zeros_like(a)
    contenders: dict[str, Callable[[], None]] = {
        "torch AdamW, foreach/fused unset (default)": opt.step,
        "torch AdamW(fused=True)": fused.step,
    }
    ds_step, _ = _deepspeed_adam(params)
    if ds_step is not None:
        contenders["DeepSpeedCPUAdam"] = ds_step
    contenders |= {
        "l2l_offload host step (fp32, as on a CPU device)": l2l_fp32,
        "  same, one optimizer call per block": per_block,
        "fused step, then bf16 shadow refresh as a separate pass": fused_then_refresh,
        f"fused kernel in {_CHUNK * 4 // 2**20} MiB chunks, each cast to bf16 right after": _chunked(fused, shadows),
        **({f"{_FOLDED} (C kernel)": l2l_bf16, _COMPILED: l2l_bf16_compiled} if shadow_kernel.kernel() is not None
           else {f"{_FOLDED} (torch.compile; no C kernel: {shadow_kernel.why_not()})"[:90]: l2l_bf16}),
        **_stream_rows(copy_params),
        f"host memory copy of {ADAMW_BYTES_PER_PARAM // 2} B/param (the limit)": lambda: dst.copy_(src),
        "in-place a += b moving the same bytes": lambda: a.add_(b),
    }
    seconds = _rounds(contenders, rounds)
    per_copy = ("host memory copy", "in-place", "  AdamW's bytes", _LIMIT)
    return f"{n / 1e6:.3g}M", {name: (copy_params if name.startswith(per_copy) else n) / s / 1e6
                               for name, s in seconds.items()}


def per_call_table(total_params: float, rounds: int) -> str:
    """What stepping block by block costs at real block sizes: one fused call per block against
    one call for all blocks, over the same parameters."""
    rows = []
    for preset, n_embd in (("tiny", 128), ("small", 384), ("gpt2", 768), ("gpt2-medium", 1024), ("gpt2-xl", 1600)):
        if 2 * (12 * n_embd**2 + 13 * n_embd) > total_params:
            continue  # fewer than two blocks: nothing to compare
        blocks = _blocks(total_params, n_embd)
        params = [p for b in blocks for p in b]
        opt = torch.optim.AdamW(params, lr=1e-4)
        seconds = _rounds({
            "all": lambda: step_params(opt, params, fuse=True),
            "block": lambda: [step_params(opt, b, fuse=True) for b in blocks],
        }, rounds)
        per_block = sum(p.numel() for p in blocks[0])
        overhead = (seconds["block"] - seconds["all"]) / len(blocks)
        rows.append([preset, f"{per_block / 1e6:.2f}M", str(len(blocks)), f"{seconds['all'] * 1e3:.1f}",
                     f"{seconds['block'] * 1e3:.1f}", f"{overhead * 1e6:.0f}", f"{seconds['block'] / seconds['all']:.2f}"])
        del opt, params, blocks
    header = ["block of", "params/block", "blocks", "one call ms", "per-block ms", "us/call extra", "per-block / one"]
    return (f"fused AdamW over {total_params / 1e6:.3g}M params: one call per block vs one call for all\n"
            + format_table(header, rows))


class _OptimizerClock(pl.Callback):
    """Seconds spent in ``optimizer.step`` per training step, the closure (forward and
    backward) excluded; steps after ``warmup``. Wraps the optimizer instance's ``step``, so
    it also counts the host steps L2L runs in its worker thread."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.per_step: list[float] = []
        self._current = 0.0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opt = trainer.optimizers[0]
        real = opt.step

        def timed(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
            inside = 0.0

            def timed_closure() -> Any:
                nonlocal inside
                start = time.perf_counter()
                try:
                    return closure()  # type: ignore[misc]
                finally:
                    inside += time.perf_counter() - start

            start = time.perf_counter()
            out = real(closure=timed_closure if closure is not None else None, **kwargs)
            self._current += time.perf_counter() - start - inside
            return out

        opt.step = timed  # type: ignore[method-assign]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step > self.warmup:
            self.per_step.append(self._current)
        self._current = 0.0


def in_fit_table(args: argparse.Namespace) -> tuple[str, float, float]:
    """Time in AdamW.step inside a Lightning fit on an optimizer-dominated GPT (tiny batch), fp32
    and bf16-mixed (under l2l_offload: the bf16 shadows written by the host step). Returns the
    table and l2l's ratios to plain training with ``AdamW(fused=True)`` in fp32 and in bf16."""
    from lightning_accel.benchmarks.offload_workload import token_data
    from lightning_accel.models import GPT, LanguageModelTask
    from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy

    # name: (strategy, AdamW's fused flag, precision)
    contenders: dict[str, tuple[Any, bool | None, str]] = {
        "plain Lightning, AdamW(fused=True)": ("auto", True, "32-true"),
        "plain Lightning, AdamW() (default)": ("auto", None, "32-true"),
        "l2l_offload, AdamW() (default)": (L2LOffloadStrategy, None, "32-true"),
        "plain Lightning bf16-mixed, AdamW(fused=True)": ("auto", True, "bf16-mixed"),
        "l2l_offload bf16-mixed, AdamW() (default)": (L2LOffloadStrategy, None, "bf16-mixed"),
    }
    times: dict[str, list[float]] = {name: [] for name in contenders}
    params = 0
    for _ in range(args.rounds):
        for name, (strategy, fused, precision) in contenders.items():
            torch.manual_seed(0)
            net = GPT(preset=args.fit_preset, n_layer=args.fit_layers, block_size=args.fit_seq)
            model = LanguageModelTask(net, optimizer=lambda p, fused=fused: torch.optim.AdamW(p, lr=1e-4, fused=fused))
            clock = _OptimizerClock(args.warmup)
            trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy() if callable(strategy) else strategy,
                                 precision=precision, max_steps=args.fit_steps, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, callbacks=[clock])
            trainer.fit(model, token_data(1, args.fit_seq, args.fit_steps))
            times[name].append(_median(clock.per_step))
            params = sum(p.numel() for p in model.parameters())
    # Each ratio pairs a round's run with the plain fused run of the same round and precision (fits
    # seconds apart): the machine's drift between rounds, 10-20% here, cancels; the median over rounds.
    base = {"32-true": "plain Lightning, AdamW(fused=True)", "bf16-mixed": "plain Lightning bf16-mixed, AdamW(fused=True)"}
    ratios = {name: [t / b for t, b in zip(times[name], times[base[precision]])] for name, (_, _, precision) in contenders.items()}
    rows = [[name, f"{_median(times[name]) * 1e3:.1f}", f"{_median(ratios[name]):.2f}", " ".join(f"{r:.2f}" for r in ratios[name])]
            for name in contenders]
    ratio32 = _median(ratios["l2l_offload, AdamW() (default)"])
    ratio16 = _median(ratios["l2l_offload bf16-mixed, AdamW() (default)"])
    title = (f"time in AdamW.step per training step (closure excluded), GPT {args.fit_preset}-width x{args.fit_layers} "
             f"({params / 1e6:.1f}M params), batch 1x{args.fit_seq}, CPU device, {args.rounds} interleaved rounds of "
             f"{args.fit_steps} steps; x plain fused: the median over rounds of each round's ratio to plain fused in the "
             f"same precision; target l2l <= 1.10x")
    header = ["run", "ms in step (median)", "x plain fused (same precision)", "per round"]
    return title + "\n" + format_table(header, rows), ratio32, ratio16


def host_step_report(args: argparse.Namespace) -> str:
    """The host-step tables of ``bench offload`` and the closing line."""
    columns: dict[str, dict[str, float]] = {}
    for size in args.host_params:
        label, rates = host_step_table(size * 1e6, args.host_rounds, args.host_width)
        columns[label] = rates
    names = list(next(iter(columns.values())))
    fused_name = "torch AdamW(fused=True)"
    rows = [[name, *(_num(columns[c][name]) for c in columns), *(f"{columns[c][name] / columns[c][fused_name]:.2f}" for c in columns)]
            for name in names]
    header = ["host step (AdamW)", *(f"Mparam/s @{c}" for c in columns), *(f"x fused @{c}" for c in columns)]
    out = [f"host optimizer step, blocks shaped like GPT blocks of width {args.host_width}, median of {args.host_rounds} interleaved rounds "
           f"(copy rows: memory moved at the rate of AdamW's {ADAMW_BYTES_PER_PARAM} B/param read+written; a memcpy "
           "also reads every destination line before writing it, so an in-place update can beat it)\n"
           + format_table(header, rows)]
    if not any(n.startswith("DeepSpeed") for n in names):
        out.append(f"(no DeepSpeedCPUAdam row: {_deepspeed_adam([nn.Parameter(torch.zeros(1))])[1]})")
    out.append(per_call_table(args.host_params[0] * 1e6, args.host_rounds))
    fit, ratio32, ratio16 = in_fit_table(args)
    out.append(fit)
    last = columns[list(columns)[-1]]
    ours = last["l2l_offload host step (fp32, as on a CPU device)"]
    folded = next(v for k, v in last.items() if k.startswith(_FOLDED))
    compiled = f"; by torch.compile: {last[_COMPILED] / last[fused_name]:.2f}" if _COMPILED in last else ""
    limit = f" (its memory limit: {last[_LIMIT] / last[fused_name]:.2f})" if _LIMIT in last else ""
    copy = next(v for k, v in last.items() if k.startswith("host memory copy"))
    out.append(f"host step: {_num(ours)} Mparam/s = {ours / last[fused_name]:.2f} x fused AdamW, "
               f"{100 * ours / copy:.0f}% of copy bandwidth; bf16 shadows folded: {folded / last[fused_name]:.2f} x fused AdamW{compiled}{limit}; "
               f"in a fit: {ratio32:.2f}x plain AdamW(fused=True)'s time in step, bf16: {ratio16:.2f}x")
    return "\n\n".join(out)
