"""Block-wise output reconstruction: the optimisation loop shared by every method that trains
quantizer parameters against a decoder block's full-precision outputs (learned rounding and
clipping after any solver; MoBiQuant's slices and routers).

    min_θ  L = E_batch ‖Block_θ(x) − y‖² / numel  (+ penalty(L, θ))

over calibration inputs x (what the already-quantized blocks before produce) and targets y (the
full-precision block's outputs), one random mini-batch of whole windows per step. Two optimisers:
"signsgd" (SignRound: θ ← θ − η_t·sign(∇θ), η_t decaying linearly from η to 0; with η = 1/steps
a rounding offset moves at most half a step in total) and "adam" (AdamW, no weight decay, same
schedule). The parameters of the step with the lowest mini-batch loss are kept (as AutoRound
does), and the loss is measured before and after on up to REPORT_WINDOWS evenly spaced windows (a report: on
a large calibration set, every window would cost more forwards than the steps themselves). Every pass, training
steps included, runs in the calibration precision (`bitquilt.calib.compute.block_pass`: in bf16 the block's
matrix products multiply in bf16 under autocast while the parameters, their gradients' accumulation and the
loss stay fp32).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bitquilt.calib.capture import block_output
from bitquilt.calib.compute import block_pass

OPTIMIZERS = ("signsgd", "adam")
REPORT_WINDOWS = 16


@dataclass(frozen=True)
class FitConfig:
    steps: int = 100
    lr: float | None = None  # None: 1/steps for signsgd, 1e-3 for adam
    batch: int = 8  # calibration windows per step
    optimizer: str = "signsgd"
    seed: int = 0
    keep_best: bool = True
    relative: bool = False  # each step minimises (L + penalty) / sg(L), i.e. ∇ log L: losses of any scale weigh alike

    def validate(self) -> FitConfig:
        if self.steps < 0 or self.batch < 1:
            raise ValueError(f"reconstruction needs steps ≥ 0 and batch ≥ 1, got steps={self.steps}, "
                             f"batch={self.batch}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown reconstruction optimizer {self.optimizer!r}; use {' or '.join(OPTIMIZERS)}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"reconstruction step size must be positive, got {self.lr}")
        return self

    @property
    def step_size(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1.0 / max(self.steps, 1) if self.optimizer == "signsgd" else 1e-3


@dataclass
class FitResult:
    loss_before: float  # mean squared error over the reported windows (`report_windows`), before and after
    loss_after: float
    steps: int
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"loss_before": self.loss_before, "loss_after": self.loss_after, "steps": self.steps,
                "seconds": round(self.seconds, 2)}


@torch.no_grad()
def block_error(block: nn.Module, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
                kwargs: dict[str, Any]) -> float:
    """Mean squared error of the block's outputs against `targets` over every window, in the calibration
    precision."""
    with block_pass(block):
        total = sum(float((block_output(block, x, kwargs).float() - y.float()).pow(2).sum()) for x, y in
                    zip(inputs, targets))
    return total / sum(y.numel() for y in targets)


def report_windows(n: int) -> list[int]:
    """The windows the loss before and after is measured on: all n, or REPORT_WINDOWS evenly spaced ones."""
    if n <= REPORT_WINDOWS:
        return list(range(n))
    return torch.linspace(0, n - 1, REPORT_WINDOWS).round().long().tolist()


class _SignSGD(torch.optim.Optimizer):
    """θ ← θ − lr·sign(∇θ)."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


@contextmanager
def only_training(block: nn.Module, params: list[nn.Parameter]):
    """Gradients for `params` alone: the block's other parameters (norms, biases) are frozen for the duration,
    so backward skips what nothing needs (e.g. the input gradient of the block's first linears)."""
    trained = {id(p) for p in params}
    frozen = [p for p in block.parameters() if p.requires_grad and id(p) not in trained]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


def fit_block(block: nn.Module, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
              kwargs: dict[str, Any], params: list[nn.Parameter], config: FitConfig,
              project: Callable[[], None] | None = None,
              penalty: Callable[[torch.Tensor], torch.Tensor] | None = None,
              anneal: Callable[[float], None] | None = None,
              step_inputs: Callable[[], Sequence[torch.Tensor]] | None = None) -> FitResult:
    """Train `params` (all inside `block`) so the block's outputs on `inputs` match `targets`.

    `project()` runs after every step (e.g. clamping offsets into their range); `penalty(L)` is added
    to the mini-batch reconstruction loss L (e.g. a bit budget, which may scale itself by L);
    `anneal(t)` runs before step t/steps ∈ [0, 1) (e.g. a router's temperature), and with t = 1 after the
    last step: the state the error after is measured in. `step_inputs()`, read after `anneal`, gives the inputs
    of the coming step when they depend on what `anneal` set (MoBiQuant's per-prefix streams: windows at the same
    positions as `inputs`); the error before and after is measured on `inputs` (`report_windows` of them).
    Deterministic for a given `config.seed`.
    """
    config.validate()
    t0 = time.perf_counter()
    measured = report_windows(len(inputs))
    inputs_measured, targets_measured = [inputs[i] for i in measured], [targets[i] for i in measured]
    before = block_error(block, inputs_measured, targets_measured, kwargs)
    params = [p for p in params if p.requires_grad]
    if config.steps == 0 or not params:
        return FitResult(before, before, 0, time.perf_counter() - t0)
    lr = config.step_size
    opt = (_SignSGD(params, lr) if config.optimizer == "signsgd"
           else torch.optim.AdamW(params, lr=lr, weight_decay=0.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 - t / config.steps)
    gen = torch.Generator().manual_seed(config.seed)
    batch = min(config.batch, len(inputs))
    best, best_state = float("inf"), None
    with torch.enable_grad(), only_training(block, params), block_pass(block):
        for step in range(config.steps):
            if anneal is not None:
                anneal(step / config.steps)
            pick = torch.randperm(len(inputs), generator=gen)[:batch].tolist()
            source = inputs if step_inputs is None else step_inputs()
            x = torch.cat([source[i] for i in pick])
            y = torch.cat([targets[i] for i in pick])
            error = (block_output(block, x, kwargs).float() - y.float()).pow(2).mean()
            loss = error if penalty is None else error + penalty(error)
            if config.keep_best and float(loss.detach()) < best:
                best, best_state = float(loss.detach()), [p.detach().clone() for p in params]
            if config.relative:
                loss = loss / error.detach().clamp_min(torch.finfo(torch.float32).tiny)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            if project is not None:
                project()
    if anneal is not None:
        anneal(1.0)
    if best_state is not None:
        with torch.no_grad():
            for p, saved in zip(params, best_state):
                p.copy_(saved)
    for p in params:
        p.grad = None
    after = block_error(block, inputs_measured, targets_measured, kwargs)
    return FitResult(before, after, config.steps, time.perf_counter() - t0)
